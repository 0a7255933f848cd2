"""A batch's kernels: ids concatenated and deduplicated, bags looked up (``lookup``, or
``TableLookup`` bound to one table), rows copied, the checks and helpers of the inputs
(csrc/dedup.h, inputs.h, lookup.h, rows.h).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from ...config.dtypes import SCALED
from .args import (
    ANY,
    F32,
    I32,
    I64,
    INT,
    INT64,
    ROWS,
    UPDATE_ROW_TYPES,
    Kernel,
    PartsArg,
    allocated,
    array,
    check_row_scales,
    ctypes_array,
    read,
    read_rows,
    written,
    written_rows,
)
from .library import threads


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D tensors, on the calling thread alone when they are contiguous
    CPU tensors of one dtype (one ``memmove`` each).

    ``torch.cat`` of a batch's scales (over 32768 elements) is a parallel op: it wakes torch's
    OpenMP workers, which then spin for about 7.5 ms waiting for the next one, on the core the
    kernels' helper needs (a W2 step: torch's idle worker took 45% of the second core). A copy of
    a few MB needs no second thread.
    """
    first = parts[0]
    if torch.compiler.is_compiling():  # (traced tensors have no data)
        return torch.cat(list(parts))
    for p in parts:  # a loop, not all(genexpr): this runs twice per table and step
        if not (p.is_cpu and p.dim() == 1 and p.dtype == first.dtype and p.is_contiguous()):
            return torch.cat(list(parts))
    out = torch.empty(sum(p.numel() for p in parts), dtype=first.dtype)
    size, at = out.element_size(), out.data_ptr()
    for p in parts:
        ctypes.memmove(at, p.data_ptr(), p.numel() * size)
        at += p.numel() * size
    return out


