"""Combine: the weighted bag sums of a lookup, and their gradient (the one combine of embcore).

The engine's lookup, the serving lookup and ``EmbeddingLayer(optimizer=None)`` all produce
activations with ``combine``.

Both directions are one fused ATen kernel: the forward an ``embedding_bag`` over the occurrences
(an ``index_select`` when every bag is one id with scale 1), the backward the same kernel
transposed: occurrences sorted by row form the bags, the output gradient rows are the table.
On the CPU with float32, float16 or bfloat16 tables the forward is the fused kernel
``cpu.lookup`` instead (the same sums, in the same order, each step one fused multiply-add
as ``embedding_bag``'s, so the same bits: docs/semantics.md section 12; with the rows ahead
prefetched; 16-bit rows widened to float32 as they are read, so their activations are float32);
on CUDA (those tables, float32 gradients) both directions are the Triton kernels of
``kernels/gpu/launch.py`` (the same sums in the same order, within float rounding:
tests/triton_cases.py); the training backward of a local table is fused into the optimizer update
(``ops/update.py``). An 8-bit table (float8_e4m3fn, float8_e5m2) is read with its row-wise
scales (``scales=``): on CUDA by the Triton lookup (each code widened and multiplied by its
row's scale as it is read), on the CPU by a ``TableCombine``'s fused lookup (likewise, the same
bits), elsewhere in torch ops: the occurrences' rows gathered, widened and multiplied by their
scales, then summed as above (float32 activations).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config.dtypes import SCALED, is_working
from ..kernels import cpu, gpu
from ..numerics.rounding import ROW_TYPES
from .backend import Backend, choose
from .bags import Bags, Dedup
from .workspace import Workspace


def _differentiable(table: torch.Tensor) -> bool:
    """Whether autograd or a tracer (torch.export / compile) must see the computation."""
    return (table.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling()


def _fused(table: torch.Tensor) -> bool:
    """Whether the fused CPU lookup takes ``table`` (the rows' dtype and layout)."""
    return table.dtype in ROW_TYPES and table.is_contiguous()


def _coded(table: torch.Tensor) -> bool:
    """Whether ``table`` holds 8-bit codes (read with their row scales)."""
    return table.dtype in SCALED


def _scaled(table: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether the fused CPU lookup reads this 8-bit table and its (N, 1) row scales."""
    return (table.dtype in cpu.UPDATE_ROW_TYPES and table.is_contiguous()
            and scales.dtype == torch.float32 and scales.is_contiguous()
            and scales.numel() == table.shape[0])


def combine(table: torch.Tensor, index: torch.Tensor, bags: Bags,
            backend: Backend | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Output row r = sum over its occurrences k of ``scales[k] * table[index[k]]``.

    Args:
        table: (N, D) the rows to read: a whole table (``index`` = ``bags.ids``) or the rows
            fetched in unique order (``index`` = ``dedup.inverse``).
        index: (nnz,) row of each occurrence in ``table``.
        bags: offsets and scales of the bags.
        backend: the kernels of the table's device (ops/backend.py); None: chosen for
            ``table``'s device now (a caller outside the step: serving, a plain module).
        scales: (N, 1) float32, an 8-bit table's row scales (a row's value is
            ``float32(table[i]) * scales[i]``); None for the other dtypes.

    Returns:
        (R, D) in ``table``'s dtype, float32 for a float16 / bfloat16 table (its rows widened:
        activations of compact rows are float32); differentiable with respect to ``table`` when
        it requires grad.
    """
    if _differentiable(table):
        return combine_torch(table, index, bags, scales)
    backend = backend if backend is not None else choose(table.device)
    if backend.fused_cpu and _fused(table):
        out = torch.empty(bags.num_rows, table.shape[1], dtype=torch.float32)  # (R, D)
        return cpu.lookup(table, index.contiguous(), bags.offsets, bags.scales, out)
    if backend.triton and gpu.lookup_supported(table) and (scales is not None) == _coded(table):
        return gpu.lookup(table, index, bags.offsets, bags.scales, bags.num_rows,
                          row_scales=scales)
    return combine_torch(table, index, bags, scales)


def combine_torch(table: torch.Tensor, index: torch.Tensor, bags: Bags,
                  scales: torch.Tensor | None = None) -> torch.Tensor:
    """``combine`` in torch ops, on any device (the other backends' answers, and theirs
    wherever autograd or a tracer must see the computation; an 8-bit table's, with its
    ``scales``)."""
    if scales is not None:  # each occurrence's row widened with its scale, then bags summed
        work = table.index_select(0, index).float() * scales.index_select(0, index)  # (nnz, D)
        index = torch.arange(index.numel(), device=index.device)  # (nnz,)
        return combine_torch(work, index, bags)
    work = table if is_working(table) else table.float()
    if bags.offsets is None or bags.scales is None:
        out = F.embedding(index, work)  # (R, D)
    else:
        out = F.embedding_bag(index, work, bags.offsets, mode="sum",
                              per_sample_weights=bags.scales.to(work.dtype),
                              include_last_offset=True)  # (R, D)
    return out if table.dtype in (torch.float16, torch.bfloat16) else out.to(table.dtype)


class TableCombine:
    """``combine`` over one table, its kernel chosen once by the backend: a rows object
    (state/rows.py) keeps one while it holds the table (its dtype, layout and device fixed):
    the fused CPU lookup with the table's arguments bound once (``cpu.TableLookup``), the
    Triton lookup, or torch ops. A call on a table that autograd or a tracer must see
    (``torch.export``, ``torch.compile``) takes torch ops on every backend: the same values.

    Args:
        table: (N, D) the rows to read, held by the caller for this object's life.
        backend: its device's backend (None: ``backend.choose(table.device)``).
        scales: (N, 1) an 8-bit table's row scales (``combine``'s; the fused CPU lookup widens
            and scales its rows as torch ops do, bit for bit), else None.
    """

    def __init__(self, table: torch.Tensor, backend: Backend | None = None,
                 scales: torch.Tensor | None = None) -> None:
        self.table, self.scales = table, scales
        self.backend = backend = backend if backend is not None else choose(table.device)
        fused = backend.fused_cpu and (_fused(table) if scales is None else _scaled(table, scales))
        self._fused = cpu.TableLookup(table, scales) if fused else None
        self._triton = (backend.triton and gpu.lookup_supported(table)
                        and (scales is not None) == _coded(table))

    def __call__(self, index: torch.Tensor, bags: Bags) -> torch.Tensor:
        """``combine(table, index, bags)``."""
        table = self.table
        if _differentiable(table):
            return combine_torch(table, index, bags, self.scales)
        if self._fused is not None:
            out = torch.empty(bags.num_rows, self._fused.d, dtype=torch.float32)  # (R, D)
            return self._fused(index.contiguous(), bags.offsets, bags.scales, out)
        if self._triton:
            return gpu.lookup(table, index, bags.offsets, bags.scales, bags.num_rows,
                              bags.verdict, self.scales)
        return combine_torch(table, index, bags, self.scales)


def combine_backward(grad: torch.Tensor, bags: Bags, dedup: Dedup,
                     backend: Backend | None = None) -> torch.Tensor:
    """Gradient of ``combine`` w.r.t. the distinct rows: each row's occurrences summed in order.

    Args:
        grad: (R, D) gradient of the output rows.
        bags, dedup: the batch and its distinct rows.

    Returns:
        (U, D) float32 (float64 for float64 grads) summed gradient per distinct row: the same
        ``embedding_bag``, with the occurrences sorted by row as the bags and ``grad`` as the
        table. (Writing it into a kept buffer with the private ``.out`` overload was measured
        twice as slow on torch 2.13: compat.py.)
    """
    backend = backend or choose(grad.device)
    if grad.dtype == torch.float32 and backend.triton:
        return gpu.row_gradients(grad, dedup.unique_offsets, dedup.order,
                                 None if bags.unit else bags.bag_of(backend), bags.scales)
    work = grad if grad.dtype == torch.float64 else grad.float()
    rows = (dedup.order if bags.unit
            else bags.bag_of(backend)[dedup.order])  # (nnz,) output row per occurrence
    weights = None if bags.scales is None else bags.scales[dedup.order].to(work.dtype)
    return F.embedding_bag(rows, work, dedup.unique_offsets, mode="sum",
                           per_sample_weights=weights, include_last_offset=True)  # (U, D)


class OutputGrads(NamedTuple):
    """The gradient of a physical table's output rows, as the features' parts (no copy).

    ``parts[i]`` is the (R_i, D) gradient of output rows ``starts[i]:starts[i+1]``, any strides
    (often a column slice of the dense part's wider gradient); the
    rows' gradients are the ``combine_backward`` of their concatenation (``row_gradients``), or
    are formed inside the fused update (ops/update.py) without it. (A named tuple: made once
    per table and step, at a third of a frozen dataclass's cost.)
    """

    parts: list[torch.Tensor]   # per feature, (R_i, D) float32 / float64
    starts: list[int]           # (len(parts) + 1,) first output row of each part, then R
    bags: Bags
    dedup: Dedup


def row_gradients(grads: OutputGrads, workspace: Workspace | None = None,
                  backend: Backend | None = None) -> torch.Tensor:
    """(U, D) summed gradient of each distinct row (``combine_backward`` of the parts; the
    backend of their device, None: chosen now)."""
    parts = grads.parts
    if len(parts) == 1:
        out = parts[0]  # (R, D)
    elif workspace is None:
        out = torch.cat(parts)
    else:
        out = workspace.get("out_grads", (grads.starts[-1], parts[0].shape[1]), parts[0].dtype,
                            parts[0].device)  # (R, D)
        torch.cat(parts, out=out)
    return combine_backward(out, grads.bags, grads.dedup, backend)
