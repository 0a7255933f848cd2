"""The native preprocess (step/native_prepare.py) against preprocess.py: bit-identical activations, tables and slots
over several steps, for every optimizer (those without a fused kernel decline at the update),
tables in memory or offloaded behind caches,
every verb that takes it (enqueue / dequeue / apply_gradients, the layer's training step,
lookup), and batches it declines mixed in; errors and shape rules as the general path's."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import requires_native
from profiles import examples
from strategies import any_optimizer
from switches import fast_path

import embcore as ec
from embcore.config.tables import INDEX_BYTES_PER_ROW
from embcore.kernels import cpu
from embcore.planning.plan import where_bytes
from embcore.step import native_prepare as fast


def engine(tables, features, optimizer, enabled, **kw):
    """The same engine (same seed) with the fast path on or off."""
    torch.manual_seed(0)
    with fast_path(enabled):
        emb = ec.Embedding(features(tables), optimizer, **kw)
        emb.build()
    assert (emb._path.native is not None) == enabled
    return emb


@st.composite
def setups(draw):
    """Tables (stacked when dims agree), features (some sharing a table), one batch shape per
    feature ((B,), (B, 1) or (B, L)), an optimizer, and per step how the batch is fed."""
    n_tables = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    tables = [ec.TableConfig(vocabulary_size=draw(st.integers(1, 30)),
                             dim=draw(st.sampled_from([1, 4, 8])),
                             combiner=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                             dtype=dtype, name=f"t{i}") for i in range(n_tables)]
    readers = draw(st.lists(st.integers(0, n_tables - 1), min_size=1, max_size=4))
    b = draw(st.integers(1, 6))
    shapes = [draw(st.sampled_from([(b,), (b, 1), (b, draw(st.integers(2, 3)))]))
              for _ in readers]
    opt, _, _ = draw(any_optimizer(dense_adam=False))
    # per step: "dense" (taken whole), or a declined variant the general path must handle
    steps = draw(st.lists(st.sampled_from(["dense", "dense", "columns", "int32", "none_grad",
                                           "float64_grad", "strided_grad"]),
                          min_size=1, max_size=4))
    # the tables in memory, or offloaded behind caches of a row or two (grown to each step's
    # rows: the budget holds the caches' indexes and a row of each, slots included) or of a few
    # rows (evicting)
    index = sum(t.vocabulary_size * where_bytes(False) + t.dim * 4 * 3 + INDEX_BYTES_PER_ROW
                for t in tables)
    budget = draw(st.sampled_from([None, index, index + 400]))
    return tables, readers, shapes, opt, steps, budget


def features_of(readers):
    return lambda tables: {f"f{i}": ec.FeatureConfig(table=tables[t])
                           for i, t in enumerate(readers)}


def batch_of(tables, readers, shapes, seed, kind):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (t, shape) in enumerate(zip(readers, shapes)):
        ids = torch.randint(0, tables[t].vocabulary_size, shape, generator=g)
        if kind == "columns" and (len(shape) == 1 or shape == (shape[0], 1)):
            wide = torch.full((shape[0], 3), -1, dtype=torch.int64)  # a column of a wider
            wide[:, 1] = ids.reshape(-1)                            # batch: not contiguous
            ids = wide[:, 1:2] if len(shape) == 2 else wide[:, 1]
        out[f"f{i}"] = ids.to(torch.int32) if kind == "int32" else ids
    return out


def gradients_of(acts, seed, kind):
    g = torch.Generator().manual_seed(seed + 1000)
    out = {}
    for i, (k, a) in enumerate(acts.items()):
        grad = torch.randn(a.shape, generator=g)
        if kind == "none_grad" and i == 0:
            grad = None
        elif kind == "float64_grad":
            grad = grad.double()
        elif kind == "strided_grad" and a.dim() == 2:
            grad = torch.randn(a.shape[1], a.shape[0], generator=g).T  # column stride > 1
        out[k] = grad
    return out


def state(emb):
    return {k: v.clone() for k, v in emb.state_dict().items()}


@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(setups())
def test_the_fast_path_equals_the_general_path(setup):
    tables, readers, shapes, opt, steps, budget = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (caches that grow warn)
        engines = [engine(tables, features_of(readers), opt, on, memory_budget=budget)
                   for on in (True, False)]
    plan = engines[0].plan
    if budget is not None and plan.bytes_per_rank()[0] > budget:
        assert any(p.offloaded for p in plan.physical)
    for step, kind in enumerate(steps):
        batch = batch_of(tables, readers, shapes, step, kind)
        outs = []
        for emb in engines:
            emb.enqueue(batch)
            acts = emb.dequeue()
            emb.apply_gradients(gradients_of(acts, step, kind), warn_on_none=False)
            outs.append(acts)
        for k in outs[0]:
            assert torch.equal(outs[0][k], outs[1][k]), (step, kind, k)
        a, b = state(engines[0]), state(engines[1])
        for k in a:
            assert torch.equal(a[k], b[k]), (step, kind, k)
    served = [emb.lookup(batch_of(tables, readers, [(2,) for _ in readers], 99, "dense"))
              for emb in engines]
    assert all(torch.equal(served[0][k], served[1][k]) for k in served[0])


@requires_native
@settings(max_examples=examples(25), deadline=None)
@given(setups())
def test_the_layer_on_the_fast_path_equals_the_general_path(setup):
    tables, readers, shapes, opt, _, _ = setup
    layers = []
    for on in (True, False):
        torch.manual_seed(0)
        with fast_path(on):
            layers.append(ec.EmbeddingLayer(features_of(readers)(tables), opt))
    for step in range(3):
        batch = batch_of(tables, readers, shapes, step, "dense")
        outs = []
        for layer in layers:
            acts = layer(batch)
            sum((a * (i + 1)).square().sum() for i, a in enumerate(acts.values())).backward()
            outs.append({k: a.detach() for k, a in acts.items()})
        assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    a, b = (layer.engine.state_dict() for layer in layers)
    assert all(torch.equal(a[k], b[k]) for k in a)


@st.composite
def dynamic_setups(draw):
    """Raw-id tables (stacked when dims agree) beside a static one or not, small capacities
    (evicting, overflowing), each map's rules drawn, and per step how the batch is fed."""
    n_tables = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    init = draw(st.sampled_from([None, functools.partial(torch.nn.init.constant_, val=0.5)]))
    tables = [ec.TableConfig(vocabulary_size=draw(st.integers(2, 10)),
                             dim=draw(st.sampled_from([4, 4, 8])),
                             combiner=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
                             dtype=dtype, name=f"t{i}", initializer=init,
                             dynamic=ec.DynamicVocabulary(
                                 eviction=draw(st.sampled_from(["lru", "lfu"])),
                                 admit_after=draw(st.sampled_from([1, 1, 2])),
                                 ttl_steps=draw(st.sampled_from([None, None, 2]))))
              for i in range(n_tables)]
    if draw(st.booleans()):  # a static table beside them
        tables.append(ec.TableConfig(vocabulary_size=12, dim=4, dtype=dtype, name="s"))
    readers = draw(st.lists(st.integers(0, len(tables) - 1), min_size=1, max_size=4))
    b = draw(st.integers(1, 5))
    shapes = [draw(st.sampled_from([(b,), (b, 1)])) for _ in readers]
    opt = draw(st.sampled_from([ec.SGD(learning_rate=0.1), ec.Adagrad(learning_rate=0.1),
                                ec.RowwiseAdagrad(learning_rate=0.1)]))
    steps = draw(st.lists(st.sampled_from(["dense", "dense", "dense", "columns", "int32",
                                           "none_grad", "strided_grad"]),
                          min_size=2, max_size=6))
    return tables, readers, shapes, opt, steps


