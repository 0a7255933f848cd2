"""Inputs: dense / jagged / sparse COO ids -> one canonical per-feature form, and shape rules.

Every feature, whatever its input kind, becomes a weighted bag lookup (``ops.bags.Bags``): ``R``
output rows, row ``r`` being ``sum_k scales[k] * E[ids[k]]`` over ``k`` in
``[offsets[r], offsets[r+1])``.
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
from typing import Any

import torch

from ..base.compat import jagged_parts, sparse_parts
from ..config.tables import FeatureConfig
from ..ops.backend import Backend
from ..ops.bags import Bags

INT_DTYPES = (torch.int32, torch.int64)


def input_kind(x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> str:
    """'dense', 'jagged' or 'sparse' for a supported input; TypeError otherwise.

    A ``(values, offsets)`` pair of tensors is a jagged batch too (TorchRec's form, and the one
    ``torch.export`` can trace: it cannot take nested tensors as inputs).
    """
    if isinstance(x, tuple) and len(x) == 2 and all(isinstance(t, torch.Tensor) for t in x):
        return "jagged"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or a (values, offsets) pair of tensors, got "
                        f"{type(x).__name__}")
    if x.is_nested:
        return "jagged"
    if x.layout == torch.sparse_coo:
        return "sparse"
    if x.layout == torch.strided:
        return "dense"
    raise TypeError(f"unsupported tensor layout {x.layout}; use dense, torch.nested (jagged) or "
                    f"sparse COO tensors")


def canonicalize(feature: FeatureConfig, name: str, table_name: str, ids: torch.Tensor,
                 weights: torch.Tensor | None, device: torch.device, backend: Backend,
                 checks: BatchChecks | None = None) -> Bags:
    """Turns one feature's ids (and weights) into its canonical form on ``device``, checked
    and combined there by ``backend`` (its kernels: ops/backend.py).

    Args:
        feature: the feature's config (its table's combiner, its sequence length, validation).
        name: the feature's name for error messages.
        table_name: its table's resolved name, for error messages.
        ids: dense (rank >= 1), jagged (``layout=torch.jagged``, rank 2) or sparse COO (rank >= 2)
            tensor of int32 / int64 ids.
        weights: None, or a float tensor of the same kind and layout as ``ids`` (not for dense
            inputs nor sequence features).
        device: where the canonical tensors live (jagged offsets and sparse indices are moved
            there before they are checked).
        backend: ``device``'s backend.
        checks: where the checks that read values back go (jagged offsets, the ids' range;
            weights too where it judges on the device), answered for the whole batch at once
            (``BatchChecks.done``); None: checked here.

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
    seq = feature.sequence_length
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
        try:
            w_kind = input_kind(weights)
        except TypeError as e:
            raise TypeError(f"{where}: weights: {e}") from None
        if w_kind != kind:
            raise ValueError(f"{where}: ids are {kind} but weights are {w_kind}; "
                             f"weights must mirror their ids")
    if kind == "dense" and seq == 0:
        shape = tuple(ids.shape[:-1]) if ids.dim() >= 2 and ids.shape[-1] == 1 else tuple(ids.shape)
        if ids.dtype not in INT_DTYPES:
            raise TypeError(f"{where}: ids must be int32 or int64, got {ids.dtype}")
        flat = (ids if ids.dim() == 1 else ids.reshape(-1)).to(
            device=device, dtype=torch.int64, non_blocking=True).contiguous()  # (nnz,)
        if table.dynamic is None:  # raw ids of a dynamic table may be any int64
            _check_ids(flat, table.vocabulary_size, where, table_name, backend, checks)
        return Bags(flat, None, None, shape)
    bag = None  # (nnz,) each id's bag, where the input gives it
    if kind == "dense":
        values, offsets, bag_shape, positions = _dense(ids, seq, where)
        w = None
    elif kind == "jagged":
        mean = table.combiner == "mean" and weights is None and seq == 0
        values, offsets, bag_shape, w = _jagged(ids, weights, where, device, backend, checks,
                                                mean)
        positions = None
    else:
        values, offsets, bag_shape, w, positions, bag = _sparse(ids, weights, where, device,
                                                                backend)
    if values.dtype not in INT_DTYPES:
        raise TypeError(f"{where}: ids must be int32 or int64, got {values.dtype}")
    # contiguous: the fused kernels read these through raw pointers
    values = values.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    offsets = offsets.to(device=device, dtype=torch.int64, non_blocking=True).contiguous()
    if w is not None:
        if not w.is_floating_point():
            raise TypeError(f"{where}: weights must be floating point, got {w.dtype}")
        w = w.to(device=device, dtype=torch.float32, non_blocking=True).contiguous()
    if table.dynamic is None:  # raw ids of a dynamic table may be any int64
        _check_ids(values, table.vocabulary_size, where, table_name, backend, checks)
    if w is not None and feature.validate_weights_and_indices:
        if checks is not None and checks.verdicts is not None:
            checks.add_weights(w, where)
        else:
            check_weights(w, where)
    if seq > 0:
        if positions is not None:
            positions = positions.to(device=device, non_blocking=True)
        if bag is not None:
            bag = bag.to(device=device, non_blocking=True)
        values, offsets = _to_sequence(values, offsets, positions, seq, backend, bag)
        scales = torch.ones_like(values, dtype=torch.float32)  # (of the values: export-safe)
        return Bags(values, offsets, scales, bag_shape + (seq,))
    if bag is not None:
        bag = bag.to(device=device, non_blocking=True)
    scales = backend.combiner_scales(offsets, w, table.combiner, values.numel(), bag)
    return Bags(values, offsets, scales, bag_shape)


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
                                  name: str, dense: bool | None) -> tuple[int, ...] | None:
    """The leading output shape for ``build(per_replica_input_shapes=...)``: the input's own shape.

    A dense input of shape ``S`` gives ``S`` (a trailing 1 dropped: ids looked up one by one); a
    jagged or sparse input of shape ``S`` gives ``S[:-1]`` (one bag per row of the last dim); a
    sequence feature gives ``S[:-1] + [L]`` whatever the kind. ``dense=None`` (the kind is not
    known until the first batch): the shape when every kind that can have this rank gives the same
    one, else None.
    """
    shape = tuple(int(s) for s in input_shape)
    if not shape:
        raise ValueError(f"feature {name!r}: per_replica_input_shapes must have rank >= 1, got []")
    if feature.sequence_length > 0:
        if len(shape) < 2:
            raise ValueError(f"feature {name!r}: a sequence feature's input shape must have rank "
                             f">= 2 ([batch, ids]), got {list(shape)}")
        return shape[:-1] + (feature.sequence_length,)
    bags = shape[:-1] if len(shape) >= 2 else None  # jagged / sparse (rank >= 2)
    ids = shape[:-1] if shape[-1] == 1 and len(shape) >= 2 else shape  # dense
    if dense is None:
        return ids if bags is None or ids == bags else None
    if not dense and bags is None:
        raise ValueError(f"feature {name!r}: a jagged or sparse input has rank >= 2, but "
                         f"build() declared its shape as {list(shape)}")
    return ids if dense else bags


