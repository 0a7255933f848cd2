"""The device step's input checks and its dedup of fixed capacity (docs/semantics.md section 2):
a training batch on the Triton backend is judged on the device, a bad one changes nothing and
``Embedding.check()`` raises its error; the dedup's sizes come from the input. Counted and run
on the CPU through the device path (Triton's interpreter, ``gpu.force_on_cpu``), in a fresh
interpreter (tests/test_triton.py), like the other Triton cases.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sync_guard import Counts  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402
from embcore.ops.bags import dedup  # noqa: E402

if CUDA:
    pytest.skip("run on the CPU's emulation of the device step", allow_module_level=True)
if not gpu.available():
    pytest.skip(f"triton does not load: {gpu.error()}", allow_module_level=True)
if not gpu.interpreted():
    pytest.skip("the kernels were loaded before TRITON_INTERPRET=1 was set: run this file alone",
                allow_module_level=True)

OPTIMIZERS = [ec.SGD(learning_rate=0.1), ec.Adagrad(learning_rate=0.1),
              ec.Adam(learning_rate=0.1), ec.FTRL(learning_rate=0.1)]


@pytest.fixture(autouse=True)
def _on_the_device_path():
    previous = gpu.force_on_cpu(True)
    try:
        yield
    finally:
        gpu.force_on_cpu(previous)


def _engine(optimizer, dtype=torch.float32, host_checks=False, combiner="mean"):
    torch.manual_seed(0)
    a = ec.TableConfig(vocabulary_size=10, dim=4, name="a", dtype=dtype, combiner=combiner)
    b = ec.TableConfig(vocabulary_size=7, dim=4, name="b", dtype=dtype, combiner=combiner)
    fc = {"d": ec.FeatureConfig(table=a), "j": ec.FeatureConfig(table=b),
          "w": ec.FeatureConfig(table=a)}
    return ec.Embedding(fc, optimizer, host_checks=host_checks)


def _jagged(rows, dtype=torch.int64):
    values = torch.tensor([x for r in rows for x in r], dtype=dtype)
    offsets = torch.tensor([0] + [sum(len(r) for r in rows[:i + 1]) for i in range(len(rows))])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def _batch(step, bad=None):
    ids = {"d": torch.tensor([1, 5, 1, step % 10]), "j": _jagged([[5, 6, 5], [], [2], [3]]),
           "w": _jagged([[1, 2], [9], [], [4, 4]])}
    weights = {"d": None, "j": None, "w": _jagged([[0.5, 2.0], [1.0], [], [1.5, 0.25]],
                                                  torch.float32)}
    if bad == "id":
        ids["d"] = torch.tensor([1, 5, 10, 2])
    elif bad == "negative":
        ids["j"] = _jagged([[5, -3, 5], [], [2], [3]])
    elif bad == "offsets":
        ids["j"] = torch.nested.nested_tensor_from_jagged(
            torch.tensor([5, 6, 5, 2, 3]), torch.tensor([0, 3, 2, 4, 5]))
    elif bad == "weight offsets":
        weights["w"] = torch.nested.nested_tensor_from_jagged(
            torch.tensor([0.5, 2.0, 1.0, 1.5, 0.25]), torch.tensor([0, 1, 3, 3, 5]))
    elif bad == "weight":
        weights["w"] = _jagged([[0.5, float("nan")], [1.0], [], [1.5, 0.25]], torch.float32)
    return ids, weights


def _step(emb, ids, weights):
    emb.enqueue(ids, weights)
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.full_like(v, 0.25) for k, v in acts.items()})
    return acts


def _state(emb):
    return {k: v.clone() for k, v in emb.state_dict().items() if k != "step"}


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("bad, message", [
    ("id", "feature 'd' has id 10 but table 'a' has vocabulary_size 10"),
    ("negative", "feature 'j' has id -3 but table 'b' has vocabulary_size 7"),
    ("offsets", "feature 'j': jagged offsets must start at 0, never decrease"),
    ("weight", "feature 'w' has a non-finite weight"),
    ("weight offsets", "feature 'w': weights must be a jagged tensor with the same offsets")])
def test_a_bad_batch_changes_nothing_and_check_names_it(optimizer, bad, message):
    emb = _engine(optimizer)
    assert emb.plan.backend == "Triton"
    _step(emb, *_batch(0))
    before = _state(emb)
    acts = _step(emb, *_batch(1, bad))  # (no error yet: nothing is read back)
    assert all(not a.detach().any() for a in acts.values())  # masked: zero activations
    after = _state(emb)
    assert all(torch.equal(before[k], after[k]) for k in before), "a masked batch wrote"
    with pytest.raises(ValueError, match="1 training batch since the last check") as e:
        emb.check()
    assert message in str(e.value)
    emb.check()  # (forgotten once raised)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_good_batches_around_a_bad_one_train_as_the_host_checked_engine(optimizer, dtype):
    """The device-checked engine, fed a bad batch between good ones, ends where the host-checked
    engine ends without it, the bad batch's step counted (the step keys of stochastic rounding
    and Adam's bias correction follow the count)."""
    device = _engine(optimizer, dtype)
    host = _engine(optimizer, dtype, host_checks=True)
    for step in range(3):
        for emb in (device, host):
            _step(emb, *_batch(step))
        if step == 1:
            _step(device, *_batch(9, "id"))
            with pytest.raises(ValueError, match="has id 10"):
                host.enqueue(*_batch(9, "id"))  # (the host's error at once, as on the CPU)
            host.load_state_dict({"step": torch.tensor(host.step + 1)}, strict=False)
    a, b = _state(device), _state(host)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert device.step == host.step == 4
    with pytest.raises(ValueError, match="feature 'd' has id 10"):
        device.check()