def raw_batch_of(tables, readers, shapes, seed, kind, pool=None):
    """``batch_of`` with raw ids for the dynamic tables, drawn from ``pool`` (default: eight
    int64s, negative and large among them)."""
    out = batch_of(tables, readers, shapes, seed, kind)
    g = torch.Generator().manual_seed(seed + 500)
    if pool is None:
        pool = torch.tensor([-7, 0, 3, 11, 2**62 + 1, -(2**40), 123456789, 5])
    for i, t in enumerate(readers):
        if tables[t].dynamic is not None:
            x = out[f"f{i}"]
            raw = pool[torch.randint(0, pool.numel(), x.shape, generator=g)]
            out[f"f{i}"] = raw.to(x.dtype) if kind == "int32" and raw.abs().max() < 2**31 \
                else raw
    return out


@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(dynamic_setups())
def test_the_fast_path_equals_the_general_path_on_raw_id_tables(setup):
    """Dynamic tables (their maps' admission, eviction, TTL, pending counts) stepped on the fast
    path and on the general path: the same activations, tables, slots and maps, the same
    overflow errors (nothing changed by them), the same evaluation lookups."""
    tables, readers, shapes, opt, steps = setup
    engines = [engine(tables, features_of(readers), opt, on) for on in (True, False)]
    _step_alike(engines, tables, readers, shapes, steps)


