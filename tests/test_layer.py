"""The layer: training through loss.backward(), optimizer translation, V0 mode, serving, export."""

from __future__ import annotations

import functools
import gc
import math
import weakref

import pytest
import torch

import embcore as ec


def config():
    users = ec.TableConfig(vocabulary_size=16, dim=4, combiner="sum", name="users")
    items = ec.TableConfig(vocabulary_size=24, dim=4, combiner="mean", name="items")
    return {"user": ec.FeatureConfig(table=users), "item": ec.FeatureConfig(table=items)}


class Model(torch.nn.Module):
    def __init__(self, optimizer, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = config()
        self.emb = ec.EmbeddingLayer(self.fc, optimizer)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, feats):
        a = self.emb(feats)
        return self.mlp(torch.cat([a["user"], a["item"]], 1)).squeeze(1)


def data(step, b=8):
    g = torch.Generator().manual_seed(step)
    feats = {"user": torch.randint(0, 16, (b,), generator=g),
             "item": torch.nested.nested_tensor_from_jagged(torch.randint(0, 24, (2 * b,), generator=g),
                                                            torch.arange(b + 1) * 2)}
    return feats, torch.randn(b, generator=g)


def train(model, steps, dense_opt, table_opt=None):
    losses = []
    for s in range(steps):
        feats, y = data(s)
        loss = torch.nn.functional.mse_loss(model(feats), y)
        dense_opt.zero_grad()
        if table_opt is not None:
            table_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if table_opt is not None:
            table_opt.step()
        losses.append(loss.item())
    return losses


def tables(model):
    return {t.name: v.detach().clone() for t, v in model.emb.embedding_tables.items()}


@pytest.mark.parametrize("engine_opt, torch_opt, tol", [
    (ec.SGD(learning_rate=0.3), functools.partial(torch.optim.SGD, lr=0.3), 1e-6),
    (ec.Adagrad(learning_rate=0.3, initial_accumulator_value=0.1),
     functools.partial(torch.optim.Adagrad, lr=0.3, initial_accumulator_value=0.1, eps=0.0), 1e-5),
])
def test_engine_training_equals_v0_with_torch_optimizer(engine_opt, torch_opt, tol):
    """Rows untouched in a step have zero gradient, so these torch optimizers leave them alone:
    training inside the engine must then give exactly what torch gives on nn.Parameters."""
    a, b = Model(engine_opt), Model(None)
    for (na, ta), (nb, tb) in zip(tables(a).items(), tables(b).items()):
        assert na == nb and torch.equal(ta, tb)  # same seed -> same initial tables in both modes
    b.mlp.load_state_dict(a.mlp.state_dict())
    la = train(a, 6, torch.optim.SGD(a.mlp.parameters(), lr=0.1))
    lb = train(b, 6, torch.optim.SGD(b.mlp.parameters(), lr=0.1),
               torch_opt([p for n, p in b.emb.named_parameters()]))
    assert la == pytest.approx(lb, rel=tol, abs=tol)
    for name, t in tables(a).items():
        torch.testing.assert_close(t, tables(b)[name], rtol=tol, atol=tol)


@pytest.mark.parametrize("spec", [
    (torch.optim.Adagrad, {"lr": 0.3, "initial_accumulator_value": 0.1}),
    functools.partial(torch.optim.Adagrad, lr=0.3, initial_accumulator_value=0.1),
])
def test_torch_optimizer_class_is_translated(spec):
    a = Model(spec)
    b = Model(None)
    b.mlp.load_state_dict(a.mlp.state_dict())
    train(a, 4, torch.optim.SGD(a.mlp.parameters(), lr=0.1))
    train(b, 4, torch.optim.SGD(b.mlp.parameters(), lr=0.1),
          torch.optim.Adagrad([p for _, p in b.emb.named_parameters()], lr=0.3,
                              initial_accumulator_value=0.1))
    for name, t in tables(a).items():
        torch.testing.assert_close(t, tables(b)[name], rtol=1e-5, atol=1e-5)


def test_translated_torch_adam_matches_torch_adam_up_to_epsilon():
    """The translation differs from torch only in where epsilon enters (eps * sqrt(1 - b2^t)
    instead of eps); with a negligible eps both must agree to float precision."""
    eps = 1e-14
    a, b = Model((torch.optim.Adam, {"lr": 0.05, "eps": eps})), Model(None)
    b.mlp.load_state_dict(a.mlp.state_dict())
    train(a, 5, torch.optim.SGD(a.mlp.parameters(), lr=0.1))
    train(b, 5, torch.optim.SGD(b.mlp.parameters(), lr=0.1),
          torch.optim.Adam([p for _, p in b.emb.named_parameters()], lr=0.05, eps=eps))
    for name, t in tables(a).items():
        torch.testing.assert_close(t, tables(b)[name], rtol=1e-5, atol=1e-6)


