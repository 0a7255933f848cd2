"""Tables beyond memory (docs/semantics.md section 10): a ``memory_budget`` sends tables to a slow
tier with a write-back cache, and nothing a user can observe changes: activations, tables and
slots are bit-identical to the run without a budget, for every optimizer, input kind, sharding
strategy, pipelining and checkpoint. Tiny budgets force misses, evictions and write-backs every
step."""

from __future__ import annotations

import gc
import os
import sys
import warnings

import pytest
import torch
from distributed import exited_pid, run_on
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from native_required import require_native
from profiles import examples
from strategies import cases
from switches import kernels
from test_sharded import OPTIMIZERS, concat, config, global_batch, grads_for, slots_whole

import embcore as ec
from embcore.config.budget import parse_budget
from embcore.config.tables import (
    INDEX_BYTES_PER_ROW,
    LOG_BYTES_PER_ROW,
    MAP_BYTES_PER_ROW,
    WHERE_BYTES_PER_ROW,
)
from embcore.kernels import cpu
from embcore.planning.plan import make_plan, where_bytes
from embcore.state.tier import cache as cache_module
from embcore.state.tier import files as files_module

pytestmark = pytest.mark.filterwarnings("ignore:table .* a step touches")


@pytest.fixture(autouse=True)
def _logs(monkeypatch):
    """Every static table here writes its slow tier as a log (the files here are small: "auto"
    would write them in place, which the other modules' budgets run, and test_slow_log.py
    compares both)."""
    monkeypatch.setenv(files_module.WRITES_ENV, "log")

# test_sharded's config(opt): 160 static rows, each with a place in its slow tier's log when
# offloaded (LOG_BYTES_PER_ROW), beside the budgets below
LOGS = 160 * LOG_BYTES_PER_ROW


def _small(opt: str, base: int = 1500) -> int:
    """A budget whose caches hold a handful of config(opt)'s rows (``base`` bytes beside their
    logs; SGD's rows, 16 and 24 bytes, are near their index's 15: its own)."""
    return 160 * (WHERE_BYTES_PER_ROW + LOG_BYTES_PER_ROW) + 450 if opt == "sgd" else base + LOGS


def _state(emb):
    return {k: v.clone() for k, v in emb.state_dict().items()}


def _run(emb, batches, grads_seed=0):
    """Trains on ``batches`` ((features, weights) pairs); returns every step's activations."""
    out = []
    for s, (feats, w) in enumerate(batches):
        emb.enqueue(feats, w)
        acts = emb.dequeue()
        out.append({k: a.detach().clone() for k, a in acts.items()})
        g = torch.Generator().manual_seed(grads_seed + s)
        emb.apply_gradients({k: torch.randn(a.shape, generator=g) for k, a in
                             sorted(acts.items())})
    return out


def _assert_same(acts_a, acts_b, state_a, state_b):
    for s, (a, b) in enumerate(zip(acts_a, acts_b)):
        for k in a:
            assert torch.equal(a[k], b[k]), f"step {s}, feature {k!r}: activations differ"
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), f"{k!r} differs"


# ------------------------------------------------------------------------------ the budget
def test_budget_values():
    assert parse_budget(None) is None
    assert parse_budget(1000) == 1000
    assert parse_budget("4GiB") == 4 * 2**30
    assert parse_budget("1.5 GB") == 1_500_000_000
    assert parse_budget("512kb") == 512_000
    assert parse_budget("2e6") == 2_000_000
    for bad, error in (("4 gigs", ValueError), (-1, ValueError), ("", ValueError),
                       (True, TypeError), ([4], TypeError), (float("inf"), ValueError)):
        with pytest.raises(error):
            parse_budget(bad)
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    with pytest.raises(ValueError, match="memory_budget 'lots' is not a size"):
        ec.Embedding(ec.FeatureConfig(table=t), memory_budget="lots")
    with pytest.raises(TypeError, match="offload_dir must be a path"):
        ec.Embedding(ec.FeatureConfig(table=t), memory_budget=10, offload_dir=3)
    with pytest.raises(ValueError, match="exists and is not a directory"):
        ec.Embedding(ec.FeatureConfig(table=t), memory_budget=10, offload_dir=__file__)


def _specs(opt=None, dynamic=False):
    sizes = [("big", 1000), ("mid", 300), ("small", 50), ("huge", 3000)]
    out = []
    for name, n in sizes:
        t = ec.TableConfig(vocabulary_size=n, dim=8, name=name,
                           dynamic=ec.DynamicVocabulary() if dynamic and name == "huge" else None)
        out.append((name, t, opt or ec.Adagrad(learning_rate=0.1)))
    return out