def _dense(ids: torch.Tensor, seq: int, where: str):
    """A dense input of a sequence feature: rows of the last dim are sequences."""
    flat = ids.reshape(-1)  # (nnz,)
    bag_shape = tuple(ids.shape[:-1]) if ids.dim() >= 2 else tuple(ids.shape)
    length = ids.shape[-1] if ids.dim() >= 2 else 1
    bags = math.prod(bag_shape)
    offsets = torch.arange(bags + 1, dtype=torch.int64) * length  # (bags + 1,)
    return flat, offsets, bag_shape, None


def _parts(x: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, offsets, lengths) of a jagged nested tensor or a ``(values, offsets)`` pair."""
    return (x[0], x[1], None) if isinstance(x, tuple) else jagged_parts(x)


def _jagged(ids: Any, weights: Any, where: str, device: torch.device, backend: Backend,
            checks: BatchChecks | None, mean: bool = False):
    if not isinstance(ids, tuple):
        # (torch's jagged class is always of the jagged layout: its ``layout`` is a dispatched
        # call, an op a feature on a device step, asked only of other nested tensors)
        if type(ids).__name__ != "NestedTensor" and ids.layout != torch.jagged:
            raise TypeError(f"{where}: nested tensors must use layout=torch.jagged, got "
                            f"{ids.layout}")
        if ids.dim() != 2:  # (a rank-2 jagged tensor is always ragged in dim 1)
            raise ValueError(f"{where}: jagged ids must have shape [B, None] (rank 2), got rank "
                             f"{ids.dim()}")
    values, given, lengths = _parts(ids)
    if lengths is not None:
        raise ValueError(f"{where}: jagged tensors with holes (lengths) are not supported; "
                         f"build them with torch.nested.nested_tensor_from_jagged(values, offsets)")
    if values.dim() != 1:  # (rank 2 means 1-D values; kept as a guard for the raw reads)
        raise ValueError(f"{where}: jagged ids must hold 1-D values, got shape "
                         f"{list(values.shape)}")
    offsets = check_offsets(given.to(device, non_blocking=True), values.numel(), where,
                            backend, checks, mean)  # (B + 1,) int64, contiguous, on the device
    w = None
    if weights is not None:
        same = f"{where}: weights must be a jagged tensor with the same offsets as the ids"
        if input_kind(weights) != "jagged" or (
                not isinstance(weights, tuple) and weights.dim() != 2):
            raise ValueError(same)
        w, w_offsets, w_lengths = _parts(weights)
        if w_lengths is not None:
            raise ValueError(same)
        if w_offsets is not given:
            if w_offsets.dtype not in INT_DTYPES:
                raise TypeError(f"{where}: weights' jagged offsets must be int32 or int64, got "
                                f"{w_offsets.dtype}; {same}")
            if tuple(w_offsets.shape) != tuple(offsets.shape):
                raise ValueError(same)
            if not tracing():
                mine = w_offsets.to(device=offsets.device, dtype=torch.int64)
                theirs = given.to(device=offsets.device, dtype=torch.int64)  # (as given)
                if checks is not None and checks.verdicts is not None:
                    checks.add_same(mine, theirs, where)
                elif not torch.equal(mine, theirs):
                    raise ValueError(same)
        if w.dim() != 1 or w.shape[0] != values.numel():
            raise ValueError(f"{where}: weights hold {w.numel()} values of shape "
                             f"{list(w.shape)} but the ids hold {values.numel()}; {same} and "
                             f"one weight per id")
    return values, offsets, (offsets.numel() - 1,), w


def _sparse(ids: torch.Tensor, weights: torch.Tensor | None, where: str, device: torch.device,
            backend: Backend):
    if ids.dim() < 2:
        raise ValueError(f"{where}: sparse ids must have rank >= 2, got rank {ids.dim()}")
    if ids.dense_dim() != 0:
        raise ValueError(f"{where}: sparse ids must be hybrid-free (dense_dim 0)")
    shape = tuple(ids.shape)
    ids = ids.to(device, non_blocking=True)  # (checked and ordered on the device)
    # (k, nnz), (nnz,) in stored order, their range checked before anything indexes with them
    indices, values = sparse_parts(
        ids, lambda i, v: check_sparse_indices(i, v, shape, where, backend))
    indices = indices.to(torch.int64).contiguous()  # (as checked: no copy)
    # Order by (bag, position); stable so an uncoalesced input keeps its order of equal keys.
    # A tensor marked coalesced whose indices do not strictly increase is sorted the same way.
    order = None
    # (traced: always sorted, as the program cannot branch on the entries)
    if tracing() or not (ids.is_coalesced() and strictly_increasing(indices, shape, backend)):
        strides = torch.tensor([math.prod(shape[i + 1:]) for i in range(len(shape))],
                               dtype=torch.int64, device=indices.device)
        order = torch.argsort((indices * strides[:, None]).sum(0), stable=True)
        indices, values = indices[:, order], values[order]
    bag_shape = shape[:-1]
    bag_strides = torch.tensor([math.prod(bag_shape[i + 1:]) for i in range(len(bag_shape))],
                               dtype=torch.int64, device=indices.device)
    bag = (indices[:-1] * bag_strides[:, None]).sum(0)  # (nnz,)
    bags = math.prod(bag_shape)
    counts = torch.zeros(bags, dtype=torch.int64, device=indices.device)  # (bags,)
    counts.index_add_(0, bag, torch.ones_like(bag))  # (a fixed size, which export can trace)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # (bags + 1,)
    w = None
    if weights is not None:
        if (weights.layout != torch.sparse_coo or tuple(weights.shape) != shape
                or weights.dense_dim() != 0):
            raise ValueError(f"{where}: weights must be a sparse COO tensor of the ids' shape "
                             f"{list(shape)}")
        w_idx, w = sparse_parts(weights.to(device, non_blocking=True), lambda i, v: (
            check_sparse_indices(i, v, shape, f"{where} (weights)", backend)))
        if tuple(w_idx.shape) != tuple(indices.shape) or tuple(w.shape) != tuple(values.shape):
            raise ValueError(f"{where}: weights hold {w.numel()} entries but the ids hold "
                             f"{values.numel()}; weights must have the same indices as the ids")
        if order is not None:
            w_idx, w = w_idx[:, order], w[order]
        if not tracing() and not torch.equal(w_idx, indices):
            raise ValueError(f"{where}: weights must have the same indices as the ids")
    return values, offsets, bag_shape, w, indices[-1], bag


def _to_sequence(values: torch.Tensor, offsets: torch.Tensor, positions: torch.Tensor | None,
                 seq: int, backend: Backend, bag: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bags -> ``seq`` output rows per bag, row p holding the id at position p (if any);
    ``bag``: each id's bag, when the input gives it."""
    bags = offsets.numel() - 1
    if bag is None:
        bag = backend.bag_index(offsets, values.numel())  # (nnz,)
    if positions is None:
        positions = torch.arange(values.numel(), device=values.device) - offsets[bag]  # (nnz,)
    keep = positions < seq
    values, row = values[keep], bag[keep] * seq + positions[keep]  # (kept,)
    counts = torch.zeros(bags * seq, dtype=torch.int64, device=values.device)  # (bags * seq,)
    counts.index_add_(0, row, torch.ones_like(row))  # (a fixed size, which export can trace)
    return values, torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # (bags * seq + 1,)


