"""The tensor vocabulary (state/vocab/torch_map.py) against the oracle (state/vocab/reference.py): random streams
of training steps and evaluation lookups, checkpoints mid-stream, bad checkpoints, ``valid`` and
the bounded counts, and one large map."""

from __future__ import annotations

import unittest.mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import requires_native
from profiles import examples

from embcore.kernels import cpu
from embcore.state.vocab import native_map as vocab
from embcore.state.vocab import torch_map
from embcore.ops.backend import FUSED_CPU, TORCH_OPS, choose
from embcore.state.vocab.native_map import NativeVocabMap
from embcore.state.vocab.torch_map import VocabMap
from embcore.state.vocab.vocabulary import vocab_map
from embcore.state.vocab.reference import ReferenceVocabulary

I64 = torch.int64
EXTREMES = [-(2**63), -(2**63) + 1, -(2**40), 2**40, 2**63 - 2, 2**63 - 1]


class HeldNativeVocabMap(NativeVocabMap):
    """The native map holding 5 rows at least: all of small capacities from the start, the
    others growing from 5 (the default holds 1 at first)."""

    min_rows = 5


_NO_KERNELS = requires_native
# Both forms of the map: torch ops (sorted keys) and the fused kernels (a hash index over the rows
# held, which grow from one row, or from five).
MAPS = [VocabMap, pytest.param(NativeVocabMap, marks=_NO_KERNELS),
        pytest.param(HeldNativeVocabMap, marks=_NO_KERNELS)]
# The native map's own tensors (its compact layout; absent in VocabMap's layout)
COMPACT = ("_ids", "_last", "_freq", "_born", "slots")


def shuffled(ids: list[int]) -> list[int]:
    """A fixed order of ``ids`` that is not ascending: a step's result must not depend on it."""
    return sorted(ids, key=lambda i: (i * 0x9E3779B97F4A7C15 + 7) % 2**64)


