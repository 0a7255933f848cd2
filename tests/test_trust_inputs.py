"""Inputs that must not be trusted ("Trust, third round"): a spec read as data is strict (an
unknown key, a value of the wrong type or out of range is an error naming the key and where it
is, never ignored or replaced by a default); sizes and initializer arguments are checked when the
configs are built, not by a failed allocation later; counts beyond int64, structures nested too
deep, a manifest that is no object and an empty offload_dir are the documented ValueError /
TypeError, not OverflowError, RuntimeError, RecursionError or AttributeError."""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import embcore as ec
from embcore.base.nest import MAX_DEPTH, flatten_like, leaves_with_paths, unflatten_like
from embcore.config.tables import MAP_BYTES_PER_ROW, MAX_TABLE_BYTES
from embcore.state.vocab import torch_map as vocab
from embcore.state.tier.files import OffloadDir
from embcore.ops.backend import choose
from embcore.state.vocab.torch_map import VocabMap
from embcore.state.vocab.vocabulary import vocab_map


def _good() -> dict:
    """A spec as data with every part that has keys: top, tables, a dynamic one, features, a
    tuple, an initializer, a table's and the default optimizer."""
    users = ec.TableConfig(vocabulary_size=10, dim=2, name="users", combiner="sum",
                           initializer=functools.partial(torch.nn.init.normal_, std=0.1),
                           optimizer=ec.Adagrad(learning_rate=0.2))
    raw = ec.TableConfig(vocabulary_size=8, dim=2, name="raw",
                         dynamic=ec.DynamicVocabulary(admit_after=2, ttl_steps=5))
    fc = {"user": ec.FeatureConfig(table=users, name="user"),
          "more": (ec.FeatureConfig(table=raw, max_sequence_length=3),)}
    spec = ec.EmbeddingSpec(fc, ec.SGD(learning_rate=0.1), memory_budget="1GiB")
    return json.loads(json.dumps(spec.to_dict()))


def _parse(change):
    d = _good()
    change(d)
    return ec.EmbeddingSpec.from_dict(d)


FEATURE = ("features", "user", "__feature__")


def _at(d, *keys):
    for k in keys:
        d = d[k]
    return d


# ---------------------------------------------------------------------------- spec: strictness
def test_the_good_spec_still_round_trips():
    d = _good()
    again = ec.EmbeddingSpec.from_dict(d)
    assert again.to_dict() == d and again == ec.EmbeddingSpec.from_dict(_good())


@pytest.mark.parametrize("path, key, match", [
    ((), "pipeline", r"not an embcore spec: unknown key 'pipeline'"),
    (("tables", "users"), "initialiser",
     r"table 'users': unknown key 'initialiser' \(did you mean 'initializer'\?"),
    (FEATURE, "initialiser", r"feature 'user': unknown key 'initialiser'"),
    (("optimizer",), "learning_rat",
     r"the default optimizer \(SGD\): unknown key 'learning_rat' \(did you mean 'learning_rate'"),
    (("tables", "users", "optimizer"), "beta",
     r"table 'users''s optimizer \(Adagrad\): unknown key 'beta'"),
    (("tables", "raw", "dynamic"), "ttl", r"table 'raw': dynamic: unknown key 'ttl'"),
    (("tables", "users", "initializer"), "args", r"table 'users': initializer: unknown key"),
    (("features", "more"), "__nope__", r"features\['more'\]: unknown key '__nope__'"),
])
def test_an_unknown_key_is_refused_naming_it_and_where_it_is(path, key, match):
    with pytest.raises(ValueError, match=match):
        _parse(lambda d: _at(d, *path).update({key: None}))