def test_plan_moves_the_largest_tables_and_sizes_their_caches():
    specs = _specs()
    row = 8 * 4 * 2  # parameters + Adagrad accumulators, float32
    everything = sum(t.vocabulary_size for _, t, _ in specs) * row
    free = make_plan(specs, 1, None, None, None)
    assert make_plan(specs, 1, None, None, everything) == free  # what fits changes nothing
    for budget in (80_000, 120_000, 250_000):
        plan = make_plan(specs, 1, None, None, budget)
        slow = {n for p in plan.physical if p.offloaded for n in p.tables}
        assert "huge" in slow and "small" not in slow  # the largest go, the smallest stay
        assert plan.bytes_per_rank(fast=True)[0] <= budget
        assert plan.bytes_per_rank(fast=True)[0] > budget - (row + INDEX_BYTES_PER_ROW) * 8  # full
        text = str(plan)
        assert "[slow tier, cached]" in text and "MiB per rank in fast memory" in text
        # the fixed part (the index, whatever the cache) is said apart: 15 bytes a static row
        huge = next(p for p in plan.physical if "huge" in p.tables)
        fixed = huge.row_counts[0] * where_bytes(False) / 2**20
        assert where_bytes(False) == 15
        assert f"of which fixed, whatever the cache: {fixed:.2f} MiB (the index: 15 bytes" in text
    # more budget, more cache
    caches = [sum(p.cache_rows[0] for p in make_plan(specs, 1, None, None, b).physical
                  if p.offloaded) for b in (80_000, 120_000)]
    assert caches[1] > caches[0]
    # A dynamic table goes to the slow tier like any other; its map stays in fast memory and is
    # charged to the budget (MAP_BYTES_PER_ROW a row of capacity). Rules that move every row stay.
    dyn = make_plan(_specs(dynamic=True), 1, None, None, 240_000)
    huge = next(p for p in dyn.physical if "huge" in p.tables)
    assert huge.offloaded and huge.dynamic
    assert dyn.bytes_per_rank(fast=True)[0] <= 240_000
    assert "+ maps" in str(dyn)
    # An offloaded table's cache index holds WHERE_BYTES_PER_ROW for each of its rows, first.
    with pytest.raises(ValueError, match=r"cache indexes of the offloaded tables \[.*'huge'"
                                         rf".*\({WHERE_BYTES_PER_ROW} bytes a row, "
                                         rf"{WHERE_BYTES_PER_ROW + LOG_BYTES_PER_ROW} for a "
                                         rf"static table's\)"):
        make_plan(_specs(dynamic=True), 1, None, None, 3000 * MAP_BYTES_PER_ROW + 5000)
    dense = make_plan(_specs(ec.Adam(learning_rate=0.1, lazy_adam=False)), 1, None, None, 10**6)
    assert not any(p.offloaded for p in dense.physical)
    with pytest.raises(ValueError,
                       match=rf"maps of dynamic tables \['huge'\] \({MAP_BYTES_PER_ROW} bytes a "
                             rf"row\): {3000 * MAP_BYTES_PER_ROW}"):
        make_plan(_specs(dynamic=True), 1, None, None, 1000)
    with pytest.raises(ValueError, match="Adam\\(lazy_adam=False\\) table 'big'"):
        make_plan(_specs(ec.Adam(learning_rate=0.1, lazy_adam=False)), 1, None, None, 1000)
    # Per process: row-split tables hold half their rows on each of 2 processes.
    two = make_plan(specs, 2, "row_div", None, 45_000)
    assert all(p.cache_rows[0] > 0 and p.cache_rows[1] > 0 for p in two.physical if p.offloaded)
    assert max(two.bytes_per_rank(fast=True)) <= 45_000


def _fast_bytes_by_hand(plan, sizes, world):
    """Each process's fast-memory bytes of a plan of ``sizes``' tables (Adagrad, float32: a row
    is its parameters and its accumulators, 8 bytes a column), counted from the rows it holds
    and the documented charges (docs/semantics.md, tables beyond memory), not by the planner:
    a dynamic table's map (MAP_BYTES_PER_ROW a row); a table kept whole, its rows; an offloaded
    one, its index (where_bytes a row) and its cache's rows with INDEX_BYTES_PER_ROW each."""
    out = [0] * world
    for i, (_, d, dyn) in enumerate(sizes):
        t = plan.table(f"t{i}")
        p = plan.physical[t.physical]
        for r in range(world):
            held = t.row_counts[r]
            out[r] += held * (MAP_BYTES_PER_ROW if dyn else 0)
            if p.offloaded:
                out[r] += held * (WHERE_BYTES_PER_ROW + (0 if dyn else LOG_BYTES_PER_ROW))
            else:
                out[r] += held * 8 * d
    for p in plan.physical:
        if p.offloaded:
            for r in range(world):
                out[r] += p.cache_rows[r] * (8 * p.dim + INDEX_BYTES_PER_ROW)
    return out


@settings(max_examples=examples(80), deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([1, 4, 8]), st.booleans()),
                      min_size=1, max_size=5),
       permille=st.one_of(st.integers(0, 1100), st.integers(940, 1010)),
       world=st.sampled_from([1, 2]),
       strategy=st.sampled_from([None, "row_div", "row_mod", "table"]))
