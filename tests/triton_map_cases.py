"""The raw-id map on the device (state/vocab/device_map.py, state/vocab/device_hash.py, kernels/gpu/index.py)
against the oracle (``ReferenceVocabulary``) and the torch-ops ``VocabMap``, bit for bit.

Like tests/triton_cases.py: compiled on CUDA tensors with a GPU, else in Triton's interpreter on
CPU tensors (this file sets ``TRITON_INTERPRET=1`` before triton is imported; tests/test_triton.py
runs it in a fresh interpreter). Small maps, few examples: the interpreter is slow.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from profiles import examples  # noqa: E402
from sync_guard import no_sync  # noqa: E402

from embcore.kernels import gpu  # noqa: E402
from embcore.state.vocab.device_hash import DeviceHash, stack  # noqa: E402
from embcore.ops.backend import TRITON, choose  # noqa: E402
from embcore.state.vocab.device_map import DeviceVocabMap, train_together  # noqa: E402
from embcore.state.vocab.vocabulary import vocab_map  # noqa: E402
from embcore.state.vocab.torch_map import VocabMap  # noqa: E402
from embcore.state.vocab.reference import ReferenceVocabulary  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
if not gpu.available():
    pytest.skip(f"triton does not load: {gpu.error()}", allow_module_level=True)
if not CUDA and not gpu.interpreted():
    pytest.skip("no CUDA GPU, and the kernels were loaded before TRITON_INTERPRET=1 was set: "
                "run this file alone", allow_module_level=True)

EXTREMES = [-2**63, -1, 0, 2**63 - 1]


def _ids(values) -> torch.Tensor:
    return torch.tensor(sorted(set(values)), dtype=torch.int64, device=DEVICE)


def _same_state(a: VocabMap, b: VocabMap, where: str) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), (where, k, sa[k], sb[k])


maps = st.fixed_dictionaries({
    "capacity": st.integers(1, 8),
    "eviction": st.sampled_from(["lru", "lfu"]),
    "admit_after": st.sampled_from([1, 1, 2, 3]),
    "ttl_steps": st.sampled_from([None, None, 1, 2, 3]),
})
pool = st.one_of(st.integers(-4, 20), st.sampled_from(EXTREMES))


@settings(max_examples=examples(40), deadline=None)
@given(maps, st.lists(st.lists(pool, max_size=12), min_size=1, max_size=14))
def test_steps_equal_the_oracle_and_the_torch_map(kw, steps):
    """Every step's rows, admitted ids, errors and state: the oracle's and VocabMap's."""
    oracle = ReferenceVocabulary(**kw)
    plain = VocabMap(**kw, device=DEVICE)
    dev = DeviceVocabMap(**kw, device=DEVICE)
    for s, values in enumerate(steps):
        ids = _ids(values)
        try:
            want = oracle.lookup(ids.tolist(), training=True)
        except ValueError:
            with pytest.raises(ValueError) as got:
                dev.train_step(ids)
            with pytest.raises(ValueError) as plain_got:
                plain.train_step(ids)
            assert str(got.value) == str(plain_got.value)
            _same_state(plain, dev, f"step {s} (overflow)")
            continue
        rows, new_ids, new_rows = dev.train_step(ids)
        p_rows, p_new, p_new_rows = plain.train_step(ids)
        assert [r if r >= 0 else None for r in rows.tolist()] == want, s
        assert torch.equal(rows, p_rows) and torch.equal(new_ids, p_new) \
            and torch.equal(new_rows, p_new_rows), s
        _same_state(plain, dev, f"step {s}")
        probe = _ids([*values, 7, -3, 2**63 - 1])
        assert torch.equal(dev.find(probe), plain.find(probe))
        assert dev.step == plain.step == oracle.step


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_eviction_takes_the_lowest_score_then_the_smaller_id(eviction):
    """Ids 1..4 at rows 0..3, then used so that (last use, frequency) are 1: (4, 4), 2: (1, 1),
    3: (3, 3), 4: (4, 2). Two new ids: LRU evicts 2 then 3, LFU 2 then 4; then LFU's ties at one
    use go to the smaller id; and a tie of both rules goes to the smaller id in the larger row
    (not the smaller row)."""
    m = DeviceVocabMap(4, eviction=eviction, device=DEVICE)
    for ids in ([1, 2, 3, 4], [1, 3], [1, 3], [1, 4]):
        m.train_step(_ids(ids))
    _, new_ids, new_rows = m.train_step(_ids([7, 8]))
    assert new_ids.tolist() == [7, 8]
    assert new_rows.tolist() == ([1, 2] if eviction == "lru" else [1, 3])
    if eviction == "lfu":
        # 4 comes back: 7 (row 1) and 8 (row 3) tie at one use, the smaller id leaves
        assert m.train_step(_ids([1, 3, 4]))[2].tolist() == [1]
        # 9: 4 (row 1) and 8 (row 3) tie at one use, the smaller id leaves
        assert m.train_step(_ids([1, 3, 9]))[2].tolist() == [1]
    # a tie whose smaller id holds the larger row (ties above put it in the smaller row too):
    # 5 at row 0, 3 at row 1, both last used at step 3, twice each; 9 takes row 1, as 3 leaves
    m = DeviceVocabMap(2, eviction=eviction, device=DEVICE)
    for ids in ([5], [3], [3, 5]):
        m.train_step(_ids(ids))
    assert m.train_step(_ids([9]))[2].tolist() == [1]
    assert m.find(_ids([3, 5, 9])).tolist() == [-1, 0, 1]


