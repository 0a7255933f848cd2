"""Hypothesis strategies: random feature configs and batches of every input kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import embcore as ec


@dataclass
class Case:
    """One feature with a batch: config, ids, weights (or None)."""

    feature: ec.FeatureConfig
    ids: torch.Tensor
    weights: torch.Tensor | None


def jagged(values: list[list[int]] | list[list[float]], dtype: torch.dtype) -> torch.Tensor:
    lengths = [len(r) for r in values]
    flat = [x for r in values for x in r]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(torch.tensor(flat, dtype=dtype), offsets)


def sparse(rows: list[list[int | None]], dtype: torch.dtype, width: int) -> torch.Tensor:
    """Rank-2 sparse tensor from rows with holes (None)."""
    idx = [(b, p) for b, r in enumerate(rows) for p, x in enumerate(r) if x is not None]
    vals = [rows[b][p] for b, p in idx]
    indices = torch.tensor(idx, dtype=torch.int64).reshape(-1, 2).T
    return torch.sparse_coo_tensor(indices, torch.tensor(vals, dtype=dtype),
                                   (len(rows), width)).coalesce()


@st.composite
def cases(draw, table: ec.TableConfig, allow_weights: bool = True) -> Case:
    """A feature of ``table`` with a random batch of a random kind."""
    n = table.vocabulary_size
    kind = draw(st.sampled_from(["dense1", "dense", "jagged", "sparse"]))
    seq = draw(st.sampled_from([0, 0, 1, 3]))
    feature = ec.FeatureConfig(table=table, max_sequence_length=seq)
    b = draw(st.integers(1, 4))
    idx_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    ident = st.integers(0, n - 1)
    if kind == "dense1":
        shape = draw(st.sampled_from([(b,), (b, 1)]))
        ids = torch.tensor(draw(st.lists(ident, min_size=b, max_size=b)), dtype=idx_dtype)
        return Case(feature, ids.reshape(shape), None)
    if kind == "dense":
        length = draw(st.integers(1, 4))
        flat = draw(st.lists(ident, min_size=b * length, max_size=b * length))
        return Case(feature, torch.tensor(flat, dtype=idx_dtype).reshape(b, length), None)
    weighted = allow_weights and seq == 0 and draw(st.booleans())
    wv = st.floats(-2, 2, allow_nan=False, width=32).filter(lambda x: abs(x) > 1e-3)
    if kind == "jagged":
        rows = draw(st.lists(st.lists(ident, max_size=5), min_size=b, max_size=b))
        ids = jagged(rows, idx_dtype)
        w = None
        if weighted:
            w = jagged([[draw(wv) for _ in r] for r in rows], torch.float32)
        return Case(feature, ids, w)
    width = draw(st.integers(1, 5))
    rows_s = draw(st.lists(st.lists(st.one_of(st.none(), ident), min_size=width, max_size=width),
                           min_size=b, max_size=b))
    ids = sparse(rows_s, idx_dtype, width)
    w = None
    if weighted:
        w_rows = [[None if x is None else draw(wv) for x in r] for r in rows_s]
        w = sparse(w_rows, torch.float32, width)
    return Case(feature, ids, w)