def ids_tensor(ids: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(ids, dtype=I64, device=device)


def config(m: VocabMap) -> dict:
    return {"eviction": m.eviction, "admit_after": m.admit_after, "ttl_steps": m.ttl_steps,
            "name": m.name}


def snapshot(m: VocabMap) -> dict:
    """Every piece of the map's state (copies)."""
    keys = ("keys", "key_rows", "row_key", "row_used", "last_use", "frequency", "born",
            "pending_ids", "pending_counts", "pending_seen")
    if isinstance(m, NativeVocabMap) and m._compact:
        keys += COMPACT
    return {"step": m.step, **{k: getattr(m, k).cpu().clone() for k in keys}}


def assert_same_snapshot(a: dict, b: dict) -> None:
    assert a.keys() - set(COMPACT) == b.keys() - set(COMPACT)
    for k, x in a.items():
        if k not in b:
            continue
        assert (x == b[k]) if k == "step" else torch.equal(x, b[k]), k


def assert_matches(m: VocabMap, v: ReferenceVocabulary) -> None:
    """The map holds the oracle's state, and its own tensors agree with each other."""
    s = {k: x.cpu().tolist() for k, x in m.state_dict().items()}
    ids = sorted(v.rows)
    assert s["ids"] == ids
    assert s["rows"] == [v.rows[i] for i in ids]
    assert s["last_use"] == [v.last_use[i] for i in ids]
    assert s["frequency"] == [v.frequency[i] for i in ids]
    assert s["pending_ids"] == sorted(v.counts)
    assert s["pending_counts"] == [v.counts[i] for i in sorted(v.counts)]
    assert s["step"] == m.step == v.step
    got_ids, got_rows = m.resident()
    assert (got_ids.tolist(), got_rows.tolist()) == v.resident()
    # internal consistency: the per-row tensors mirror keys / key_rows
    used = m.row_used.cpu()
    assert int(used.sum()) == len(ids)
    assert torch.equal(m.row_key[m.key_rows].cpu(), m.keys.cpu())
    assert bool(used[m.key_rows.cpu()].all())
    assert bool((m.row_key.cpu()[~used] == 0).all()) and bool((m.born.cpu()[~used] == -1).all())
    assert bool((m.born.cpu()[used] <= m.step).all())
    assert m.pending_ids.numel() == m.pending_seen.numel() == m.pending_counts.numel()


def oracle_from_state(state: dict, capacity: int, **kw) -> ReferenceVocabulary:
    s = {k: x.cpu().tolist() for k, x in state.items()}
    return ReferenceVocabulary(
        capacity=capacity, eviction=kw.get("eviction", "lru"),
        admit_after=kw.get("admit_after", 1), ttl_steps=kw.get("ttl_steps"), step=s["step"],
        rows=dict(zip(s["ids"], s["rows"])), last_use=dict(zip(s["ids"], s["last_use"])),
        frequency=dict(zip(s["ids"], s["frequency"])),
        counts=dict(zip(s["pending_ids"], s["pending_counts"])))


def run_step(maps: list[VocabMap], v: ReferenceVocabulary, ids: list[int], training: bool,
             history: list[tuple[int, list[int]]] | None = None, full: bool = True) -> None:
    """One step on every map and on the oracle; asserts they agree after it (with ``full``, on
    the whole state, else on the step's results)."""
    device = maps[0].device
    if not training:
        before = [snapshot(m) for m in maps]
        want = [-1 if r is None else r for r in v.lookup(ids, training=False)]
        for m, b in zip(maps, before):
            assert m.find(ids_tensor(ids, device)).cpu().tolist() == want
            assert_same_snapshot(snapshot(m), b)  # evaluation changes nothing
        return
    distinct = shuffled(sorted(set(ids)))  # any order
    t = v.step + 1
    old_rows = dict(v.rows)
    expired = {i for i, u in v.last_use.items() if v.ttl_steps is not None and t - u > v.ttl_steps}
    try:
        want = v.lookup(ids, training=True)
    except ValueError as e:
        msg = str(e)
        for m in maps:
            before = snapshot(m)
            with pytest.raises(ValueError) as err:
                m.train_step(ids_tensor(distinct, device))
            assert m.name in str(err.value) and msg in str(err.value)
            assert_same_snapshot(snapshot(m), before)  # nothing changed
            assert_matches(m, v)
        return
    admitted = sorted(i for i in v.rows if i not in old_rows or i in expired)
    for m in maps:
        rows, new_ids, new_rows = m.train_step(ids_tensor(distinct, device))
        assert rows.cpu().tolist() == [v.rows.get(i, -1) for i in distinct]
        assert new_ids.cpu().tolist() == admitted
        assert new_rows.cpu().tolist() == [v.rows[i] for i in admitted]
        assert m.find(ids_tensor(ids, device)).cpu().tolist() == \
            [-1 if r is None else r for r in want]
        if full:
            assert_matches(m, v)
    if history is not None:
        history.append((v.step, [v.rows[i] for i in admitted]))


POOL = st.one_of(st.integers(-4, 10), st.sampled_from(EXTREMES))


@st.composite
def streams(draw):
    cfg = {"eviction": draw(st.sampled_from(["lru", "lfu"])),
           "admit_after": draw(st.integers(1, 3)),
           "ttl_steps": draw(st.sampled_from([None, 1, 2, 3]))}
    capacity = draw(st.integers(1, 8))
    steps = draw(st.lists(st.tuples(st.lists(POOL, max_size=10),
                                    st.sampled_from([True, True, True, False])), max_size=24))
    reload_at = draw(st.integers(0, max(len(steps), 1)))
    return capacity, cfg, steps, reload_at


@pytest.mark.parametrize("Map", MAPS)
@settings(max_examples=examples(400), deadline=None)
@given(streams())
def test_random_streams_equal_the_oracle(Map, case):
    capacity, cfg, steps, reload_at = case
    v = ReferenceVocabulary(capacity=capacity, **cfg)
    maps = [Map(capacity, name="t7", **cfg)]
    assert_matches(maps[0], v)
    history: list[tuple[int, list[int]]] = []  # (step, rows given to new ids by the step)
    for k, (ids, training) in enumerate(steps):
        if k == reload_at:  # a checkpoint mid-stream: the restored map continues like the original
            restored = Map(capacity, name="t7", **cfg)
            restored.load_state_dict(maps[0].state_dict())
            assert_matches(restored, v)
            maps.append(restored)
        run_step(maps, v, ids, training, history)
    # valid(): a row looked up at step s is valid iff in use and given its id at or before s
    assigned = {r: step for step, rows in history for r in rows}  # row -> last assignment
    in_use = set(v.rows.values())
    probe = ids_tensor(list(range(-1, capacity + 1)))
    for s in range(v.step + 1):
        want = [r in in_use and assigned[r] <= s for r in probe.tolist()]
        assert maps[0].valid(probe, s).tolist() == want


@pytest.mark.parametrize("Map", MAPS)
def test_hand_made_cases_of_the_oracle(Map):
    m = Map(capacity=4)
    rows, new_ids, new_rows = m.train_step(ids_tensor([10, 20, 30]))
    assert rows.tolist() == [0, 1, 2] and new_ids.tolist() == [10, 20, 30]
    assert m.find(ids_tensor([30, 10, 20, 10, 99])).tolist() == [2, 0, 1, 0, -1]
    assert m.find(ids_tensor([99, 10]), fill=4).tolist() == [4, 0]  # fill: the zero row, say
    # the lowest id takes the last free row, the other evicts 10 (ties on last use: smaller id)
    rows, new_ids, new_rows = m.train_step(ids_tensor([-(2**63), 2**63 - 1]))
    assert rows.tolist() == [3, 0] and new_ids.tolist() == [-(2**63), 2**63 - 1]
    assert new_rows.tolist() == [3, 0]
    assert m.resident()[0].tolist() == [-(2**63), 20, 30, 2**63 - 1]

    m = Map(capacity=2, name="clicks")
    m.train_step(ids_tensor([1]))
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"clicks: this step admits 2 new ids but the shard holds "
                                         r"2 rows, 1 free and 0 evictable"):
        m.train_step(ids_tensor([1, 2, 3]))
    assert_same_snapshot(snapshot(m), before)
    assert m.train_step(ids_tensor([2, 3]))[0].tolist() == [1, 0]

    m = Map(capacity=4, ttl_steps=2)
    for ids in ([1], [2], [2], [2]):
        m.train_step(ids_tensor(ids))
    assert m.resident()[0].tolist() == [2]
    assert m.train_step(ids_tensor([3]))[0].tolist() == [0]