def test_counts_beyond_the_bound_are_forgotten_as_the_torch_map_does():
    """More counted ids than ``pending_limit`` (1024 here): the same ids are forgotten."""
    rng = random.Random(0)
    plain, dev = VocabMap(4, admit_after=6), DeviceVocabMap(4, admit_after=6, device=DEVICE)
    for s in range(6):
        ids = _ids(rng.randrange(0, 3000) for _ in range(700))
        for x, y in zip(plain.train_step(ids), dev.train_step(ids)):
            assert torch.equal(x, y.cpu()), s
        _same_state(plain, dev, f"step {s}")
    assert plain.pending_ids.numel() == plain.pending_limit


def test_async_steps_read_nothing_back_and_overflow_is_raised_by_confirm():
    """``train_step_async`` issues no op that would synchronise on CUDA; it gives
    ``train_step``'s rows; an overflow changes nothing (nor do the steps after it) until
    ``confirm`` raises ``train_step``'s error and rewinds the step counter."""
    plain = VocabMap(3, eviction="lfu", admit_after=2, ttl_steps=2)
    dev = DeviceVocabMap(3, eviction="lfu", admit_after=2, ttl_steps=2, device=DEVICE)
    seq = [[5, 1, 2], [2, 1], [9, 1, 2, 3], [3, 9], [4, 9, 8, 7, 3], [7, 8, 4, 6]]
    for s, values in enumerate(seq):
        ids = torch.tensor(values, dtype=torch.int64, device=DEVICE)  # unsorted: the async
        with no_sync():  # step sorts them itself
            rows, admitted, new_rows, overflow = dev.train_step_async(ids, fill=-1)
        try:
            want, new_ids, _ = plain.train_step(ids)
        except ValueError as e:
            with pytest.raises(ValueError) as got:
                dev.confirm()
            assert str(got.value) == str(e)
            assert bool(overflow)
            _same_state(plain, dev, f"step {s} (overflow)")
            continue
        assert not bool(overflow)
        assert torch.equal(rows.cpu(), want)
        assert sorted(ids[admitted].tolist()) == new_ids.tolist()
        assert torch.equal(new_rows[admitted].cpu(), want[admitted.cpu()])
        dev.confirm()
        _same_state(plain, dev, f"step {s}")
    # an overflow followed by more unconfirmed steps: none of them changes anything
    dev = DeviceVocabMap(3, device=DEVICE)
    dev.train_step(torch.tensor([1], device=DEVICE))
    before = dev.state_dict()
    dev.train_step_async(torch.arange(10, 20, device=DEVICE))  # 10 ids for 3 rows
    dev.train_step_async(torch.tensor([5], device=DEVICE))
    assert dev.step == 3
    with pytest.raises(ValueError, match="admits 10 new ids but the shard holds 3 rows"):
        dev.confirm()
    assert dev.step == 1
    after = dev.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    dev.confirm()  # read once: nothing more to raise
    assert dev.train_step(torch.tensor([5], device=DEVICE))[0].tolist() == [1]


@settings(max_examples=examples(20), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "delete", "rebuild"]),
                          st.lists(st.one_of(st.integers(-40, 40), st.sampled_from(EXTREMES)),
                                   max_size=10)), max_size=12))