def test_a_plan_fits_its_budget_or_raises(sizes, permille, world, strategy):
    """Property: whatever the tables (some dynamic) and budget, the plan's fast memory (tables,
    caches with their index, maps), counted by hand from the rows each process holds, fits the
    budget on every process, and every offloaded table has a cache row where it has rows; or the
    planner raises, and then the tables held whole are over the budget somewhere."""
    specs = [(f"t{i}", ec.TableConfig(vocabulary_size=n, dim=d, name=f"t{i}",
                                      dynamic=ec.DynamicVocabulary() if dyn else None),
              ec.Adagrad(learning_rate=0.1)) for i, (n, d, dyn) in enumerate(sizes)]
    whole = make_plan(specs, world, strategy)  # (the same placement, nothing offloaded)
    held_whole = max(_fast_bytes_by_hand(whole, sizes, world))
    budget = held_whole * permille // 1000  # (a share of it: most plans offload something)
    try:
        plan = make_plan(specs, world, strategy, None, budget)
    except ValueError as e:
        assert "below what must stay in fast memory" in str(e)
        assert held_whole > budget  # (else: nothing moves)
        return
    fast = _fast_bytes_by_hand(plan, sizes, world)
    assert max(fast) <= budget, (fast, budget)
    for p in plan.physical:
        if p.offloaded:
            assert all(p.cache_rows[r] >= 1 for r in range(world) if p.row_counts[r])


def test_planner_follows_the_lookup_curves():
    """Two equal tables: the one whose lookups are concentrated on few rows needs fewer fast
    rows for the same hits, so the greedy gives the spread-out one more (or: with a flat curve,
    rows are worth their average; the skewed table's cold rows are worth nothing)."""
    from embcore.planning.tiers import fast_rows, profile_curve, zipf_curve

    skewed = profile_curve([(10, 0.9), (100, 1.0)], 1000)  # 10 rows serve 90%
    flat = profile_curve([(500, 0.5)], 1000)
    got = fast_rows([1000, 1000], [10, 10], [1.0, 1.0], [skewed, flat], 5000)
    assert got[0] >= 10 and got[0] <= 100 and got[1] > 350
    assert sum(got) * 10 <= 5000
    assert zipf_curve(100)(100) == pytest.approx(1.0) and 0 < zipf_curve(100)(10) < 1
    # a table read by more features gets more of the budget
    heavy = fast_rows([1000, 1000], [10, 10], [3.0, 1.0], [zipf_curve(1000)] * 2, 5000)
    assert heavy[0] > heavy[1]


# ------------------------------------------------------------------------------ exactness
NAMES = sorted(OPTIMIZERS)


@settings(max_examples=examples(15), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), opt=st.sampled_from([n for n in NAMES if n != "adam_dense"]),
       fraction=st.sampled_from([0.0, 0.3, 0.7]), steps=st.integers(1, 4))
def test_cached_tables_equal_in_memory_tables(data, opt, fraction, steps):
    """Property: random tables (dynamic or not), features of every input kind and batch sizes
    (through the layer, whose batches may change shape), any optimizer, a budget below the
    tables' bytes (0: caches of one row, which most steps grow) -> bit-identical to no
    budget."""
    dyn = st.one_of(st.none(), st.builds(ec.DynamicVocabulary,
                                         eviction=st.sampled_from(["lru", "lfu"]),
                                         admit_after=st.integers(1, 2)))
    tables = [ec.TableConfig(vocabulary_size=data.draw(st.integers(1, 40)), dim=d, name=f"t{i}",
                             combiner=data.draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                             dynamic=data.draw(dyn))
              for i, d in enumerate(data.draw(st.lists(st.sampled_from([2, 3]), min_size=1,
                                                       max_size=3)))]
    first = [data.draw(cases(tables[data.draw(st.integers(0, len(tables) - 1))]))
             for _ in range(data.draw(st.integers(1, 3)))]
    fc = {f"f{i}": c.feature for i, c in enumerate(first)}
    batches = [({f"f{i}": c.ids for i, c in enumerate(first)},
                {f"f{i}": c.weights for i, c in enumerate(first)})]
    for _ in range(steps - 1):
        drawn = [data.draw(cases(c.feature.table,
                                 allow_weights=c.feature.max_sequence_length == 0))
                 for c in first]
        batches.append(({f"f{i}": d.ids for i, d in enumerate(drawn)},
                        {f"f{i}": d.weights if first[i].feature.max_sequence_length == 0
                         else None for i, d in enumerate(drawn)}))
    results = []
    budget = None
    for _ in range(2):
        torch.manual_seed(3)
        layer = ec.EmbeddingLayer(fc, OPTIMIZERS[opt](), memory_budget=budget)
        acts_seen = []
        for s, (feats, w) in enumerate(batches):
            acts = layer(feats, w)
            acts_seen.append({k: a.detach().clone() for k, a in acts.items()})
            sum((a * grads_for(acts, s)[k]).sum() for k, a in sorted(acts.items())).backward()
        results.append((acts_seen, _state(layer.engine)))
        if budget is None:  # (dynamic tables' maps and the caches' indexes stay in fast memory)
            plan = layer.engine.plan
            maps = plan.bytes_per_rank(fast=True)[0] - plan.bytes_per_rank()[0]
            index = sum(p.row_counts[0] * where_bytes(p.dynamic) for p in plan.physical)
            least = sum(plan.physical[t.physical].bytes_per_row + INDEX_BYTES_PER_ROW
                        for t in plan.tables)  # a cache row of each table
            rows = plan.bytes_per_rank()[0]
            assume(index + least < rows)  # (else the tables are too small to offload)
            budget = min(maps + index + least + int(rows * fraction), maps + rows - 1)
    assert any(p.offloaded for p in layer.engine.plan.physical)
    _assert_same(results[0][0], results[1][0], results[0][1], results[1][1])


