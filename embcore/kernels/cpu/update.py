"""The update's kernels: the fused sparse update (``sparse_update``, or ``SparseUpdate`` bound to
one table) and the rounding of 16-bit rows (``round16``) (csrc/update.h, half.h).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from ...config.dtypes import SCALED
from ...numerics import rounding
from ...numerics.rounding import ROW_TYPES
from ..rules import NATIVE, Rule
from .args import (
    F32,
    HYPER,
    I16,
    I32,
    I64,
    INT,
    INT64,
    ROWS,
    U8,
    UPDATE_ROW_TYPES,
    Hyper,
    Kernel,
    array,
    check_row_scales,
    ctypes_array,
    read,
    read_rows,
    written,
)
from .library import threads

# Optimizer rules of ec_sparse_update (the enum in csrc/update.h).
SGD, ADAGRAD, ROWWISE_ADAGRAD = Rule.SGD, Rule.ADAGRAD, Rule.ROWWISE_ADAGRAD

_GRADIENT_ROWS = read_rows(F32)  # a part of the output gradient (occurrences)
_SUMMED_GRADIENT = read(F32, dim=2)  # the (U, D) summed gradient (direct)

_SPARSE_UPDATE = Kernel("ec_sparse_update", INT64, [
    ("rule", INT),                            # SGD, ADAGRAD or ROWWISE_ADAGRAD
    ("type", INT),                            # UPDATE_ROW_TYPES[w.dtype]
    ("w", written(ROWS + SCALED, dim=2)),     # (N, d) float32, 16-bit or 8-bit
    ("acc", written(F32, optional=True)),     # (N, d) or (N, 1); None for SGD
    ("row_scales", written(F32, optional=True)),  # (N,) 8-bit rows' scales; else None
    ("d", INT64),
    ("rows", read(I64)),                      # (U,) distinct
    ("u_rows", INT64),
    ("uoff", read(I64, optional=True)),       # (U + 1,); None: direct
    ("order", read(I64, optional=True)),      # (nnz,)
    ("bags", read(I64, optional=True)),       # (nnz,); None: occurrence k is row k
    ("scales", read(F32, optional=True)),     # (nnz,); None: all 1
    ("slices", array(ctypes.c_void_p)),       # (nslices,) gradient parts (_GRADIENT_ROWS)
    ("starts", array(ctypes.c_int64)),        # (nslices + 1,) their first output rows
    ("strides", array(ctypes.c_int64)),       # (nslices,) their row strides
    ("nslices", INT64),
    ("hyper", HYPER),
    ("stochastic", INT),                      # 16-bit rows: 1 stochastic rounding, 0 nearest
    ("key_rows", read(I64, optional=True)),   # (n_keys,) per table row, its identity's row
    ("n_keys", INT64),                        # rows from n_keys on are their own
    ("seg_starts", read(I64)),                # (nseg + 1,)
    ("seg_bases", read(I64)),                 # (nseg,)
    ("seg_muls", read(I64)),                  # (nseg,)
    ("nseg", INT64),
    ("col0", INT64),
    ("step_key", INT64),
    ("overflow", written(U8, optional=True)),  # (U,) 16-bit rows: flags of rows left alone
    ("nt", INT),
], packed=True)


_RULES = {int(r): r.name for r in sorted(NATIVE)}  # the kernel's rules by id
_NEAREST = rounding.nearest()


def sparse_update(rule: int, table: torch.Tensor, acc: torch.Tensor | None, rows: torch.Tensor,
                  hyper: Hyper, grads: Sequence[torch.Tensor],
                  starts: Sequence[int] | None = None, unique_offsets: torch.Tensor | None = None,
                  order: torch.Tensor | None = None, bags: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None,
                  round_to: rounding.Rounding | None = None,
                  overflow: torch.Tensor | None = None,
                  row_scales: torch.Tensor | None = None) -> int:
    """Updates ``table[rows]`` (and ``acc[rows]``) in place, each row once; returns how many
    rows ``overflow`` flagged.

    Args:
        rule: ``SGD``, ``ADAGRAD`` or ``ROWWISE_ADAGRAD``.
        table: (N, D) contiguous float32, float16, bfloat16, float8_e4m3fn or float8_e5m2
            parameters (16-bit rows are widened, updated in float32 and rounded back by
            ``round_to``: numerics/rounding.py; 8-bit ones widened with ``row_scales`` and
            quantized back, a new scale per row: ``rounding.quantize``).
        acc: (N, D) or (N, 1) contiguous float32 accumulators; None for SGD.
        rows: (U,) distinct int64 rows.
        hyper: the optimizer's hyper-parameters by name (``Hyper``; infinities for no bound).
        grads: the gradient source: with ``unique_offsets``, the output gradient rows split in
            consecutive (R_i, D) float32 parts (rows ``starts[i]:starts[i+1]``), each with unit
            column stride and any row stride (e.g. column slices of a wider gradient: no copy);
            without, one contiguous (U, D) tensor, row u the summed gradient of ``rows[u]``.
        starts: (len(grads) + 1) first output row of each part (needed with several parts).
        unique_offsets, order: as returned by ``dedup`` (occurrences of each row, sorted).
        bags: (nnz,) the output row of each occurrence; None when occurrence k is row k.
        scales: (nnz,) float32 scale of each occurrence; None for 1.
        round_to: how a 16-bit table's rows are rounded (None: to nearest; numerics/rounding.py).
        overflow: (U,) uint8 or bool flags (16-bit tables; None: no guard): a row whose rounded
            result holds an infinity or NaN where its float32 result is finite (the rounding
            overflowed the 16-bit type) is left as it was, its accumulators too, and its flag
            set (the others' set to 0). Unused for a float32 or 8-bit table.
        row_scales: (N, 1) contiguous float32 scales of an 8-bit table's rows (its "scales"
            slot; updated in place); None for other tables.

    Raises:
        TypeError, ValueError: an argument the kernel cannot take (named).
    """
    _check_rule(rule, acc)
    _check_sources(unique_offsets, order)
    check_row_scales(_SPARSE_UPDATE.name, table, row_scales)
    n_rows, d, u = table.shape[0], table.shape[-1], rows.numel()
    nnz = order.numel() if order is not None else None
    return _SPARSE_UPDATE.call(
        rule, UPDATE_ROW_TYPES.get(table.dtype, 0), (table, None),
        (acc, n_rows * (1 if rule == ROWWISE_ADAGRAD else d)), (row_scales, n_rows), d,
        (rows, None), u, (unique_offsets, u + 1), (order, None), (bags, nnz), (scales, nnz),
        *_gradient_args(table, d, u, grads, starts, unique_offsets), hyper,
        *_rounding_args(_NEAREST if round_to is None else round_to), (overflow, u), threads())


def _check_rule(rule: int, acc: torch.Tensor | None) -> None:
    name = _SPARSE_UPDATE.name
    if rule not in _RULES:
        raise ValueError(f"{name}: rule {rule!r} is none of {', '.join(_RULES.values())} "
                         f"({tuple(_RULES)})")
    if acc is None and rule != SGD:
        raise ValueError(f"{name}: rule {rule} ({_RULES[rule]}) needs the accumulators 'acc', "
                         f"got None")


def _check_sources(unique_offsets: torch.Tensor | None, order: torch.Tensor | None) -> None:
    if (unique_offsets is None) != (order is None):
        raise ValueError(f"{_SPARSE_UPDATE.name}: give both unique_offsets and order "
                         f"(occurrences) or neither (a summed gradient)")


# The kernel's arguments of a rounding, in order (``_rounding_args``).
_ROUNDING = ("stochastic", "key_rows", "n_keys", "seg_starts", "seg_bases", "seg_muls", "nseg",
             "col0", "step_key")


def _rounding_args(r: rounding.Rounding) -> tuple[Any, ...]:
    """The kernel's arguments ``_ROUNDING`` of rounding ``r``."""
    seg = r.segments
    nseg = seg.bases.numel()
    return (int(r.stochastic), (r.key_rows, None),
            0 if r.key_rows is None else r.key_rows.numel(), (seg.starts, nseg + 1),
            (seg.bases, nseg), (seg.muls, nseg), nseg, r.col0, r.key_of_step)