def test_hash_index_finds_what_a_dict_holds(ops):
    """An owner of 6 places (keys racing for the same slots of a 16-slot index): inserts, some
    lanes masked out, deletions and rebuilds; ``find`` answers as a dict does."""
    owner = torch.zeros(6, dtype=torch.int64, device=DEVICE)  # the key at each place
    index = DeviceHash(6, owner)
    assert index.slots == 16 and index.slot.dtype == torch.int32
    held: dict[int, int] = {}  # key -> place
    for op, keys in ops:
        keys = list(dict.fromkeys(keys))
        if op == "insert":
            free = [v for v in range(6) if v not in held.values()]
            new = [k for k in keys if k not in held][:len(free)]
            if not new:
                continue
            take = [i % 3 != 2 for i in range(len(new))]
            for k, v, t in zip(new, free, take):
                if t:
                    owner[v] = k
            if index.due(len(new)):
                held_mask = torch.zeros(6, dtype=torch.bool, device=DEVICE)
                held_mask[list(held.values())] = True
                index.rebuild(held_mask)
            index.insert(torch.tensor(new, device=DEVICE), torch.tensor(free[:len(new)],
                                                                        device=DEVICE),
                         torch.tensor(take, device=DEVICE))
            held.update({k: v for k, v, t in zip(new, free, take) if t})
        elif op == "delete":
            gone = [k for k in keys if k in held]
            if gone:
                index.delete(torch.tensor(gone, device=DEVICE),
                             torch.tensor([held[k] for k in gone], device=DEVICE),
                             torch.ones(len(gone), dtype=torch.bool, device=DEVICE))
                for k in gone:
                    del held[k]
        else:
            held_mask = torch.zeros(6, dtype=torch.bool, device=DEVICE)
            held_mask[list(held.values())] = True
            index.rebuild(held_mask)
        probe = list(held) + keys + EXTREMES
        got = index.find(torch.tensor(probe, dtype=torch.int64, device=DEVICE)).tolist()
        assert got == [held.get(k, -1) for k in probe]
        assert int((index.slot[:index.slots] == 0).sum()) >= index.slots // 4  # probes end


def test_a_map_churning_for_many_steps_keeps_a_quarter_of_its_slots_empty():
    """Every step evicts every id (fresh ids, 4 rows): deleted slots pile up until the index
    is rebuilt; it always keeps a quarter of its slots empty, and finds what the map holds."""
    m = DeviceVocabMap(4, device=DEVICE)
    for s in range(40):
        ids = torch.arange(4 * s, 4 * s + 4, device=DEVICE) * 7919 - 50
        rows, _, _ = m.train_step(ids)
        slots = m.index.slot[:m.index.slots]
        assert int((slots == 0).sum()) >= m.index.slots // 4, s
        assert torch.equal(m.find(ids), rows)


def test_the_device_map_is_the_triton_backends_where_the_kernels_apply():
    if CUDA:
        assert choose(DEVICE) is TRITON
        assert type(vocab_map(4, choose(DEVICE), device=DEVICE)) is DeviceVocabMap
        return
    previous = gpu.force_on_cpu(True)
    try:
        assert choose("cpu") is TRITON
        assert type(vocab_map(4, choose("cpu"), eviction="lfu")) is DeviceVocabMap
    finally:
        gpu.force_on_cpu(previous)
    assert choose("cpu") is not TRITON
    assert type(vocab_map(4, choose("cpu"), eviction="lfu")) is not DeviceVocabMap