@pytest.mark.parametrize("opt,fused", [(o, True) for o in NAMES] + [("adagrad", False)])
def test_every_optimizer_with_evictions_every_step(opt, fused):
    """Six tables of test_sharded's config, eight features of every kind; a budget whose caches
    hold a handful of rows: misses, evictions and write-backs every step (``fused`` False: the
    cached run on torch ops only, its index included)."""
    with kernels(fused):
        _evictions_every_step(opt)


@pytest.mark.parametrize("opt", ["adagrad", "rowwise", "sgd"])
def test_moves_that_ask_for_their_pages_first_change_nothing(opt, monkeypatch):
    """Every move timed and judged slow (the disk's case): each asks for its rows' pages first
    (madvise), static tables (one file of records) and dynamic ones (a file per array) alike;
    the runs stay bit-identical to the in-memory run."""
    require_native()
    monkeypatch.setattr(cache_module, "SLOW_ROW_SECONDS", -1.0)
    monkeypatch.setattr(cache_module, "SLOW_ROW_MIN_ROWS", 1)
    advised = []
    real = cpu.will_need
    monkeypatch.setattr(cpu, "will_need", lambda t, r: advised.append(r.numel()) or real(t, r))
    _evictions_every_step(opt)
    assert advised, "the moves asked for their pages"
    advised.clear()
    runs = []
    for budget in (None, 40 * MAP_BYTES_PER_ROW + RAW_INDEX + 200):
        emb = _raw_engine(opt, budget)
        runs.append((_run(emb, _raw_batches(5)), _state(emb), emb))
    _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
    assert any(p.offloaded and p.dynamic for p in runs[1][2].plan.physical) and advised


def test_will_need_asks_once_per_run_of_rows_on_the_same_pages(tmp_path):
    require_native()
    from embcore.state.tier.files import slow_tensor
    t = slow_tensor(tmp_path / "t.bin", (1024, 16), torch.float32)  # 64-byte rows, 64 a page
    rows = torch.tensor([0, 1, 63, 64, 65, 1000, 5], dtype=torch.int64)
    assert cpu.will_need(t, rows) == 4  # pages 0, 1, 15, 0 again (not the previous one)
    assert cpu.will_need(t, rows[:0]) == 0


def _resident_pages(t: torch.Tensor) -> tuple[int, int]:
    """(resident, all): the pages under ``t`` in memory now (``mincore``)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    start = t.data_ptr() & ~(page - 1)
    length = t.data_ptr() + t.nbytes - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0
    return sum(v & 1 for v in vec), len(vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")
def test_a_cpu_cache_holds_its_pages_from_the_start(tmp_path):
    """A cache's rows and slots are faulted in when it is made (docs/semantics.md section 10):
    the steps that fill it do not fault (and zero) its pages one by one. Values unchanged."""
    from embcore.state.tier.cache import CachedRows
    from embcore.state.tier.files import slow_tensor
    n, dim, capacity = 1 << 16, 32, 1 << 16  # 8 MiB of rows (beyond malloc's reuse of pages)
    slow = {"parameters": slow_tensor(tmp_path / "p.bin", (n, dim), torch.float32),
            "accumulators": slow_tensor(tmp_path / "a.bin", (n, 1), torch.float32)}
    slow["parameters"].copy_(torch.arange(n * dim, dtype=torch.float32).view(n, dim))
    slow["accumulators"].fill_(0.5)
    cache = CachedRows("t", slow, capacity, torch.device("cpu"), [0, n], ["t"], mapped=True)
    for t in (cache.table, cache.slots["accumulators"]):
        resident, pages = _resident_pages(t)
        assert resident == pages, f"{resident} of {pages} pages resident"
    rows = torch.tensor([5, 4, 3])
    at = cache.resolve(rows)
    assert torch.equal(cache.table[at], slow["parameters"][rows])
    assert torch.equal(cache.slots["accumulators"][at], slow["accumulators"][rows])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")
def test_populate_without_madvise_writes_each_page_its_own_bytes(monkeypatch):
    """Where ``MADV_POPULATE_WRITE`` is not there, ``populate`` faults the pages in by writing
    each page's first byte back: every page resident, every value unchanged."""
    from embcore.ops import memory
    monkeypatch.setattr(memory, "_madvise", False)
    t = torch.empty(1 << 21, dtype=torch.float32)[3:]  # (8 MiB, not starting on a page)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    before = t.clone()
    t2 = torch.empty(1 << 21, dtype=torch.float32)  # never touched
    assert memory.populate(t) and memory.populate(t2)
    assert torch.equal(t, before)
    resident, pages = _resident_pages(t2)
    assert resident == pages, f"{resident} of {pages} pages resident"