def test_toy_problem_loss_goes_down():
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=50, dim=8, name="t")
    layer = ec.EmbeddingLayer({"x": ec.FeatureConfig(table=t)}, ec.Adagrad(learning_rate=0.5))
    head = torch.nn.Linear(8, 1)
    target = torch.randn(50)
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    losses = []
    for s in range(200):
        ids = torch.randint(0, 50, (32,))
        loss = torch.nn.functional.mse_loss(head(layer({"x": ids})["x"]).squeeze(1), target[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20


def test_eval_and_no_grad_do_not_update_and_a_forward_without_backward_blocks_nothing():
    m = Model("sgd")
    before = tables(m)
    feats, _ = data(0)
    m.eval()
    m(feats)
    with torch.no_grad():
        m.train()
        m(feats)
    assert all(torch.equal(v, before[k]) for k, v in tables(m).items())
    m.train()
    m(feats)  # a training forward whose backward never runs (a skipped NaN loss, logging)
    assert all(torch.equal(v, before[k]) for k, v in tables(m).items())
    feats2, y2 = data(1)
    torch.nn.functional.mse_loss(m(feats2), y2).backward()  # the next step is not blocked
    ref = Model("sgd")
    torch.nn.functional.mse_loss(ref(feats2), y2).backward()
    for k, v in tables(ref).items():  # the skipped forward applied nothing
        assert torch.equal(tables(m)[k], v), k


def linear_loss(acts, seed):
    """A loss linear in the activations: its gradient does not depend on the tables."""
    g = torch.Generator().manual_seed(seed)
    return sum((a * torch.randn(a.shape, generator=g)).sum() for a in acts.values())


def test_two_forwards_then_one_backward_apply_both_each_once():
    torch.manual_seed(0)
    layer = ec.EmbeddingLayer(config(), ec.SGD(learning_rate=0.5))
    torch.manual_seed(0)
    engine = ec.Embedding(config(), ec.SGD(learning_rate=0.5))
    (f1, _), (f2, _) = data(0), data(1)
    (linear_loss(layer(f1), 1) + linear_loss(layer(f2), 2)).backward()
    for feats, seed in ((f1, 1), (f2, 2)):  # the same two steps through the queue
        engine.enqueue(feats)
        acts = engine.dequeue()
        linear_loss(acts, seed).backward()
        engine.apply_gradients({k: a.grad for k, a in acts.items()})
    assert layer.engine.step == engine.step == 2
    want = engine.state_dict()
    for k, v in layer.engine.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=1e-6)


def test_backward_twice_through_one_forward_is_an_error_and_changes_nothing_more():
    layer = ec.EmbeddingLayer(config(), ec.SGD(learning_rate=0.5))
    loss = linear_loss(layer(data(0)[0]), 1)
    loss.backward(retain_graph=True)
    after = {t: v.clone() for t, v in layer.embedding_tables.items()}
    with pytest.raises(RuntimeError, match="applied already"):
        loss.backward()
    assert all(torch.equal(v, after[t]) for t, v in layer.embedding_tables.items())


def test_a_training_forward_keeps_nothing_once_its_outputs_are_gone():
    """The step's activations (and with them its batch) are freed with the graph: no cycle
    through autograd's ctx, which Python's gc cannot break (every step's activations used to
    stay for good, ~9 MB a step on benchmarks/dlrm.py)."""
    layer = ec.EmbeddingLayer(config(), ec.SGD(learning_rate=0.5))
    acts = layer(data(0)[0])
    refs = [weakref.ref(a) for a in acts.values()]
    linear_loss(acts, 1).backward()
    del acts
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_partial_last_batch_trains_unless_the_shape_is_fixed():
    layer = ec.EmbeddingLayer(config(), "adagrad")
    for b in (8, 8, 3):  # a DataLoader without drop_last
        linear_loss(layer(data(b, b=b)[0]), b).backward()
    assert layer.engine.step == 3
    fixed = ec.EmbeddingLayer(config(), "adagrad")
    fixed.engine.build(per_replica_batch_size=8)
    with pytest.raises(ValueError, match="fixed at \\[8\\]"):
        fixed(data(0, b=3)[0])
    assert fixed.engine.step == 0


def test_to_moves_tables_and_refuses_a_busy_engine():
    layer = ec.EmbeddingLayer(config(), "sgd")
    before = {t: v.clone() for t, v in layer.embedding_tables.items()}
    assert layer.to("cpu") is layer and layer.engine.device == torch.device("cpu")
    layer.to(torch.float64)  # a dtype conversion leaves the tables (TableConfig.dtype)
    assert all(v.dtype == torch.float32 and torch.equal(v, before[t])
               for t, v in layer.embedding_tables.items())
    layer.engine.enqueue(data(0)[0])
    with pytest.raises(ValueError, match="finish the step"):
        layer.engine.to("meta")
    layer.engine.dequeue()
    layer.engine.apply_gradients({"user": None, "item": None})
    with pytest.raises(ValueError, match="not a device"):
        layer.engine.to("bogus")
    layer.engine.to("meta")  # (the one other device every machine has)
    assert all(v.device.type == "meta" for v in layer.engine.embedding_tables.values())


def test_tf_keyword_arguments_are_accepted():
    emb = ec.Embedding(config(), ec.SGD(learning_rate=0.1))
    emb.enqueue(data(0)[0], name="enqueue", device="cpu")
    acts = emb.dequeue(name="dequeue")
    emb.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()}, name="apply")
    assert emb.step == 1
    assert ec.EmbeddingLayer(config(), "sgd", timeout=30).engine.step == 0