def test_one_launch_over_several_indexes_answers_as_each_alone():
    """Three indexes over their own owners (the same keys in two of them, at other places):
    ``stack``'s find, delete and insert of runs act on each index as its own calls would."""
    owners = [torch.tensor(k, dtype=torch.int64, device=DEVICE)
              for k in ([5, 6, 7, 8], [7, 5, 2**63 - 1, -9, 40], [1])]
    indexes = [DeviceHash(o.numel(), o) for o in owners]
    for h, o in zip(indexes, owners):
        h.rebuild(torch.ones(o.numel(), dtype=torch.bool, device=DEVICE))
    runs = [[5, 7, 9], [7, 2**63 - 1, 1, 5], [1, 5]]
    many = stack(indexes, [len(r) for r in runs])
    assert many is not None
    keys = torch.tensor([k for r in runs for k in r], device=DEVICE)
    assert many.find(keys).tolist() == [0, 2, -1, 0, 2, -1, 1, 0, -1]
    # delete 7 from the first and 5 from the second; insert 9 at place 2 of the first
    many.delete(keys, torch.tensor([0, 2, 0, 0, 0, 0, 1, 0, 0], device=DEVICE),
                torch.tensor([0, 1, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool, device=DEVICE))
    owners[0][2] = 9
    many.insert(keys, torch.tensor([0, 0, 2, 0, 0, 0, 0, 0, 0], device=DEVICE),
                torch.tensor([0, 0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bool, device=DEVICE))
    assert many.find(keys).tolist() == [0, -1, 2, 0, 2, -1, -1, 0, -1]
    assert indexes[1].find(torch.tensor([5, 7], device=DEVICE)).tolist() == [-1, 0]


@settings(max_examples=examples(15), deadline=None)
@given(st.lists(maps, min_size=2, max_size=3),
       st.lists(st.lists(st.lists(pool, max_size=8), min_size=3, max_size=3), min_size=1,
                max_size=8))
def test_maps_stepped_together_equal_each_stepped_alone(kws, steps):
    """``train_together`` (one read back, the indexes' kernels launched once over all the
    maps) gives each map's ``train_step``; an overflow in one changes none."""
    alone = [VocabMap(**kw, device=DEVICE) for kw in kws]
    together = [DeviceVocabMap(**kw, device=DEVICE) for kw in kws]
    for s, runs in enumerate(steps):
        runs = [_ids(r) for r in runs[:len(kws)]]
        try:
            got = train_together(together, runs)
        except ValueError as e:
            assert any(_overflows(m, r) for m, r in zip(alone, runs)), e
            for a, b in zip(alone, together):
                _same_state(a, b, f"step {s} (overflow)")
            continue
        for a, b, r, g in zip(alone, together, runs, got):
            want = a.train_step(r)
            for x, y in zip(want, g):
                assert torch.equal(x, y), s
            _same_state(a, b, f"step {s}")


def _overflows(m: VocabMap, ids: torch.Tensor) -> bool:
    import copy
    try:
        copy.deepcopy(m).train_step(ids)
    except ValueError:
        return True
    return False


def test_an_async_step_of_ids_that_are_not_integers_is_refused():
    m = DeviceVocabMap(3, device=DEVICE)
    with pytest.raises(ValueError, match="integer tensor of ids"):
        m.train_step_async(torch.tensor([1.0, 2.0], device=DEVICE))
    with pytest.raises(ValueError, match="must be 1-D"):
        m.train_step_async(torch.tensor([[1, 2]], device=DEVICE))
    assert m.step == 0 and m.n_resident == 0


# -------------------------------------------------------------- new rows' initial values
@settings(max_examples=examples(25), deadline=None)
@given(st.lists(st.one_of(st.integers(-2**63, 2**63 - 1), st.sampled_from(EXTREMES)),
                min_size=1, max_size=40, unique=True),
       st.one_of(st.integers(-2**63, 2**64 - 1), st.sampled_from([0, 1, -1, 2**64 - 1])),
       st.integers(1, 40), st.data(),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_one_kernel_writes_the_new_rows_initial_values_bit_for_bit(ids, seed, dim, data, dtype):
    """The Triton backend's new rows (``initialize_rows``: one kernel, hash -> uniform ->
    truncated normal, on the device) equal the torch ops' ``initial_values`` bit for bit, in
    any columns of the table, rounded to a 16-bit table's dtype; rows not taken, and rows of
    no id, are left alone."""
    import embcore as ec
    from embcore.state.vocab.vocabulary import initial_values, initialize_rows
    c0 = data.draw(st.integers(0, dim - 1))
    c1 = data.draw(st.integers(c0 + 1, dim))
    n = len(ids)
    take = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)),
                        device=DEVICE)
    t = ec.TableConfig(vocabulary_size=4, dim=dim, dynamic=ec.DynamicVocabulary())
    x = torch.tensor(ids, dtype=torch.int64)
    want = initial_values(t, "t", seed, x)[:, c0:c1].to(dtype)  # torch ops, on the CPU
    rows = torch.randperm(n + 3, generator=torch.Generator().manual_seed(n))[:n].to(DEVICE)
    out = torch.full((n + 3, c1 - c0), 7.0, dtype=dtype, device=DEVICE)
    previous = gpu.force_on_cpu(True) if not CUDA else None
    try:
        with no_sync():
            initialize_rows(t, "t", seed, x.to(DEVICE), rows, out, (c0, c1), TRITON, take=take)
    finally:
        if previous is not None:
            gpu.force_on_cpu(previous)
    kept = torch.full_like(out, 7.0)
    kept[rows[take]] = want.to(DEVICE)[take]
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       kept.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_victims_are_chosen_only_when_a_step_admits_more_ids_than_free_rows(eviction):
    """A step whose new ids fit in the free rows sorts nothing over the rows (no ``topk``); one
    that admits more chooses its victims (``topk``), the same as the torch map's, lowest score
    then the smaller id; alone and stepped together."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Topk(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket is torch.ops.aten.topk
            return func(*args, **(kwargs or {}))

    plain = VocabMap(8, eviction=eviction, device=DEVICE)
    alone = DeviceVocabMap(8, eviction=eviction, device=DEVICE)
    together = [DeviceVocabMap(8, eviction=eviction, device=DEVICE) for _ in range(2)]
    steps = [[1, 2, 3], [2, 4, 5], [2, 6, 7, 8], [2, 9, 10], [11, 12, 2, 4], [13]]
    for s, ids in enumerate(steps):
        r = _ids(ids)
        want = plain.train_step(r)
        evicts = plain.n_resident == 8 and s >= 3  # (the rows are full from step 3 on)
        for run in ([alone], together):
            with Topk() as seen:
                got = (alone.train_step(r) if len(run) == 1 else
                       train_together(run, [r, r])[0])
            assert (seen.n > 0) == evicts, (s, seen.n)
            for x, y in zip(want, got):
                assert torch.equal(x, y), s
        for m in [alone, *together]:
            _same_state(plain, m, f"step {s}")
