"""The fast lookup and gradient path against the readable reference (ops/reference.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples
from strategies import cases

import embcore as ec
from embcore.ops.reference import (
    bag_scale,
    reference_bags,
    reference_lookup,
    reference_row_gradients,
)


def magnitude(feature, ids, weights, table=None, grad=None):
    """sum_k |scale_k| * |value_k| of every output (table given) or touched row (grad given): the
    scale of float32 rounding errors. A mean bag whose weights nearly cancel has huge scales, so
    its float32 result is only as exact as that magnitude allows."""
    bags, _, combine = reference_bags(feature, ids, weights)
    c = feature.table.combiner
    if table is not None:
        rows = table.double().abs()
        return torch.stack([sum((abs(s) * _cond(bag, c, combine) * rows[i] for (i, _), s in
                                 zip(bag, bag_scale(bag, c, combine))),
                                torch.zeros(rows.shape[1], dtype=torch.float64))
                            for bag in bags]).reshape(-1, rows.shape[1])
    g = grad.double().abs().reshape(len(bags), -1)
    out: dict[int, torch.Tensor] = {}
    for r, bag in enumerate(bags):
        for (i, _), s in zip(bag, bag_scale(bag, c, combine)):
            out[i] = (out.get(i, torch.zeros(g.shape[1], dtype=torch.float64))
                      + abs(s) * _cond(bag, c, combine) * g[r])
    return out


def _cond(bag, combiner, combine):
    """How much a mean bag's float32 weight sum amplifies rounding: sum |w| / |sum w| (weights
    that nearly cancel make the scales w / sum w inexact by that factor); 1 otherwise."""
    if combiner != "mean" or not combine:
        return 1.0
    w = [float(x) for _, x in bag]
    total = abs(sum(w))
    return sum(abs(x) for x in w) / total if total else 1.0


def assert_close_scaled(got, want, scale):
    """``got`` within 1e-5 relative + 1e-4 absolute of ``want``, or 1e-5 of ``scale``."""
    err = (got.double() - want).abs()
    limit = 1e-4 + 1e-5 * want.abs() + 1e-5 * scale
    assert bool((err <= limit).all()), f"max error {err.max().item()} over limit {limit.min()}"


def row_id_table(n: int, d: int) -> torch.Tensor:
    """Row i holds i (plus a column pattern), so a wrong row is obvious."""
    return torch.arange(n, dtype=torch.float32)[:, None] * 10 + torch.arange(d)[None, :] * 0.1


@st.composite
def multi_feature(draw):
    """2-4 features over 1-3 tables (some shared, some stackable), each with a batch."""
    combiners = ["sum", "mean", "sqrtn"]
    tables = [ec.TableConfig(vocabulary_size=draw(st.integers(1, 12)), dim=draw(st.sampled_from([2, 3])),
                             combiner=draw(st.sampled_from(combiners)), name=f"t{i}")
              for i in range(draw(st.integers(1, 3)))]
    n = draw(st.integers(1, 4))
    feats = [draw(cases(draw(st.sampled_from(tables)))) for _ in range(n)]
    return tables, feats


def make_engine(tables, feats, lr=1.0):
    fc = {f"f{i}": c.feature for i, c in enumerate(feats)}
    emb = ec.Embedding(fc, ec.SGD(learning_rate=lr))
    for t, v in emb.embedding_tables.items():
        v.copy_(row_id_table(t.vocabulary_size, t.dim))
    ids = {f"f{i}": c.ids for i, c in enumerate(feats)}
    w = {f"f{i}": c.weights for i, c in enumerate(feats)}
    return emb, fc, ids, w


@settings(max_examples=examples(60), deadline=None)
@given(multi_feature())
def test_lookup_matches_reference(case):
    tables, feats = case
    emb, fc, ids, w = make_engine(tables, feats)
    before = {t: v.clone() for t, v in emb.embedding_tables.items()}
    got = emb.lookup(ids, w)
    emb.enqueue(ids, w, training=False)
    queued = emb.dequeue()
    served = ec.serving_embedding_lookup(ids, w, before, fc)
    for k, f in fc.items():
        ref = reference_lookup(before[f.table], f, ids[k], w[k])
        assert got[k].shape == ref.shape, k
        scale = magnitude(f, ids[k], w[k], table=before[f.table]).reshape(ref.shape)
        assert_close_scaled(got[k], ref, scale)
        torch.testing.assert_close(queued[k], got[k])
        torch.testing.assert_close(served[k], got[k])


@settings(max_examples=examples(60), deadline=None)
@given(multi_feature(), st.integers(0, 2**31 - 1))
def test_gradient_matches_reference(case, seed):
    """With SGD(lr=1) a table moves by exactly minus the summed reference gradient."""
    tables, feats = case
    emb, fc, ids, w = make_engine(tables, feats)
    before = {t: v.clone().double() for t, v in emb.embedding_tables.items()}
    emb.enqueue(ids, w)
    acts = emb.dequeue()
    gen = torch.Generator().manual_seed(seed)
    grads = {k: torch.randn(a.shape, generator=gen) for k, a in acts.items()}
    emb.apply_gradients(grads)
    expected = {t: v.clone() for t, v in before.items()}
    scale = {t: torch.zeros_like(v) for t, v in before.items()}
    for k, f in fc.items():
        for row, g in reference_row_gradients(f, ids[k], w[k], grads[k]).items():
            expected[f.table][row] -= torch.tensor(g, dtype=torch.float64)
        for row, m in magnitude(f, ids[k], w[k], grad=grads[k]).items():
            scale[f.table][row] += m
    for t, v in emb.embedding_tables.items():
        assert_close_scaled(v, expected[t], scale[t])


def test_empty_bags_give_zero_vectors():
    t = ec.TableConfig(vocabulary_size=5, dim=3, combiner="mean", name="t")
    f = ec.FeatureConfig(table=t)
    emb = ec.Embedding({"f": f})
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2], dtype=torch.int64),
                                                 torch.tensor([0, 0, 2, 2]))
    out = emb.lookup({"f": ids})["f"]
    assert out.shape == (3, 3)
    assert torch.equal(out[0], torch.zeros(3)) and torch.equal(out[2], torch.zeros(3))


def test_weights_summing_to_zero_give_zero_not_nan():
    t = ec.TableConfig(vocabulary_size=5, dim=2, combiner="mean", name="t")
    f = ec.FeatureConfig(table=t)
    emb = ec.Embedding({"f": f})
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2]), torch.tensor([0, 2]))
    w = torch.nested.nested_tensor_from_jagged(torch.tensor([1.0, -1.0]), torch.tensor([0, 2]))
    assert torch.equal(emb.lookup({"f": ids}, {"f": w})["f"], torch.zeros(1, 2))


def test_rank3_sparse_one_bag_per_leading_index():
    t = ec.TableConfig(vocabulary_size=10, dim=2, combiner="sum", name="t")
    f = ec.FeatureConfig(table=t)
    emb = ec.Embedding({"f": f})
    emb.embedding_tables[t].copy_(row_id_table(10, 2))
    idx = torch.tensor([[0, 0, 1], [1, 1, 0], [0, 2, 1]])  # (b0, b1, position)
    ids = torch.sparse_coo_tensor(idx, torch.tensor([3, 4, 5]), (2, 2, 3))
    out = emb.lookup({"f": ids})["f"]
    assert out.shape == (2, 2, 2)
    table = row_id_table(10, 2)
    torch.testing.assert_close(out[0, 1], table[3] + table[4])
    torch.testing.assert_close(out[1, 0], table[5])
    assert torch.equal(out[0, 0], torch.zeros(2))


def test_sequence_truncates_and_pads():
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    f = ec.FeatureConfig(table=t, max_sequence_length=2)
    emb = ec.Embedding({"f": f})
    emb.embedding_tables[t].copy_(row_id_table(10, 2))
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2, 3, 4]),
                                                 torch.tensor([0, 3, 4]))
    out = emb.lookup({"f": ids})["f"]
    table = row_id_table(10, 2)
    assert out.shape == (2, 2, 2)
    torch.testing.assert_close(out[0], table[[1, 2]])  # id 3 past the length is dropped
    torch.testing.assert_close(out[1, 0], table[4])
    assert torch.equal(out[1, 1], torch.zeros(2))


def test_dense_shapes():
    t = ec.TableConfig(vocabulary_size=10, dim=3, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)})
    assert emb.lookup({"f": torch.tensor([1, 2])})["f"].shape == (2, 3)
    assert emb.lookup({"f": torch.tensor([[1], [2]])})["f"].shape == (2, 3)
    assert emb.lookup({"f": torch.tensor([[1, 2, 3], [2, 3, 4]])})["f"].shape == (2, 3, 3)


class FakeKeyedJaggedTensor:
    """TorchRec's KeyedJaggedTensor as far as embcore reads it (torchrec is not a dependency;
    benchmarks/sys_torchrec.py uses the real one)."""

    def __init__(self, keys, values, lengths, weights=None):
        self._keys, self._values, self._weights = keys, values, weights
        self._offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self._stride = lengths.numel() // len(keys)

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def offsets(self):
        return self._offsets

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return self._stride


def test_keyed_jagged_tensor_equals_the_same_batch_as_jagged_tensors():
    items = ec.TableConfig(vocabulary_size=20, dim=3, combiner="mean", name="items")
    users = ec.TableConfig(vocabulary_size=10, dim=3, combiner="sum", name="users")
    fc = {"history": ec.FeatureConfig(table=items), "user": ec.FeatureConfig(table=users)}
    lengths = torch.tensor([2, 0, 3, 1, 1, 1])  # history: 3 bags, then user: 3 bags
    values = torch.tensor([1, 2, 5, 6, 7, 9, 3, 4])
    weights = torch.rand(8)
    kjt = FakeKeyedJaggedTensor(["history", "user"], values, lengths, weights)

    def jag(x, lo, hi, off):
        return torch.nested.nested_tensor_from_jagged(x[lo:hi], torch.tensor(off))
    ids = {"history": jag(values, 0, 5, [0, 2, 2, 5]), "user": jag(values, 5, 8, [0, 1, 2, 3])}
    w = {"history": jag(weights, 0, 5, [0, 2, 2, 5]), "user": jag(weights, 5, 8, [0, 1, 2, 3])}
    torch.manual_seed(0)
    emb = ec.Embedding(fc, ec.SGD(learning_rate=0.5))
    want = emb.lookup(ids, w)
    got = emb.lookup(kjt)
    for k in fc:
        torch.testing.assert_close(got[k], want[k])
    served = ec.serving_embedding_lookup(kjt, None, emb.embedding_tables, fc)  # its weights
    for k in fc:
        torch.testing.assert_close(served[k], want[k])
    emb.enqueue(kjt)  # training through the queue and through the layer's step
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(a) for k, a in acts.items()})
    step = emb.training_step(kjt)
    assert step.activations["history"].shape == (3, 3)
    with pytest.raises(ValueError, match="keys \\['history', 'user'\\] differ"):
        emb.lookup(kjt, serving_config={"history": fc["history"]})


def test_output_shape_overrides_max_sequence_length_as_in_tf():
    """TF ignores max_sequence_length when output_shape is set: the bags are combined into
    output_shape; the reference agrees."""
    t = ec.TableConfig(vocabulary_size=10, dim=2, combiner="sum", name="t")
    f = ec.FeatureConfig(table=t, max_sequence_length=3, output_shape=[2])
    assert f.sequence_length == 0 and ec.FeatureConfig(table=t, max_sequence_length=3).sequence_length == 3
    emb = ec.Embedding({"f": f})
    emb.embedding_tables[t].copy_(row_id_table(10, 2))
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 4]))
    out = emb.lookup({"f": ids})["f"]
    table = row_id_table(10, 2)
    assert out.shape == (2, 2)
    torch.testing.assert_close(out[0], table[1] + table[2] + table[3])
    torch.testing.assert_close(out.double(), reference_lookup(table, f, ids))