_JAGGED_FIX = ("build jagged ids with torch.nested.nested_tensor_from_jagged(values, offsets), "
               "offsets = [0, cumsum of the bag lengths] (B + 1 entries, the last = len(values))")


def tracing() -> bool:
    """Whether torch.export / torch.compile is tracing: the data-dependent checks below (host
    syncs on values) are skipped then, as the traced program cannot branch on data."""
    return torch.compiler.is_compiling()


def check_offsets(offsets: torch.Tensor, nnz: int, where: str, backend: Backend,
                  checks: BatchChecks | None = None, mean: bool = False) -> torch.Tensor:
    """Jagged offsets as (B + 1,) contiguous int64, after one pass checking that they start at 0,
    never decrease and end at ``nnz`` (so every bag lies inside the values). With ``checks``,
    a backend that would wait for the answer returns the offsets made safe and leaves the
    verdict to ``checks.done()``. ``mean``: the mean combiner's scales of these bags, unweighted,
    will be asked for (``Backend.offsets_verdict``).

    Raises:
        TypeError: offsets that are not int32 / int64.
        ValueError: any other inconsistency, naming the first bad entry.
    """
    if offsets.dtype not in INT_DTYPES:
        raise TypeError(f"{where}: jagged offsets must be int32 or int64, got {offsets.dtype}; "
                        f"{_JAGGED_FIX}")
    if offsets.dim() != 1 or offsets.numel() == 0:
        raise ValueError(f"{where}: jagged offsets must be 1-D with B + 1 >= 1 entries, got shape "
                         f"{list(offsets.shape)}; {_JAGGED_FIX}")
    offsets = offsets.to(torch.int64).contiguous()
    if tracing():
        return offsets
    if checks is None or offsets.numel() == 1:  # (no bag: nothing to make safe, answer now)
        bad = backend.offsets_error(offsets, nnz)
    else:
        safe, verdict = backend.offsets_verdict(offsets, nnz, mean)
        if not isinstance(verdict, int):  # read with the batch's other checks
            checks.add_offsets(verdict, offsets, nnz, where)
            return safe
        bad = verdict
    if bad < 0:
        return offsets
    _refuse_offsets(offsets, nnz, where, bad)
    return offsets  # (not reached)


