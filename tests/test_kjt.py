"""A KeyedJaggedTensor, read once (inputs/kjt.py) and checked as TorchRec's
``validate_keyed_jagged_tensor`` checks it, on every path that takes one: ``Embedding``'s lookup
and queue, ``EmbeddingLayer``'s training forward and serving. torchrec is not needed: the KJT here
is duck-typed (tests/test_torchrec.py checks TorchRec's modules with TorchRec's own KJT)."""

from __future__ import annotations

import re

import pytest
import torch

import embcore as ec


class DuckKJT:
    """TorchRec's KeyedJaggedTensor as embcore reads it: keys, values, weights, and lengths or
    offsets or both, as given (no checks of its own)."""

    def __init__(self, keys, values, lengths=None, offsets=None, weights=None):
        self._keys, self._values, self._weights = keys, values, weights
        self._lengths, self._given_offsets = lengths, offsets
        self._offsets = offsets if offsets is not None else torch.cat(
            [torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        self._stride = (self._offsets.numel() - 1) // max(len(keys), 1)

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def offsets(self):
        return self._offsets

    def lengths_or_none(self):
        return self._lengths

    def offsets_or_none(self):
        return self._given_offsets

    def weights_or_none(self):
        return self._weights

    def stride(self):
        return self._stride


def t(*xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


KEYS = ["f", "g"]
# (a KJT TorchRec's validator refuses, what the error says); 2 keys, 2 bags per key
BAD = {
    "lengths summing to fewer than the values (trailing ids dropped)": (
        DuckKJT(KEYS, t(1, 2, 3, 4), lengths=t(1, 1, 0, 1)),
        r"offsets run from 0 to 3 but there are 4 values"),
    "bags of one id each and a value more": (
        DuckKJT(KEYS, t(1, 2, 3, 4, 5), lengths=t(1, 1, 1, 1)),
        r"offsets run from 0 to 4 but there are 5 values"),
    "lengths summing to more than the values": (
        DuckKJT(KEYS, t(1, 2, 3), lengths=t(1, 1, 1, 1)),
        r"offsets run from 0 to 4 but there are 3 values"),
    "4 weights for 3 ids": (
        DuckKJT(KEYS, t(1, 2, 3), lengths=t(1, 1, 1, 0), weights=torch.ones(4)),
        r"4 weights of shape \[4\] for 3 values"),
    "weights of another shape": (
        DuckKJT(KEYS, t(1, 2, 3), lengths=t(1, 1, 1, 0), weights=torch.ones(3, 1)),
        r"3 weights of shape \[3, 1\] for 3 values"),
    "3 lengths for 2 keys": (
        DuckKJT(KEYS, t(1, 2, 3), lengths=t(1, 1, 1)), r"3 lengths for 2 keys"),
    "a negative length": (
        DuckKJT(KEYS, t(1, 2, 3), lengths=t(2, -1, 1, 1)),
        r"key 'f', bag 1 has length -1; lengths must be >= 0"),
    "offsets not starting at 0": (
        DuckKJT(KEYS, t(1, 2, 3), offsets=t(1, 1, 2, 3, 3)), r"offsets run from 1 to 3"),
    "lengths and offsets that disagree": (
        DuckKJT(KEYS, t(1, 2, 3), lengths=t(1, 1, 1, 0), offsets=t(0, 2, 2, 3, 3)),
        r"lengths are not the differences of its 5 offsets"),
    "a repeated key": (
        DuckKJT(["f", "f"], t(1, 2, 3), lengths=t(1, 1, 1, 0)), r"repeat \['f'\]"),
    "2-D values": (
        DuckKJT(KEYS, t(1, 2, 3).view(3, 1), lengths=t(1, 1, 1, 0)),
        r"values must be 1-D .* got shape \[3, 1\]"),
}


def _features():
    table = ec.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="t")
    return {k: ec.FeatureConfig(table=table) for k in KEYS}


@pytest.mark.parametrize("case", list(BAD))
def test_every_path_refuses_what_torchrec_refuses_and_changes_nothing(case):
    kjt, message = BAD[case]
    torch.manual_seed(0)
    fc = _features()
    emb = ec.Embedding(fc, ec.SGD(learning_rate=0.5))
    layer = ec.EmbeddingLayer(_features(), ec.SGD(learning_rate=0.5))
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    layer_before = {k: v.clone() for k, v in layer.state_dict().items()}
    calls = {
        "Embedding.lookup": lambda: emb.lookup(kjt),
        "Embedding.enqueue": lambda: emb.enqueue(kjt),
        "Embedding.training_step": lambda: emb.training_step(kjt),
        "EmbeddingLayer forward": lambda: layer(kjt),
        "serving_embedding_lookup": lambda: ec.serving_embedding_lookup(
            kjt, None, emb.embedding_tables, fc),
        "for_serving()": lambda: layer.for_serving()(kjt),
    }
    for where, call in calls.items():
        try:
            call()
        except ValueError as e:
            assert re.search(message, str(e)), f"{where}: {e}"
        else:
            pytest.fail(f"{where} accepted a KJT with {case}")
    emb.enqueue({k: t(1, 2) for k in KEYS})  # the queue holds nothing of the refused batches
    assert emb.dequeue()["f"].shape == (2, 4)
    for k, v in before.items():
        assert torch.equal(emb.state_dict()[k], v), k
    for k, v in layer_before.items():
        assert torch.equal(layer.state_dict()[k], v), k


def test_weights_beside_a_kjt_are_refused_not_ignored():
    """A KJT carries its weights: weights= passed beside it would be dropped; refused instead."""
    fc = _features()
    emb = ec.Embedding(fc, ec.SGD(learning_rate=0.5))
    layer = ec.EmbeddingLayer(_features(), ec.SGD(learning_rate=0.5))
    kjt = DuckKJT(KEYS, t(1, 2, 3), lengths=t(2, 0, 1, 0))
    weights = {"f": torch.nested.nested_tensor_from_jagged(torch.tensor([2.0, 3.0]), t(0, 2, 2)),
               "g": torch.nested.nested_tensor_from_jagged(torch.tensor([4.0]), t(0, 1, 1))}
    for call in {"Embedding.lookup": lambda: emb.lookup(kjt, weights),
                        "Embedding.enqueue": lambda: emb.enqueue(kjt, weights),
                        "EmbeddingLayer forward": lambda: layer(kjt, weights),
                        "serving_embedding_lookup": lambda: ec.serving_embedding_lookup(
                            kjt, weights, emb.embedding_tables, fc),
                        "for_serving()": lambda: layer.for_serving()(kjt, weights)}.values():
        with pytest.raises(ValueError, match=r"weights were given beside a KeyedJaggedTensor"):
            call()
    assert emb.lookup(kjt)["f"].shape == (2, 4)  # the KJT alone is read


def test_integer_lengths_and_offsets_only():
    from embcore.inputs.kjt import read_keyed_jagged
    for name in ("lengths", "offsets"):
        kjt = DuckKJT(KEYS, t(1, 2, 3), **{name: t(1, 1, 1, 0) if name == "lengths"
                                           else t(0, 1, 2, 3, 3)})
        setattr(kjt, f"_{'lengths' if name == 'lengths' else 'given_offsets'}",
                getattr(kjt, f"{name}_or_none")().float())
        with pytest.raises(TypeError, match=rf"{name} must be integers, got torch.float32"):
            read_keyed_jagged(kjt)


def test_a_valid_kjt_reads_as_its_keys_bags():
    """Lengths and offsets both given (and agreeing), empty bags, a key of no ids, weights:
    each key's ids, offsets from 0, lengths and weights; one id per bag is seen as such."""
    from embcore.inputs.kjt import read_keyed_jagged
    kjt = DuckKJT(["a", "b", "c"], t(5, 6, 7, 8), lengths=t(2, 0, 0, 0, 1, 1),
                  offsets=t(0, 2, 2, 2, 2, 3, 4), weights=torch.tensor([.5, 1., 2., 3.]))
    kj = read_keyed_jagged(kjt)
    assert (kj.stride, kj.bounds, kj.one_id_per_bag) == (2, [0, 2, 2, 4], False)
    values, offsets = kj.ids("a")
    assert values.tolist() == [5, 6] and offsets.tolist() == [0, 2, 2]
    values, offsets = kj.ids("b")
    assert values.tolist() == [] and offsets.tolist() == [0, 0, 0]
    values, offsets = kj.ids("c")
    assert values.tolist() == [7, 8] and offsets.tolist() == [0, 1, 2]
    assert kj.lengths("c").tolist() == [1, 1] and kj.weights_of("c").tolist() == [2., 3.]
    ones = read_keyed_jagged(DuckKJT(["a", "b"], t(5, 6, 7, 8), lengths=t(1, 1, 1, 1)))
    assert ones.one_id_per_bag and ones.dense("b").tolist() == [7, 8]
    empty = read_keyed_jagged(DuckKJT(["a", "b"], t(), lengths=t()))
    assert (empty.stride, empty.bounds, empty.one_id_per_bag) == (0, [0, 0, 0], False)
