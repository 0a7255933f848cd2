"""Inputs: dense / jagged / sparse COO ids -> one canonical per-feature form, and shape rules.

Every feature, whatever its input kind, becomes a weighted bag lookup (``ops.bags.Bags``): ``R``
output rows, row ``r`` being ``sum_k scales[k] * E[ids[k]]`` over ``k in [offsets[r], offsets[r+1])``.
The combiner (2.2) and the user's weights are folded into ``scales`` here, once, so the lookup and
its gradient are the same two kernels for sum / mean / sqrtn, dense ids (bags of one id), sequence
features (bags of zero or one id) and ragged / sparse bags. The activation is the (R, D) result
viewed as ``shape + (D,)``.

Shape rules (docs/semantics.md section 1), giving the *natural* leading shape of a batch:
- dense ids of shape ``S + [1]`` or ``S``: ``S`` (every id alone);
- jagged ``[B, None]``: ``[B]``; sparse of rank k: ``shape[:-1]`` (one bag per leading index);
- sequence features (``max_sequence_length = L > 0``): the bag shape (dense: all but the last dim)
  followed by ``L``; ids past ``L`` are dropped, missing positions are zero rows.
"""

from __future__ import annotations

import math
import torch

from .compat import jagged_parts, sparse_parts
from .config import FeatureConfig
from .ops import native
from .ops.bags import Bags

INT_DTYPES = (torch.int32, torch.int64)