@pytest.mark.parametrize("Map", MAPS)
def test_bad_arguments(Map):
    with pytest.raises(ValueError, match="eviction"):
        VocabMap(4, eviction="fifo")
    with pytest.raises(ValueError, match="capacity"):
        VocabMap(0)
    with pytest.raises(ValueError, match="ttl_steps"):
        VocabMap(4, ttl_steps=0)
    m = Map(4)
    for bad in (ids_tensor([1, 1]), ids_tensor([3, 1, 3]), ids_tensor([[1, 2]]),
                torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError):
            m.train_step(bad)
        assert m.step == 0 and m.keys.numel() == 0


@pytest.mark.parametrize("Map", MAPS)
def test_valid_drops_rows_reassigned_after_the_lookup(Map):
    m = Map(capacity=2, ttl_steps=3)
    rows1 = m.train_step(ids_tensor([10, 20]))[0]          # step 1: rows 0, 1
    m.train_step(ids_tensor([10]))                         # step 2
    assert m.valid(rows1, since=1).tolist() == [True, True]
    assert m.train_step(ids_tensor([30]))[0].tolist() == [1]  # step 3: 30 takes 20's row
    assert m.valid(rows1, since=1).tolist() == [True, False]
    assert m.valid(rows1, since=3).tolist() == [True, True]  # a lookup at step 3 sees 30 there
    assert m.valid(ids_tensor([-1, 2, 5]), since=10).tolist() == [False, False, False]
    for _ in range(3):
        m.train_step(ids_tensor([30]))                    # steps 4-6: 10 (last use 2) expires
    assert m.find(ids_tensor([10])).tolist() == [-1]
    assert m.valid(rows1, since=6).tolist() == [False, True]  # row 0 is free


@pytest.mark.parametrize("Map", MAPS)
def test_counts_beyond_the_bound_forget_the_ids_seen_longest_ago(Map):
    m = Map(capacity=1, admit_after=3)
    assert m.pending_limit == 1024
    m.train_step(torch.arange(0, 1000))                   # step 1: 1000 ids counted once
    m.train_step(torch.arange(1000, 1100))                # step 2: 1100 > 1024
    # the 76 seen longest ago (step 1; ties: smaller ids) are forgotten
    assert m.pending_ids.tolist() == list(range(76, 1100))
    assert m.pending_counts.tolist() == [1] * 1024
    assert m.pending_seen.tolist() == [1] * (1000 - 76) + [2] * 100
    m.train_step(ids_tensor([0, 76]))                     # 0 counts from zero again, 76 twice
    assert m.find(ids_tensor([0, 76])).tolist() == [-1, -1]
    assert m.pending_counts[m.pending_ids == 0].tolist() == [1]
    assert m.pending_counts[m.pending_ids == 76].tolist() == [2]
    rows, new_ids, _ = m.train_step(ids_tensor([0, 76]))
    assert rows.tolist() == [-1, 0] and new_ids.tolist() == [76]
    assert 76 not in m.pending_ids.tolist() and m.pending_ids.numel() <= m.pending_limit
    # 5000 is not admitted yet: ``fill``; 0 is (seen in 3 steps), evicting 76
    assert m.train_step(ids_tensor([5000, 0]), fill=9)[0].tolist() == [9, 0]
    # with admit_after == 1 nothing is counted
    m = Map(capacity=1)
    with pytest.raises(ValueError):
        m.train_step(torch.arange(5))
    m.train_step(torch.arange(1))
    assert m.pending_ids.numel() == 0


def checkpointed_map(Map: type = VocabMap) -> VocabMap:
    m = Map(capacity=4, admit_after=2, eviction="lfu")
    for ids in ([1, 2, 3], [1, 2, 3, 7], [1, 9], [2, 9, 11]):
        m.train_step(ids_tensor(ids))
    s = m.state_dict()
    assert s["ids"].numel() >= 2 and s["pending_ids"].numel() >= 2
    return m


def _set(key, f):
    def corrupt(s):
        s = dict(s)
        s[key] = f(s[key])
        return s
    return corrupt


CORRUPTIONS = {
    "ids unsorted": ("ids", _set("ids", lambda x: x.flip(0))),
    "ids repeated": ("ids", _set("ids", lambda x: torch.cat([x[:1], x[:-1]]))),
    "ids float": ("ids", _set("ids", lambda x: x.double())),
    "ids 2-d": ("ids", _set("ids", lambda x: x[None])),
    "ids missing": ("ids", lambda s: {k: x for k, x in s.items() if k != "ids"}),
    "rows repeated": ("rows", _set("rows", lambda x: torch.full_like(x, int(x[0])))),
    "rows beyond capacity": ("rows", _set("rows", lambda x: x + 4)),
    "rows negative": ("rows", _set("rows", lambda x: x - 10)),
    "rows short": ("rows", _set("rows", lambda x: x[:-1])),
    "last_use in the future": ("last_use", _set("last_use", lambda x: x + 100)),
    "last_use long": ("last_use", _set("last_use", lambda x: torch.cat([x, x[:1]]))),
    "frequency zero": ("frequency", _set("frequency", lambda x: x * 0)),
    "frequency short": ("frequency", _set("frequency", lambda x: x[1:])),
    "pending unsorted": ("pending_ids", _set("pending_ids", lambda x: x.flip(0))),
    "pending resident": ("pending_ids", lambda s: {**s, "pending_ids": s["ids"][:2].clone(),
                                                  "pending_counts": s["pending_counts"][:2]}),
    "pending counts zero": ("pending_counts", _set("pending_counts", lambda x: x * 0)),
    "pending counts short": ("pending_counts", _set("pending_counts", lambda x: x[1:])),
    "step negative": ("step", _set("step", lambda x: -x)),
    "step 1-d": ("step", _set("step", lambda x: x[None])),
}


