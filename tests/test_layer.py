"""The layer: training through loss.backward(), optimizer translation, V0 mode, serving, export."""

from __future__ import annotations

import functools

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


def test_eval_and_no_grad_do_not_update_and_forward_twice_is_an_error():
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
    m(feats)
    with pytest.raises(RuntimeError, match="before apply_gradients"):
        m(feats)  # the previous forward's backward never ran


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
