"""Fast lookup and its gradient: weighted bag sums (torch ops).

Both directions are one fused ATen kernel: the forward an ``embedding_bag`` over the occurrences
(an ``index_select`` when every bag is one id with scale 1), the backward the same kernel
transposed: occurrences sorted by row form the bags, the output gradient rows are the table.
On the CPU with float32 tables the forward is the fused kernel ``native.lookup`` instead (the same
sums, in the same order, with the rows ahead prefetched); the training backward of a local table
is fused into the optimizer update (``ops/update.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..preprocess import TableBatch
from . import native
from .workspace import Workspace


def _work(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def combine(table: torch.Tensor, index: torch.Tensor, tb: TableBatch) -> torch.Tensor:
    """Output row r = sum over its occurrences k of ``scales[k] * table[index[k]]``.

    Args:
        table: (N, D) the rows to read: the whole local table (``index`` = ``tb.ids``) or the
            fetched unique rows (``index`` = ``tb.inverse``).
        index: (nnz,) row of each occurrence in ``table``.
        tb: the batch (offsets, scales, unit).

    Returns:
        (R, D) in ``table``'s dtype (computed in float32 for half types).
    """
    if (table.dtype == torch.float32 and table.is_contiguous()
            and native.usable(table, index)):
        out = torch.empty(tb.num_rows, table.shape[1], dtype=table.dtype)  # (R, D)
        return native.lookup(table, index.contiguous(), tb.offsets, tb.scales, out)
    work = _work(table)
    if tb.unit:
        out = work.index_select(0, index)  # (R, D)
    else:
        assert tb.offsets is not None and tb.scales is not None
        out = F.embedding_bag(index, work, tb.offsets, mode="sum",
                              per_sample_weights=tb.scales.to(work.dtype),
                              include_last_offset=True)  # (R, D)
    return out.to(table.dtype)


def combine_backward(grad: torch.Tensor, tb: TableBatch,
                     workspace: Workspace | None = None) -> torch.Tensor:
    """Gradient of ``combine`` w.r.t. the unique rows: each row's occurrences summed in order.

    Args:
        grad: (R, D) gradient of the output rows.
        tb: the batch.
        workspace: where to put the result (a view valid until the workspace's next use);
            None allocates it.

    Returns:
        (U, D) float32 (float64 for float64 grads) summed gradient per unique row.
    """
    work = grad if grad.dtype == torch.float64 else grad.float()
    rows = tb.order if tb.unit else tb.bags[tb.order]  # (nnz,) output row per occ.
    weights = None if tb.scales is None else tb.scales[tb.order].to(work.dtype)
    if workspace is None or not work.is_contiguous():
        return F.embedding_bag(rows, work, tb.unique_offsets, mode="sum",
                               per_sample_weights=weights, include_last_offset=True)  # (U, D)
    out = workspace.get("row_grads", (tb.unique.numel(), work.shape[1]), work.dtype,
                        work.device)  # (U, D)
    small = [torch.empty(0, dtype=torch.int64, device=work.device) for _ in range(3)]
    torch.ops.aten._embedding_bag_forward_only.out(
        work, rows, tb.unique_offsets, False, 0, False, weights, True, -1,
        out0=out, out1=small[0], out2=small[1], out3=small[2])
    return out
