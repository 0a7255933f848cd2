"""Tables beyond device memory: the cache's index on the device (state/tier/device_index.py) and
its rows moved by the GPU (kernels/gpu/move.py), against runs held entirely in memory.

Like tests/triton_cases.py: compiled on CUDA tensors with a GPU, else in Triton's interpreter on
CPU tensors, the GPU's choice points forced onto them (``gpu.force_on_cpu``: an engine on the CPU
then keeps its slow tier in host memory, as a GPU's, and its cache's index on its device).
tests/test_triton.py runs this file in a fresh interpreter.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator

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

import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402
from embcore.ops.backend import TRITON  # noqa: E402
from embcore.state.tier.cache import CachedRows  # noqa: E402
from embcore.state.tier.device_index import DeviceCacheIndex  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
if not gpu.available():
    pytest.skip(f"triton does not load: {gpu.error()}", allow_module_level=True)
if not CUDA and not gpu.interpreted():
    pytest.skip("no CUDA GPU, and the kernels were loaded before TRITON_INTERPRET=1 was set: "
                "run this file alone", allow_module_level=True)


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    previous = gpu.force_on_cpu(not CUDA)
    try:
        yield
    finally:
        gpu.force_on_cpu(previous)


def _zipf(gen: torch.Generator, n: int, size: int) -> torch.Tensor:
    """Skewed ids in [0, n): a few hot rows, a long tail."""
    u = torch.rand(size, generator=gen, dtype=torch.float64)
    return (n ** u - 1).floor().long().clamp(max=n - 1)


def _train(budget, *, dynamic=False, optimizer=None, pipelined=False, steps=10, save=None):
    """Activations of every step and the tables after them (and a checkpoint at ``save``)."""
    torch.manual_seed(0)  # (the tables' initial values)
    gen = torch.Generator().manual_seed(1)
    dyn = ec.DynamicVocabulary(eviction="lfu") if dynamic else None
    t, v, d, b, bag = 2, 300, 8, 16, 4
    cfgs = [ec.TableConfig(vocabulary_size=v, dim=d, name=f"t{i}", dynamic=dyn)
            for i in range(t)]
    fc = {f"f{i}": ec.FeatureConfig(table=c) for i, c in enumerate(cfgs)}
    kw = {} if budget is None else {"memory_budget": budget,
                                    "offload_dir": tempfile.mkdtemp(prefix="ec-devcache-")}
    emb = ec.Embedding(fc, optimizer or ec.Adagrad(learning_rate=0.1), device=DEVICE,
                       pipeline_execution=pipelined, **kw)
    offsets = torch.arange(0, b * bag + 1, bag)
    seen = []
    for _ in range(steps):
        batch = {}
        for i in range(t):
            ids = _zipf(gen, v, b * bag) + (10**12 if dynamic else 0)
            batch[f"f{i}"] = torch.nested.nested_tensor_from_jagged(ids.to(DEVICE),
                                                                    offsets.to(DEVICE))
        emb.enqueue(batch)
        acts = emb.dequeue()
        seen.append({k: a.detach().cpu().clone() for k, a in acts.items()})
        emb.apply_gradients({k: torch.full_like(a, 0.25) for k, a in acts.items()})
    caches = emb._store.caches() if budget is not None else []
    if save is not None:
        ec.save(save, emb)
    tables = [emb.embedding_tables[c].detach().cpu().clone() for c in cfgs]
    return seen, tables, caches


@pytest.mark.parametrize("case", ["static", "dynamic", "rowwise", "pipelined"])
def test_a_budgeted_run_equals_the_run_in_memory(case):
    """Bit for bit: every activation and the tables after the run; the caches evicted and
    wrote rows back, their index on the device."""
    kw = {"dynamic": case == "dynamic", "pipelined": case == "pipelined",
          "optimizer": ec.RowwiseAdagrad(learning_rate=0.1) if case == "rowwise" else None}
    with on_device():
        want = _train(None, **kw)
        got = _train(12000 + (600 * 49 if kw["dynamic"] else 0), **kw)  # (+ the maps)
    for a, b in zip(want[0], got[0]):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for a, b in zip(want[1], got[1]):
        assert torch.equal(a, b)
    caches = got[2]
    assert caches and all(c.on_device and isinstance(c.index, DeviceCacheIndex) for c in caches)
    assert sum(c.evictions for c in caches) > 0 and sum(c.written_rows for c in caches) > 0


def test_a_checkpoint_of_a_budgeted_run_loads_into_a_run_in_memory():
    with tempfile.TemporaryDirectory() as d:
        with on_device():
            _, tables, _ = _train(12000, save=f"{d}/ck")
        t = [ec.TableConfig(vocabulary_size=300, dim=8, name=f"t{i}") for i in range(2)]
        emb = ec.Embedding({f"f{i}": ec.FeatureConfig(table=c) for i, c in enumerate(t)},
                           ec.Adagrad(learning_rate=0.1))
        ec.load(f"{d}/ck", emb)
        for c, want in zip(t, tables):
            assert torch.equal(emb.embedding_tables[c].detach(), want)


def _cache(rows: int, capacity: int, width: int) -> tuple[CachedRows, torch.Tensor]:
    slow = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    acc = slow * 0.5
    with on_device():
        cache = CachedRows("t", {"parameters": slow, "acc": acc}, capacity, DEVICE,
                           [0, rows], ["t"], backend=TRITON)
    return cache, slow.clone()


def test_a_resolve_reads_nothing_back_and_moves_whole_rows():
    """Resolve, update the cached rows, resolve other rows (evicting): no op that would
    synchronise on CUDA; the rows read are the tier's, the evicted updates reach the tier."""
    cache, start = _cache(40, 8, 3)
    assert cache.on_device
    gen = torch.Generator().manual_seed(0)
    truth = start.clone()
    for step in range(12):
        rows = torch.randperm(40, generator=gen)[:5].to(DEVICE)
        with on_device(), no_sync():
            slots = cache.resolve(rows)
            cache.table.index_add_(0, slots, torch.ones(5, 3, device=DEVICE))
            cache.touched(slots)
        truth[rows.cpu()] += 1
        assert torch.equal(cache.table[slots].cpu(), truth[rows.cpu()]), step
        assert torch.equal(cache.slots["acc"][slots].cpu(), (start * 0.5)[rows.cpu()]), step
    with on_device():
        cache.flush()
    assert torch.equal(cache.slow["parameters"], truth)
    assert cache.evictions > 0 and cache.read_rows > 0