@pytest.mark.parametrize("Map", MAPS)
@pytest.mark.parametrize("what", sorted(CORRUPTIONS))
def test_a_bad_state_is_rejected_and_changes_nothing(what, Map):
    key, corrupt = CORRUPTIONS[what]
    m = checkpointed_map(Map)
    before = snapshot(m)
    with pytest.raises(ValueError, match=f"'{key}'"):
        m.load_state_dict(corrupt(m.state_dict()))
    assert_same_snapshot(snapshot(m), before)


@pytest.mark.parametrize("Map", MAPS)
def test_a_state_loads_into_another_capacity_when_its_rows_fit(Map):
    m = checkpointed_map(Map)
    s = m.state_dict()
    small = Map(capacity=int(s["rows"].max()), admit_after=2, eviction="lfu")
    with pytest.raises(ValueError, match="'rows'"):
        small.load_state_dict(s)
    assert small.keys.numel() == 0 and small.step == 0
    big = Map(capacity=9, admit_after=2, eviction="lfu")
    big.load_state_dict(s)
    v = oracle_from_state(s, 9, admit_after=2, eviction="lfu")
    assert_matches(big, v)
    assert big.valid(s["rows"], since=m.step).all() and not big.valid(s["rows"], m.step - 1).any()
    for ids in ([20, 21, 22, 23, 24, 25, 26], [20, 21, 22, 23, 24, 25, 26], [1, 30], [30, 31]):
        run_step([big], v, ids, True)


@pytest.mark.parametrize("Map", MAPS)
def test_to_moves_the_state(Map):
    m = checkpointed_map(Map)
    before = snapshot(m)
    m.to("cpu")
    assert m.device == torch.device("cpu")
    assert_same_snapshot(snapshot(m), before)


def skewed_steps(steps: int, size: int, seed: int) -> list[list[int]]:
    """``steps`` sorted lists of ``size`` distinct ids, popular ids most often (a power law)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        draw = (torch.rand(6 * size, generator=gen) ** 2 * 200_000).long() - 50_000  # skewed
        distinct = torch.unique(torch.cat([draw, ids_tensor(EXTREMES)]))
        pick = distinct[torch.randperm(distinct.numel(), generator=gen)[:size]]
        out.append(pick.sort().values.tolist())
    return out


@pytest.fixture
def one_thread():
    """One intra-op thread: the results do not depend on it (test_results_do_not_depend_on_the_
    thread_count), and on a busy machine threads waiting on each other make large steps slow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("cfg", [{"eviction": "lru", "admit_after": 1, "ttl_steps": None},
                                 {"eviction": "lfu", "admit_after": 1, "ttl_steps": None},
                                 {"eviction": "lfu", "admit_after": 2, "ttl_steps": 3}])
@pytest.mark.parametrize("Map", MAPS)
def test_a_large_map_equals_the_oracle(cfg, Map, one_thread):
    capacity = 50_000
    v = ReferenceVocabulary(capacity=capacity, **cfg)
    m = Map(capacity, **cfg)
    gen = torch.Generator().manual_seed(7)
    fill = (torch.randperm(200_000, generator=gen)[:48_000] - 50_000).sort().values.tolist()
    steps = [fill, fill] + skewed_steps(6, 4096, seed=3)  # nearly full, then steps of 4096
    gone = 0
    for k, ids in enumerate(steps):
        before = set(v.rows)
        run_step([m], v, ids, True, full=k in (1, len(steps) - 1))
        gone += len(before - set(v.rows))
    assert gone > 4096  # evicted (or expired) ids
    # many ids in any order, repeated (find sorts them first): resident, evicted, never seen
    gen = torch.Generator().manual_seed(8)
    pool = ids_tensor(fill + steps[-1] + EXTREMES + list(range(-50, 50)))
    query = pool[torch.randint(0, pool.numel(), (30_000,), generator=gen)]
    want = [v.rows.get(i, -1) for i in query.tolist()]
    assert m.find(query).tolist() == want
    assert m.find(query.reshape(100, 300)).flatten().tolist() == want