def _step_alike(engines, tables, readers, shapes, steps, pool=None):
    """Steps both engines over the same raw-id batches; the same results, errors and state."""
    for step, kind in enumerate(steps):
        batch = raw_batch_of(tables, readers, shapes, step, kind, pool)
        outs, errors = [], []
        for emb in engines:
            try:
                emb.enqueue(batch)
                acts = emb.dequeue()
            except ValueError as e:  # more new ids than a table holds: both refuse
                errors.append(str(e))
                continue
            emb.apply_gradients(gradients_of(acts, step, kind), warn_on_none=False)
            outs.append(acts)
        assert len(errors) in (0, 2) and len(set(errors)) <= 1, errors
        if outs:
            for k in outs[0]:
                assert torch.equal(outs[0][k], outs[1][k]), (step, kind, k)
        a, b = state(engines[0]), state(engines[1])
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (step, kind, k)
    served = [emb.lookup(raw_batch_of(tables, readers, [(3,) for _ in readers], 99, "dense",
                                      pool)) for emb in engines]
    assert all(torch.equal(served[0][k], served[1][k]) for k in served[0])


@requires_native
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_offloaded_raw_id_tables_on_the_fast_path_equal_the_general_path(tmp_path, eviction):
    """Stacked raw-id tables behind a cache (rows and slots in the slow tier, maps in memory):
    the fast path's steps equal the general path's, bit for bit."""
    dyn = ec.DynamicVocabulary(eviction=eviction, admit_after=2, ttl_steps=4)
    tables = [ec.TableConfig(vocabulary_size=v, dim=16, combiner=c, name=f"t{k}", dynamic=dyn)
              for k, (v, c) in enumerate([(30, "sum"), (24, "mean"), (40, "sum")])]
    readers = [0, 1, 2, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (caches that grow warn)
        engines = [engine(tables, features_of(readers), ec.Adagrad(learning_rate=0.1), on,
                          memory_budget=12000, offload_dir=tmp_path / f"slow{on}")
                   for on in (True, False)]
    assert engines[0].plan.physical[0].offloaded
    pool = torch.arange(70) * (2**40 + 7) - 2**45  # more ids than the tables hold: evictions
    _step_alike(engines, tables, readers, [(12,)] * 4, ["dense"] * 10, pool)
    assert engines[0]._ready().store.cache_stats()  # (the cache was used)


def two_features(optimizer=None):
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    u = ec.TableConfig(vocabulary_size=5, dim=4, name="u")
    torch.manual_seed(0)
    emb = ec.Embedding({"a": ec.FeatureConfig(table=t), "b": ec.FeatureConfig(table=u)},
                       optimizer or ec.Adagrad(learning_rate=0.1))
    emb.build()
    return emb


@requires_native
def test_dense_batches_take_the_fast_path_and_others_do_not():
    emb = two_features()
    assert (emb._path.native is not None)
    calls = []  # the batches the native preprocess took
    real = emb._path.native.prepare

    def counted(*args):
        got = real(*args)
        if got is not None:
            calls.append(got)
        return got

    emb._path.native.prepare = counted
    emb.enqueue({"a": torch.tensor([1, 2, 3]), "b": torch.tensor([[4], [0], [4]])})
    emb.apply_gradients({k: torch.ones(3, 4) for k in emb.dequeue()})
    assert len(calls) == 1
    emb.enqueue({"a": torch.tensor([1, 2, 3]), "b": torch.tensor([4, 0, 4])},
                weights={"a": None, "b": None})  # weights: the general path
    emb.apply_gradients({k: torch.ones(3, 4) for k in emb.dequeue()})
    assert len(calls) == 1
    emb.enqueue({"a": torch.tensor([1, 2, 3], dtype=torch.int32),  # int32: the general path
                 "b": torch.tensor([4, 0, 4])})
    emb.apply_gradients({k: torch.ones(3, 4) for k in emb.dequeue()})
    assert len(calls) == 1
    x = torch.tensor([[1, 9], [2, 9], [3, 9]])[:, 0]  # a column: the fast path, in place
    emb.enqueue({"a": x, "b": torch.tensor([4, 0, 4])})
    emb.apply_gradients({k: torch.ones(3, 4) for k in emb.dequeue()})
    assert len(calls) == 2
    assert emb.step == 4


@requires_native
@pytest.mark.parametrize("bad", [10, -1, 2**62])
def test_an_id_out_of_range_raises_the_general_error_and_changes_nothing(bad):
    emb = two_features()
    before = state(emb)
    with pytest.raises(ValueError, match=r"feature 'a' has id .* vocabulary_size 10"):
        emb.enqueue({"a": torch.tensor([1, bad, 3]), "b": torch.tensor([4, 0, 4])})
    with pytest.raises(ValueError, match=r"feature 'b' has id 5 .* vocabulary_size 5"):
        emb.enqueue({"a": torch.tensor([1, 2, 3]), "b": torch.tensor([4, 5, 4])})
    with pytest.raises(RuntimeError, match="nothing enqueued"):
        emb.dequeue()
    after = state(emb)
    assert all(torch.equal(before[k], after[k]) for k in before)


@requires_native
def test_shapes_are_fixed_and_checked_as_on_the_general_path():
    emb = two_features()
    emb.enqueue({"a": torch.tensor([1, 2]), "b": torch.tensor([[4], [0]])})  # fixes (2,)
    emb.apply_gradients({k: torch.ones(2, 4) for k in emb.dequeue()})
    with pytest.raises(ValueError, match=r"fixed at \[2\]"):
        emb.enqueue({"a": torch.tensor([1, 2, 3]), "b": torch.tensor([4, 0, 4])})
    with pytest.raises(ValueError, match=r"gradient of feature 'a'.*shape"):
        emb.enqueue({"a": torch.tensor([1, 2]), "b": torch.tensor([4, 0])})
        emb.dequeue()
        emb.apply_gradients({"a": torch.ones(3, 4), "b": torch.ones(2, 4)})
    # the refused gradients changed nothing: the batch still awaits its gradients
    emb.apply_gradients({"a": torch.ones(2, 4), "b": torch.ones(2, 4)})
    assert emb.step == 2
    assert emb.lookup({"a": torch.tensor([1, 2, 3, 4]), "b": torch.tensor([0])})["a"].shape == (
        4, 4)  # lookup: any batch shape


def test_engines_the_fast_path_cannot_take_have_none():
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    seq = ec.Embedding({"a": ec.FeatureConfig(table=t, max_sequence_length=2)}, ec.SGD())
    seq.build()
    assert not (seq._path.native is not None)
    shaped = ec.Embedding({"a": ec.FeatureConfig(table=t, output_shape=[2, 2])}, ec.SGD())
    shaped.build()
    assert not (shaped._path.native is not None)
    half = ec.Embedding({"a": ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=10, dim=4, dtype=torch.float64))}, ec.SGD())
    half.build()
    assert not (half._path.native is not None)
    with fast_path(False):
        off = ec.Embedding({"a": ec.FeatureConfig(table=t)}, ec.SGD())
        off.build()
    assert not (off._path.native is not None)


def test_raw_id_tables_take_the_fast_path_in_memory_and_offloaded(tmp_path):
    raw = ec.TableConfig(vocabulary_size=40, dim=16, name="r", dynamic=ec.DynamicVocabulary())
    here = ec.Embedding({"a": ec.FeatureConfig(table=raw)}, ec.SGD())
    here.build()
    assert (here._path.native is not None) == cpu.available()
    away = ec.Embedding({"a": ec.FeatureConfig(table=raw)}, ec.SGD(), memory_budget=3000,
                        offload_dir=tmp_path)  # rows behind a cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        away.build()
    assert away.plan.physical[0].offloaded
    assert (away._path.native is not None) == cpu.available()
    assert fast.set_enabled(True) is True
