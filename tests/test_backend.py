"""The backend (ops/backend.py) is chosen once per device: the plan prints it, every rows
object, map and cache of the store holds it, and a switch flipped after the tables are built
changes nothing about the kernels they run; and every verb the step asks of a backend answers
on the fused CPU kernels as on torch ops."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import embcore as ec
from embcore.kernels import cpu
from embcore.ops.backend import FUSED_CPU, NAMES, TORCH_OPS, choose, named
from embcore.state.vocab.native_map import NativeVocabMap
from embcore.state.vocab.torch_map import VocabMap
from switches import kernels


def _engine(dynamic: bool = False) -> ec.Embedding:
    table = ec.TableConfig(vocabulary_size=8, dim=4, name="t",
                           dynamic=ec.DynamicVocabulary() if dynamic else None)
    return ec.Embedding({"f": ec.FeatureConfig(table=table)}, ec.Adagrad(learning_rate=0.1))


def _step(emb: ec.Embedding, ids: list[int]) -> torch.Tensor:
    emb.enqueue({"f": torch.tensor(ids)}, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({"f": torch.ones_like(acts["f"])})
    return acts["f"]


def test_named_and_choose():
    assert [named(n).name for n in NAMES] == list(NAMES)
    with pytest.raises(ValueError, match="backend 'cuda': expected one of"):
        named("cuda")
    assert choose("meta") is TORCH_OPS


@pytest.mark.parametrize("on", [True, False])
def test_the_plan_prints_the_backend_and_the_store_holds_it(on):
    if on and not cpu.available():
        pytest.skip(f"the fused CPU kernels are not built here: {cpu.error()}")
    with kernels(on):
        emb = _engine(dynamic=True)
        want = FUSED_CPU if on else TORCH_OPS
        assert emb.plan.backend == want.name
        assert f"backend: {want.name})" in str(emb.plan).splitlines()[0]
        _step(emb, [3, 5])
    store = emb._store
    assert store.backend is want and all(rows.backend is want for rows in store)
    maps = [m.map for m in store[0].members]
    assert all(type(m) is (NativeVocabMap if on else VocabMap) for m in maps)


def test_a_switch_flipped_after_the_build_changes_no_kernel(monkeypatch):
    """Chosen once: tables built on torch ops keep them when the kernels are switched on
    later (no call reaches the fused kernels), and give the same rows as an engine that never
    had them."""
    if not cpu.available():
        pytest.skip(f"the fused CPU kernels are not built here: {cpu.error()}")
    with kernels(False):
        torch.manual_seed(0)
        a = _engine()
        _step(a, [1, 2, 2])
        torch.manual_seed(0)
        b = _engine()
        _step(b, [1, 2, 2])
    called = []
    for name in ("TableLookup", "SparseUpdate"):  # (the kernels a table binds)
        real = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _r=real, _n=name, **k: called.append(_n)
                            or _r(*a, **k))
    with kernels(False):
        want = _step(b, [2, 7, 7])
    got = _step(a, [2, 7, 7])  # kernels switched on again: still torch ops
    assert called == [] and torch.equal(got, want)
    assert torch.equal(a._store[0].table, b._store[0].table)


def test_moving_the_tables_chooses_again():
    emb = _engine()
    _step(emb, [1])
    emb.to("meta")
    assert emb.plan.backend == "torch ops" and emb._store.backend is TORCH_OPS
    assert all(rows.backend is TORCH_OPS for rows in emb._store)


# ------------------------------------------------------------------- the verbs, backend by backend
# Every verb the step asks of a backend (ops/backend.py) gives the torch ops' answer on the fused
# CPU backend, on random batches: the checks' verdicts, each id's bag, the combiner's scales (bit
# for bit), the dedup (the same distinct ids and grouping; raw ids come in order of first
# occurrence there) and the moves of rows with their checksums.


@st.composite
def _batches(draw):
    lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
    nnz = sum(lengths)
    ids = draw(st.lists(st.integers(0, 40), min_size=nnz, max_size=nnz))
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    weights = draw(st.none() | st.lists(st.floats(-4, 4, width=32), min_size=nnz, max_size=nnz))
    return (torch.tensor(ids, dtype=torch.int64), offsets,
            None if weights is None else torch.tensor(weights, dtype=torch.float32))


def _grouping(ids, dd):
    """The dedup's content, whatever order its distinct ids come in: {id: its occurrences}."""
    return {int(dd.unique[u]): dd.order[dd.unique_offsets[u]:dd.unique_offsets[u + 1]].tolist()
            for u in range(dd.unique.numel())}


