"""Fast lookup and its gradient: weighted bag sums over deduplicated rows (torch ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def combine(rows: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
            scales: torch.Tensor) -> torch.Tensor:
    """Output row r = sum over its occurrences k of ``scales[k] * rows[inverse[k]]``.

    Args:
        rows: (U, D) the unique rows.
        inverse: (nnz,) index into ``rows`` per occurrence.
        offsets: (R + 1,) bag boundaries.
        scales: (nnz,) per-occurrence scale.

    Returns:
        (R, D) in ``rows``' dtype (computed in float32 for half types).
    """
    work = rows if rows.dtype in (torch.float32, torch.float64) else rows.float()
    out = F.embedding_bag(inverse, work, offsets, mode="sum",
                          per_sample_weights=scales.to(work.dtype),
                          include_last_offset=True)  # (R, D)
    return out.to(rows.dtype)


def combine_backward(grad: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor,
                     scales: torch.Tensor, num_unique: int) -> torch.Tensor:
    """Gradient of ``combine`` w.r.t. its rows: occurrences of a row summed.

    Args:
        grad: (R, D) gradient of the output rows.
        inverse, offsets, scales: as for ``combine``.
        num_unique: U.

    Returns:
        (U, D) float32 (float64 for float64 grads) summed gradient per unique row.
    """
    dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    lengths = offsets[1:] - offsets[:-1]  # (R,)
    bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=grad.device), lengths,
                                  output_size=inverse.numel())  # (nnz,)
    per_occurrence = grad.to(dtype)[bag] * scales.to(dtype)[:, None]  # (nnz, D)
    out = torch.zeros(num_unique, grad.shape[1], dtype=dtype, device=grad.device)  # (U, D)
    return out.index_add_(0, inverse, per_occurrence)