def test_check_reports_the_first_bad_batch_and_how_many_across_folds(monkeypatch):
    from embcore.inputs.canonical import Verdicts
    monkeypatch.setattr(Verdicts, "FOLD", 2)
    emb = _engine(ec.Adagrad(learning_rate=0.1))
    kinds = [None, "negative", None, "id", "weight", None, None]
    for step, bad in enumerate(kinds):
        _step(emb, *_batch(step, bad))
    with pytest.raises(ValueError, match="3 training batches since the last check") as e:
        emb.check()
    assert "feature 'j' has id -3" in str(e.value)  # the first of them


def test_no_synchronisation_with_weights_stacked_tables_and_the_layer():
    """A steady step with weighted jagged bags, dense ids and two tables stacked in one
    physical table, through the mid-level API and through the layer: no synchronisation."""
    emb = _engine(ec.Adam(learning_rate=0.1))
    assert len(emb.plan.physical) == 1  # (both tables stacked)
    for step in range(3):
        _step(emb, *_batch(step))
    ids, weights = _batch(3)
    with Counts() as counted:
        _step(emb, ids, weights)
    assert counted.syncs == 0, sorted(set(counted.why))
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "adagrad")
    for step in range(4):
        batch = {"f": torch.tensor([1, 5, 1, step])}
        with Counts() as counted:
            layer(batch)["f"].sum().backward()
    assert counted.syncs == 0, sorted(set(counted.why))
    layer.engine.check()


def test_lookups_and_the_host_mode_still_raise_at_once():
    emb = _engine(ec.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="has id 10"):
        emb.lookup(*_batch(0, "id"))  # (no update: checked on the host, as before)
    host = _engine(ec.SGD(learning_rate=0.1), host_checks=True)
    with pytest.raises(ValueError, match="non-finite weight"):
        host.enqueue(*_batch(0, "weight"))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 12), max_size=40))
def test_the_dedup_of_fixed_capacity_is_the_dedup_padded(ids):
    from embcore.ops.bags import dedup_padded
    ids = torch.tensor(ids, dtype=torch.int64)
    want, got = dedup(ids), dedup_padded(ids)
    n, u = ids.numel(), want.unique.numel()
    assert got.unique.shape == (n,) and got.unique_offsets.shape == (n + 1,)
    assert torch.equal(got.order, want.order)
    assert torch.equal(got.unique[:u], want.unique)
    assert torch.equal(got.unique_offsets[:u + 1], want.unique_offsets)
    assert (got.unique_offsets[u:] == n).all()  # padding: no occurrence
    assert torch.equal(got.inverse, want.inverse)
    with Counts() as counted:
        dedup_padded(ids)
    assert counted.syncs == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(-2**40, 2**40) | st.integers(-3, 40), max_size=70),
                max_size=5),
       st.lists(st.integers(-50, 10**6), min_size=5, max_size=5),
       st.lists(st.integers(1, 40), min_size=5, max_size=5))