@settings(max_examples=examples(60), deadline=None)
@given(_batches(), st.sampled_from(["sum", "mean", "sqrtn"]), st.integers(-3, 3))
def test_the_fused_cpu_verbs_answer_as_the_torch_ops(batch, combiner, shift):
    if not cpu.available():
        pytest.skip(f"the fused CPU kernels are not built here: {cpu.error()}")
    ids, offsets, weights = batch
    nnz = ids.numel()
    bad = offsets.clone()
    bad[-1] += shift  # (shift 0: valid offsets)
    f, t = FUSED_CPU, TORCH_OPS
    assert f.offsets_error(bad, nnz) == t.offsets_error(bad, nnz)
    if nnz:
        assert f.minmax(ids) == t.minmax(ids) == (int(ids.min()), int(ids.max()))
    assert torch.equal(f.bag_index(offsets, nnz), t.bag_index(offsets, nnz))
    assert torch.equal(f.combiner_scales(offsets, weights, combiner, nnz),
                       t.combiner_scales(offsets, weights, combiner, nnz))
    parts, adds = [ids[: nnz // 2], ids[nnz // 2:]], [0, 41]
    for bound in (82, None):  # row ids (radix sort), raw ids (hashing)
        (fi, fd), (ti, td) = f.dedup(parts, adds, bound), t.dedup(parts, adds, bound)
        assert torch.equal(fi, ti)
        assert _grouping(fi, fd) == _grouping(ti, td)
        assert torch.equal(fd.unique[fd.inverse], fi) and torch.equal(td.unique[td.inverse], ti)
        if bound is not None:  # ascending on both
            assert torch.equal(fd.unique, td.unique) and torch.equal(fd.order, td.order)
    if nnz:
        indices = torch.stack([ids % 7, ids]).contiguous()
        assert f.strictly_increasing(indices, (7, 41)) == \
            t.strictly_increasing(indices, (7, 41))
    src = torch.randn(41, 3)
    rows = torch.unique(ids)
    got, want = torch.zeros(50, 3), torch.zeros(50, 3)
    f.copy_rows(src, rows, got, rows + 5)
    t.copy_rows(src, rows, want, rows + 5)
    assert torch.equal(got, want)
    fs, ts = torch.zeros(41, dtype=torch.int32), torch.zeros(41, dtype=torch.int32)
    assert f.move_summed([src], rows, None, None, rows, fs, False) == \
        t.move_summed([src], rows, None, None, rows, ts, False) == -1
    assert torch.equal(fs, ts)


def test_the_host_backend_beside_each_device():
    """The slow tier's work runs on the host: the backend's own on a CPU, and beside a GPU the
    fused CPU kernels where they are built."""
    assert FUSED_CPU.host() is FUSED_CPU and TORCH_OPS.host() is TORCH_OPS
    assert named("Triton").host() is (FUSED_CPU if cpu.available() else TORCH_OPS)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(-3, 12), min_size=2, max_size=9), st.integers(0, 10))
def test_offsets_made_safe_while_their_verdict_waits(offsets, nnz):
    """``offsets_verdict`` (a device's way: no wait): the verdict is nonzero exactly when
    ``offsets_error`` finds a bad entry, and the offsets returned are safe to index with (0
    first, never decreasing, ``nnz`` last): the given ones when they are valid."""
    given_ = torch.tensor(offsets, dtype=torch.int64)
    safe, verdict = TORCH_OPS.offsets_verdict(given_, nnz)
    bad = TORCH_OPS.offsets_error(given_, nnz)
    assert bool(verdict) == (bad >= 0)
    assert safe[0] == 0 and safe[-1] == nnz and bool((safe[1:] >= safe[:-1]).all())
    if bad < 0:
        assert torch.equal(safe, given_)
    if cpu.available():
        assert FUSED_CPU.offsets_verdict(given_, nnz)[1] == bad  # (known at once there)