def test_a_key_that_is_not_a_feature_marker_is_refused():
    with pytest.raises(ValueError, match=r"features: unknown key '__feature_'"):
        _parse(lambda d: d["features"].update(__feature_={"table": "users"}))


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(pipeline_execution="no"),
     "pipeline_execution must be true or false, got str 'no'"),
    (lambda d: d.update(pipeline_execution=1), "pipeline_execution must be true or false"),
    (lambda d: d["tables"]["users"].update(vocabulary_size="10"), "vocabulary_size must be an int"),
    (lambda d: d["tables"]["users"].update(dim=2.0), "dim must be an int"),
    (lambda d: d["tables"]["users"].update(dtype=["float32"]), "table 'users': dtype must be"),
    (lambda d: _at(d, *FEATURE).update(validate_weights_and_indices="no"),
     "validate_weights_and_indices must be a bool"),
    (lambda d: _at(d, *FEATURE).update(max_sequence_length=2.5), "max_sequence_length"),
    (lambda d: d["tables"]["users"]["initializer"]["kwargs"].update(std="0.1"),
     r"table 'users': initializer: argument 'std' of normal_ must be a number"),
    (lambda d: d["tables"]["users"].update(dynamic=[1]),
     "table 'users': dynamic must be an object"),
    (lambda d: d.update(tables=[]), "spec: tables must be an object"),
    (lambda d: d["features"].update(user="users"), r"features\['user'\]: expected a feature"),
    (lambda d: d.update(sharding=3), "sharding must be None"),
    (lambda d: d["optimizer"].update(learning_rate="fast"), "learning_rate must be a real"),
])
def test_a_value_of_the_wrong_type_is_a_type_error_naming_it(change, match):
    with pytest.raises(TypeError, match=match):
        _parse(change)


@pytest.mark.parametrize("change, match", [
    (lambda d: d["tables"]["users"].pop("dim"), "table 'users': missing key 'dim'"),
    (lambda d: _at(d, *FEATURE).pop("table"), "feature 'user': missing key 'table'"),
    (lambda d: _at(d, *FEATURE).update(table="items"), "feature 'user': unknown table 'items'"),
    (lambda d: d["tables"].update(spare=d["tables"]["users"]),
     "table 'spare' is used by no feature"),
    (lambda d: d["tables"]["users"]["initializer"].update({"torch.nn.init": "xavier_uniform_"}),
     "unknown initializer"),
    (lambda d: d["tables"]["raw"]["dynamic"].update(eviction="fifo"), "eviction must be one of"),
])
def test_a_missing_key_or_a_bad_value_is_a_value_error_naming_it(change, match):
    with pytest.raises(ValueError, match=match):
        _parse(change)


@settings(max_examples=examples(30), deadline=None)
@given(where=st.sampled_from([(), ("tables", "users"), ("tables", "raw", "dynamic"), FEATURE,
                              ("optimizer",), ("tables", "users", "optimizer"),
                              ("tables", "users", "initializer")]),
       key=st.text(min_size=1, max_size=12))
def test_no_key_that_to_dict_does_not_write_is_ever_ignored(where, key):
    d = _good()
    part = _at(d, *where)
    if key in part or key == "__feature__":
        return
    part[key] = 0
    with pytest.raises(ValueError, match="unknown key"):
        ec.EmbeddingSpec.from_dict(d)


# ---------------------------------------------------------------------------- sizes
def test_a_table_beyond_2_48_bytes_is_refused_naming_the_bytes():
    with pytest.raises(ValueError, match=r"would take 8000000000000000 bytes \(7.11 PiB\).*"
                                         r"at most 2\*\*48 bytes"):
        ec.TableConfig(vocabulary_size=10**15, dim=2, name="users")
    with pytest.raises(ValueError, match=r"would take 4000000000000000 bytes"):
        ec.TableConfig(vocabulary_size=10**6, dim=10**9)
    with pytest.raises(ValueError, match="vocabulary_size must be at most 9223372036854775807"):
        ec.TableConfig(vocabulary_size=2**63, dim=1)  # rows beyond int64
    with pytest.raises(ValueError, match="dim must be at most"):
        ec.TableConfig(vocabulary_size=1, dim=2**64)
    # The bound itself is allowed, one row more is not; float64 takes twice the bytes.
    assert MAX_TABLE_BYTES == 2**48
    ec.TableConfig(vocabulary_size=2**40, dim=64)
    with pytest.raises(ValueError, match=f"would take {2**48 + 256} bytes"):
        ec.TableConfig(vocabulary_size=2**40 + 1, dim=64)
    with pytest.raises(ValueError, match=f"would take {2**49} bytes"):
        ec.TableConfig(vocabulary_size=2**40, dim=64, dtype=torch.float64)
    # Big tables within the bound are for a memory_budget to offload, not errors.
    big = ec.TableConfig(vocabulary_size=10**9, dim=128, name="big")  # 512 GB
    ec.FeatureConfig(table=big)