def test_the_batch_kernels_are_their_torch_references(parts, shifts, vocabs):
    """One launch each (kernels/gpu/batch.py) for what torch ops did: the Triton backend's
    dedup (the parts concatenated and shifted, then ``dedup_padded``), its ids' bounds and
    verdict (``Backend.id_bounds`` of the torch ops; the verdict nonzero exactly when an id is
    outside ``[0, vocab)``), bit for bit, across the blocks of the scan (up to 350 ids)."""
    from embcore.ops.backend import TORCH_OPS, TRITON
    from embcore.ops.bags import dedup_padded
    ts = [torch.tensor(p, dtype=torch.int64) for p in parts]
    adds = shifts[:len(ts)]
    if ts:
        ids, got = TRITON.dedup(ts, adds, 1, padded=True)
        want_ids = torch.cat([t + a for t, a in zip(ts, adds)])
        want = dedup_padded(want_ids)
        assert torch.equal(ids, want_ids)
        for name in ("unique", "order", "unique_offsets"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert torch.equal(got.inverse, want.inverse)
    full = [t for t in ts if t.numel()]
    if full:
        vs = vocabs[:len(full)]
        bounds, verdict = TRITON.id_bounds(full, vs)
        want_bounds, none = TORCH_OPS.id_bounds(full, vs)
        assert none is None and torch.equal(bounds, want_bounds)
        outside = any(int(t.min()) < 0 or int(t.max()) >= v for t, v in zip(full, vs))
        assert verdict.dtype == torch.int64 and int(verdict) == int(outside)
        flags = [torch.tensor(0), torch.tensor(bool(len(full) % 2))]  # (the offsets' flags)
        report, verdict = TRITON.id_bounds(full, vs, flags)
        assert torch.equal(report, TORCH_OPS.id_bounds(full, vs, flags)[0])
        assert int(verdict) == int(outside or len(full) % 2 == 1)


def test_the_batch_kernels_span_many_blocks():
    """The scan's blocks (1024 ids each) continue one another's ranks."""
    from embcore.ops.backend import TRITON
    from embcore.ops.bags import dedup_padded
    g = torch.Generator().manual_seed(3)
    parts = [torch.randint(0, 900, (n,), generator=g) for n in (1500, 0, 1023, 2049)]
    ids, got = TRITON.dedup(parts, [0, 5, 1000, 3000], 1, padded=True)
    want = dedup_padded(ids)
    for name in ("unique", "order", "unique_offsets"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    bounds, verdict = TRITON.id_bounds([parts[0], parts[3]], [900, 899])
    assert bounds.tolist() == [int(parts[0].min()), int(parts[0].max()),
                               int(parts[3].min()), int(parts[3].max())]
    assert int(verdict) == int(int(parts[3].max()) >= 899)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=12), st.integers(-2, 2),
       st.integers(0, 12), st.booleans())
def test_the_triton_backends_offsets_and_scales_are_the_torch_ops(lengths, nudge, at, weighted):
    """The Triton backend's ``offsets_verdict`` and mean scales in fewer launches: the verdict
    nonzero exactly when the offsets are malformed, the offsets safe to index with (the given
    ones when valid), the scales the torch ops' bit for bit."""
    from embcore.ops.backend import TORCH_OPS, TRITON
    offsets = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
    nnz = int(offsets[-1])
    bad = offsets.clone()
    bad[at % bad.numel()] += nudge
    for given_ in (offsets, bad):
        safe, verdict = TRITON.offsets_verdict(given_, nnz, mean=True)
        malformed = TORCH_OPS.offsets_error(given_, nnz) >= 0
        assert bool(verdict) == malformed
        # safe to index with: 0 first, nnz last, never decreasing; the given ones when valid
        assert safe[0] == 0 and safe[-1] == nnz and (safe[1:] >= safe[:-1]).all()
        assert malformed or torch.equal(safe, given_)
        want_safe, _ = TORCH_OPS.offsets_verdict(given_, nnz)
        assert torch.equal(safe, want_safe)
        # the mean scales computed with them, kept for the combiner's call
        got = TRITON.combiner_scales(safe, None, "mean", nnz)
        assert torch.equal(got, TORCH_OPS.combiner_scales(safe, None, "mean", nnz))
        assert torch.equal(TRITON.bag_index(safe, nnz), TORCH_OPS.bag_index(safe, nnz))
    weights = torch.rand(nnz) if weighted else None
    for combiner in ("sum", "mean", "sqrtn"):
        got = TRITON.combiner_scales(offsets, weights, combiner, nnz)
        want = TORCH_OPS.combiner_scales(offsets, weights, combiner, nnz)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    parts = [offsets, torch.tensor([0]), offsets[:2] - offsets[0]]
    shifts = [0, nnz, nnz]
    total = nnz + int(parts[2][-1])
    assert torch.equal(TRITON.concat_offsets(parts, shifts, total),
                       TORCH_OPS.concat_offsets(parts, shifts, total))


def test_the_layer_masks_a_bad_batch_or_raises_at_once_with_host_checks():
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "adagrad")
    before = layer.embedding_tables[t].clone()
    layer({"f": torch.tensor([1, 10])})["f"].sum().backward()  # masked: nothing moves
    assert torch.equal(layer.embedding_tables[t], before)
    with pytest.raises(ValueError, match="feature 'f' has id 10"):
        layer.engine.check()
    host = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "adagrad", host_checks=True)
    with pytest.raises(ValueError, match="feature 'f' has id 10"):
        host({"f": torch.tensor([1, 10])})


def test_a_masked_batch_beside_a_publish_flags_no_row_outside_the_table(tmp_path):
    """Change tracking (a publish) beside a masked batch whose ids are out of range: the step
    runs, no row moves, the next delta holds only rows inside the table."""
    emb = _engine(ec.SGD(learning_rate=0.1))
    _step(emb, *_batch(0))
    ec.publish(tmp_path / "pub", emb)
    before = _state(emb)
    ids, weights = _batch(1)
    ids["d"] = torch.tensor([1, 1000, -7, 2])  # (outside the stacked physical table too)
    _step(emb, ids, weights)
    assert all(torch.equal(before[k], v) for k, v in _state(emb).items())
    ec.publish(tmp_path / "pub", emb)
    with pytest.raises(ValueError, match="has id -7"):
        emb.check()