def _refuse_offsets(offsets: torch.Tensor, nnz: int, where: str, bad: int) -> None:
    """The ``ValueError`` of malformed jagged ``offsets`` whose first bad entry is ``bad``
    (``Backend.offsets_error``; -1: none)."""
    if bad < 0:
        return
    n = offsets.numel()
    if bad == 0 and int(offsets[0]) != 0:
        what = f"must start at 0, got offsets[0] = {int(offsets[0])}"
    elif bad > 0 and int(offsets[bad]) < int(offsets[bad - 1]):
        what = (f"must never decrease, got offsets[{bad}] = {int(offsets[bad])} < "
                f"offsets[{bad - 1}] = {int(offsets[bad - 1])}")
    else:
        what = (f"must end at the number of values ({nnz}), got offsets[{n - 1}] = "
                f"{int(offsets[-1])}")
    raise ValueError(f"{where}: jagged offsets {what}; {_JAGGED_FIX}")


def check_sparse_indices(indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...],
                         where: str, backend: Backend) -> torch.Tensor:
    """A COO tensor's (k, nnz) indices as contiguous int64, after one min / max pass per dim
    checking ``0 <= indices[d] < shape[d]`` (and that indices and values agree in size).

    Raises:
        TypeError: indices that are not int32 / int64.
        ValueError: an index outside the shape, naming it and its dim.
    """
    if indices.dtype not in INT_DTYPES:
        raise TypeError(f"{where}: sparse indices must be int64 (or int32), got {indices.dtype}")
    k = len(shape)
    if (indices.dim() != 2 or indices.shape[0] != k or values.dim() != 1
            or values.shape[0] != indices.shape[1]):
        raise ValueError(f"{where}: a sparse COO tensor of shape {list(shape)} must hold "
                         f"({k}, nnz) indices and (nnz,) values, got {list(indices.shape)} and "
                         f"{list(values.shape)}")
    indices = indices.to(torch.int64).contiguous()
    if indices.shape[1] == 0 or tracing():
        return indices
    bounds = [backend.minmax(indices[d]) for d in range(k)]  # (one pass, or sync, per dim)
    for d, (lo_v, hi_v) in enumerate(bounds):
        if lo_v < 0 or hi_v >= shape[d]:
            raise ValueError(f"{where}: sparse index {lo_v if lo_v < 0 else hi_v} in dim {d} is "
                             f"outside the tensor's shape {list(shape)}; indices in dim {d} must "
                             f"be in [0, {shape[d]}) (build sparse ids with "
                             f"torch.sparse_coo_tensor(indices, values, size, "
                             f"check_invariants=True) to catch this where they are made)")
    return indices