def test_serving_config_subset_and_for_serving_export(tmp_path):
    m = Model(ec.Adagrad(learning_rate=0.1))
    train(m, 3, torch.optim.SGD(m.mlp.parameters(), lr=0.1))
    m.eval()
    feats, _ = data(9)
    full = m.emb(feats)
    sub = m.emb({"user": feats["user"]}, serving_config={"user": m.fc["user"]})
    assert list(sub) == ["user"] and torch.equal(sub["user"], full["user"])
    serving = m.emb.for_serving({"user": m.fc["user"]})
    assert not any("accumulators" in k for k in serving.state_dict())
    ids = {"user": torch.tensor([3, 1, 15])}
    ep = torch.export.export(serving, (ids,))
    torch.export.save(ep, tmp_path / "s.pt2")
    loaded = torch.export.load(tmp_path / "s.pt2").module()
    torch.testing.assert_close(loaded(ids)["user"], m.emb(ids, serving_config={"user": m.fc["user"]})["user"])
    eager = m.emb.for_serving()
    torch.testing.assert_close(eager(feats)["item"], full["item"])


def test_state_dict_inside_a_model_and_load():
    m = Model("adagrad")
    train(m, 2, torch.optim.SGD(m.mlp.parameters(), lr=0.1))
    sd = m.state_dict()
    assert {"emb.users/parameters", "emb.users/accumulators", "emb.step", "mlp.0.weight"} <= set(sd)
    m2 = Model("adagrad", seed=1)
    m2.load_state_dict({k: v.clone() for k, v in sd.items()})
    for k, v in m2.state_dict().items():
        assert torch.equal(v, sd[k]), k
    with pytest.raises(RuntimeError, match="Missing key"):
        m2.load_state_dict({k: v for k, v in sd.items() if k != "emb.users/parameters"})