def test_a_dynamic_table_counts_its_map_and_an_absurd_capacity_is_a_value_error():
    for capacity, dim in ((2**62, 2), (2**40, 64)):
        want = capacity * (dim * 4 + MAP_BYTES_PER_ROW)
        with pytest.raises(ValueError, match=f"name='users'.*dynamic vocabulary's map would "
                                             f"take {want} bytes"):
            ec.TableConfig(vocabulary_size=capacity, dim=dim, name="users",
                           dynamic=ec.DynamicVocabulary())
    ec.TableConfig(vocabulary_size=2**40, dim=64)  # 2**48 bytes: the same rows, not dynamic
    with pytest.raises(ValueError, match="would take"):
        _parse(lambda d: d["tables"]["raw"].update(vocabulary_size=2**62))
    with pytest.raises(ValueError, match="would take"):
        _parse(lambda d: d["tables"]["users"].update(vocabulary_size=10**15))


def test_a_sequence_length_beyond_2_31_is_refused():
    t = ec.TableConfig(vocabulary_size=10, dim=2)
    with pytest.raises(ValueError, match=r"max_sequence_length must be at most 2147483647 "
                                         r"\(2\*\*31 - 1"):
        ec.FeatureConfig(table=t, max_sequence_length=10**12)
    assert ec.FeatureConfig(table=t, max_sequence_length=2**31 - 1).sequence_length == 2**31 - 1
    with pytest.raises(ValueError, match="max_sequence_length must be at most"):
        _parse(lambda d: _at(d, *FEATURE).update(max_sequence_length=10**12))
    with pytest.raises(ValueError, match="output_shape"):
        ec.FeatureConfig(table=t, output_shape=[2**40, 2**40])
    with pytest.raises(TypeError, match="validate_weights_and_indices must be a bool"):
        ec.FeatureConfig(table=t, validate_weights_and_indices="no")


# ---------------------------------------------------------------------------- initializers
@pytest.mark.parametrize("init, kwargs, error, match", [
    ("normal_", {"std": math.nan}, ValueError, "std must be finite"),
    ("normal_", {"std": math.inf}, ValueError, "std must be finite"),
    ("normal_", {"mean": -math.inf}, ValueError, "mean must be finite"),
    ("normal_", {"std": -1.0}, ValueError, "std must be >= 0"),
    ("uniform_", {"a": 5, "b": -5}, ValueError, "a=5 is greater than b=-5"),
    ("uniform_", {"a": 3}, ValueError, "a=3 is greater than b=1.0"),  # b's default
    ("trunc_normal_", {"std": 0.0}, ValueError, "std must be > 0"),
    ("trunc_normal_", {"a": 1.0, "b": -1.0}, ValueError, "a=1.0 is greater than b=-1.0"),
    ("constant_", {"val": math.nan}, ValueError, "val must be finite"),
    ("constant_", {}, TypeError, "needs the argument 'val'"),
    ("normal_", {"stdev": 0.1}, TypeError, "takes no argument 'stdev'"),
    ("zeros_", {"val": 1.0}, TypeError, "takes no argument 'val'"),
])
def test_initializer_arguments_are_checked_when_the_table_is_built(init, kwargs, error, match):
    partial = functools.partial(getattr(torch.nn.init, init), **kwargs)
    with pytest.raises(error, match=f"TableConfig\\(name='users'\\): initializer "
                                    f"torch.nn.init.{init}.*{match}"):
        ec.TableConfig(vocabulary_size=10, dim=2, name="users", initializer=partial)

    def change(d):
        d["tables"]["users"]["initializer"] = {"torch.nn.init": init, "kwargs": kwargs}

    with pytest.raises(error, match=match):
        _parse(change)