def strictly_increasing(indices: torch.Tensor, shape: tuple[int, ...], backend: Backend) -> bool:
    """Whether the columns of (k, nnz) contiguous int64 indices, in range of ``shape``, strictly
    increase (a really coalesced tensor: sorted, no duplicates); one pass."""
    nnz = indices.shape[1]
    if nnz < 2:
        return True
    if tracing():
        return False  # (sorting costs the traced program nothing it cannot branch on)
    return backend.strictly_increasing(indices, shape)


def check_ids(ids: torch.Tensor, vocab: int, where: str, table: str, backend: Backend) -> None:
    """Ids in ``[0, vocab)``: one min / max pass, done whatever ``validate_weights_and_indices``
    says, since the lookups and updates read and write ``table + id * D`` unchecked. (Not while
    tracing for export: the exported program's own gathers check their indices.)"""
    if ids.numel() and not tracing():
        _refuse_ids(*backend.minmax(ids), vocab, where, table)


def _check_ids(ids: torch.Tensor, vocab: int, where: str, table: str, backend: Backend,
               checks: BatchChecks | None) -> None:
    """Always (memory safety): now, or in ``checks``."""
    if checks is None:
        check_ids(ids, vocab, where, table, backend)
    else:
        checks.add(ids, vocab, where, table)