@pytest.mark.parametrize("Map", MAPS)
def test_results_do_not_depend_on_the_thread_count(Map):
    steps = skewed_steps(6, 4096, seed=11)
    results = []
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            # rows reused (evictions, expiry); counts beyond the bound forgotten
            for m in (Map(5_000, eviction="lfu", ttl_steps=3),
                      Map(1_000, eviction="lru", admit_after=2)):
                outs = [m.train_step(ids_tensor(ids)) for ids in steps]
                results.append((outs, snapshot(m)))
    finally:
        torch.set_num_threads(threads)
    for (o1, s1), (o2, s2) in zip(results[:2], results[2:]):
        assert all(torch.equal(a, b) for x, y in zip(o1, o2) for a, b in zip(x, y))
        assert_same_snapshot(s1, s2)
    assert sum(len(new_ids) for _, new_ids, _ in results[0][0]) > 5_000
    assert results[1][1]["pending_ids"].numel() == 4_000


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@settings(max_examples=examples(40), deadline=None)
@given(streams())
def test_random_streams_on_cuda_equal_the_oracle(case):
    capacity, cfg, steps, _ = case
    v = ReferenceVocabulary(capacity=capacity, **cfg)
    maps = [VocabMap(capacity, device="cuda", **cfg)]
    for ids, training in steps:
        run_step(maps, v, ids, training)


@requires_native
@settings(max_examples=examples(150), deadline=None)
@given(streams(), st.lists(st.booleans(), min_size=24, max_size=24))
def test_the_native_map_switching_to_torch_ops_and_back_equals_the_oracle(case, kernels_on):
    """Steps taken by VocabMap's torch ops (kernels switched off) leave the hash index stale; it is
    rebuilt when the kernels apply again."""
    capacity, cfg, steps, _ = case
    v = ReferenceVocabulary(capacity=capacity, **cfg)
    m = NativeVocabMap(capacity, name="t7", **cfg)
    try:
        for (ids, training), on in zip(steps, kernels_on):
            cpu.set_enabled(on)
            run_step([m], v, ids, training)
    finally:
        cpu.set_enabled(True)


def test_the_one_map_factory_makes_the_backends_kind():
    assert type(vocab_map(4, FUSED_CPU, eviction="lfu")) is NativeVocabMap
    assert type(vocab_map(4, TORCH_OPS, eviction="lfu")) is VocabMap
    assert choose("cpu") is (FUSED_CPU if cpu.available() else TORCH_OPS)
    previous = cpu.set_enabled(False)
    try:
        assert choose("cpu") is TORCH_OPS
    finally:
        cpu.set_enabled(previous)