def test_good_initializer_arguments_still_build():
    for init, kwargs in (("uniform_", {"a": -0.5, "b": 0.5}), ("uniform_", {"a": 2, "b": 2}),
                         ("normal_", {"mean": 1, "std": 0}), ("trunc_normal_", {"std": 0.02}),
                         ("constant_", {"val": 0.25}), ("ones_", {}), ("zeros_", {})):
        t = ec.TableConfig(vocabulary_size=3, dim=2, name="t",
                           initializer=functools.partial(getattr(torch.nn.init, init), **kwargs))
        values = ec.Embedding(ec.FeatureConfig(table=t)).embedding_tables[t]
        assert values.shape == (3, 2) and bool(torch.isfinite(values).all())


# ---------------------------------------------------------------------------- dynamic counts
def test_counts_beyond_int64_are_value_errors_and_the_largest_works():
    for kwargs in ({"admit_after": 10**30}, {"admit_after": 2**63}, {"ttl_steps": 2**63}):
        with pytest.raises(ValueError, match=f"{next(iter(kwargs))} must be at most "
                                             f"9223372036854775807"):
            ec.DynamicVocabulary(**kwargs)
    with pytest.raises(ValueError, match="admit_after must be at most"):
        _parse(lambda d: d["tables"]["raw"]["dynamic"].update(admit_after=10**30))
    t = ec.TableConfig(vocabulary_size=4, dim=2, name="t", dynamic=ec.DynamicVocabulary(
        admit_after=2**63 - 1, ttl_steps=2**63 - 1))
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.5))
    for _ in range(2):
        emb.enqueue({"f": torch.tensor([1, 2**62])})
        acts = emb.dequeue()
        emb.apply_gradients({"f": torch.ones_like(acts["f"])})
    assert torch.equal(acts["f"], torch.zeros(2, 2))  # counted, never admitted


@pytest.mark.parametrize("make", [VocabMap, lambda *a, **kw: vocab_map(*a, backend=choose("cpu"),
                                                                        **kw)],
                         ids=["VocabMap", "vocab_map"])
def test_a_map_refuses_counts_beyond_int64_and_names_the_bytes_it_cannot_have(make,
                                                                              monkeypatch):
    for kwargs in ({"capacity": 2**63}, {"capacity": 4, "admit_after": 10**30},
                   {"capacity": 4, "ttl_steps": 2**63}, {"capacity": 4, "admit_after": 1.5}):
        with pytest.raises(ValueError, match="must be an int in \\[1, 2\\*\\*63 - 1\\]"):
            make(name="table 't'", **kwargs)
    with pytest.raises(ValueError, match=f"table 'big': .* capacity {2**62} needs up to "
                                         f"{2**62 * MAP_BYTES_PER_ROW} bytes"):
        make(2**62, name="table 'big'")

    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate")

    monkeypatch.setattr(vocab, "_physical_memory", lambda: None)
    monkeypatch.setattr(torch, "zeros", no_memory)
    with pytest.raises(ValueError, match=f"table 'big': .* capacity 1000 needs up to "
                                         f"{1000 * MAP_BYTES_PER_ROW} bytes .*could not be "
                                         f"allocated on cpu: DefaultCPUAllocator"):
        make(1000, name="table 'big'")


# ---------------------------------------------------------------------------- deep structures
def _nested(leaf, depth):
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