def test_optimizer_spec_errors():
    with pytest.raises((ValueError, TypeError)):
        ec.EmbeddingLayer(config(), "rmsprop")
    with pytest.raises(ValueError, match="momentum"):
        ec.EmbeddingLayer(config(), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
    with pytest.raises(TypeError):
        ec.EmbeddingLayer(config(), 3)


def test_tutorial_serving_config_fresh_features_on_the_same_tables():
    """TF's tutorial serves through new FeatureConfigs on the training tables (another batch
    shape): the engine-backed layer accepts them, as for_serving and serving_embedding_lookup do."""
    m = Model("adagrad")
    train(m, 2, torch.optim.SGD(m.mlp.parameters(), lr=0.1))
    tables_by_name = {t.name: t for t in m.emb.embedding_tables}
    serving = {"user": ec.FeatureConfig(table=tables_by_name["users"], output_shape=[2, 2])}
    ids = {"user": torch.tensor([1, 2, 3, 4])}
    m.eval()
    got = m.emb(ids, serving_config=serving)["user"]
    assert got.shape == (2, 2, 4)
    want = ec.serving_embedding_lookup(ids, None, m.emb.embedding_tables, serving)["user"]
    assert torch.equal(got, want)
    assert torch.equal(m.emb.for_serving(serving)(ids)["user"], want)
    other = ec.TableConfig(vocabulary_size=3, dim=4, name="other")
    with pytest.raises(ValueError, match="reads table 'other', which this engine does not have"):
        m.emb(ids, serving_config={"user": ec.FeatureConfig(table=other)})


def test_a_compiled_model_trains_like_the_eager_one():
    """torch.compile around a model with the layer (the tables are built at construction, so no
    first-forward build runs inside the compiled region; the engine step is a graph break)."""
    results = []
    for compile_it in (False, True):
        torch.manual_seed(0)
        t = ec.TableConfig(vocabulary_size=50, dim=4, name="t")
        layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
        mlp = torch.nn.Linear(4, 1)

        def model(ids, layer=layer, mlp=mlp):
            return mlp(layer({"f": ids})["f"]).sum()
        run = torch.compile(model, backend="eager") if compile_it else model
        for i in range(3):
            run(torch.tensor([1, 2, 3 + i])).backward()
        results.append((layer.engine.step, layer.embedding_tables[t].clone()))
    assert results[0][0] == results[1][0] == 3
    torch.testing.assert_close(results[0][1], results[1][1])


def test_jagged_pairs_train_serve_and_export():
    """A (values, offsets) pair is a jagged batch like the nested tensor it describes, and it is
    the jagged form torch.export can trace (it cannot take nested tensors as inputs)."""
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=20, dim=4, combiner="mean", name="t")
    fc = {"bag": ec.FeatureConfig(table=t), "seq": ec.FeatureConfig(table=t, max_sequence_length=3)}
    layer = ec.EmbeddingLayer(fc, ec.SGD(learning_rate=0.1))
    values, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 5])
    w = torch.tensor([1.0, 2.0, 1.0, 1.0, 3.0])
    pairs = {"bag": (values, offsets), "seq": (values, offsets)}
    nested = {k: torch.nested.nested_tensor_from_jagged(values, offsets) for k in fc}
    weights = {"bag": (w, offsets), "seq": None}
    nested_w = {"bag": torch.nested.nested_tensor_from_jagged(w, offsets), "seq": None}
    layer.eval()
    want = layer(nested, nested_w)
    got = layer(pairs, weights)
    for k in fc:
        torch.testing.assert_close(got[k], want[k])
    layer.train()
    linear_loss(layer(pairs, weights), 0).backward()  # trains like the nested form
    assert layer.engine.step == 1
    serving = layer.for_serving()
    eager = serving(pairs, weights)
    exported = torch.export.export(serving, (pairs, weights)).module()
    out = exported(pairs, weights)
    for k in fc:
        torch.testing.assert_close(out[k], eager[k])
    with pytest.raises(ValueError, match="jagged offsets must end at the number of values"):
        layer({"bag": (values, torch.tensor([0, 2, 9])), "seq": pairs["seq"]})


def _random_sparse(shape, nnz, high, g, coalesced):
    """A sparse COO batch of ``nnz`` ids at distinct random positions (stored shuffled unless
    ``coalesced``)."""
    lin = torch.randperm(math.prod(shape), generator=g)[:nnz]
    x = torch.sparse_coo_tensor(torch.stack(torch.unravel_index(lin, shape)),
                                torch.randint(0, high, (nnz,), generator=g), shape)
    return x.coalesce() if coalesced else x


