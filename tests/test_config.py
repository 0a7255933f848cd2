"""Configs: validation with messages that name the field and value; frozen; identity semantics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import embcore as ec


@pytest.mark.parametrize("kwargs, match", [
    ({"vocabulary_size": 0, "dim": 4}, "vocabulary_size must be an int >= 1, got 0"),
    ({"vocabulary_size": 10, "dim": -1}, "dim must be an int >= 1, got -1"),
    ({"vocabulary_size": 10, "dim": 4, "combiner": "max"}, "combiner must be one of .* got 'max'"),
    ({"vocabulary_size": 10, "dim": 4, "name": "a/b"}, "without '/'"),
    ({"vocabulary_size": 10, "dim": 4, "initializer": torch.zeros(3, 4)}, "shape \\(10, 4\\)"),
])
def test_table_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ec.TableConfig(**kwargs)


def test_table_config_type_errors():
    with pytest.raises(TypeError, match="dtype"):
        ec.TableConfig(vocabulary_size=3, dim=2, dtype=torch.int64)
    with pytest.raises(TypeError, match="initializer"):
        ec.TableConfig(vocabulary_size=3, dim=2, initializer="normal")
    with pytest.raises(TypeError, match="embcore optimizer"):
        ec.TableConfig(vocabulary_size=3, dim=2, optimizer=torch.optim.SGD)
    with pytest.raises(TypeError):
        ec.TableConfig(10, 4)  # keyword-only


@pytest.mark.parametrize("kwargs, match", [
    ({"vocabulary_size": 10.0, "dim": 4}, "vocabulary_size must be an int >= 1, got float 10.0"),
    ({"vocabulary_size": "10", "dim": 4}, "vocabulary_size must be an int >= 1, got str '10'"),
    ({"vocabulary_size": 10, "dim": True}, "dim must be an int >= 1, got bool True"),
    ({"vocabulary_size": 10, "dim": None}, "dim must be an int >= 1, got NoneType None"),
    ({"vocabulary_size": 10, "dim": 4, "combiner": 1}, "combiner must be a string"),
    ({"vocabulary_size": 10, "dim": 4, "name": 3}, "name must be a non-empty string"),
])
def test_table_config_wrong_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ec.TableConfig(**kwargs)
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        ec.TableConfig(vocabulary_size=3, dim=2, name="")


def test_feature_config_wrong_types():
    t = ec.TableConfig(vocabulary_size=3, dim=2)
    for kwargs, match in [({"max_sequence_length": 2.0}, "max_sequence_length must be an int"),
                          ({"max_sequence_length": None}, "max_sequence_length must be an int"),
                          ({"output_shape": 4}, "output_shape must be a non-empty sequence"),
                          ({"output_shape": "ab"}, "output_shape must be a non-empty sequence"),
                          ({"output_shape": [2, 1.5]}, r"output_shape .* got \[2, 1\.5\]"),
                          ({"name": b"f"}, "name must be a non-empty string")]:
        with pytest.raises(TypeError, match=match):
            ec.FeatureConfig(table=t, **kwargs)
    for kwargs, match in [({"output_shape": []}, "output_shape"), ({"name": ""}, "name")]:
        with pytest.raises(ValueError, match=match):
            ec.FeatureConfig(table=t, **kwargs)
    assert ec.FeatureConfig(table=t, output_shape=torch.Size([4])).output_shape == (4,)
    assert ec.FeatureConfig(table=t, name="a/b").name == "a/b"  # '/' is refused in table names only


def test_feature_config_errors_and_normalisation():
    t = ec.TableConfig(vocabulary_size=3, dim=2)
    with pytest.raises(TypeError, match="table must be a TableConfig"):
        ec.FeatureConfig(table="t")
    with pytest.raises(ValueError, match="max_sequence_length must be an int >= 0, got -1"):
        ec.FeatureConfig(table=t, max_sequence_length=-1)
    with pytest.raises(ValueError, match="output_shape"):
        ec.FeatureConfig(table=t, output_shape=[0])
    assert ec.FeatureConfig(table=t, output_shape=[2, 3]).output_shape == (2, 3)


def test_frozen_and_identity():
    a = ec.TableConfig(vocabulary_size=3, dim=2)
    b = ec.TableConfig(vocabulary_size=3, dim=2)
    assert a != b and len({a, b}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(a, "dim", 3)


def test_engine_structure_errors():
    t = ec.TableConfig(vocabulary_size=3, dim=2)
    f = ec.FeatureConfig(table=t)
    with pytest.raises(ValueError, match="appears twice"):
        ec.Embedding([f, f])
    with pytest.raises(ValueError, match="no FeatureConfig"):
        ec.Embedding({})
    with pytest.raises(TypeError, match="embcore optimizer"):
        ec.Embedding(f, torch.optim.SGD)
    with pytest.raises(ValueError, match="unknown sharding strategy 'diagonal'"):
        ec.Embedding(f, sharding="diagonal")


def test_initializers_tf_convention_and_ones_that_do_not_fill():
    def tf_style(shape, dtype):  # TF's convention: (shape, dtype) -> values
        return torch.full(shape, 0.5, dtype=dtype)

    t = ec.TableConfig(vocabulary_size=5, dim=3, name="t", initializer=tf_style)
    assert torch.equal(ec.Embedding(ec.FeatureConfig(table=t)).embedding_tables[t],
                       torch.full((5, 3), 0.5))
    for leaves_unset in (lambda x: None, lambda x: x[:2].zero_()):
        bad = ec.TableConfig(vocabulary_size=5, dim=3, name="bad", initializer=leaves_unset)
        with pytest.raises(ValueError, match="table 'bad': its initializer left NaN"):
            ec.Embedding(ec.FeatureConfig(table=bad)).build()
    with pytest.raises(TypeError, match="must be floating point"):
        ec.TableConfig(vocabulary_size=5, dim=3, initializer=torch.zeros(5, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN or infinite"):
        ec.TableConfig(vocabulary_size=5, dim=3, initializer=torch.full((5, 3), float("nan")))