def dedup(ids: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort with run-length encoding, as ``preprocess.dedup``.

    Args:
        ids: (nnz,) contiguous int64 CPU ids in ``[0, num_rows)``.
        num_rows: an upper bound of the ids (sets the radix sort's passes).

    Returns:
        ``(unique (U,), order (nnz,), unique_offsets (U + 1,))``.
    """
    got = concat_dedup([ids], [0], num_rows)
    if isinstance(got, int):
        raise RuntimeError("ec_concat_dedup reported an id out of range without limits")
    _, unique, order, uoff = got
    return unique, order, uoff


def concat_dedup(parts: Sequence[torch.Tensor], adds: Sequence[int], num_rows: int,
                 limits: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | int:
    """Concatenates ``parts[i] + adds[i]`` and deduplicates the result, in one call.

    Args:
        parts: contiguous int64 CPU id tensors (one per feature).
        adds: the row offset added to each part.
        num_rows: an upper bound of the shifted ids.
        limits: None, or each part's bound: its ids must lie in ``[0, limits[i])`` (checked in
            the same pass as the copy).

    Returns:
        ``(ids (nnz,), unique (U,), order (nnz,), unique_offsets (U + 1,))``, views of one
        buffer; or, when ``limits`` are given and part ``i`` has an id outside its own, ``i``.
    """
    return ConcatDedup([t.numel() for t in parts], adds, num_rows, limits)(parts)


_CONCAT_DEDUP = Kernel("ec_concat_dedup", INT64, [
    ("parts", PartsArg()),                 # (nparts,) part p: lens[p] ids, steps[p] apart
    ("lens", array(ctypes.c_int64)),     # (nparts,)
    ("steps", array(ctypes.c_int64)),    # (nparts,), or None: all 1
    ("adds", array(ctypes.c_int64)),     # (nparts,) added to part p's ids
    ("limits", array(ctypes.c_int64)),   # (nparts,) part p's ids in [0, limits[p]), or None
    ("nparts", INT64),
    ("bits", INT),                       # the shifted ids lie in [0, 2^bits)
    ("ids_out", allocated(I64)),         # (n,) the shifted ids, n = sum of lens
    ("order", allocated(I64)),           # (n,)
    ("unique", allocated(I64)),          # (U,)
    ("uoff", allocated(I64)),            # (U + 1,)
    ("nt", INT),
], packed=True)


class ConcatDedup:
    """``concat_dedup`` for parts of fixed lengths: the call's fixed arguments converted once
    (the fast path makes one per batch layout and calls it every step)."""

    def __init__(self, lens: Sequence[int], adds: Sequence[int], num_rows: int,
                 limits: Sequence[int] | None = None) -> None:
        k = len(lens)
        if len(adds) != k or (limits is not None and len(limits) != k):
            raise ValueError(f"ConcatDedup: {k} parts but {len(adds)} adds and "
                             f"{None if limits is None else len(limits)} limits; give one each")
        longs = ctypes_array(ctypes.c_int64, k)
        self.k, self.n, self.sizes = k, sum(lens), list(lens)
        self.lens, self.adds, self._longs = longs(*lens), longs(*adds), longs
        self.limits = None if limits is None else longs(*limits)
        self.bits = max(int(num_rows) - 1, 1).bit_length()
        # the kernel with the fixed arguments bound (``Kernel.partial``), from the second call
        # on: binding compiles a function, which a one-off ``concat_dedup`` would pay each time
        self._call: Any = None
        self._called = False

    def __call__(self, parts: Sequence[torch.Tensor], steps: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | int:
        """``parts``: int64 CPU tensors of the lengths given, contiguous, or ``steps[i]``
        elements apart (e.g. a column of a wider batch) when ``steps`` are given."""
        n, call = self.n, self._call
        buf = torch.empty(4 * n + 1, dtype=torch.int64)  # [ids | order | unique | uoff]
        base = buf.data_ptr()
        stepped = None if steps is None else self._longs(*steps)
        if call is None and not self._called:  # the first call: unbound
            self._called = True
            u = _CONCAT_DEDUP.call((parts, self.sizes, steps), self.lens, stepped, self.adds,
                                   self.limits, self.k, self.bits, base, base + 8 * n,
                                   base + 16 * n, base + 24 * n, threads())
        else:
            if call is None:  # (called again: a batch layout's, every step)
                call = self._call = _CONCAT_DEDUP.partial(lens=self.lens, adds=self.adds,
                                                          limits=self.limits, nparts=self.k,
                                                          bits=self.bits)
            u = call((parts, self.sizes, steps), stepped, base, base + 8 * n, base + 16 * n,
                     base + 24 * n, threads())
        if u < 0:
            return -1 - u
        # the four tensors in one call (a view costs about a microsecond: this runs every step;
        # not views that autograd tracks: int64 buffers that only the kernels write)
        ids, order, unique, _, uoff, _ = buf.unsafe_split_with_sizes(
            [n, n, u, n - u, u + 1, n - u])
        return ids, unique, order, uoff


_LOOKUP = Kernel("ec_lookup", None, [
    ("type", INT),                            # UPDATE_ROW_TYPES[table.dtype]
    ("table", read(ROWS + SCALED, dim=2)),    # (N, d) float32, 16-bit or 8-bit
    ("row_scales", read(F32, optional=True)),  # (N,) an 8-bit table's row scales; else None
    ("d", INT64),
    ("ids", read(I64)),                       # (nnz,) rows of table
    ("offsets", read(I64, optional=True)),    # (r_rows + 1,); None: bag r is ids[r] alone
    ("scales", read(F32, optional=True)),     # (nnz,); None: all 1
    ("r_rows", INT64),
    ("out", written(F32, dim=2)),             # (r_rows, d)
    ("nt", INT),
], packed=True)


def lookup(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
           scales: torch.Tensor | None, out: torch.Tensor,
           row_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = sum_k scales[k] * table[ids[k]]`` over bag r (``offsets`` None: row ids[r]).

    Args:
        table: (N, D) contiguous float32, float16, bfloat16 (rows widened to float32),
            float8_e4m3fn or float8_e5m2 (a row's value ``float32(code) * row_scales[row]``).
        ids: (nnz,) int64 rows of ``table``.
        offsets: (R + 1,) int64 bag boundaries, or None for one id per row with scale 1.
        scales: (nnz,) float32, or None for 1.
        out: (R, D) contiguous float32, written.
        row_scales: (N, 1) contiguous float32 scales of an 8-bit table's rows; None for the
            other tables.
    """
    check_row_scales(_LOOKUP.name, table, row_scales)
    d, r = table.shape[-1], out.shape[0]
    _LOOKUP.call(UPDATE_ROW_TYPES.get(table.dtype, 0), (table, None),
                 (row_scales, table.shape[0]), d,
                 (ids, r if offsets is None else None), (offsets, r + 1),
                 (scales, ids.numel()), r, (out, r * d), threads())
    return out


class TableLookup:
    """``lookup`` from one table: the table's arguments checked once, here, and bound
    (``Kernel.partial``); each call checks the rest, as ``lookup`` does, and that the table
    still has the storage it was bound with (else binds it again, as ``SparseUpdate``). For the rows
    objects, which read the same table every step.

    Args:
        table, row_scales: as ``lookup``'s (kept referenced).
    """

    def __init__(self, table: torch.Tensor, row_scales: torch.Tensor | None = None) -> None:
        check_row_scales(_LOOKUP.name, table, row_scales)
        self.table, self.row_scales = table, row_scales
        self._bind()

    def _bind(self) -> None:
        table, sc = self.table, self.row_scales
        self.d = table.shape[-1]
        self._at = (table.data_ptr(), None if sc is None else sc.data_ptr())
        self._call = _LOOKUP.partial(type=UPDATE_ROW_TYPES.get(table.dtype, 0),
                                     table=(table, None), row_scales=(sc, table.shape[0]),
                                     d=self.d)

    def __call__(self, ids: torch.Tensor, offsets: torch.Tensor | None,
                 scales: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``lookup(table, ids, offsets, scales, out)``."""
        table, sc = self.table, self.row_scales
        if table.data_ptr() != self._at[0] or (sc is not None and sc.data_ptr() != self._at[1]):
            self._bind()  # (its storage was replaced since: checked and bound again)
        d, r = self.d, out.shape[0]
        self._call((ids, r if offsets is None else None), (offsets, r + 1),
                   (scales, ids.numel()), r, (out, r * d), threads())
        return out


_COPY_ROWS = Kernel("ec_copy_rows", None, [
    ("src", read_rows(ANY)),          # rows src_stride bytes apart
    ("src_stride", INT64),
    ("src_rows", read(I64)),          # (n,)
    ("dst", written_rows(ANY)),       # rows dst_stride bytes apart, src's dtype and width
    ("dst_stride", INT64),
    ("dst_rows", read(I64)),          # (n,)
    ("n", INT64),
    ("row_bytes", INT64),
    ("nt", INT),
])


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
              dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows] = src[src_rows]`` in one pass: 2-D CPU tensors of one dtype and width,
    rows contiguous; ``src_rows`` / ``dst_rows`` (n,) int64, contiguous, in range."""
    size, n = src.element_size(), src_rows.numel()
    _COPY_ROWS.call((src, None), src.stride(0) * size, (src_rows, None), (dst, src),
                    dst.stride(0) * size, (dst_rows, n), n, src.shape[-1] * size, threads())


_COPY_ROWS_SUMMED = Kernel("ec_copy_rows_summed", INT64, [
    ("src", read_rows(ANY)),          # rows src_stride bytes apart
    ("src_stride", INT64),
    ("src_rows", read(I64)),          # (n,)
    ("dst", written_rows(ANY)),       # rows dst_stride bytes apart, src's dtype and width
    ("dst_stride", INT64),
    ("dst_rows", read(I64)),          # (n,)
    ("n", INT64),
    ("row_bytes", INT64),
    ("copy", INT),
    ("keys", read(I64)),              # (n,) the rows' shard rows
    ("versions", read(I32, optional=True)),  # (n,) the rows' versions (first), or None
    ("acc", written(I32)),            # (n,) the checksums so far
    ("first", INT),
    ("sums", written(I32, optional=True)),  # (N,) the tier's checksums, by shard row
    ("verify", INT),
    ("nt", INT),
])


def copy_rows_summed(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor | None,
                     dst_rows: torch.Tensor | None, keys: torch.Tensor, acc: torch.Tensor,
                     first: bool, sums: torch.Tensor | None = None, verify: bool = False,
                     versions: torch.Tensor | None = None) -> int:
    """One array's part of a move of rows with their checksums (ops/checksum.py): ``dst[dst_rows]
    = src[src_rows]`` unless ``dst`` is None, and each row's bytes folded into its checksum
    ``acc`` ((n,) int32; ``first``: started from its key ``keys[i]``, the shard row, and its
    version ``versions[i]``, (n,) int32, 0 where ``versions`` is None). The last
    array's call passes ``sums`` ((N,) int32, by key): ``verify``, each must equal its row's
    checksum, else it is set to it. Returns the first row (of ``src_rows``' order) whose checksum
    differs, or -1. 2-D CPU tensors of one dtype and width, rows contiguous; index tensors (n,)
    int64, contiguous, in range."""
    size, n = src.element_size(), src_rows.numel()
    copy = dst is not None
    if dst is None or dst_rows is None:
        dst, dst_rows = src, src_rows
    return int(_COPY_ROWS_SUMMED.call(
        (src, None), src.stride(0) * size, (src_rows, None), (dst, src), dst.stride(0) * size,
        (dst_rows, n), n, src.shape[-1] * size, int(copy), (keys, n), (versions, n),
        (acc, n), int(first),
        (sums, None), int(verify), threads()))


_WILL_NEED = Kernel("ec_will_need", INT64, [
    ("base", read_rows(ANY)),         # rows stride bytes apart
    ("stride", INT64),
    ("rows", read(I64)),              # (n,)
    ("n", INT64),
    ("row_bytes", INT64),
])


def will_need(src: torch.Tensor, rows: torch.Tensor) -> int:
    """Asks the kernel to read the pages under rows ``rows`` ((n,) int64, contiguous, in range)
    of ``src`` (a 2-D CPU tensor of a mapped file, rows contiguous; each row's whole stride:
    a record's other fields too) ahead (``madvise(MADV_WILLNEED)``); returns the system calls
    made."""
    size = src.element_size()
    return _WILL_NEED.call((src, None), src.stride(0) * size, (rows, None), rows.numel(),
                           max(src.stride(0), src.shape[-1]) * size)


_BAG_OF = Kernel("ec_bag_of", None, [
    ("offsets", read(I64)),           # (r_rows + 1,)
    ("r_rows", INT64),
    ("bags", written(I64)),           # (nnz,)
])


def bag_of(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """(nnz,) int64: the bag of every occurrence."""
    out = torch.empty(nnz, dtype=torch.int64)
    _BAG_OF.call((offsets, None), offsets.numel() - 1, (out, nnz))
    return out


_EXPAND = Kernel("ec_expand", None, [
    ("values", read(I64)),            # (U,)
    ("order", read(I64)),             # (nnz,)
    ("uoff", read(I64)),              # (U + 1,)
    ("n_unique", INT64),
    ("out", written(I64)),            # (nnz,)
])


def expand(values: torch.Tensor, order: torch.Tensor, unique_offsets: torch.Tensor
           ) -> torch.Tensor:
    """(nnz,) int64: ``values`` (U,) of a ``Dedup``'s distinct rows at their occurrences
    (``values[dedup.inverse]`` without the inverse)."""
    u, nnz = values.numel(), order.numel()
    out = torch.empty(nnz, dtype=torch.int64)
    _EXPAND.call((values, None), (order, None), (unique_offsets, u + 1), u, (out, nnz))
    return out


_MINMAX = Kernel("ec_minmax", None, [
    ("ids", read(I64, nonempty=True)),  # (n,)
    ("n", INT64),
    ("out", array(ctypes.c_int64)),     # (2,) smallest, largest
])


def minmax(ids: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest of (n > 0,) contiguous int64 ids."""
    out = (ctypes.c_int64 * 2)()
    _MINMAX.call((ids, None), ids.numel(), out)
    return out[0], out[1]


_OFFSETS_ERROR = Kernel("ec_offsets_error", INT64, [
    ("offsets", read(I64, nonempty=True)),  # (n,)
    ("n", INT64),
    ("nnz", INT64),
])


def offsets_error(offsets: torch.Tensor, nnz: int) -> int:
    """-1 when (n >= 1,) contiguous int64 ``offsets`` start at 0, never decrease and end at
    ``nnz``; else the first entry breaking that (0: the first is not 0; i: ``offsets[i] <
    offsets[i - 1]``; n - 1: the last is not ``nnz``)."""
    return _OFFSETS_ERROR.call((offsets, None), offsets.numel(), nnz)


_FIRST_UNORDERED = Kernel("ec_first_unordered", INT64, [
    ("idx", read(I64, dim=2)),        # (k, n)
    ("k", INT64),
    ("n", INT64),
])


def first_unordered(indices: torch.Tensor) -> int:
    """-1 when the columns of (k, n) contiguous int64 ``indices`` strictly increase in
    lexicographic order (a coalesced COO tensor's indices); else the first column j >= 1 that is
    not greater than column j - 1 (out of order, or a duplicate)."""
    return _FIRST_UNORDERED.call((indices, None), indices.shape[0], indices.shape[-1])


COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}

_COMBINER_SCALES = Kernel("ec_combiner_scales", None, [
    ("offsets", read(I64)),                   # (r_rows + 1,)
    ("r_rows", INT64),
    ("weights", read(F32, optional=True)),    # (nnz,); None: all 1
    ("combiner", INT),                        # COMBINERS' code
    ("out", written(F32)),                    # (nnz,)
])


def combiner_scales(offsets: torch.Tensor, weights: torch.Tensor | None, combiner: str,
                    nnz: int) -> torch.Tensor:
    """As ``inputs.combiner_scales``: (nnz,) float32 per-id scales applying the combiner."""
    code = COMBINERS.get(combiner)
    if code is None:
        raise ValueError(f"combiner_scales: combiner {combiner!r} is none of {sorted(COMBINERS)}")
    out = torch.empty(nnz, dtype=torch.float32)
    _COMBINER_SCALES.call((offsets, None), offsets.numel() - 1, (weights, nnz), code,
                          (out, nnz))
    return out