class _Arrays:
    """The ctypes arrays of a gradient source, kept across calls (``SparseUpdate``'s: a batch
    layout has the same number of parts and the same ``starts`` every step)."""

    def __init__(self) -> None:
        self.n = -1
        self.slices: Any = None
        self.strides: Any = None
        self.starts: Any = None
        self.starts_of: Sequence[int] | None = None


def _gradient_args(table: torch.Tensor, d: int, u: int, grads: Sequence[torch.Tensor],
                   starts: Sequence[int] | None, unique_offsets: torch.Tensor | None,
                   keep: _Arrays | None = None) -> tuple[Any, Any, Any, int]:
    """``sparse_update``'s gradient source checked, as the kernel's ``slices``, ``starts``,
    ``strides`` and ``nslices`` (in ``keep``'s arrays when given, else new ones)."""
    name = _SPARSE_UPDATE.name
    n = len(grads)
    if keep is not None and keep.n == n:
        slices, strides = keep.slices, keep.strides
    else:
        slices = ctypes_array(ctypes.c_void_p, n)()
        strides = ctypes_array(ctypes.c_int64, n)()
        if keep is not None:
            keep.n, keep.slices, keep.strides, keep.starts_of = n, slices, strides, None
    if unique_offsets is None:  # one (U, D) summed gradient
        if n != 1:
            raise ValueError(f"{name}: a summed gradient is one (U, D) tensor, got {n}")
        slices[0] = _SUMMED_GRADIENT.address(name, "slices[0]", (grads[0], u * d))
        strides[0] = d
    else:  # the output gradient's parts
        given = starts is not None  # (each part's rows checked against the starts given)
        if starts is None:
            if n > 1:
                raise ValueError(f"{name}: {n} gradient parts need their 'starts'")
            starts = [0] * (n + 1)
        elif len(starts) != n + 1:
            raise ValueError(f"{name}: 'starts' must have {n + 1} entries (one more than the "
                             f"gradient parts), got {len(starts)}")
        like = table if table.dtype is torch.float32 else None
        for i, g in enumerate(grads):  # (one pass: this runs once per table and step)
            try:  # (_GRADIENT_ROWS's check written out for the usual part: it runs every step)
                ok = (g.dtype is torch.float32 and g.layout is torch.strided and g.is_cpu
                      and g.dim() == 2 and g.stride(1) == 1)
            except AttributeError:
                ok = False
            slices[i] = (g.data_ptr() if ok and (like is None or g.shape[1] == like.shape[1])
                         else _GRADIENT_ROWS.address(name, "slices", (g, like), i))
            shape = g.shape
            if shape[1] != d and g.numel():
                raise ValueError(f"{name}: gradient part {i} must have {d} columns (as the "
                                 f"table), got {shape[1]}")
            if given and shape[0] != starts[i + 1] - starts[i]:
                raise ValueError(f"{name}: gradient part {i} must have starts[{i + 1}] - "
                                 f"starts[{i}] = {starts[i + 1] - starts[i]} rows, got "
                                 f"{shape[0]}")
            strides[i] = g.stride(0) if shape[0] > 1 else shape[1]
    if starts is None:
        return slices, None, strides, n
    if keep is None or keep.starts_of != starts:
        array = ctypes_array(ctypes.c_int64, n + 1)(*starts)
        if keep is None:
            return slices, array, strides, n
        keep.starts, keep.starts_of = array, list(starts)
    return slices, keep.starts, strides, n