def _refuse_ids(lo_v: int, hi_v: int, vocab: int, where: str, table: str) -> None:
    if lo_v < 0 or hi_v >= vocab:
        bad = lo_v if lo_v < 0 else hi_v
        raw = (f" ({bad} looks like a raw id, a hash or 64-bit key: declare table {table!r} "
               f"with dynamic=ec.DynamicVocabulary() to map raw ids to rows, "
               f"docs/semantics.md section 9)" if not -2**31 <= bad < 2**31 else "")
        raise ValueError(f"{where} has id {bad} but table {table!r} has "
                         f"vocabulary_size {vocab}; ids must be in [0, {vocab}){raw}")


class BatchChecks:
    """The checks of one batch that read values back (each feature's jagged offsets, its ids'
    range), answered once for the whole batch by ``done``: on a device one synchronisation a
    batch instead of two a feature. Meanwhile the batch is made with offsets made safe to index
    with (``Backend.offsets_verdict``) and nothing reads or writes a row with the ids (the
    lookups come after the batch is made), so a bad batch still changes nothing. ``done``
    raises the first malformed offsets' error, then the first bad id's, in the batch's order
    (docs/semantics.md section 2). The fused CPU kernels answer at once (nothing is left to
    ``done`` but the ids).

    With ``verdicts`` (a training batch on the Triton backend) nothing is read back: ``done``
    reduces the checks, finite weights included, to a report on the device and returns the
    batch's verdict there (``Verdicts.judge``), which its kernels read (``Bags.verdict``)."""

    def __init__(self, backend: Backend, verdicts: Verdicts | None = None) -> None:
        self.backend = backend
        self.verdicts = verdicts
        self._ids: list[tuple[torch.Tensor, int, str, str]] = []
        self._pairs: list[tuple[torch.Tensor, int, str, str]] = []  # (ids judged on the device)
        self._jagged: list[tuple[torch.Tensor, torch.Tensor, int, str]] = []
        self._weights: list[tuple[torch.Tensor, str]] = []
        self._same: list[tuple[torch.Tensor, torch.Tensor, str]] = []

    def add(self, ids: torch.Tensor, vocab: int, where: str, table: str) -> None:
        """``check_ids(ids, ...)``, answered by ``done``."""
        if ids.numel() and not tracing():
            if self.verdicts is None:
                self._ids.append((self.backend.bounds(ids), vocab, where, table))  # (2,)
            else:  # (their min and max: ``Backend.id_bounds``, the batch's at once)
                self._pairs.append((ids, vocab, where, table))

    def add_offsets(self, verdict: torch.Tensor, offsets: torch.Tensor, nnz: int,
                    where: str) -> None:
        """Offsets whose ``verdict`` (0-d, nonzero: malformed) ``done`` reads."""
        self._jagged.append((verdict, offsets, nnz, where))

    def add_weights(self, weights: torch.Tensor, where: str) -> None:
        """``check_weights(weights, where)``, judged on the device (with ``verdicts`` only)."""
        if weights.numel() and not tracing():
            self._weights.append((weights, where))

    def add_same(self, offsets: torch.Tensor, given: torch.Tensor, where: str) -> None:
        """The weights' jagged ``offsets`` equal to the ids' (``given``), judged on the device
        (with ``verdicts`` only)."""
        self._same.append((offsets, given, where))

    def done(self) -> torch.Tensor | None:
        """Raises the first malformed offsets' ``ValueError``, else the first bad id's; with
        ``verdicts``, returns the batch's verdict on the device instead (None: nothing to
        judge)."""
        if self.verdicts is not None:
            return self._judged(self.verdicts)
        if not self._ids and not self._jagged:
            return None
        ids, self._ids = self._ids, []
        jagged, self._jagged = self._jagged, []
        got = torch.cat([*(v.reshape(1).to(torch.int64) for v, _, _, _ in jagged),
                         *(b for b, _, _, _ in ids)]).tolist()  # one read back
        for flag, (_, given, nnz, where) in zip(got, jagged):
            if flag:
                _refuse_offsets(given, nnz, where, self.backend.offsets_error(given, nnz))
        at = len(jagged)
        for k, (_, vocab, where, table) in enumerate(ids):
            _refuse_ids(got[at + 2 * k], got[at + 2 * k + 1], vocab, where, table)
        return None

    def _judged(self, verdicts: Verdicts) -> torch.Tensor | None:
        # the offsets' and the weights' offsets' values are flags, 0 good; a weights' is 1 good
        flags = not self._weights
        values: list[torch.Tensor] = [v for v, _, _, _ in self._jagged]
        layout: list[Entry] = [("offsets", where, 0, "") for _, _, _, where in self._jagged]
        for mine, theirs, where in self._same:
            values.append((mine != theirs).any())
            layout.append(("same", where, 0, ""))
        for w, where in self._weights:
            values.append(torch.isfinite(w).all())
            layout.append(("weights", where, 0, ""))
        for _, vocab, where, table in self._pairs:
            layout.append(("ids", where, vocab, table))
        pairs = self._pairs
        self._pairs, self._jagged, self._weights, self._same = [], [], [], []
        if not layout:
            return None
        # (L,) int64: the values that judge the batch, the ids' min and max last; flags go with
        # the ids' bounds, judged in the same launch where the backend can
        if pairs:
            report, verdict = self.backend.id_bounds(
                [t for t, _, _, _ in pairs], [v for _, v, _, _ in pairs],
                values if flags else ())
            if verdict is not None and flags:  # (judged in the same launch)
                return verdicts.keep(tuple(layout), report, verdict)
            if not flags:
                report = torch.cat([torch.stack(values), report]) if values else report
        else:
            report = torch.stack(values)
        return verdicts.judge(tuple(layout), report)