def input_kind(x: torch.Tensor) -> str:
    """'dense', 'jagged' or 'sparse' for a supported input; TypeError otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.is_nested:
        return "jagged"
    if x.layout == torch.sparse_coo:
        return "sparse"
    if x.layout == torch.strided:
        return "dense"
    raise TypeError(f"unsupported tensor layout {x.layout}; use dense, torch.nested (jagged) or "
                    f"sparse COO tensors")


def canonicalize(feature: FeatureConfig, name: str, table_name: str, ids: torch.Tensor,
                 weights: torch.Tensor | None, device: torch.device) -> Bags:
    """Turns one feature's ids (and weights) into its canonical form on ``device``.

    Args:
        feature: the feature's config (its table's combiner, its sequence length, validation).
        name: the feature's name for error messages.
        table_name: its table's resolved name, for error messages.
        ids: dense (rank >= 1), jagged (``layout=torch.jagged``, rank 2) or sparse COO (rank >= 2)
            tensor of int32 / int64 ids.
        weights: None, or a float tensor of the same kind and layout as ``ids`` (not for dense
            inputs nor sequence features).
        device: where the canonical tensors live.

    Raises:
        TypeError: unsupported tensor kinds or dtypes.
        ValueError: out-of-range ids, non-finite weights, mismatched weights, bad ranks.
    """
    where = f"feature {name!r}"
    try:
        kind = input_kind(ids)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    table = feature.table
    seq = feature.max_sequence_length
    if kind == "dense" and ids.dim() < 1:
        raise ValueError(f"{where}: dense ids must have rank >= 1, got a scalar")
    if weights is not None:
        if seq > 0:
            raise ValueError(f"{where}: weights were given for a sequence feature "
                             f"(max_sequence_length={seq}); sequence ids are not combined, so "
                             f"weights do not apply")
        if kind == "dense":
            raise ValueError(f"{where}: weights were given for a dense input; dense ids are looked "
                             f"up one by one, so weights apply only to jagged or sparse bags")
        if input_kind(weights) != kind:
            raise ValueError(f"{where}: ids are {kind} but weights are {input_kind(weights)}; "
                             f"weights must mirror their ids")
    if kind == "dense" and seq == 0:
        shape = tuple(ids.shape[:-1]) if ids.dim() >= 2 and ids.shape[-1] == 1 else tuple(ids.shape)
        if ids.dtype not in INT_DTYPES:
            raise TypeError(f"{where}: ids must be int32 or int64, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=device, dtype=torch.int64, non_blocking=True)  # (nnz,)
        if feature.validate_weights_and_indices:
            _validate(flat, None, table.vocabulary_size, where, table_name)
        return Bags(flat, None, None, shape)
    if kind == "dense":
        values, offsets, bag_shape, positions = _dense(ids, seq, where)
        w = None
    elif kind == "jagged":
        values, offsets, bag_shape, w = _jagged(ids, weights, where)
        positions = None
    else:
        values, offsets, bag_shape, w, positions = _sparse(ids, weights, where)
    if values.dtype not in INT_DTYPES:
        raise TypeError(f"{where}: ids must be int32 or int64, got {values.dtype}")
    values = values.to(device=device, dtype=torch.int64, non_blocking=True)
    offsets = offsets.to(device=device, dtype=torch.int64, non_blocking=True)
    if w is not None:
        if not w.is_floating_point():
            raise TypeError(f"{where}: weights must be floating point, got {w.dtype}")
        w = w.to(device=device, dtype=torch.float32, non_blocking=True)
    if feature.validate_weights_and_indices:
        _validate(values, w, table.vocabulary_size, where, table_name)
    if seq > 0:
        if positions is not None:
            positions = positions.to(device=device, non_blocking=True)
        values, offsets = _to_sequence(values, offsets, positions, seq)
        scales = torch.ones(values.shape, dtype=torch.float32, device=device)
        return Bags(values, offsets, scales, bag_shape + (seq,))
    scales = combiner_scales(offsets, w, table.combiner, values.numel())
    return Bags(values, offsets, scales, bag_shape)


def combiner_scales(offsets: torch.Tensor, weights: torch.Tensor | None, combiner: str,
                    nnz: int) -> torch.Tensor:
    """Per-id scale so that a weighted sum over each bag applies the combiner (docs/semantics.md section 2).

    A bag whose weights sum (mean) or square-sum (sqrtn) to zero gets zero scales, not NaN.
    """
    if native.usable(offsets) and offsets.is_contiguous() and (
            weights is None or weights.is_contiguous()):
        return native.combiner_scales(offsets, weights, combiner, nnz)
    w = weights if weights is not None else torch.ones(nnz, dtype=torch.float32,
                                                       device=offsets.device)  # (nnz,)
    if combiner == "sum":
        return w
    lengths = offsets[1:] - offsets[:-1]  # (R,)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths,
                                  output_size=nnz)  # (nnz,)
    per_bag = torch.zeros(lengths.numel(), dtype=torch.float32, device=offsets.device)  # (R,)
    per_bag.index_add_(0, seg, w if combiner == "mean" else w * w)
    denom = (per_bag if combiner == "mean" else per_bag.sqrt())[seg]  # (nnz,)
    # w / denom, not w * (1 / denom): the inverse of a tiny denominator overflows
    return torch.where(denom != 0, w / torch.where(denom != 0, denom, 1.0), 0.0)


def resolve_shape(feature: FeatureConfig, name: str, natural: tuple[int, ...],
                  fixed: tuple[int, ...] | None) -> tuple[int, ...]:
    """The leading shape of this batch's activation: ``output_shape``, else the fixed one.

    Args:
        natural: the shape the batch itself gives.
        fixed: the shape set by ``build`` or the first enqueue, or None.

    Raises:
        ValueError: when the batch cannot take the configured shape.
    """
    if feature.output_shape is not None:
        target = tuple(feature.output_shape)
        if math.prod(target) != math.prod(natural):
            raise ValueError(f"feature {name!r}: output_shape={list(target)} holds "
                             f"{math.prod(target)} rows but this batch gives {list(natural)} "
                             f"({math.prod(natural)} rows); feed batches matching output_shape")
        return target
    if fixed is not None and fixed != natural:
        raise ValueError(f"feature {name!r}: this batch gives activations of leading shape "
                         f"{list(natural)}, but the shape was fixed at {list(fixed)} by build() or "
                         f"the first enqueue; feed batches of one shape (e.g. "
                         f"DataLoader(drop_last=True)), or use lookup() for other shapes")
    return natural


def output_shape_from_input_shape(feature: FeatureConfig, input_shape: tuple[int, ...],
                                  name: str) -> tuple[int, ...]:
    """The leading output shape for ``build(per_replica_input_shapes=...)``.

    An input shape names the ids per bag in its last dim, as in TF: ``[B, 1]`` for one id per
    example, ``[B, L]`` for bags of up to L ids (``[B, L, 1]`` for a dense ``[B, L]`` input whose ids
    are looked up one by one). Sequence features give ``input_shape[:-1] + [L]``.
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) < 2:
        raise ValueError(f"feature {name!r}: per_replica_input_shapes must have rank >= 2 (the last "
                         f"dim counts ids per bag, e.g. [batch, 1]), got {list(shape)}")
    if feature.max_sequence_length > 0:
        return shape[:-1] + (feature.max_sequence_length,)
    return shape[:-1]


def _dense(ids: torch.Tensor, seq: int, where: str):
    """A dense input of a sequence feature: rows of the last dim are sequences."""
    flat = ids.reshape(-1)  # (nnz,)
    bag_shape = tuple(ids.shape[:-1]) if ids.dim() >= 2 else tuple(ids.shape)
    length = ids.shape[-1] if ids.dim() >= 2 else 1
    bags = math.prod(bag_shape)
    offsets = torch.arange(bags + 1, dtype=torch.int64) * length  # (bags + 1,)
    return flat, offsets, bag_shape, None