# ---------------------------------------------------------------- the native map's compact layout
def held_bytes(m: VocabMap) -> int:
    """The bytes of every tensor the map holds (each storage once), its counted ids' aside."""
    seen = {}
    for key, v in vars(m).items():
        if isinstance(v, torch.Tensor) and not key.startswith("pending_"):
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def random_ids(n: int, seed: int) -> torch.Tensor:
    """(n,) distinct int64 ids over the whole range, in random order."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.unique(torch.randint(-(2**63), 2**63 - 1, (n + n // 50 + 16,), generator=gen))
    return ids[torch.randperm(ids.numel(), generator=gen)[:n]]


@_NO_KERNELS
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_the_native_map_holds_at_most_48_bytes_per_resident_id_at_any_fill(eviction, one_thread):
    """Filled by steps of 4096 new ids (and a few resident ones) to 10%, 57% and 100% of 100k
    rows, then evicting; filled by one step; loaded from a checkpoint: every tensor it holds,
    over its resident ids, is at most 48 bytes (the sorted layout's: 111 at 57%)."""
    capacity = 100_000
    pool = random_ids(200_000, seed=5)
    m = NativeVocabMap(capacity, eviction=eviction)
    resident, per_id = 0, {}
    for target in (10_000, 57_000, 100_000, 112_288):
        while resident < target:
            new = min(4096, target - resident)
            hits = pool[max(resident - 1000, 0):resident]  # resident: used again
            step = torch.cat([hits, pool[resident:resident + new]])
            m.train_step(step)
            resident += new
            per_id[resident] = held_bytes(m) / min(resident, capacity)
    assert max(per_id.values()) <= 48, per_id
    queue = 3.0 if eviction == "lru" else 0  # LRU's eviction queue, once every row is held
    assert per_id[10_000] <= 48 and per_id[57_000] <= 48 and per_id[100_000] < 30.001 + queue
    assert m.nbytes(pending=False) == held_bytes(m) <= m.nbytes()
    assert m.n_resident == capacity
    # one step to 57%, and a checkpoint of it loaded
    m = NativeVocabMap(capacity, eviction=eviction)
    m.train_step(pool[:57_000])
    assert held_bytes(m) / 57_000 <= 48
    loaded = NativeVocabMap(capacity, eviction=eviction)
    loaded.load_state_dict(m.state_dict())
    assert held_bytes(loaded) / 57_000 <= 48
    assert torch.equal(loaded.find(pool[:60_000]), m.find(pool[:60_000]))


@st.composite
def growing_streams(draw):
    """Streams over capacities up to 40 and steps of up to 30 ids: the native map's held rows
    grow through 1, 2, 3, 4, 6, 9, 13, 19, 28, 40 (or straight to what a step needs) while ids
    are counted, admitted, evicted and expire."""
    cfg = {"eviction": draw(st.sampled_from(["lru", "lfu"])),
           "admit_after": draw(st.integers(1, 3)),
           "ttl_steps": draw(st.sampled_from([None, 1, 2, 4]))}
    capacity = draw(st.integers(1, 40))
    pool = st.one_of(st.integers(-20, 60), st.sampled_from(EXTREMES))
    steps = draw(st.lists(st.tuples(st.lists(pool, max_size=30),
                                    st.sampled_from([True, True, True, True, False])),
                          max_size=20))
    reload_at = draw(st.integers(0, max(len(steps), 1)))
    return capacity, cfg, steps, reload_at


@_NO_KERNELS
@pytest.mark.parametrize("Map", [NativeVocabMap, HeldNativeVocabMap])
@settings(max_examples=examples(300), deadline=None)
@given(growing_streams())
def test_the_native_map_growing_its_rows_equals_the_oracle(Map, case):
    capacity, cfg, steps, reload_at = case
    v = ReferenceVocabulary(capacity=capacity, **cfg)
    maps = [Map(capacity, name="t7", **cfg)]
    for k, (ids, training) in enumerate(steps):
        if k == reload_at:  # a checkpoint mid-stream into a map holding its first rows only
            restored = Map(capacity, name="t7", **cfg)
            restored.load_state_dict(maps[0].state_dict())
            maps.append(restored)
        run_step(maps, v, ids, training)
        for m in maps:  # the rows held: every row in use, at most the capacity
            used = (m._born >= 0).nonzero()
            assert m.n_resident == used.numel() == len(v.rows)
            assert used.numel() == 0 or int(used.max()) < m._ids.numel() <= capacity
            assert m.slots.numel() == vocab._slots_for(m._ids.numel())


@_NO_KERNELS
@pytest.mark.parametrize("Map", [NativeVocabMap, HeldNativeVocabMap])
def test_a_checkpoint_of_a_growing_map_loads_into_a_fresh_one_and_continues_alike(Map):
    """The state's content and format do not depend on the rows held: a fresh map of the same
    capacity (native or not) loads it and continues exactly as the saved one, with the oracle."""
    capacity = 300
    cfg = {"eviction": "lfu", "admit_after": 2, "ttl_steps": 6}
    m, v = Map(capacity, **cfg), ReferenceVocabulary(capacity=capacity, **cfg)
    gen = torch.Generator().manual_seed(13)  # ids of 600 (the counts stay below their bound)
    pool = ids_tensor(list(range(-297, 297)) + EXTREMES)
    steps = [pool[torch.randperm(600, generator=gen)[:n]].tolist()
             for n in [3, 9, 30, 60, 120] * 8]
    held = []
    for k, ids in enumerate(steps):
        if k % 7 == 3:
            s = m.state_dict()
            assert set(s) == {"ids", "rows", "last_use", "frequency", "pending_ids",
                              "pending_counts", "pending_seen", "step"}
            assert all(x.dtype == torch.int64 for x in s.values())
            others = [Map(capacity, **cfg), VocabMap(capacity, **cfg)]
            for o in others:
                o.load_state_dict(s)
                got = o.state_dict()
                assert all(torch.equal(got[key], s[key]) for key in s)
            w = oracle_from_state(s, capacity, **cfg)
            for later in steps[k:k + 6]:
                run_step(others, w, later, True)
        run_step([m], v, ids, True)
        held.append(m._ids.numel())
    assert held[0] < held[-1] and len(set(held)) > 3  # it grew, several times


@_NO_KERNELS
@pytest.mark.parametrize("wide", [False, True])
@settings(max_examples=examples(100), deadline=None)
@given(streams())
def test_steps_and_frequencies_beyond_int32_widen_the_native_map_exactly(wide, case):
    """A map loaded at step 2**31 - 3 (with frequencies near 2**31, or beyond) keeps int32 step
    values while they fit, then int64: the results are the oracle's throughout."""
    capacity, cfg, steps, _ = case
    state = VocabMap(capacity + 2).state_dict()
    state["step"] = torch.tensor(2**31 - 3)
    state["ids"], state["rows"] = torch.tensor([-5, 7]), torch.tensor([capacity + 1, 0])
    state["last_use"] = torch.tensor([2**31 - 4, 2**31 - 3])
    state["frequency"] = torch.tensor([2**31 - 2 if not wide else 2**40, 2**31 - 3])
    v = oracle_from_state(state, capacity + 2, **cfg)
    m = NativeVocabMap(capacity + 2, name="t7", **cfg)
    m.load_state_dict(state)
    assert m._last.dtype == (torch.int64 if wide else torch.int32)
    for ids, training in steps:
        run_step([m], v, ids, training)
        # int32 while the next step's values fit: after one step (2**31 - 1 at most), not two
        assert m._last.dtype == m._freq.dtype == m._born.dtype == (
            torch.int64 if wide or m.step >= 2**31 - 1 else torch.int32)


@_NO_KERNELS
@settings(max_examples=examples(60), deadline=None)
@given(streams())
def test_a_shard_of_2_31_rows_indexes_them_in_int64_as_int32_does_below(case):
    """From a capacity of 2**31 rows the index holds int64 slots: it gives the rows an int32
    index gives a capacity of 2**31 - 1 (no step here fills either)."""
    _, cfg, steps, _ = case
    with unittest.mock.patch.object(torch_map, "_physical_memory", lambda: None):  # (held: a few)
        wide, narrow = NativeVocabMap(2**31, **cfg), NativeVocabMap(2**31 - 1, **cfg)
        assert wide.slots.dtype == torch.int64 and narrow.slots.dtype == torch.int32
        for ids, training in steps:
            distinct = ids_tensor(shuffled(sorted(set(ids))))
            if training:
                a, b = wide.train_step(distinct), narrow.train_step(distinct)
                assert all(torch.equal(x, y) for x, y in zip(a, b))
            assert torch.equal(wide.find(ids_tensor(ids)), narrow.find(ids_tensor(ids)))
            assert torch.equal(wide.valid(ids_tensor(list(range(-1, 9))), wide.step),
                               narrow.valid(ids_tensor(list(range(-1, 9))), narrow.step))
        sw, sn = wide.state_dict(), narrow.state_dict()
    assert all(torch.equal(sw[k], sn[k]) for k in sw)


@pytest.mark.parametrize("Map", MAPS)
def test_row_values_and_ids_of_rows_read_every_row_of_the_capacity(Map):
    """Per row of the capacity (free rows and rows never held: 0), as VocabMap's tensors say."""
    m = Map(capacity=50, ttl_steps=3, eviction="lfu")
    for ids in ([1, 2, 3], [2, 3, 4, 5, 6, 7], [3, 8], [3, 8], [3, 8, 9], [3, 9]):
        m.train_step(ids_tensor(ids))  # 1 expires at step 5, 2 and 4-7 at step 6
    used = m.row_used
    for key, full in (("ids", m.row_key), ("last_use", m.last_use),
                      ("frequency", m.frequency)):
        want = torch.where(used, full, 0)
        assert torch.equal(m.row_values(key), want)
        rows = ids_tensor([49, 0, 3, 8, 1, 2, 30])
        assert torch.equal(m.row_values(key, rows), want[rows])
    rows = ids_tensor([0, 1, 2, 5, 8, 49])
    assert torch.equal(m.ids_of_rows(rows), m.row_key[rows])
    held = m.row_ids()
    assert torch.equal(held, m.row_key[:held.numel()]) and not m.row_key[held.numel():].any()
    assert m.n_resident == m.keys.numel() == 3


@st.composite
def stacks(draw):
    """Several maps stepped together: each its own capacity (up to 40), eviction and TTL
    (``admit_after`` 2 sometimes: then the fused steps do not apply), and steps naming some
    of the maps with their ids (an empty run too)."""
    k = draw(st.integers(1, 4))
    cfgs = [{"eviction": draw(st.sampled_from(["lru", "lfu"])),
             "admit_after": draw(st.sampled_from([1, 1, 1, 1, 2])),
             "ttl_steps": draw(st.sampled_from([None, 1, 2, 4]))} for _ in range(k)]
    capacities = [draw(st.integers(1, 40)) for _ in range(k)]
    pool = st.one_of(st.integers(-20, 60), st.sampled_from(EXTREMES))
    steps = draw(st.lists(st.lists(st.one_of(st.none(), st.lists(pool, max_size=30)),
                                   min_size=k, max_size=k), max_size=16))
    return cfgs, capacities, steps


@_NO_KERNELS
@settings(max_examples=examples(200), deadline=None)
@given(stacks(), st.sampled_from([1, 2]))
def test_maps_stepped_together_equal_each_map_stepped_alone(case, threads):
    """``train_steps`` (two fused calls for every map) gives each map's ``train_step`` results
    (as shard rows: its start added), leaves the same state, writes the admitted ids' initial
    values (``init_normal``, each map's seed) and fresh slots, and where it does not apply (``admit_after > 1``,
    an overflow) returns None having changed nothing."""
    cfgs, capacities, steps = case
    together = [NativeVocabMap(c, name=f"t{k}", **cfg)
                for k, (c, cfg) in enumerate(zip(capacities, cfgs))]
    alone = [NativeVocabMap(c, name=f"t{k}", **cfg)
             for k, (c, cfg) in enumerate(zip(capacities, cfgs))]
    starts = [sum(capacities[:k]) for k in range(len(capacities))]
    seeds = [11 * k - 5 for k in range(len(capacities))]
    d, width = 3, 0.9
    rows_total = sum(capacities) + 1
    table, want_table = torch.zeros(rows_total, d), torch.zeros(rows_total, d)
    slots = [(torch.zeros(rows_total, d), 0.5), (torch.zeros(rows_total, 1), -1.25)]
    want_slots = [torch.zeros(rows_total, d), torch.zeros(rows_total, 1)]
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in steps:
            named = [k for k, ids in enumerate(step) if ids is not None]
            runs = [shuffled(sorted(set(step[k]))) for k in named]
            flat = ids_tensor([i for r in runs for i in r])
            before = [snapshot(together[k]) for k in named]
            got = vocab.train_steps([together[k] for k in named], flat,
                                    [len(r) for r in runs], [starts[k] for k in named],
                                    [seeds[k] for k in named],
                                    (table, (0, d), 0.05, width, 2.0), slots)
            want, failed = [], False
            for k, r in zip(named, runs):
                try:
                    want.append(alone[k].train_step(ids_tensor(r)))
                except ValueError:
                    failed = True  # (the other maps step on: ``alone`` is only compared below)
                    break
            if got is None:
                assert failed or any(together[k].admit_after > 1 for k in named)
                for k, b in zip(named, before):  # nothing changed
                    assert_same_snapshot(snapshot(together[k]), b)
                for k, r in zip(named, runs):  # the caller's way then: a map at a time
                    try:
                        together[k].train_step(ids_tensor(r))
                    except ValueError:
                        break
                continue
            assert not failed
            rows, new_ids, new_rows, admitted = got
            assert admitted == [w[1].numel() for w in want]
            assert rows.tolist() == [x for k, w in zip(named, want)
                                     for x in (w[0] + starts[k]).tolist()]
            assert new_ids.tolist() == [x for w in want for x in w[1].tolist()]
            assert new_rows.tolist() == [x for k, w in zip(named, want)
                                         for x in (w[2] + starts[k]).tolist()]
            for k, w in zip(named, want):
                cpu.init_normal(seeds[k], w[1], w[2] + starts[k], (0, d), 0.05, width, 2.0,
                                   want_table)
                for (_, value), want_slot in zip(slots, want_slots):
                    want_slot.index_fill_(0, w[2] + starts[k], value)
            assert torch.equal(table, want_table)
            for (slot, _), want_slot in zip(slots, want_slots):
                assert torch.equal(slot, want_slot)
            for k in range(len(together)):
                assert_same_snapshot(snapshot(together[k]), snapshot(alone[k]))
            # evaluation: every map's find at once, the same as each map's, nothing changed
            asked = [r + [99, -(2**63)] for r in runs]
            before = [snapshot(together[k]) for k in named]
            found = vocab.find_many([together[k] for k in named],
                                    ids_tensor([i for r in asked for i in r]),
                                    [len(r) for r in asked], [starts[k] for k in named], -7)
            want_found = [x for k, r in zip(named, asked)
                          for x in torch.where(alone[k].find(ids_tensor(r)) < 0, -7,
                                               alone[k].find(ids_tensor(r)) + starts[k]).tolist()]
            assert found.tolist() == want_found
            for k, b in zip(named, before):
                assert_same_snapshot(snapshot(together[k]), b)
    finally:
        torch.set_num_threads(old)


@_NO_KERNELS
@pytest.mark.parametrize("ttl", [None, 50])
def test_lru_evictions_from_the_queue_equal_the_oracle(ttl):
    """An LRU map that evicts a few ids a step takes its victims from its eviction queue (the
    lowest candidates of the last scan) for several steps between scans: the same victims as
    the oracle's, step after step, hits and TTL expiries invalidating entries on the way."""
    capacity = 4096  # a queue of 128 entries
    v = ReferenceVocabulary(capacity=capacity, eviction="lru", ttl_steps=ttl)
    m = NativeVocabMap(capacity, eviction="lru", ttl_steps=ttl)
    gen = torch.Generator().manual_seed(11)
    served = 0
    for k in range(100):
        draw = (torch.rand(300, generator=gen) ** 4 * 10_000).long()  # popular ids most often
        ids = torch.unique(draw).tolist()
        before = m._queued
        run_step([m], v, ids, True, full=k % 20 == 19)
        served += before[0] > 0 and before[1] > 0 and m._queued[0] == before[0] \
            and m._queued[1] > before[1]
    assert m._queue is not None and served >= 10, served
    assert_matches(m, v)


@_NO_KERNELS
def test_maps_stepped_together_refuse_runs_that_do_not_fit_and_change_nothing():
    """Runs that do not cover the ids, a missing start or seed, ids not 1-D, bad offsets or
    miss counts below: a ValueError naming the maps or the kernel, before any map changes."""
    maps = [NativeVocabMap(10, name="a"), NativeVocabMap(10, name="b")]
    maps[0].train_step(ids_tensor([5]))
    before = [snapshot(m) for m in maps]
    fields = torch.zeros(2, len(cpu.MAP_FIELDS), dtype=I64)
    cases = [
        (lambda: vocab.train_steps(maps, ids_tensor([1, 2, 3]), [1, 1], [0, 10], [1, 2]),
         r"train_steps of \['a', 'b'\]"),
        (lambda: vocab.train_steps(maps, ids_tensor([1, 2]), [1, 1], [0], [1, 2]),
         r"train_steps of \['a', 'b'\]"),
        (lambda: vocab.train_steps(maps, ids_tensor([1, 2]), [3, -1], [0, 10], [1, 2]),
         r"train_steps of \['a', 'b'\]"),
        (lambda: vocab.find_many(maps, ids_tensor([1, 2]).reshape(1, 2), [1, 1], [0, 10], -1),
         r"find_many of \['a', 'b'\]"),
        (lambda: cpu.dedup_raw_runs([ids_tensor([1])], [2]), "ec_dedup_raw_runs: runs"),
        (lambda: cpu.vocab_find_many(fields, ids_tensor([1, 2]), ids_tensor([0, 5, 2])),
         "ec_vocab_find_many: offsets"),
        (lambda: cpu.vocab_step_many(fields, ids_tensor([1, 2]), ids_tensor([0, 1, 2]),
                                        ids_tensor([0, 1]), ids_tensor([2, 0]),
                                        torch.zeros(14, dtype=I64), None),
         "ec_vocab_step_many: missing"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    for m, b in zip(maps, before):
        assert_same_snapshot(snapshot(m), b)
