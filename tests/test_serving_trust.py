"""Serving that keeps the engine's promises ("Trust, third round", points 6, 8, 9 and 10).

(6) A sparse COO input flagged coalesced whose indices are not sorted (or hold duplicates) is
read by every serving entry point exactly as the engine reads it: sorted as an uncoalesced
input, and refused with the same error where its indices are out of range.
(8) ``ServingModule.export`` (and ``torch.export.export`` given ``dynamic_shapes()``) gives a
program that serves any number of ids and any batch size: dense ids, ``(values, offsets)``
pairs and sparse COO, not only the traced counts.
(9) ``embedding_tables`` takes a table's name wherever it takes its TableConfig.
(10) A table named like an attribute of the serving module (``forward``, ``training``,
``table_bytes``, ...) or holding a ``'.'`` is served, its buffers named by ``buffer_name``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from switches import kernels, private_paths

import embcore as ec
from embcore.serving.serve import ServingModule

DIM = 3


def _sparse(indices, values, shape, coalesced=None) -> torch.Tensor:
    """A COO tensor with exactly these stored entries (torch checks nothing)."""
    idx = torch.tensor(indices, dtype=torch.int64).reshape(len(shape), -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch: "sparse invariant checks are disabled")
        return torch.sparse_coo_tensor(idx, torch.tensor(values), shape, is_coalesced=coalesced,
                                       check_invariants=False)


# ------------------------------------------------------------------ (6) sparse inputs, eager
def _entry_points(fc, emb, layer):
    """Every way to look a batch up, each ``(features, weights) -> activations``."""
    served = layer.for_serving()
    quantized = layer.for_serving(quantize="fp16")

    def enqueue(x, w):
        emb.enqueue(x, w, training=False)
        return emb.dequeue()

    return {
        "lookup": lambda x, w: emb.lookup(x, w),
        "enqueue": enqueue,
        "serving_embedding_lookup": lambda x, w: ec.serving_embedding_lookup(
            x, w, emb.embedding_tables, fc),
        "ServingModule": served,
        "ServingModule fp16": lambda x, w: quantized(x, w),
    }


@pytest.mark.parametrize("fallbacks", [False, True], ids=["kernels", "fallbacks"])
def test_a_falsely_coalesced_sparse_input_is_read_as_the_engine_reads_it(fallbacks):
    with kernels(not fallbacks), private_paths(not fallbacks):
        torch.manual_seed(0)
        t = ec.TableConfig(vocabulary_size=10, dim=DIM, combiner="mean", name="t")
        fc = {"bag": ec.FeatureConfig(table=t),
              "seq": ec.FeatureConfig(table=t, max_sequence_length=3)}
        layer = ec.EmbeddingLayer(fc, ec.SGD(learning_rate=0.1))
        emb = layer.engine
        entries = _entry_points(fc, emb, layer)
        unsorted = ([[2, 0, 0, 1], [0, 1, 0, 2]], [5, 2, 1, 7], (3, 3))
        dup = ([[0, 0, 1, 2], [1, 1, 0, 0]], [2, 3, 4, 9], (3, 2))  # two ids at (0, 1)
        weights = [1.0, 2.0, 0.5, 3.0]
        honest = _sparse(*unsorted, coalesced=False)
        for idx, vals, shape in (unsorted, dup):
            liars = {"is_coalesced=True": lambda i=idx, v=vals, s=shape: _sparse(i, v, s, True),
                     "_coalesced_(True)": lambda i=idx, v=vals, s=shape:
                         _sparse(i, v, s)._coalesced_(True)}
            for how, make in liars.items():
                def batch(make=make, idx=idx, shape=shape):
                    return ({"bag": make(), "seq": make()},
                            {"bag": _sparse(idx, weights, shape, True), "seq": None})
                want = emb.lookup(*batch())
                if idx is unsorted[0]:  # sorted as the uncoalesced input it really is
                    w = {"bag": _sparse(idx, weights, shape, False), "seq": None}
                    sure = emb.lookup({"bag": honest, "seq": honest}, w)
                    for k in fc:
                        assert torch.equal(want[k], sure[k]), (how, k)
                for name, call in entries.items():
                    got = call(*batch())
                    tol = 1e-3 if "fp16" in name else 0
                    for k in fc:
                        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol,
                                                   msg=f"{how} {name} {k}")
        # out of range, flagged coalesced: every entry point refuses it, naming the feature
        bad = _sparse([[0, 5], [0, 0]], [1, 2], (3, 2), coalesced=True)
        ok = _sparse([[0], [0]], [1], (3, 2))
        for name, call in entries.items():
            with pytest.raises(ValueError, match="feature 'bag': sparse index 5 in dim 0"):
                call({"bag": bad, "seq": ok}, None)
        # weights stored in another order than their (falsely coalesced) ids: refused alike
        ids = _sparse(*unsorted, coalesced=True)
        order = sorted(range(4), key=lambda k: (unsorted[0][0][k], unsorted[0][1][k]))
        w_sorted = _sparse([[unsorted[0][d][k] for k in order] for d in range(2)],
                           [1.0, 2.0, 3.0, 4.0], (3, 3), coalesced=True)
        for name, call in entries.items():
            with pytest.raises(ValueError, match="weights must have the same indices"):
                call({"bag": ids, "seq": ok}, {"bag": w_sorted, "seq": None})


# ------------------------------------------------------------------------- (8) export
def _mixed_layer():
    """Dense (1-D and 2-D), jagged pairs (weighted bags, sequences, raw ids of a dynamic table)
    and sparse COO (rank 2 and 3) features, trained one step (raw ids admitted)."""
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=20, dim=DIM, combiner="mean", name="t")
    u = ec.TableConfig(vocabulary_size=20, dim=DIM, combiner="sqrtn", name="u")
    raw = ec.TableConfig(vocabulary_size=20, dim=DIM, name="raw", dynamic=ec.DynamicVocabulary())
    fc = {"dense": ec.FeatureConfig(table=t), "dense2": ec.FeatureConfig(table=u),
          "jag": ec.FeatureConfig(table=u), "seq": ec.FeatureConfig(table=t, max_sequence_length=3),
          "raw": ec.FeatureConfig(table=raw), "sp": ec.FeatureConfig(table=u),
          "sp3": ec.FeatureConfig(table=t)}
    layer = ec.EmbeddingLayer(fc, ec.SGD(learning_rate=0.1))
    g = torch.Generator().manual_seed(1)
    x, w = _mixed_batch(g, 4, 8, high_raw=30)
    sum(a.sum() for a in layer(x, w).values()).backward()
    return layer, fc, g


def _pair(g, b, n, high=20):
    cuts = torch.sort(torch.randint(0, n + 1, (b - 1,), generator=g)).values
    return (torch.randint(0, high, (n,), generator=g),
            torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))


def _coo(g, shape, n, high=20):
    lin = torch.randperm(math.prod(shape), generator=g)[:min(n, math.prod(shape))]
    x = torch.sparse_coo_tensor(torch.stack(torch.unravel_index(lin, shape)),
                                torch.randint(0, high, (lin.numel(),), generator=g), shape)
    return x.coalesce() if n % 2 else x  # (coalesced or not)


def _mixed_batch(g, b, n, high_raw=30):
    """A batch of ``b`` rows / bags, ``n`` ids per feature."""
    jag = _pair(g, b, n)
    x = {"dense": torch.randint(0, 20, (n,), generator=g),
         "dense2": torch.randint(0, 20, (b, 4), generator=g),
         "jag": jag, "seq": _pair(g, b, n), "raw": _pair(g, b, n, high_raw),
         "sp": _coo(g, (b, 5), n), "sp3": _coo(g, (b, 2, 3), n)}
    w = {k: None for k in x}
    w["jag"] = (torch.rand(n, generator=g), jag[1])
    return x, w


def _assert_serves_like_eager(program, served, x, w, where):
    args = (x,) if w is None else (x, w)
    got = program(*args)
    with kernels(False):  # the eager module through the same torch ops: bit for bit
        same_ops = served(*args)
    want = served(*args)  # (the fused kernels: the same sums, maybe in another order)
    for k in want:
        assert got[k].shape == want[k].shape, (where, k)
        assert torch.equal(got[k], same_ops[k]), (where, k)
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=str((where, k)))


def test_an_exported_program_serves_any_number_of_ids_and_any_batch_size(tmp_path):
    layer, _, g = _mixed_layer()
    served = layer.for_serving(quantize={"u": "int8"})
    program = served.export(*_mixed_batch(g, 3, 5))
    torch.export.save(program, tmp_path / "p.pt2")
    loaded = torch.export.load(tmp_path / "p.pt2").module()
    for n in (0, 1, 3, 17):
        for b in (1, 2, 5):
            x, w = _mixed_batch(g, b, n)
            _assert_serves_like_eager(loaded, served, x, w, (n, b))


def test_a_program_traced_from_one_id_in_one_bag_serves_others():
    layer, fc, g = _mixed_layer()
    served = layer.for_serving({k: fc[k] for k in ("dense", "jag", "seq", "sp")})
    features = {"dense": torch.tensor([3]), "jag": (torch.tensor([4]), torch.tensor([0, 1])),
                "seq": (torch.tensor([4]), torch.tensor([0, 1])),
                "sp": _sparse([[0], [2]], [7], (1, 5))}
    program = served.export(features).module()
    for n in (0, 1, 3, 17):
        for b in (1, 2, 5):
            x, _ = _mixed_batch(g, b, n)
            x = {k: x[k] for k in ("dense", "jag", "seq", "sp")}
            _assert_serves_like_eager(program, served, x, None, (n, b))


def test_plain_torch_export_with_dynamic_shapes_serves_other_counts():
    """The documented form without ``export()``: any number of ids; jagged batches of two
    bags or more (torch's ops guard a bag count against 1 unless traced size-obliviously)."""
    layer, fc, g = _mixed_layer()
    served = layer.for_serving({"dense": fc["dense"], "jag": fc["jag"]})
    args = ({"dense": torch.tensor([1, 2, 3]), "jag": (torch.tensor([1, 2, 3]),
                                                       torch.tensor([0, 1, 3]))},)
    shapes = served.dynamic_shapes(*args)
    auto = torch.export.Dim.AUTO
    assert shapes == ({"dense": {0: auto}, "jag": ({0: auto}, {0: auto})},)
    program = torch.export.export(served, args, dynamic_shapes=shapes).module()
    for n in (1, 3, 17):
        for b in (2, 5):
            x, _ = _mixed_batch(g, b, n)
            x = {"dense": x["dense"], "jag": x["jag"]}
            _assert_serves_like_eager(program, served, x, None, (n, b))


def test_dynamic_shapes_mirrors_the_inputs_and_refuses_what_export_cannot_take():
    layer, _, g = _mixed_layer()
    served = layer.for_serving()
    x, w = _mixed_batch(g, 2, 3)
    f_dims, w_dims = served.dynamic_shapes(x, w)
    assert list(f_dims) == list(x) and list(w_dims) == list(w)
    assert f_dims["dense2"] == {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    assert len(f_dims["sp3"]) == 3 and isinstance(f_dims["jag"], tuple)
    assert w_dims["dense"] is None and isinstance(w_dims["jag"], tuple)
    assert served.dynamic_shapes(x, None) == (f_dims, None)
    with pytest.raises(TypeError, match="nested tensors"):
        served.dynamic_shapes({**x, "jag": torch.nested.nested_tensor_from_jagged(*x["jag"])})
    with pytest.raises(ValueError, match="keys differ"):
        served.dynamic_shapes({"dense": x["dense"]})
    with pytest.raises(TypeError, match="one or two|\\(features,\\)"):
        served.dynamic_shapes(x, w, None)


# --------------------------------------------------------------- (9) tables by name
@pytest.mark.parametrize("optimizer", ["sgd", None], ids=["engine", "parameters"])
def test_embedding_tables_take_a_table_s_name(optimizer):
    users = ec.TableConfig(vocabulary_size=5, dim=DIM, name="users")
    unnamed = ec.TableConfig(vocabulary_size=4, dim=DIM)
    fc = {"u": ec.FeatureConfig(table=users), "x": ec.FeatureConfig(table=unnamed)}
    layer = ec.EmbeddingLayer(fc, optimizer)
    sources = [layer.embedding_tables] + ([layer.engine.embedding_tables] if optimizer else [])
    for tables in sources:
        assert isinstance(tables, dict) and list(tables) == [users, unnamed]
        assert tables["users"] is tables[users] and tables["table_1"] is tables[unnamed]
        assert tables.get("users") is tables[users] and tables.get("nope") is None
        assert tables.get("nope", 7) == 7
        assert "users" in tables and users in tables and "nope" not in tables
        assert dict(tables) == {users: tables[users], unnamed: tables[unnamed]}
        with pytest.raises(KeyError, match="'nope' is not a table here.*'table_1', 'users'"):
            tables["nope"]
        with pytest.raises(KeyError):
            tables[ec.TableConfig(vocabulary_size=5, dim=DIM, name="other")]
    if optimizer is None:  # the parameters themselves, by name too
        assert layer.embedding_tables["users"] is dict(layer.named_parameters())[
            "users/parameters"]
    ids = {"u": torch.tensor([1, 4]), "x": torch.tensor([0, 3])}
    by_name = {"users": layer.embedding_tables["users"],
               "table_1": layer.embedding_tables["table_1"]}
    want = ec.serving_embedding_lookup(ids, None, layer.embedding_tables, fc)
    got = ec.serving_embedding_lookup(ids, None, by_name, fc)
    for k in fc:
        assert torch.equal(got[k], want[k])


def test_a_dynamic_table_is_served_from_its_name():
    raw = ec.TableConfig(vocabulary_size=8, dim=DIM, name="raw", dynamic=ec.DynamicVocabulary())
    fc = {"r": ec.FeatureConfig(table=raw)}
    emb = ec.Embedding(fc, ec.SGD(learning_rate=0.1))
    ids = {"r": torch.tensor([1000, -5, 1000])}
    emb.enqueue(ids)
    emb.apply_gradients({"r": torch.ones_like(emb.dequeue()["r"])})
    entry = (emb.embedding_tables["raw"], *emb.vocabulary("raw"))
    got = ec.serving_embedding_lookup(ids, None, {"raw": entry}, fc)["r"]
    assert torch.equal(got, emb.lookup(ids)["r"])


# ------------------------------------------- (10) tables named like the module's attributes
COLLIDING = ["forward", "training", "table_bytes", "precisions", "export", "dynamic_shapes",
             "buffer_name", "feature_config", "_buffers", "version", "a.b", "t", "t__scale",
             "table__forward"]


@pytest.mark.parametrize("quantize", [None, "int8", "fp16"])
def test_tables_named_like_module_attributes_are_served(quantize):
    torch.manual_seed(0)
    tables = [ec.TableConfig(vocabulary_size=6, dim=DIM, name=n, combiner="sum")
              for n in COLLIDING]
    tables.append(ec.TableConfig(vocabulary_size=6, dim=DIM, name="_dims",
                                 dynamic=ec.DynamicVocabulary()))
    fc = {f"f{i}": ec.FeatureConfig(table=t) for i, t in enumerate(tables)}
    layer = ec.EmbeddingLayer(fc, ec.SGD(learning_rate=0.1))
    ids = {k: torch.tensor([1, 4]) for k in fc}
    sum(a.sum() for a in layer(ids).values()).backward()  # raw ids 1 and 4 admitted
    served = layer.for_serving(quantize=quantize)
    names = [t.name for t in tables]
    buffers = dict(served.named_buffers())
    parts = {n: served.buffer_name(n) for n in names}
    assert len(set(parts.values())) == len(names)
    for n, b in parts.items():
        assert b in buffers and "." not in b
        assert (b == n) == (n in ("t", "table__forward"))  # free names are kept
    assert parts["a.b"] == "table__a%2Eb" and parts["forward"] != parts["table__forward"]
    assert callable(served.forward) and isinstance(served.training, bool)
    assert set(served.table_bytes()) == set(names) and served.precisions.keys() == set(names)
    want = layer.engine.lookup(ids)
    got = served(ids)
    for k in fc:
        tol = {None: 0, "fp16": 2e-3, "int8": 2e-2}[quantize]
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=k)
    # a module of the same tables loads its state (the same buffer names)
    again = layer.for_serving(quantize=quantize)
    again.load_state_dict(served.state_dict())
    with pytest.raises(KeyError, match="not a table served here"):
        served.buffer_name("nope")
    assert served.buffer_name("_dims", "__ids") in buffers


def test_a_free_table_name_keeps_its_buffer_names_and_a_renamed_one_exports():
    items = ec.TableConfig(vocabulary_size=6, dim=DIM, name="items")
    fwd = ec.TableConfig(vocabulary_size=6, dim=DIM, name="forward")
    fc = {"i": ec.FeatureConfig(table=items), "f": ec.FeatureConfig(table=fwd)}
    layer = ec.EmbeddingLayer(fc, "sgd")
    served = layer.for_serving(quantize={"items": "int8"})
    assert served.items.dtype == torch.uint8 and served.items__scale.shape == (6,)
    assert {"items", "items__scale", "items__bias", "table__forward"} == set(served.state_dict())
    x = {"i": torch.tensor([1, 2, 5]), "f": torch.tensor([0, 5, 5])}
    program = served.export(x).module()
    y = {"i": torch.tensor([4]), "f": torch.tensor([3, 1, 2, 0])}
    for k in fc:
        assert torch.equal(program(y)[k], served(y)[k])


def test_buffer_name_of_a_module_pickled_before_it_existed():
    """A ServingModule unpickled from before ``buffer_name`` keeps its tables' own names."""
    items = ec.TableConfig(vocabulary_size=6, dim=DIM, name="items")
    served = ec.EmbeddingLayer({"i": ec.FeatureConfig(table=items)}, "sgd").for_serving()
    del served.__dict__["_buffer_names"]
    assert isinstance(served, ServingModule) and served.buffer_name("items", "__ids") == \
        "items__ids"
    assert served({"i": torch.tensor([1])})["i"].shape == (1, DIM)