def _jagged(ids: torch.Tensor, weights: torch.Tensor | None, where: str):
    if ids.layout != torch.jagged:
        raise TypeError(f"{where}: nested tensors must use layout=torch.jagged, got {ids.layout}")
    if ids.dim() != 2:  # (a rank-2 jagged tensor is always ragged in dim 1)
        raise ValueError(f"{where}: jagged ids must have shape [B, None] (rank 2), got rank "
                         f"{ids.dim()}")
    values, offsets, lengths = jagged_parts(ids)
    if lengths is not None:
        raise ValueError(f"{where}: jagged tensors with holes (lengths) are not supported; "
                         f"build them with torch.nested.nested_tensor_from_jagged(values, offsets)")
    w = None
    if weights is not None:
        if weights.layout != torch.jagged:
            raise ValueError(f"{where}: weights must be a jagged tensor with the same offsets as "
                             f"the ids")
        w, w_offsets, w_lengths = jagged_parts(weights)
        if w_lengths is not None or not (w_offsets is offsets or torch.equal(
                w_offsets.to(offsets.device), offsets)):
            raise ValueError(f"{where}: weights must be a jagged tensor with the same offsets as "
                             f"the ids")
    return values, offsets, (offsets.numel() - 1,), w


def _sparse(ids: torch.Tensor, weights: torch.Tensor | None, where: str):
    if ids.dim() < 2:
        raise ValueError(f"{where}: sparse ids must have rank >= 2, got rank {ids.dim()}")
    if ids.dense_dim() != 0:
        raise ValueError(f"{where}: sparse ids must be hybrid-free (dense_dim 0)")
    indices, values = sparse_parts(ids)  # (k, nnz), (nnz,) in stored order
    shape = tuple(ids.shape)
    # Order by (bag, position); stable so an uncoalesced input keeps its order of equal keys.
    order = None
    if not ids.is_coalesced():
        strides = torch.tensor([math.prod(shape[i + 1:]) for i in range(len(shape))],
                               dtype=torch.int64, device=indices.device)
        order = torch.argsort((indices * strides[:, None]).sum(0), stable=True)
        indices, values = indices[:, order], values[order]
    bag_shape = shape[:-1]
    bag_strides = torch.tensor([math.prod(bag_shape[i + 1:]) for i in range(len(bag_shape))],
                               dtype=torch.int64, device=indices.device)
    bag = (indices[:-1] * bag_strides[:, None]).sum(0)  # (nnz,)
    counts = torch.bincount(bag, minlength=math.prod(bag_shape))  # (bags,)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=indices.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    w = None
    if weights is not None:
        if weights.layout != torch.sparse_coo or tuple(weights.shape) != shape:
            raise ValueError(f"{where}: weights must be a sparse COO tensor of the ids' shape "
                             f"{list(shape)}")
        w_idx, w = sparse_parts(weights)
        if order is not None:
            w_idx, w = w_idx[:, order], w[order]
        if not torch.equal(w_idx, indices):
            raise ValueError(f"{where}: weights must have the same indices as the ids")
    return values, offsets, bag_shape, w, indices[-1]


def _to_sequence(values: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor | None,
                 seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags -> ``seq`` output rows per bag, row p holding the id at position p (if any)."""
    bags = offsets.numel() - 1
    lengths = offsets[1:] - offsets[:-1]  # (bags,)
    bag = torch.repeat_interleave(torch.arange(bags, device=values.device), lengths,
                                  output_size=values.numel())  # (nnz,)
    if positions is None:
        positions = torch.arange(values.numel(), device=values.device) - offsets[bag]  # (nnz,)
    keep = positions < seq
    values, row = values[keep], bag[keep] * seq + positions[keep]  # (kept,)
    counts = torch.bincount(row, minlength=bags * seq)  # (bags * seq,)
    out = torch.zeros(bags * seq + 1, dtype=torch.int64, device=values.device)
    torch.cumsum(counts, 0, out=out[1:])
    return values, out


def _validate(ids: torch.Tensor, weights: torch.Tensor | None, vocab: int, where: str,
              table: str) -> None:
    if ids.numel():
        if native.usable(ids) and ids.is_contiguous():
            lo_v, hi_v = native.minmax(ids)
        else:
            lo_v, hi_v = torch.stack(torch.aminmax(ids)).tolist()  # one host sync
        if lo_v < 0 or hi_v >= vocab:
            bad = lo_v if lo_v < 0 else hi_v
            raise ValueError(f"{where} has id {bad} but table {table!r} has "
                             f"vocabulary_size {vocab}; ids must be in [0, {vocab})")
    if weights is not None and weights.numel() and not bool(torch.isfinite(weights).all()):
        bad = weights[~torch.isfinite(weights)][0].item()
        raise ValueError(f"{where} has a non-finite weight ({bad}); weights must be finite")
