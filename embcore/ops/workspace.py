"""Workspaces: per-step temporaries kept allocated across steps.

A temporary larger than glibc's mmap threshold (32 MB at most) is handed back to the kernel when
freed and comes back as fresh, zero-filled pages at the next step: on W2 that was ~47k page faults
(~180 MiB) per step. The engine's internal temporaries (the gathered rows of the torch-ops
optimizer update, the concatenated output gradients) live in buffers kept here instead, grown
geometrically and reused every step. Tensors handed to the user (activations) are never workspaces.
"""

from __future__ import annotations

import math

import torch

SMALL = 1 << 20  # bytes


class Workspace:
    """Named buffers reused across steps; ``get`` returns a view of the requested shape."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` view of buffer ``name``; valid until its next ``get``.

        Requests under ``SMALL`` bytes are plain allocations: they never reach the mmap threshold,
        and a fresh small tensor costs less than the bookkeeping.
        """
        n = math.prod(shape)
        if n * dtype.itemsize < SMALL:
            return torch.empty(shape, dtype=dtype, device=device)
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n + n // 4, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n].view(shape)
