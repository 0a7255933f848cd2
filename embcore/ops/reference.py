"""The readable reference of lookup, combine and gradient: plain loops, the specification.

Everything here reads the user's raw inputs (dense / jagged / sparse tensors) directly, without the
canonical form of ``inputs/canonical.py``, so tests comparing the fast path against it check the
canonicalization too. Slow on purpose; only for tests.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..config.tables import FeatureConfig

Bag = list[tuple[int, float]]  # (id, weight) pairs of one output row


def reference_bags(feature: FeatureConfig, ids: torch.Tensor,
                   weights: torch.Tensor | None = None) -> tuple[list[Bag], tuple[int, ...], bool]:
    """Splits a raw input into output rows.

    Returns:
        (bags, leading shape, combine): one list of (id, weight) per output row, in row-major
        order; ``combine`` is False when each row is a single id looked up alone (dense ids,
        sequence positions).
    """
    seq = feature.sequence_length
    if ids.is_nested:
        rows = [([int(i) for i in r], [float(x) for x in w] if w is not None else None)
                for r, w in zip(ids.unbind(), weights.unbind() if weights is not None
                                else itertools.repeat(None))]
        bag_shape: tuple[int, ...] = (len(rows),)
    elif ids.layout == torch.sparse_coo:
        shape = tuple(ids.shape)
        bag_shape = shape[:-1]
        dense_ids = ids.to_dense().tolist()
        mask = torch.zeros(shape, dtype=torch.bool)
        idx = ids.coalesce().indices()  # the stored positions (public API)
        mask[tuple(idx)] = True
        dense_w = weights.to_dense().tolist() if weights is not None else None
        rows = []
        for bag in itertools.product(*[range(s) for s in bag_shape]):
            positions = [p for p in range(shape[-1]) if mask[bag + (p,)]]
            row_ids = [_at(dense_ids, bag + (p,)) for p in positions]
            row_w = [_at(dense_w, bag + (p,)) for p in positions] if dense_w is not None else None
            if seq > 0:  # sequence: position = the last index
                by_position = dict(zip(positions, row_ids))
                row_ids = [by_position.get(k) for k in range(shape[-1])]
            rows.append((row_ids, row_w))
        if seq > 0:
            bags = []
            for row_ids, _ in rows:
                for p in range(seq):
                    i = row_ids[p] if p < len(row_ids) else None
                    bags.append([] if i is None else [(int(i), 1.0)])
            return bags, bag_shape + (seq,), False
    else:  # dense
        if seq > 0:
            bag_shape = tuple(ids.shape[:-1]) if ids.dim() >= 2 else tuple(ids.shape)
            flat = ids.reshape(math.prod(bag_shape), -1).tolist()
            rows = [(r, None) for r in flat]
        else:
            shape = tuple(ids.shape[:-1]) if ids.dim() >= 2 and ids.shape[-1] == 1 \
                else tuple(ids.shape)
            return [[(int(i), 1.0)] for i in ids.reshape(-1).tolist()], shape, False
    if seq > 0:
        bags = []
        for row_ids, _ in rows:
            for p in range(seq):
                bags.append([(int(row_ids[p]), 1.0)] if p < len(row_ids) else [])
        return bags, bag_shape + (seq,), False
    return ([[(int(i), 1.0 if w is None else float(w[k])) for k, i in enumerate(r)]
             for r, w in rows], bag_shape, True)


def _at(nested: list, index: tuple[int, ...]):
    for i in index:
        nested = nested[i]
    return nested


def bag_scale(bag: Bag, combiner: str, combine: bool) -> list[float]:
    """The factor each (id, weight) of a bag contributes with (docs/semantics.md section 2)."""
    if not combine:
        return [w for _, w in bag]
    if combiner == "sum":
        return [w for _, w in bag]
    if combiner == "mean":
        total = sum(w for _, w in bag)
        return [w / total if total != 0 else 0.0 for _, w in bag]
    norm = math.sqrt(sum(w * w for _, w in bag))
    return [w / norm if norm != 0 else 0.0 for _, w in bag]


def reference_lookup(table: torch.Tensor, feature: FeatureConfig, ids: torch.Tensor,
                     weights: torch.Tensor | None = None) -> torch.Tensor:
    """Activation of one feature, by loops. Returns ``shape + (D,)`` float64."""
    bags, shape, combine = reference_bags(feature, ids, weights)
    dim = table.shape[1]
    rows = table.double().tolist()
    out = []
    for bag in bags:
        acc = [0.0] * dim
        for (i, _), s in zip(bag, bag_scale(bag, feature.table.combiner, combine)):
            for d in range(dim):
                acc[d] += s * rows[i][d]
        out.append(acc)
    return torch.tensor(out, dtype=torch.float64).reshape(*shape, dim)


def reference_row_gradients(feature: FeatureConfig, ids: torch.Tensor,
                            weights: torch.Tensor | None,
                            grad: torch.Tensor) -> dict[int, list[float]]:
    """Summed gradient per touched row of the feature's table, by loops.

    Args:
        grad: ``shape + (D,)`` gradient of the feature's activation.

    Returns:
        {row id: D floats}; a row looked up with a zero scale still appears (it is touched).
    """
    bags, _, combine = reference_bags(feature, ids, weights)
    dim = grad.shape[-1]
    g = grad.double().reshape(-1, dim).tolist()
    out: dict[int, list[float]] = {}
    for r, bag in enumerate(bags):
        for (i, _), s in zip(bag, bag_scale(bag, feature.table.combiner, combine)):
            acc = out.setdefault(i, [0.0] * dim)
            for d in range(dim):
                acc[d] += s * g[r][d]
    return out