# One check of a batch's report: (kind, where, vocabulary size, table): "offsets" (a 0 / 1
# value: 1 malformed), "same" (1: the weights' jagged offsets differ from the ids'),
# "weights" (1: every weight finite) or "ids" (two values: min, max).
Entry = tuple[str, str, int, str]
Layout = tuple[Entry, ...]


class Verdicts:
    """The verdicts of an engine's training batches checked on the device (the Triton backend),
    read at one point: ``check`` (``Embedding.check``; docs/semantics.md section 2).

    ``judge`` gives a batch its verdict without reading a value: () int64, nonzero when an id
    is out of range, its jagged offsets are malformed or a weight is not finite. The batch's
    kernels read it and then change nothing: its activations are zeros and its update leaves
    every row and slot as they were (``Bags.verdict``, kernels/gpu/rows.py). The reports are
    kept until ``check``; every ``FOLD`` batches they are folded on the device into the first
    bad one's and a count (a few ops, no value read), so that they take bounded memory.
    ``check`` reads what is kept once and raises the error the host's checks would have
    raised for the first bad batch, with how many were dropped.
    """

    FOLD = 64

    def __init__(self) -> None:
        self._reports: list[tuple[Layout, torch.Tensor]] = []  # since the last fold
        self._kept: dict[Layout, torch.Tensor] = {}  # (1 + L,): bad batches, first's report
        self._limits: dict[Layout, tuple[torch.Tensor, torch.Tensor]] = {}

    def _bounds(self, layout: Layout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(L,) int64 lowest and highest value of a good batch's report, per entry."""
        got = self._limits.get(layout)
        if got is None or got[0].device != device:
            lo: list[int] = []
            hi: list[int] = []
            for kind, _, vocab, _ in layout:
                if kind == "ids":
                    lo += [0, 0]
                    hi += [vocab - 1, vocab - 1]
                else:
                    good = int(kind == "weights")
                    lo.append(good)
                    hi.append(good)
            got = self._limits[layout] = (torch.tensor(lo, device=device),
                                          torch.tensor(hi, device=device))
        return got

    def judge(self, layout: Layout, report: torch.Tensor) -> torch.Tensor:
        """The verdict of a batch whose checks gave ``report`` ((L,) int64, as ``layout``
        says), kept for ``check``: () int64 on the device, nonzero when the batch is bad."""
        lo, hi = self._bounds(layout, report.device)
        self._reports.append((layout, report))
        if len(self._reports) >= self.FOLD:
            self._fold()
        return (report.clamp(lo, hi) != report).sum()

    def keep(self, layout: Layout, report: torch.Tensor, verdict: torch.Tensor) -> torch.Tensor:
        """``judge``'s, for a ``report`` whose ``verdict`` was computed with it (nonzero exactly
        where ``judge``'s would be: ``Backend.id_bounds``): kept for ``check``, returned."""
        self._reports.append((layout, report))
        if len(self._reports) >= self.FOLD:
            self._fold()
        return verdict

    def _fold(self) -> None:
        """The reports since the last fold, merged on the device into ``_kept``."""
        reports, self._reports = self._reports, []
        by: dict[Layout, list[torch.Tensor]] = {}
        for layout, r in reports:
            by.setdefault(layout, []).append(r)
        for layout, rs in by.items():
            lo, hi = self._bounds(layout, rs[0].device)
            stacked = torch.stack(rs)  # (n, L)
            bad = (stacked.clamp(lo, hi) != stacked).any(1)  # (n,)
            new = torch.cat([bad.sum().reshape(1),
                             stacked[bad.to(torch.int64).argmax()]])  # (1 + L,)
            old = self._kept.get(layout)
            if old is not None:  # the earlier first bad batch stays the first
                count = old[:1] + new[:1]
                new = torch.cat([count, torch.where(old[0] != 0, old[1:], new[1:])])
            self._kept[layout] = new

    def check(self) -> None:
        """Raises the ``ValueError`` of the first batch judged bad since the last check (one
        read back, none when no batch was judged); forgets them either way."""
        self._fold()
        kept, self._kept = self._kept, {}
        if not kept:
            return
        got = torch.cat(list(kept.values())).tolist()  # one read back
        at = 0
        for layout in kept:
            count, values = got[at], got[at + 1:at + 1 + _width(layout)]
            at += 1 + _width(layout)
            if count:
                _refuse_report(layout, values, count)


def _width(layout: Layout) -> int:
    return sum(2 if kind == "ids" else 1 for kind, _, _, _ in layout)


def _refuse_report(layout: Layout, values: list[int], count: int) -> None:
    """The ``ValueError`` of a batch judged bad on the device from its report ``values``."""
    dropped = (f"{count} training batch{'es' if count > 1 else ''} since the last check "
               f"failed the input checks on the device and changed nothing (masked); the "
               f"first: ")
    at = 0
    errors: list[str] = []
    for kind, where, vocab, table in layout:
        if kind == "offsets" and values[at]:
            errors.append(f"{where}: jagged offsets must start at 0, never decrease and end "
                          f"at the number of values; {_JAGGED_FIX}")
        elif kind == "same" and values[at]:
            errors.append(f"{where}: weights must be a jagged tensor with the same offsets as "
                          f"the ids")
        elif kind == "weights" and not values[at]:
            errors.append(f"{where} has a non-finite weight; weights must be finite")
        elif kind == "ids":
            try:
                _refuse_ids(values[at], values[at + 1], vocab, where, table)
            except ValueError as e:
                errors.append(str(e))
        at += 2 if kind == "ids" else 1
    raise ValueError(dropped + (errors[0] if errors else "a check failed"))


def check_weights(weights: torch.Tensor, where: str) -> None:
    """Finite weights (the optional check of ``validate_weights_and_indices``)."""
    if weights.numel() and not tracing() and not bool(torch.isfinite(weights).all()):
        bad = weights[~torch.isfinite(weights)][0].item()
        raise ValueError(f"{where} has a non-finite weight ({bad}); weights must be finite")
