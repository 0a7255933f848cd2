"""The steady device step traced (docs/semantics.md, "The traced step"): ``enqueue`` ->
``dequeue`` -> ``apply_gradients`` of static tables, dense ids and jagged bags, compiled with
``torch.compile(fullgraph=True)`` (no graph break) on the Triton backend, counted on the CPU as
tests/step_budget_cases.py does (kernels in Triton's interpreter, ``gpu.force_on_cpu``). The
compiled step's activations and rows equal the eager step's, bit for bit, over several steps;
its graph also runs under ``FakeTensorMode`` (shapes only, no data). Run in a fresh
interpreter by tests/test_step_trace.py (``TRITON_INTERPRET=1`` is chosen before triton loads).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from torch._subclasses import FakeTensorMode  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402

if CUDA:
    pytest.skip("traced on the CPU's emulation of the device step (a GPU traces the real one)",
                allow_module_level=True)
if not gpu.available():
    pytest.skip(f"triton does not load: {gpu.error()}", allow_module_level=True)
if not gpu.interpreted():
    pytest.skip("the kernels were loaded before TRITON_INTERPRET=1 was set: run this file alone",
                allow_module_level=True)

OPTIMIZERS = {"SGD": ec.SGD, "Adagrad": ec.Adagrad}


@pytest.fixture(autouse=True)
def _on_the_device_path():
    previous = gpu.force_on_cpu(True)
    torch.compiler.reset()
    try:
        yield
    finally:
        gpu.force_on_cpu(previous)
        torch.compiler.reset()


def _engine(optimizer: type) -> ec.Embedding:
    torch.manual_seed(0)  # (the tables' seed: two engines, the same rows)
    features = {f"f{k}": ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=50, dim=8, name=f"t{k}")) for k in range(2)}
    emb = ec.Embedding(features, optimizer(learning_rate=0.1))
    assert emb.plan.backend == "Triton"
    return emb


def _batches(kind: str, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "dense":
        return [{f"f{k}": torch.randint(0, 50, (8,), generator=g) for k in range(2)}
                for _ in range(n)]
    return [{f"f{k}": torch.nested.nested_tensor_from_jagged(  # bags of 3
        torch.randint(0, 50, (24,), generator=g), torch.arange(0, 25, 3)) for k in range(2)}
        for _ in range(n)]


def _step(emb: ec.Embedding, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    emb.enqueue(batch, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({k: v * 0.5 + 1.0 for k, v in acts.items()})
    return {k: v.detach() for k, v in acts.items()}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["dense", "jagged"])
def test_the_compiled_steady_step_equals_the_eager_step(kind, optimizer, backend):
    eager, traced = _engine(OPTIMIZERS[optimizer]), _engine(OPTIMIZERS[optimizer])
    batches = _batches(kind, 6)
    for b in batches[:3]:  # (warm: the workspaces and maps)
        _step(eager, b)
        _step(traced, b)
    graphs = []

    def counting(gm, inputs):
        graphs.append(gm)
        return gm.forward if backend == "eager" else aot(gm, inputs)

    aot = torch._dynamo.lookup_backend("aot_eager")  # (tests may name private torch)
    tol = 0.0 if kind == "dense" else 1e-6  # (dense: bit for bit)

    def same(got, want):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)

    step = torch.compile(_step, fullgraph=True, backend=counting)
    for b in batches[3:]:
        want, got = _step(eager, b), step(traced, b)
        for k in want:  # (jagged bags: pooled by torch ops when traced, to 1e-6)
            same(got[k], want[k])
        for name in ("t0", "t1"):
            same(traced.embedding_tables[name], eager.embedding_tables[name])
    assert graphs and eager.step == traced.step == 6


@pytest.mark.parametrize("kind", ["dense", "jagged"])
def test_the_traced_step_runs_under_fake_tensors(kind):
    """Its graph run again on fake tensors: the activations' shapes and dtypes, no data (the
    real rows unchanged by the fake run)."""
    emb = _engine(ec.Adagrad)
    batches = _batches(kind, 4)
    for b in batches[:3]:
        _step(emb, b)
    ran = []

    def on_fakes(gm, inputs):  # (the compiler's fake mode: its shape environment)
        mode = torch._guards.detect_fake_mode(inputs)
        assert isinstance(mode, FakeTensorMode)
        with mode:
            fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs]
            ran.append([(tuple(o.shape), o.dtype) for o in gm(*fakes)
                        if isinstance(o, torch.Tensor)])
        return gm.forward

    before = {n: emb.embedding_tables[n].clone() for n in ("t0", "t1")}
    twin = _engine(ec.Adagrad)
    for b in batches[:3]:
        _step(twin, b)
    acts = torch.compile(_step, fullgraph=True, backend=on_fakes)(emb, batches[3])
    want = _step(twin, batches[3])
    assert ran and all(isinstance(shape, tuple) for shape, _ in ran[0])
    for k in want:
        torch.testing.assert_close(acts[k], want[k], rtol=1e-6, atol=1e-6)
        assert ((8, 8), torch.float32) in ran[0]  # (8 examples of D 8, as the real ones)
    for n in before:
        assert not torch.equal(before[n], emb.embedding_tables[n])  # (the real run: applied)
        torch.testing.assert_close(emb.embedding_tables[n], twin.embedding_tables[n],
                                   rtol=1e-6, atol=1e-6)