def _evictions_every_step(opt):
    fc, _ = config(opt, {})
    if OPTIMIZERS[opt]().updates_every_row:  # every row moves every step: it stays in fast memory
        with pytest.raises(ValueError, match="below what must stay in fast memory"):
            ec.Embedding(fc, OPTIMIZERS[opt](), memory_budget=1500 + LOGS)
        return
    batches = [concat(global_batch(s, 2)) for s in range(6)]
    runs = []
    for budget in (None, _small(opt)):
        torch.manual_seed(11)
        emb = ec.Embedding(fc, OPTIMIZERS[opt](), memory_budget=budget)
        runs.append((_run(emb, batches), _state(emb), emb))
    _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
    emb = runs[1][2]
    stats = emb.cache_stats()
    assert stats and all(s["misses"] > 0 for s in stats.values())
    assert set(stats) == {n for p in emb.plan.physical if p.offloaded for n in p.tables}
    cache = next(iter(emb._store.caches()))
    assert cache.written_rows > 0  # updated rows went back to the slow tier


def _raw_batches(steps, seed=0):
    """Raw int64 ids from a pool of 120 (a dynamic table of capacity 40 evicts every step), of
    two kinds (dense (B, 3) and jagged), and a static table's ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        raw = (torch.randint(-60, 60, (8, 3), generator=g) * (2**40 + 7))
        lengths = torch.randint(0, 4, (8,), generator=g)
        values = torch.randint(-60, 60, (int(lengths.sum()),), generator=g) * (2**40 + 7)
        jag = torch.nested.nested_tensor_from_jagged(values, torch.cat(
            [torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
        out.append(({"d": raw, "j": jag, "s": torch.randint(0, 30, (8,), generator=g)}, None))
    return out


RAW_INDEX = (40 + 30) * WHERE_BYTES_PER_ROW + 30 * LOG_BYTES_PER_ROW  # _raw_engine's indexes


def _raw_engine(opt, budget, eviction="lru", admit_after=1, pipelined=False, sharding=None,
                capacity=40):
    torch.manual_seed(5)
    dyn = ec.TableConfig(vocabulary_size=capacity, dim=3, name="dyn", combiner="mean",
                         dynamic=ec.DynamicVocabulary(eviction=eviction,
                                                      admit_after=admit_after))
    static = ec.TableConfig(vocabulary_size=30, dim=3, name="static")
    fc = {"d": ec.FeatureConfig(table=dyn), "j": ec.FeatureConfig(table=dyn),
          "s": ec.FeatureConfig(table=static)}
    return ec.Embedding(fc, OPTIMIZERS[opt](), memory_budget=budget,
                        pipeline_execution=pipelined, sharding=sharding,
                        **({"timeout": 60} if sharding else {}))


@pytest.mark.parametrize("opt,eviction,admit_after",
                         [(o, "lru", 1) for o in NAMES if o != "adam_dense"]
                         + [("adagrad", "lfu", 1), ("adagrad", "lru", 2), ("sgd", "lfu", 2)])
def test_dynamic_tables_in_the_slow_tier_equal_in_memory(opt, eviction, admit_after):
    """A dynamic table offloaded (its map in fast memory, its rows behind a cache of a few rows):
    ids evicted from the map every step, new ids' rows written straight into the cache, an
    evaluation lookup between steps -> bit-identical to no budget."""
    batches = _raw_batches(8)
    runs = []
    # the map, the indexes, a few rows
    for budget in (None, 40 * MAP_BYTES_PER_ROW + RAW_INDEX + 200):
        emb = _raw_engine(opt, budget, eviction, admit_after)
        acts = _run(emb, batches[:5])
        emb.enqueue(batches[5][0], training=False)  # evaluation: admits nothing
        acts.append({k: a.clone() for k, a in emb.dequeue().items()})
        acts += _run(emb, batches[5:])
        runs.append((acts, _state(emb), emb))
    _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
    emb = runs[1][2]
    assert {n for p in emb.plan.physical if p.offloaded for n in p.tables} == {"dyn", "static"}
    stats = emb.cache_stats()
    assert stats["dyn"]["misses"] > 0 and stats["dyn"]["hits"] > 0 and stats["dyn"]["new"] > 0
    assert stats["static"]["new"] == 0
    d = stats["dyn"]
    assert d["hit_rate"] == d["hits"] / (d["hits"] + d["misses"] + d["new"])
    assert torch.equal(emb.vocabulary("dyn")[0], runs[0][2].vocabulary("dyn")[0])


def test_dynamic_tables_in_the_slow_tier_pipelined_and_through_checkpoints(tmp_path):
    """Pipelined (the next batch's map step, with its evictions and new rows, runs before the
    pending update), then saved and loaded under another budget -> as without a budget."""
    batches = _raw_batches(10, seed=3)
    runs = []
    for budget in (None, 40 * MAP_BYTES_PER_ROW + RAW_INDEX + 150):
        emb = _raw_engine("adagrad", budget, pipelined=True)
        runs.append((_run(emb, batches[:6]), _state(emb)))
    _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
    emb = _raw_engine("adagrad", 40 * MAP_BYTES_PER_ROW + RAW_INDEX + 150)
    _run(emb, batches[:6])
    ec.save(tmp_path / "ck", emb)
    outs = []
    for budget in (None, 40 * MAP_BYTES_PER_ROW + RAW_INDEX + 110):
        other = _raw_engine("adagrad", budget)
        ec.load(tmp_path / "ck", other)
        outs.append((_run(other, batches[6:]), _state(other)))
    _assert_same(outs[0][0], outs[1][0], outs[0][1], outs[1][1])


def test_batch_eviction_frees_rows_ahead_and_stays_exact():
    """A cache that must evict frees an eighth of its rows at once (the least recently used,
    written back first): the next steps admit into them without a scan. Still bit-identical."""
    t = ec.TableConfig(vocabulary_size=3000, dim=4, name="t", combiner="sum")
    fc = {"f": ec.FeatureConfig(table=t)}
    g = torch.Generator().manual_seed(0)
    ranks = torch.arange(1, 3001, dtype=torch.float64) ** -1.05
    batches = [({"f": torch.multinomial(ranks, 200, replacement=True, generator=g)}, None)
               for _ in range(25)]
    runs, freed_seen = [], 0
    for budget in (None, 3000 * (WHERE_BYTES_PER_ROW + LOG_BYTES_PER_ROW) + 300 * (4 * 8 + 40)):
        torch.manual_seed(1)
        emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.3), memory_budget=budget)
        if budget is not None:
            _run(emb, batches[:1])
            cache = next(iter(emb._store.caches()))
            assert cache.capacity >= 200
            for i, b in enumerate(batches[1:], start=1):
                written, rounds = cache.written_rows, cache.evictions
                _run(emb, [b], grads_seed=i)  # (the gradients of step i, as in one run)
                # a step that evicted left rows free for the next ones
                freed_seen += cache.evictions > rounds and cache.index.n_free > 0
                assert cache.written_rows >= written
            runs.append(_state(emb))
        else:
            _run(emb, batches)
            runs.append(_state(emb))
    assert freed_seen > 0, "no step freed rows ahead"
    _assert_same([], [], runs[0], runs[1])


def test_pipelined_and_layer_training_with_a_budget():
    fc, _ = config("adagrad", {})
    batches = [concat(global_batch(s, 2)) for s in range(5)]
    runs = []
    for budget in (None, 1500 + LOGS):
        torch.manual_seed(5)
        emb = ec.Embedding(fc, OPTIMIZERS["adagrad"](), memory_budget=budget,
                           pipeline_execution=True)
        runs.append((_run(emb, batches), _state(emb)))
    _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])
    layers = []
    for budget in (None, f"{(1500 + LOGS) / 1000}KB"):
        torch.manual_seed(5)
        layer = ec.EmbeddingLayer(fc, ec.Adagrad(learning_rate=0.3), memory_budget=budget)
        for s, (feats, w) in enumerate(batches):
            acts = layer(feats, w)
            loss = sum((a * grads_for(acts, s)[k]).sum() for k, a in sorted(acts.items()))
            loss.backward()
        layers.append(_state(layer.engine))
    _assert_same([], [], layers[0], layers[1])


def test_checkpoints_load_under_any_budget(tmp_path):
    fc, _ = config("adagrad", {})
    batches = [concat(global_batch(s, 2)) for s in range(6)]
    torch.manual_seed(2)
    cached = ec.Embedding(fc, OPTIMIZERS["adagrad"](), memory_budget=1500 + LOGS)
    _run(cached, batches[:3])
    ec.save(tmp_path / "ckpt", cached)
    for budget in (None, 1500 + LOGS, 4000 + LOGS):
        torch.manual_seed(9)  # other initial values: the checkpoint must replace them all
        emb = ec.Embedding(fc, OPTIMIZERS["adagrad"](), memory_budget=budget)
        ec.load(tmp_path / "ckpt", emb)
        _assert_same([], [], _state(cached), _state(emb))
        rest = _run(emb, batches[3:], grads_seed=3)
        if budget is None:
            reference = (rest, _state(emb))
        else:
            _assert_same(reference[0], rest, reference[1], _state(emb))
    # an in-memory checkpoint into a cached engine, through state dicts
    torch.manual_seed(9)
    plain = ec.Embedding(fc, OPTIMIZERS["adagrad"]())
    _run(plain, batches[:2])
    torch.manual_seed(1)
    target = ec.Embedding(fc, OPTIMIZERS["adagrad"](), memory_budget=1500 + LOGS)
    _run(target, batches[2:4])  # a warm, dirty cache that the load must not write back over
    target.load_state_dict(plain.state_dict())
    _assert_same([], [], _state(plain), _state(target))


def test_slow_tier_files_live_in_offload_dir_and_go_with_the_engine(tmp_path):
    fc, _ = config("sgd", {})
    emb = ec.Embedding(fc, OPTIMIZERS["sgd"](), memory_budget=_small("sgd"), offload_dir=tmp_path)
    _run(emb, [concat(global_batch(0, 2))])
    files = list(tmp_path.rglob("*.bin"))
    assert files, "the slow tier's files are under offload_dir"
    del emb
    gc.collect()
    assert not list(tmp_path.rglob("*.bin")) and not any(tmp_path.iterdir())


def test_files_a_killed_process_left_are_removed_by_the_next_one(tmp_path):
    """A process killed mid-run cannot remove its slow-tier files (tens of GB at scale): the
    next engine using the same offload_dir removes those of dead processes of this host, and
    leaves those of live ones."""
    import socket

    host = "".join(c if c.isalnum() or c in "_." else "_" for c in socket.gethostname())
    gone = exited_pid()
    dead = tmp_path / f"embcore-offload-{host}-p{gone}-r0-abc"
    live = tmp_path / f"embcore-offload-{host}-p{os.getpid()}-r0-xyz"
    other = tmp_path / "embcore-offload-otherhost-p1-r0-q"
    for d in (dead, live, other):
        d.mkdir()
        (d / "p0-1.bin").write_bytes(b"x" * 10)
    fc, _ = config("sgd", {})
    emb = ec.Embedding(fc, OPTIMIZERS["sgd"](), memory_budget=_small("sgd"), offload_dir=tmp_path)
    _run(emb, [concat(global_batch(0, 2))])
    assert not dead.exists() and live.exists() and other.exists()


def test_a_step_larger_than_its_cache_grows_it_with_one_warning():
    t = ec.TableConfig(vocabulary_size=200, dim=16, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                       memory_budget=200 * (WHERE_BYTES_PER_ROW + LOG_BYTES_PER_ROW) + 64 * 10)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            emb.enqueue({"f": torch.randperm(200)[:50]})
            emb.dequeue()
            emb.apply_gradients({"f": torch.ones(50, 16)})
    grew = [r for r in rec if "the cache grows" in str(r.message)]
    assert len(grew) == 1 and "table 't'" in str(grew[0].message)


# ------------------------------------------------------------------------------ sharded
def _sharded_worker(rank, world, init, cases_, steps):
    init()
    batches = [global_batch(s, world)[rank] for s in range(steps)]
    for opt_name, strategies in cases_:
        fc, strategies = config(opt_name, strategies)
        runs = []
        for budget in (None, _small(opt_name, 1200)):
            torch.manual_seed(7)
            emb = ec.Embedding(fc, OPTIMIZERS[opt_name](), sharding=strategies, timeout=60,
                               memory_budget=budget)
            acts = _run(emb, batches, grads_seed=rank * 100)
            tables = {t.name: v.clone() for t, v in emb.embedding_tables.items()}
            runs.append((acts, {**tables, **slots_whole(emb)}))
        _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])


def _sharded_dynamic_worker(rank, world, init, strategies):
    init()
    batches = []
    for feats, _ in _raw_batches(5, seed=7):  # this rank's half of each batch
        half = {k: v[rank * 4:(rank + 1) * 4] if not v.is_nested else
                torch.nested.nested_tensor_from_jagged(
                    v.values()[v.offsets()[rank * 4]:v.offsets()[rank * 4 + 4]],
                    v.offsets()[rank * 4:rank * 4 + 5] - v.offsets()[rank * 4])
                for k, v in feats.items()}
        batches.append((half, None))
    for strategy in strategies:
        runs = []
        budget = None
        for _ in range(2):
            emb = _raw_engine("adagrad", budget, sharding={"dyn": strategy, "static": "row_mod"},
                              capacity=80)
            runs.append((_run(emb, batches, grads_seed=rank * 100), {
                t.name: v.clone() for t, v in emb.embedding_tables.items()}))
            assert (budget is None) != any(p.offloaded for p in emb.plan.physical)
            fast = emb.plan.bytes_per_rank(fast=True)
            # the maps, the caches' indexes (at most 80 + 30 rows, the static table's logs) and
            # a few rows
            budget = (max(fast) - min(emb.plan.bytes_per_rank()) + 110 * WHERE_BYTES_PER_ROW
                      + 30 * LOG_BYTES_PER_ROW + 150)
        _assert_same(runs[0][0], runs[1][0], runs[0][1], runs[1][1])


MIXED = {"a": "row_div", "b": "row_mod", "c": "column", "d": "table", "e": "replicated",
         "f": "row_mod"}


@pytest.mark.slow
def test_sharded_cached_tables_equal_in_memory_tables():
    """W = 2, every strategy (mixed in one engine), two optimizers: a budget changes nothing."""
    run_on(2, _sharded_worker, [("adagrad", MIXED), ("ftrl", MIXED), ("rowwise", MIXED)], 4)


@pytest.mark.slow
def test_sharded_dynamic_tables_in_the_slow_tier_equal_in_memory():
    """W = 2, a dynamic table split by hash (each owner's map, rows offloaded) or replicated:
    a budget changes nothing."""
    run_on(2, _sharded_dynamic_worker, ["hash", "replicated"])


# ------------------------------------------------------------------------------ profiles
def _skewed_batches(steps, b=64, seed=0):
    """Table "skewed" (2000 rows): 95% of lookups on 20 rows; table "spread" (500): uniform."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield {"skewed": torch.where(torch.rand(b, generator=g) < 0.95,
                                     torch.randint(0, 20, (b,), generator=g),
                                     torch.randint(0, 2000, (b,), generator=g)),
               "spread": torch.randint(0, 500, (b,), generator=g)}


