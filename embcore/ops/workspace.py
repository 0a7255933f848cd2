"""Workspaces: per-step temporaries kept allocated across steps.

A temporary larger than glibc's mmap threshold (32 MB at most) is handed back to the kernel when
freed and comes back as fresh, zero-filled pages at the next step: on W2 that was ~47k page faults
(~180 MiB) per step. The engine's internal temporaries (the unique rows' gradients, the gathered
rows of the optimizer update, the concatenated output gradients) live in buffers kept here
instead, grown geometrically and reused every step. Tensors handed to the user (activations) are
never workspaces.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named buffers reused across steps; ``get`` returns a view of the requested shape."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """An uninitialised ``shape`` view of buffer ``name``; valid until its next ``get``."""
        n = 1
        for s in shape:
            n *= s
        key = (name, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n + n // 4, 1024), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n].view(shape)
