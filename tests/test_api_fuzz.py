"""Malformed calls over the public API beyond ids and gradients (those are test_input_safety.py
and test_gradient_safety.py): configs, optimizers, build, the protocol, state dicts, checkpoints,
the layer. Every call must raise a clear error of the documented kind (TypeError for a wrong type,
ValueError for a wrong value, RuntimeError for the protocol, KeyError / FileNotFoundError for
state and checkpoints), change nothing (tables, slots, step, queue: the next valid step works and
gives the tables of a run that never saw the bad call).

``python tests/test_api_fuzz.py`` prints the figures quoted in docs/semantics.md section 8.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import embcore as ec

ERRORS = (TypeError, ValueError, KeyError, RuntimeError, FileNotFoundError)


def make():
    torch.manual_seed(0)
    users = ec.TableConfig(vocabulary_size=12, dim=4, combiner="sum", name="users")
    items = ec.TableConfig(vocabulary_size=20, dim=3, combiner="mean", name="items")
    fc = {"user": ec.FeatureConfig(table=users), "item": ec.FeatureConfig(table=items)}
    emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.1))
    return emb, fc, users, items


def batch():
    return {"user": torch.tensor([1, 2, 3]),
            "item": torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2, 5, 7]),
                                                           torch.tensor([0, 2, 3, 4]))}


def step(emb):
    emb.enqueue(batch())
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})


def snapshot(emb):
    return {k: v.clone() for k, v in emb.state_dict().items()}


# Each case: (what, call(emb, fc, users, items), expected error types). The call may leave a
# protocol state behind only when it raised before changing it.
def _config_cases():
    t = ec.TableConfig(vocabulary_size=4, dim=2, name="t")
    # (a wrong type is a TypeError, a wrong value of the right type a ValueError)
    bad_tables = [(dict(vocabulary_size=0, dim=2), ValueError),
                  (dict(vocabulary_size=4.0, dim=2), TypeError),
                  (dict(vocabulary_size=True, dim=2), TypeError),
                  (dict(vocabulary_size=4, dim=-1), ValueError),
                  (dict(vocabulary_size=4, dim=2, combiner="max"), ValueError),
                  (dict(vocabulary_size=4, dim=2, combiner=3), TypeError),
                  (dict(vocabulary_size=4, dim=2, name="a/b"), ValueError),
                  (dict(vocabulary_size=4, dim=2, name=""), ValueError),
                  (dict(vocabulary_size=4, dim=2, dtype=torch.int64), TypeError),
                  (dict(vocabulary_size=4, dim=2, initializer=torch.zeros(3, 2)), ValueError),
                  (dict(vocabulary_size=4, dim=2, initializer="zeros"), TypeError),
                  (dict(vocabulary_size=4, dim=2, optimizer="adagrad"), TypeError)]
    for kw, error in bad_tables:
        yield f"TableConfig({kw})", lambda *a, kw=kw: ec.TableConfig(**kw), (error,)
    bad_features = [(dict(table="t"), TypeError), (dict(table=t, max_sequence_length=-1),
                                                   ValueError),
                    (dict(table=t, max_sequence_length=1.5), TypeError),
                    (dict(table=t, output_shape=[]), ValueError),
                    (dict(table=t, output_shape=[0]), ValueError),
                    (dict(table=t, output_shape=3), TypeError), (dict(table=t, name=7), TypeError)]
    for kw, error in bad_features:
        yield f"FeatureConfig({kw})", lambda *a, kw=kw: ec.FeatureConfig(**kw), (error,)
    bad_optimizers = [(ec.SGD, dict(learning_rate=-1), ValueError),
                      (ec.SGD, dict(learning_rate="x"), TypeError),
                      (ec.SGD, dict(learning_rate=math.nan), ValueError),
                      (ec.Adagrad, dict(initial_accumulator_value=-0.1), ValueError),
                      (ec.Adam, dict(beta_1=1.0), ValueError),
                      (ec.Adam, dict(epsilon=0), ValueError),
                      (ec.FTRL, dict(learning_rate_power=0.5), ValueError),
                      (ec.SGD, dict(clipvalue=-1.0), ValueError),
                      (ec.SGD, dict(clipvalue=(1.0, -1.0)), ValueError),
                      (ec.SGD, dict(clip_weight_min=1.0, clip_weight_max=0.0), ValueError),
                      (ec.SGD, dict(weight_decay_factor=-1.0), ValueError),
                      (ec.SGD, dict(gradient_multiplier=2.0), TypeError),
                      (ec.SGD, dict(use_gradient_accumulation=False), ValueError),
                      (ec.AdagradMomentum, dict(beta2=0.0), ValueError)]
    for cls, kw, error in bad_optimizers:
        yield f"{cls.__name__}({kw})", lambda *a, cls=cls, kw=kw: cls(**kw), (error,)


def _engine_cases():
    yield "Embedding({})", lambda *a: ec.Embedding({}), (ValueError,)
    yield "Embedding(optimizer='sgd')", lambda e, fc, *a: ec.Embedding(fc, "sgd"), (TypeError,)
    yield "Embedding(sharding='bogus')", lambda e, fc, *a: ec.Embedding(fc, sharding="bogus"), \
        (ValueError,)
    yield "Embedding(sharding=3)", lambda e, fc, *a: ec.Embedding(fc, sharding=3), (TypeError,)
    yield "Embedding(sharding={'nope': ...})", lambda e, fc, *a: ec.Embedding(
        fc, sharding={"nope": "table"}), (ValueError,)
    yield "Embedding(timeout=-5)", lambda e, fc, *a: ec.Embedding(fc, timeout=-5), (ValueError,)
    for bad, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), ("4", TypeError),
                       (True, TypeError)):
        yield f"build(per_replica_batch_size={bad!r})", \
            lambda e, *a, bad=bad: e.build(per_replica_batch_size=bad), (error,)
    for bad, error in (({"user": [0, 1], "item": [3, 2]}, ValueError),
                       ({"user": [3.0, 1], "item": [3, 2]}, TypeError),
                       ({"user": [], "item": [3, 2]}, ValueError),
                       ({"user": [3, 1]}, ValueError), ([3, 1], ValueError)):
        yield f"build(per_replica_input_shapes={bad!r})", \
            lambda e, *a, bad=bad: e.build(per_replica_input_shapes=bad), (error,)
    yield "dequeue() first", lambda e, *a: e.dequeue(), (RuntimeError,)
    yield "apply_gradients() first", lambda e, *a: e.apply_gradients({"user": None,
                                                                       "item": None}), \
        (RuntimeError,)
    yield "enqueue(features=list)", lambda e, *a: e.enqueue([torch.tensor([1])]), (ValueError,)
    yield "enqueue(missing key)", lambda e, *a: e.enqueue({"user": torch.tensor([1])}), \
        (ValueError,)
    yield "enqueue(extra key)", lambda e, *a: e.enqueue({**batch(), "x": torch.tensor([1])}), \
        (ValueError,)
    yield "enqueue(weights on dense)", lambda e, *a: e.enqueue(
        batch(), {"user": torch.ones(3), "item": None}), (ValueError,)
    yield "lookup(serving_config=foreign)", lambda e, *a: e.lookup(
        {"x": torch.tensor([1])}, serving_config={"x": ec.FeatureConfig(
            table=ec.TableConfig(vocabulary_size=3, dim=2, name="other"))}), (ValueError,)


def _state_cases():
    def sd(emb, **change):
        out = {k: v.clone() for k, v in emb.state_dict().items()}
        out.update(change)
        return out
    yield "load_state_dict(unknown key)", lambda e, *a: e.load_state_dict(
        sd(e, **{"x/parameters": torch.zeros(1)})), (KeyError,)
    yield "load_state_dict(missing key)", lambda e, *a: e.load_state_dict(
        {k: v for k, v in sd(e).items() if k != "users/parameters"}), (KeyError,)
    yield "load_state_dict(wrong shape)", lambda e, *a: e.load_state_dict(
        sd(e, **{"users/parameters": torch.zeros(12, 5)})), (ValueError,)
    yield "load_state_dict(negative accumulators)", lambda e, *a: e.load_state_dict(
        sd(e, **{"items/accumulators": -torch.ones(20, 3)})), (ValueError,)
    yield "load(no checkpoint)", lambda e, *a: ec.load("/nonexistent/ckpt", e), \
        (FileNotFoundError,)
    yield "load(obj=dict)", lambda e, *a: ec.load("/nonexistent/ckpt", {}), (TypeError,)
    yield "save(obj=dict)", lambda e, *a: ec.save("/tmp/never", {}), (TypeError,)
    yield "save(extra=set)", lambda e, *a: ec.save("/tmp/never", e, extra={"s": {1}}), \
        (TypeError,)


def _layer_cases():
    def layer(fc, opt):
        return ec.EmbeddingLayer(fc, opt)
    for bad, error in (("rmsprop", ValueError), (torch.optim.RMSprop, ValueError), (3, TypeError)):
        yield f"EmbeddingLayer(optimizer={bad!r})", lambda e, fc, *a, bad=bad: layer(fc, bad), \
            (error,)


CASES = [*_config_cases(), *_engine_cases(), *_state_cases(), *_layer_cases()]


def run_case(call: Callable, expected: tuple[type, ...]) -> str:
    """Runs one malformed call on a fresh engine; returns how it ended (asserting the rules)."""
    emb, fc, users, items = make()
    step(emb)
    before = snapshot(emb)
    try:
        call(emb, fc, users, items)
    except expected as e:
        assert str(e), "an error without a message"
        outcome = type(e).__name__
    else:
        raise AssertionError("accepted")
    after = snapshot(emb)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k])
                                                 for k in before), "state changed"
    step(emb)  # still usable: the next step runs and is the step of an untouched engine
    ref, *_ = make()
    step(ref)
    step(ref)
    want = snapshot(ref)
    assert all(torch.equal(v, want[k]) for k, v in snapshot(emb).items()), "next step differs"
    return outcome


@pytest.mark.parametrize("what, call, expected", CASES, ids=[c[0] for c in CASES])
def test_malformed_call_is_a_clear_error_and_changes_nothing(what, call, expected):
    run_case(call, expected)


if __name__ == "__main__":
    counts = Counter(run_case(call, expected) for _, call, expected in CASES)
    print(f"{len(CASES)} malformed calls: {dict(counts)}; 0 accepted, 0 state changes, "
          f"0 crashes")