def test_structures_nested_too_deep_are_value_errors_not_recursion_errors():
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    deep = _nested(ec.FeatureConfig(table=t), 5000)
    with pytest.raises(ValueError, match=f"more than {MAX_DEPTH} levels deep"):
        ec.Embedding(deep, ec.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match=f"more than {MAX_DEPTH} levels deep"):
        ec.EmbeddingSpec(deep, ec.SGD(learning_rate=0.1))
    loop: list = [ec.FeatureConfig(table=t)]
    loop.append(loop)  # a structure that holds itself
    with pytest.raises(ValueError, match="levels deep"):
        ec.Embedding(loop)

    def is_leaf(x):
        return isinstance(x, int)

    with pytest.raises(ValueError, match="levels deep"):
        leaves_with_paths(_nested(1, 5000), is_leaf)
    with pytest.raises(ValueError, match=r"features\['0/k/0.*levels deep"):
        flatten_like(_nested(1, 5000), _nested(1, 5000), is_leaf, "features")
    with pytest.raises(ValueError, match="levels deep"):
        unflatten_like(_nested(1, 5000), [1], is_leaf)
    # From data: the same limit, before anything recurses further.
    d = _good()
    d["features"]["user"] = _nested(d["features"]["user"], 5000)
    with pytest.raises(ValueError, match="levels deep"):
        ec.EmbeddingSpec.from_dict(d)


def test_structures_at_the_depth_limit_work():
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    fc = _nested(ec.FeatureConfig(table=t), MAX_DEPTH)
    emb = ec.Embedding(fc, ec.SGD(learning_rate=0.1))
    ids = _nested(torch.tensor([1, 2]), MAX_DEPTH)
    emb.enqueue(ids)
    out = emb.dequeue()
    assert len(leaves_with_paths(out, lambda x: isinstance(x, torch.Tensor))) == 1
    spec = ec.EmbeddingSpec(fc, ec.SGD(learning_rate=0.1))
    assert ec.EmbeddingSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# ---------------------------------------------------------------------------- files
@pytest.mark.parametrize("content", ["[]", "3", '"spec"', "null"])
def test_a_manifest_that_is_not_an_object_is_a_value_error(tmp_path, content):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ValueError, match="not a checkpoint manifest"):
        ec.EmbeddingSpec.from_checkpoint(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"spec": json.loads(content)}))
    with pytest.raises(ValueError, match="not an embcore spec|holds no spec"):
        ec.EmbeddingSpec.from_checkpoint(tmp_path)


def test_an_empty_offload_dir_is_a_value_error_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="offload_dir='' is not a directory name"):
        OffloadDir.check("")
    t = ec.TableConfig(vocabulary_size=100, dim=4, name="t")
    with pytest.raises(ValueError, match="offload_dir=''"):
        ec.Embedding(ec.FeatureConfig(table=t), ec.SGD(learning_rate=0.1), memory_budget=10,
                     offload_dir="")
    assert os.listdir(tmp_path) == []
    OffloadDir.check(tmp_path / "sub")  # a directory to be: fine


@pytest.mark.parametrize("strategy", ["replicated", "table", "row_div", "row_mod", "column",
                                      "hash"])
def test_the_planner_counts_rows_without_making_them(strategy):
    from embcore.planning.placement import make_placement
    for rows in (0, 1, 2, 5, 7, 64, 101):
        for world in (1, 2, 3, 4):
            p = make_placement(strategy, rows, 8, world, owner=world - 1)
            assert [p.held_count(r) for r in range(world)] == \
                [len(p.held_rows(r)) for r in range(world)], (rows, world)


def test_tables_beyond_memory_without_a_budget_are_a_value_error_naming_them():
    """2^36 rows x 64 (16 TiB) is under the 2^48-byte bound, so it is planned (the planner
    counts rows, it does not list them); building it without a memory_budget is a ValueError
    naming the table and the way out, and the engine stays unbuilt."""
    t = ec.TableConfig(vocabulary_size=2**36, dim=64, name="big")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    assert emb.plan.table("big").rows == 2**36
    with pytest.raises(ValueError, match=r"tables \['big'\].*memory_budget"):
        emb.build()
    raw = ec.TableConfig(vocabulary_size=2**40, dim=2, name="raw",
                         dynamic=ec.DynamicVocabulary())
    emb = ec.Embedding({"f": ec.FeatureConfig(table=raw)}, ec.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="'raw'"):
        emb.build()