def test_sparse_inputs_export_for_any_number_of_entries(tmp_path):
    """Sparse COO inputs export: the program traced with one batch serves batches with other
    numbers of entries, other batch sizes, uncoalesced, of rank 3, weighted, as sequences and
    from a dynamic table, equal to eager serving (a traced sparse tensor's entry count is not a
    traced size, so nothing in the program may depend on it)."""
    g = torch.Generator().manual_seed(0)
    t = ec.TableConfig(vocabulary_size=20, dim=3, combiner="mean", name="t")
    u = ec.TableConfig(vocabulary_size=20, dim=3, combiner="sqrtn", name="u")
    raw = ec.TableConfig(vocabulary_size=20, dim=3, name="raw", dynamic=ec.DynamicVocabulary())
    fc = {"bag": ec.FeatureConfig(table=t), "seq": ec.FeatureConfig(table=u, max_sequence_length=3),
          "r3": ec.FeatureConfig(table=t), "raw": ec.FeatureConfig(table=raw)}

    def batch(b, nnz, coalesced):
        ids = {"bag": _random_sparse((b, 5), nnz, 20, g, coalesced),
               "seq": _random_sparse((b, 5), nnz, 20, g, coalesced),
               "r3": _random_sparse((b, 2, 3), min(nnz, b * 6), 20, g, coalesced),
               "raw": _random_sparse((b, 5), nnz, 1000, g, coalesced)}
        bag = ids["bag"]
        w = torch.sparse_coo_tensor(bag._indices(), torch.rand(bag._nnz(), generator=g),
                                    bag.shape)
        return ids, {"bag": w.coalesce() if coalesced else w, "seq": None, "r3": None, "raw": None}

    layer = ec.EmbeddingLayer(fc, ec.SGD(learning_rate=0.1))
    linear_loss(layer(*batch(4, 8, False)), 0).backward()  # trained rows, raw ids admitted
    serving = layer.for_serving()
    b = torch.export.Dim("batch")
    program = torch.export.export(serving, batch(4, 6, True), dynamic_shapes=(
        {k: {0: b} for k in fc}, {"bag": {0: b}, "seq": None, "r3": None, "raw": None}))
    torch.export.save(program, tmp_path / "sparse.pt2")
    served = torch.export.load(tmp_path / "sparse.pt2").module()
    for size, nnz, coalesced in [(4, 0, True), (4, 1, False), (4, 6, False), (4, 17, True),
                                 (4, 20, False), (7, 9, True), (2, 10, False)]:
        ids, w = batch(size, nnz, coalesced)
        got, want = served(ids, w), serving(ids, w)
        for k in fc:
            assert got[k].shape == want[k].shape
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_the_layer_gives_a_raw_id_tables_vocabulary():
    """``layer.vocabulary`` / ``whole_vocabulary``: the engine's, for a raw-id table; a static
    table is refused as the engine refuses it."""
    raw = ec.TableConfig(vocabulary_size=8, dim=2, name="raw", dynamic=ec.DynamicVocabulary())
    static = ec.TableConfig(vocabulary_size=5, dim=2, name="static")
    layer = ec.EmbeddingLayer({"r": ec.FeatureConfig(table=raw),
                               "s": ec.FeatureConfig(table=static)}, "sgd")
    out = layer({"r": torch.tensor([10**12, -3, 10**12]), "s": torch.tensor([0, 1, 2])})
    (out["r"].sum() + out["s"].sum()).backward()
    ids, rows = layer.vocabulary("raw")
    assert ids.tolist() == [-3, 10**12] and rows.numel() == 2
    for got, want in zip(layer.vocabulary(raw), layer.engine.vocabulary(raw)):
        assert torch.equal(got, want)
    whole_ids, whole_rows = layer.whole_vocabulary("raw")
    assert torch.equal(whole_ids, ids) and torch.equal(whole_rows, rows)
    with pytest.raises(ValueError):
        layer.vocabulary("static")


def test_print_shows_the_tables_optimizer_and_plan():
    """``print(layer)`` names each table with its size, combiner, kind, strategy and the
    features that read it, the optimizer and the plan's summary; past 12 tables it counts the
    others."""
    movies = ec.TableConfig(vocabulary_size=2048, dim=64, name="movies")
    users = ec.TableConfig(vocabulary_size=500, dim=8, name="users", combiner="sum",
                           dtype=torch.float16, dynamic=ec.DynamicVocabulary())
    layer = ec.EmbeddingLayer({"movie": ec.FeatureConfig(table=movies),
                               "seen": ec.FeatureConfig(table=movies),
                               "user": ec.FeatureConfig(table=users)}, ec.Adagrad(0.1))
    text = str(layer)
    assert text.startswith("EmbeddingLayer(\n  3 features, 2 tables, optimizer=Adagrad("), text
    assert "plan: world_size=1, 2 physical tables, backend: " in text
    assert "MiB per rank (parameters + slots): " in text
    assert "table movies: 2048 x 64, mean, sharding table, features movie, seen\n" in text
    assert ("table users: 500 x 8, sum, float16, dynamic (raw ids), sharding table, "
            "features user\n") in text
    assert len(text.splitlines()) == 6  # compact: a line a table
    v0 = str(ec.EmbeddingLayer({"movie": ec.FeatureConfig(table=movies)}, None))
    assert "1 feature, 1 table, tables as nn.Parameters (optimizer=None)" in v0
    many = [ec.TableConfig(vocabulary_size=10, dim=4, name=f"t{i}") for i in range(15)]
    wide = str(ec.EmbeddingLayer({f"f{i}": ec.FeatureConfig(table=t) for i, t in enumerate(many)},
                                 "sgd"))
    assert "table t11: 10 x 4" in wide and "table t12" not in wide
    assert "... and 3 more tables (print(layer.engine.plan))" in wide