def _two_tables():
    t = {n: ec.TableConfig(vocabulary_size=v, dim=8, name=n)
         for n, v in (("skewed", 2000), ("spread", 500))}
    return {n: ec.FeatureConfig(table=t[n]) for n in t}


def test_profile_records_curves_and_the_planner_uses_them(tmp_path):
    fc = _two_tables()
    prof = ec.profile(_skewed_batches(50), fc, tmp_path / "profile.json")
    assert (tmp_path / "profile.json").stat().st_size < 8000
    assert ec.LookupProfile.load(tmp_path / "profile.json") == prof and prof.batches == 50
    skewed, spread = prof.tables["skewed"], prof.tables["spread"]
    assert skewed.lookups_per_batch == spread.lookups_per_batch == 64
    share = dict(skewed.points)
    assert share[max(k for k in share if k <= 20)] > 0.9  # 20 rows take > 90% of lookups
    flat = dict(spread.points)
    assert flat[max(k for k in flat if k <= 20)] < 0.1
    # The prior (Zipf) splits the budget between the two; the measured curves show that the
    # skewed table needs 20 rows for 95% of its lookups, so the uniform table stays whole.
    budget = 80_000 + 2500 * LOG_BYTES_PER_ROW

    def slow(emb):
        return {n for p in emb.plan.physical if p.offloaded for n in p.tables}

    plain = ec.Embedding(fc, ec.Adagrad(learning_rate=0.1), memory_budget=budget)
    sized = ec.Embedding(fc, ec.Adagrad(learning_rate=0.1), memory_budget=budget,
                         profile=tmp_path / "profile.json")
    assert slow(plain) == {"skewed", "spread"} and slow(sized) == {"skewed"}
    # both train exactly as without a budget
    batches = [(b, None) for b in _skewed_batches(4, seed=1)]
    runs = []
    start = _state(plain)
    for emb in (ec.Embedding(fc, ec.Adagrad(learning_rate=0.1)), plain, sized):
        emb.load_state_dict(start)  # the same start
        runs.append((_run(emb, batches), _state(emb)))
    for other in runs[1:]:
        _assert_same(runs[0][0], other[0], runs[0][1], other[1])
    with pytest.raises(ValueError, match="not an embcore profile"):
        ec.LookupProfile.from_dict({"format": "x"})
    with pytest.raises(TypeError, match="profile must be"):
        ec.Embedding(fc, profile=3)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not an embcore profile"):
        ec.LookupProfile.load(tmp_path / "bad.json")