class SparseUpdate:
    """``sparse_update`` of one table (and its accumulators) under one rule: the table's
    arguments checked once, here, and bound (``Kernel.partial``); each call checks the rest,
    as ``sparse_update`` does, and that the table and accumulators still have the storage they
    were bound with (else binds them again: a storage replaced, e.g. by a ``resize_`` that
    grows it; one that shrinks keeps its memory, so no write leaves it). The rounding to
    nearest's arguments (``round_to`` None) are bound too. For the rows objects, which update
    the same table every step; not for concurrent calls (its gradient arrays are reused).

    Args:
        rule, table, acc: as ``sparse_update``'s (kept referenced: the kernel writes them).
        row_scales: an 8-bit table's scales (as ``sparse_update``'s; kept referenced too).

    Raises:
        TypeError, ValueError: an argument the kernel cannot take (named), here or at a call.
    """

    def __init__(self, rule: int, table: torch.Tensor, acc: torch.Tensor | None,
                 row_scales: torch.Tensor | None = None) -> None:
        _check_rule(rule, acc)
        check_row_scales(_SPARSE_UPDATE.name, table, row_scales)
        self.rule, self.table, self.acc, self.row_scales = rule, table, acc, row_scales
        self._arrays = _Arrays()
        self._bind()

    def _bind(self) -> None:
        rule, table, acc, sc = self.rule, self.table, self.acc, self.row_scales
        n_rows, self.d = table.shape[0], table.shape[-1]
        self._at = (table.data_ptr(), None if acc is None else acc.data_ptr(),
                    None if sc is None else sc.data_ptr())
        fixed = {"rule": rule, "type": UPDATE_ROW_TYPES.get(table.dtype, 0), "w": (table, None),
                 "acc": (acc, n_rows * (1 if rule == ROWWISE_ADAGRAD else self.d)),
                 "row_scales": (sc, n_rows), "d": self.d}
        self._call = _SPARSE_UPDATE.partial(**fixed)
        self._nearest = _SPARSE_UPDATE.partial(
            **fixed, **dict(zip(_ROUNDING, _rounding_args(_NEAREST))))

    def __call__(self, rows: torch.Tensor, hyper: Hyper, grads: Sequence[torch.Tensor],
                 starts: Sequence[int] | None = None,
                 unique_offsets: torch.Tensor | None = None, order: torch.Tensor | None = None,
                 bags: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                 round_to: rounding.Rounding | None = None,
                 overflow: torch.Tensor | None = None) -> int:
        """``sparse_update(rule, table, acc, rows, hyper, grads, ...)``."""
        table, acc, sc = self.table, self.acc, self.row_scales
        if table.data_ptr() != self._at[0] or (acc is not None and
                                               acc.data_ptr() != self._at[1]) or (
                sc is not None and sc.data_ptr() != self._at[2]):
            self._bind()  # (their storage was replaced since: checked and bound again)
        _check_sources(unique_offsets, order)
        u = rows.numel()
        nnz = order.numel() if order is not None else None
        slices, starts_, strides, n = _gradient_args(table, self.d, u, grads, starts,
                                                     unique_offsets, self._arrays)
        if round_to is None:  # (the arguments written out twice: a tuple a call costs)
            return self._nearest((rows, None), u, (unique_offsets, u + 1), (order, None),
                                 (bags, nnz), (scales, nnz), slices, starts_, strides, n, hyper,
                                 (overflow, u), threads())
        return self._call((rows, None), u, (unique_offsets, u + 1), (order, None), (bags, nnz),
                          (scales, nnz), slices, starts_, strides, n, hyper,
                          *_rounding_args(round_to), (overflow, u), threads())


_ROUND16 = Kernel("ec_round16", None, [
    ("type", INT),                            # ROW_TYPES[float16 or bfloat16]
    ("src", read(F32)),                       # (n,)
    ("bits", read(I32, optional=True)),       # (n,) random bits; None: to nearest
    ("dst", written(I16)),                    # (n,)
    ("n", INT64),
])


def round16(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x`` rounded to ``dtype`` (float16 / bfloat16) by the kernels' rule (csrc/half.h):
    to nearest, or stochastically with the uint32 random ``bits`` (int64 values, ``x``'s shape).
    For tests of numerics/rounding.py's reference."""
    if dtype not in rounding.COMPACT:
        raise TypeError(f"round16 rounds into {rounding.COMPACT}, not {dtype}")
    src = x.to(torch.float32).contiguous().reshape(-1)
    b = None if bits is None else bits.reshape(-1).to(torch.int64).to(torch.int32).contiguous()
    out = torch.empty(src.numel(), dtype=torch.int16)
    n = src.numel()
    _ROUND16.call(ROW_TYPES[dtype], (src, None), (b, n), (out, n), n)
    return out.view(dtype).reshape(x.shape)
