"""ec.EmbeddingSpec (DESIGN 7.4): an engine's configuration as data, its exact round trip, engines
built from it, and the spec in checkpoints (a served model rebuilt from its checkpoint alone)."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from test_sharded import OPTIMIZERS, concat, config, global_batch

import embcore as ec
from embcore.config.optimizers import records
from embcore.config.tables import LOG_BYTES_PER_ROW

# a budget whose caches hold a handful of test_sharded's config rows, beside their logs
BUDGET = 1500 + 160 * LOG_BYTES_PER_ROW


def _round_trip(spec):
    d = json.loads(json.dumps(spec.to_dict(), allow_nan=False))  # JSON-safe
    again = ec.EmbeddingSpec.from_dict(d)
    assert again == spec and again.to_dict() == d and hash(again) == hash(spec)
    return again


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_every_optimizer_and_structure_round_trips_exactly(opt):
    fc, strategies = config(opt, {"a": "row_div", "c": "column"})
    t = ec.TableConfig(vocabulary_size=30, dim=4, name="own", combiner="sqrtn",
                       optimizer=ec.SGD(learning_rate=0.5, clipvalue=(None, 1.0)),
                       initializer=functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1))
    raw = ec.TableConfig(vocabulary_size=20, dim=4, dtype=torch.float64,
                         dynamic=ec.DynamicVocabulary(eviction="lfu", admit_after=2, ttl_steps=9))
    nested = {"base": fc, "more": [ec.FeatureConfig(table=t, output_shape=[2, 3]),
                                   (ec.FeatureConfig(table=raw, name="r"),)]}
    spec = ec.EmbeddingSpec(nested, OPTIMIZERS[opt](), sharding=strategies,
                            memory_budget="2GiB", pipeline_execution=True)
    again = _round_trip(spec)
    leaves = again.to_dict()["tables"]
    assert leaves["own"]["optimizer"]["class"] == "SGD" and leaves["own"]["combiner"] == "sqrtn"
    assert isinstance(again.feature_config["more"][1], tuple)


@pytest.mark.parametrize("record", records(), ids=lambda r: r.name)
def test_every_declared_optimizer_round_trips_by_its_name(record):
    """The spec names an optimizer by its record (``"class"``), whatever its hyper-parameters."""
    f = ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=10, dim=2, name="t"))
    own = {fl.name: fl.default for fl in dataclasses.fields(record.cls)
           if fl.name not in ("_", "learning_rate") and isinstance(fl.default, float)}
    for opt in (record.cls(), record.cls(learning_rate=0.25, clipvalue=(None, 1.0),
                                         **{k: v / 2 for k, v in own.items()})):
        spec = _round_trip(ec.EmbeddingSpec(f, opt))
        assert spec.to_dict()["optimizer"]["class"] == record.name
        assert type(spec.optimizer) is record.cls and spec.optimizer == opt


def test_laprop_in_a_spec():
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t",
                       optimizer=ec.LaProp(learning_rate=0.05, beta_2=0.5, epsilon=1e-8))
    spec = _round_trip(ec.EmbeddingSpec(ec.FeatureConfig(table=t), ec.SGD()))
    assert spec.to_dict()["tables"]["t"]["optimizer"] == {
        "class": "LaProp", "learning_rate": 0.05, "use_gradient_accumulation": True,
        "clip_weight_min": None, "clip_weight_max": None, "weight_decay_factor": None,
        "multiply_weight_decay_factor_by_learning_rate": None, "clipvalue": None,
        "gradient_multiplier": None, "skip_nonfinite_gradients": False, "beta_1": 0.9,
        "beta_2": 0.5, "epsilon": 1e-8}
    bad = spec.to_dict()
    bad["tables"]["t"]["optimizer"]["beta_2"] = 1.5
    with pytest.raises(ValueError, match=r"LaProp: beta_2 must be in \[0, 1\), got 1\.5"):
        ec.EmbeddingSpec.from_dict(bad)


def test_engines_from_a_spec_train_as_the_engines_it_describes():
    fc, _ = config("adagrad", {})
    spec = _round_trip(ec.EmbeddingSpec(fc, OPTIMIZERS["adagrad"](), memory_budget=BUDGET))
    batches = [concat(global_batch(s, 2)) for s in range(3)]
    results = []
    for build in (lambda: ec.Embedding(fc, OPTIMIZERS["adagrad"](), memory_budget=BUDGET),
                  lambda: ec.Embedding.from_spec(spec)):
        torch.manual_seed(4)
        emb = build()
        for feats, w in batches:
            emb.enqueue(feats, w)
            acts = emb.dequeue()
            emb.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})
        results.append({k: v.clone() for k, v in emb.state_dict().items()})
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    layer = ec.EmbeddingLayer.from_spec(spec)
    assert isinstance(layer, ec.EmbeddingLayer) and layer.engine.plan == ec.Embedding(
        fc, OPTIMIZERS["adagrad"](), memory_budget=BUDGET).plan
    with pytest.raises(TypeError, match="from_spec takes an ec.EmbeddingSpec"):
        ec.Embedding.from_spec(spec.to_dict())


def test_what_is_not_data_is_refused_by_name():
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    f = ec.FeatureConfig(table=t)
    with pytest.raises(ValueError, match="learning_rate=.* is a callable"):
        ec.EmbeddingSpec(f, ec.SGD(learning_rate=lambda: 0.1))
    with pytest.raises(ValueError, match="gradient_multiplier"):
        ec.EmbeddingSpec(f, ec.SGD(learning_rate=0.1, gradient_multiplier=lambda s: 1.0))
    for init in (lambda x: x.zero_(), torch.zeros(10, 2),
                 functools.partial(torch.nn.init.uniform_, a=torch.tensor(0.0))):
        bad = ec.TableConfig(vocabulary_size=10, dim=2, name="bad", initializer=init)
        with pytest.raises(ValueError, match="table 'bad': its initializer"):
            ec.EmbeddingSpec(ec.FeatureConfig(table=bad), ec.SGD(learning_rate=0.1))
    with pytest.raises(TypeError, match="optimizer must be an embcore optimizer"):
        ec.EmbeddingSpec(f, "sgd")
    with pytest.raises(ValueError, match="memory_budget"):
        ec.EmbeddingSpec(f, memory_budget="lots")
    good = ec.EmbeddingSpec(f, ec.SGD(learning_rate=0.1)).to_dict()
    for change, match in ((lambda d: d.update(format="x"), "not an embcore spec"),
                          (lambda d: d["optimizer"].update({"class": "Lion"}), "unknown optimizer"),
                          (lambda d: d["tables"]["t"].update(dtype="int8"), "unknown dtype"),
                          (lambda d: d.pop("features"), "not an embcore spec")):
        d = json.loads(json.dumps(good))
        change(d)
        with pytest.raises(ValueError, match=match):
            ec.EmbeddingSpec.from_dict(d)


def test_checkpoints_carry_the_spec(tmp_path):
    t = ec.TableConfig(vocabulary_size=40, dim=4, name="items", combiner="sum")
    fc = {"item": ec.FeatureConfig(table=t)}
    torch.manual_seed(0)
    layer = ec.EmbeddingLayer(fc, ec.Adagrad(learning_rate=0.2), memory_budget="1KB")
    layer({"item": torch.tensor([1, 5, 7])})["item"].sum().backward()
    ec.save(tmp_path / "ckpt", layer)
    spec = ec.EmbeddingSpec.from_checkpoint(tmp_path / "ckpt")
    assert spec == ec.EmbeddingSpec(fc, ec.Adagrad(learning_rate=0.2), memory_budget="1KB")
    served = ec.EmbeddingLayer.from_spec(spec)  # built from the checkpoint alone
    ec.load(tmp_path / "ckpt", served)
    ids = {"item": torch.tensor([5, 7, 9])}
    torch.testing.assert_close(served.for_serving()(ids)["item"],
                               layer.for_serving()(ids)["item"], rtol=0, atol=0)
    odd = ec.Embedding(fc, ec.SGD(learning_rate=lambda: 0.1))
    ec.save(tmp_path / "odd", odd)
    with pytest.raises(ValueError, match="holds no spec .*learning_rate"):
        ec.EmbeddingSpec.from_checkpoint(tmp_path / "odd")
