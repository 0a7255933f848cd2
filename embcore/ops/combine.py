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
(``ops/update.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..config.dtypes import is_working
from ..kernels import cpu, gpu
from ..numerics.rounding import ROW_TYPES
from .bags import Bags, Dedup
from .workspace import Workspace


def _differentiable(table: torch.Tensor) -> bool:
    """Whether autograd or a tracer (torch.export / compile) must see the computation."""
    return (table.requires_grad and torch.is_grad_enabled()) or torch.compiler.is_compiling()


def _native(table: torch.Tensor) -> bool:
    """Whether the fused CPU lookup reads ``table`` (the rows' dtype and layout, the kernels)."""
    return table.dtype in ROW_TYPES and table.is_contiguous() and cpu.usable(table)


def combine(table: torch.Tensor, index: torch.Tensor, bags: Bags) -> torch.Tensor:
    """Output row r = sum over its occurrences k of ``scales[k] * table[index[k]]``.

    Args:
        table: (N, D) the rows to read: a whole table (``index`` = ``bags.ids``) or the rows
            fetched in unique order (``index`` = ``dedup.inverse``).
        index: (nnz,) row of each occurrence in ``table``.
        bags: offsets and scales of the bags.

    Returns:
        (R, D) in ``table``'s dtype, float32 for a float16 / bfloat16 table (its rows widened:
        activations of compact rows are float32); differentiable with respect to ``table`` when
        it requires grad.
    """
    if (gpu.usable(table, index) and gpu.lookup_supported(table)
            and not _differentiable(table)):  # CUDA: the Triton kernel
        return gpu.lookup(table, index, bags.offsets, bags.scales, bags.num_rows)
    if _native(table) and index.is_cpu and not _differentiable(table):
        out = torch.empty(bags.num_rows, table.shape[1], dtype=torch.float32)  # (R, D)
        return cpu.lookup(table, index.contiguous(), bags.offsets, bags.scales, out)
    work = table if is_working(table) else table.float()
    if bags.offsets is None or bags.scales is None:
        out = F.embedding(index, work)  # (R, D)
    else:
        out = F.embedding_bag(index, work, bags.offsets, mode="sum",
                              per_sample_weights=bags.scales.to(work.dtype),
                              include_last_offset=True)  # (R, D)
    return out if table.dtype in (torch.float16, torch.bfloat16) else out.to(table.dtype)


class TableCombine:
    """``combine`` over one table, the kernel chosen once: a rows object (state/rows.py) keeps
    one while it holds the table (its dtype, layout and device fixed), so the fused CPU lookup
    is chosen here, its table's arguments bound once (``cpu.TableLookup``), and again only
    when the kernels are switched on or off. A call that the fused lookup does not take (the
    table made differentiable, an index elsewhere) goes through ``combine``: the same values.

    Args:
        table: (N, D) the rows to read, held by the caller for this object's life.
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._choose()

    def _choose(self) -> None:
        self._switch = cpu.enabled()
        t = self.table
        self._kernel = cpu.TableLookup(t) if _native(t) else None

    def __call__(self, index: torch.Tensor, bags: Bags) -> torch.Tensor:
        """``combine(table, index, bags)``."""
        if self._switch is not cpu.enabled():
            self._choose()
        kernel = self._kernel
        if kernel is None or not index.is_cpu or _differentiable(self.table):
            return combine(self.table, index, bags)
        out = torch.empty(bags.num_rows, kernel.d, dtype=torch.float32)  # (R, D)
        return kernel(index.contiguous(), bags.offsets, bags.scales, out)


def combine_backward(grad: torch.Tensor, bags: Bags, dedup: Dedup) -> torch.Tensor:
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
    if grad.dtype == torch.float32 and gpu.usable(grad, dedup.order):  # CUDA: Triton
        return gpu.row_gradients(grad, dedup.unique_offsets, dedup.order,
                                 None if bags.unit else bags.bag_of, bags.scales)
    work = grad if grad.dtype == torch.float64 else grad.float()
    rows = dedup.order if bags.unit else bags.bag_of[dedup.order]  # (nnz,) output row per occ.
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


def row_gradients(grads: OutputGrads, workspace: Workspace | None = None) -> torch.Tensor:
    """(U, D) summed gradient of each distinct row (``combine_backward`` of the parts)."""
    parts = grads.parts
    if len(parts) == 1:
        out = parts[0]  # (R, D)
    elif workspace is None:
        out = torch.cat(parts)
    else:
        out = workspace.get("out_grads", (grads.starts[-1], parts[0].shape[1]), parts[0].dtype,
                            parts[0].device)  # (R, D)
        torch.cat(parts, out=out)
    return combine_backward(out, grads.bags, grads.dedup)
