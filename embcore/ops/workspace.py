"""Workspaces: per-step temporaries kept allocated across steps.

A temporary larger than glibc's mmap threshold (32 MB at most) is handed back to the kernel when
freed and comes back as fresh, zero-filled pages at the next step: on W2 that was ~47k page faults
(~180 MiB) per step. The engine's internal temporaries (the gathered rows of the torch-ops
optimizer update, the concatenated output gradients) live in buffers kept here instead, grown
geometrically and reused every step. Tensors handed to the user (activations) are never workspaces.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

SMALL = 1 << 20  # bytes
KEPT = 64  # values ``kept``


class Workspace:
    """Named buffers reused across steps; ``get`` returns a view of the requested shape."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._kept: dict[tuple[Any, ...], tuple[object, Any]] = {}

    def kept(self, make: Callable[..., Any], owner: object, *key: Any) -> Any:
        """``make(owner, *key)``, kept across steps for ``owner`` (by identity) and ``key``
        (hashable): small per-step arguments that are the same every step (a kernel's
        hyper-parameters). At most ``KEPT`` are kept (a schedule makes new ones every step)."""
        k = (make, id(owner), *key)
        got = self._kept.get(k)
        if got is not None and got[0] is owner:
            return got[1]
        if len(self._kept) >= KEPT:
            self._kept.clear()
        value = make(owner, *key)
        self._kept[k] = (owner, value)
        return value

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