def test_profile_of_raw_ids_counts_every_id():
    """A dynamic table's profile (raw ids, any int64) equals a plain count of the ids."""
    from collections import Counter

    t = ec.TableConfig(vocabulary_size=10, dim=2, name="d", dynamic=ec.DynamicVocabulary())
    g = torch.Generator().manual_seed(0)
    batches = [{"f": torch.randint(-50, 50, (30,), generator=g) * 2**40} for _ in range(7)]
    prof = ec.profile(batches, {"f": ec.FeatureConfig(table=t)}).tables["d"]
    counts = Counter(x for b in batches for x in b["f"].tolist())
    freq = sorted(counts.values(), reverse=True)
    assert prof.distinct == len(counts) and prof.lookups_per_batch == 30
    for k, share in prof.points:
        assert share == pytest.approx(sum(freq[:k]) / sum(freq), abs=1e-12)


@pytest.mark.parametrize("opt", ["adagrad", "rowwise", "momentum", "sgd"])
def test_a_static_tables_row_and_slots_are_one_record_of_one_file(tmp_path, opt):
    """Moving a row reads (and dirties) the pages of one record, not one page per array: each
    offloaded static physical table is one file whose records hold a row and its slots, each
    field aligned, the record a multiple of RECORD_ALIGN bytes; the arrays are views of it."""
    from embcore.state.tier.files import RECORD_ALIGN
    fc, _ = config(opt, {})
    emb = ec.Embedding(fc, OPTIMIZERS[opt](), memory_budget=_small(opt, 1200),
                       offload_dir=tmp_path)
    _run(emb, [concat(global_batch(0, 2))])
    caches = list(emb._store.caches())
    assert caches, "the budget offloads a table"
    assert all(c.log is not None for c in caches)  # (written as logs here: ``_logs``)
    for cache in caches:
        arrays = list(cache.slow.values())
        record = arrays[0].stride(0) * arrays[0].element_size()
        assert record % RECORD_ALIGN == 0
        assert all(a.stride(0) * a.element_size() == record for a in arrays)
        assert len({a.untyped_storage().data_ptr() for a in arrays}) == 1  # one mapping
        starts = sorted(a.data_ptr() - arrays[0].data_ptr() for a in arrays)
        widths = sorted((a.data_ptr() - arrays[0].data_ptr(), a.shape[1] * a.element_size())
                        for a in arrays)
        assert starts[0] == 0 and all(o + w <= record for o, w in widths)
        assert all(o1 + w1 <= o2 for (o1, w1), (o2, _) in zip(widths, widths[1:]))  # apart
    files = list(tmp_path.rglob("*.bin"))
    assert len(files) == len(caches)
