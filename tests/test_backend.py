"""The backend (ops/backend.py) is chosen once per device: the plan prints it, every rows
object, map and cache of the store holds it, and a switch flipped after the tables are built
changes nothing about the kernels they run."""

import pytest
import torch

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