@settings(max_examples=examples(20), deadline=None)
@given(st.integers(1, 12), st.lists(st.tuples(st.lists(st.integers(0, 29), max_size=12),
                                              st.booleans()), min_size=1, max_size=12),
       st.integers(0, 4))
def test_the_index_keeps_every_step_s_rows_and_writes_back_what_was_dirty(capacity, steps,
                                                                          spare):
    """Random steps: each step's rows get distinct cache rows, hits keep theirs, only rows
    not used by the step leave, and exactly the dirty ones that leave are written back;
    ``where`` and ``owner`` agree throughout."""
    index = DeviceCacheIndex(30, capacity, (), DEVICE)
    held: dict[int, int] = {}  # shard row -> cache row
    dirty: set[int] = set()
    for rows, mark in steps:
        rows = list(dict.fromkeys(rows))[:capacity]
        t = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
        with no_sync():
            s = index.step(t, spare=spare)
        slots = s.slots.tolist()
        assert len(set(slots)) == len(slots) and all(0 <= x < capacity for x in slots)
        for r, x, m in zip(rows, slots, s.miss.tolist()):
            assert m == (r not in held) and (m or held[r] == x)
        out = [(r, x) for r, x, o in zip(s.out_rows.tolist(), s.out_slots.tolist(),
                                         s.out.tolist()) if o]
        left = set(held) - set(rows) - {r for r in held if r in rows}
        for r, x in out:
            assert r in dirty and r in left and held[r] == x
        now = dict(zip(rows, slots))
        for r in list(held):
            if r not in rows and int(index.where[r]) < 0:  # evicted
                assert r not in dirty or (r, held[r]) in out
                dirty.discard(r)
                del held[r]
        held.update(now)
        assert {r: int(index.where[r]) for r in held} == held
        assert all(int(index.owner[x]) == r for r, x in held.items())
        assert int((index.owner >= 0).sum()) == len(held)
        if mark:
            index.mark(index.dirty, s.slots)
            dirty |= set(rows)
