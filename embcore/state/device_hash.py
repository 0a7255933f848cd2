"""A hash index on the device: int64 keys -> int64 values, found and inserted by GPU kernels.

``DeviceHash`` is the index of a ``DeviceVocabMap`` (state/device_map.py): raw id -> row, and
counted id -> its entry. Open addressing with linear probing (kernels/triton_hash.py has the
layout and the kernels); deletion marks a slot deleted (a tombstone), so the index is rebuilt
from its owner's state now and then. Nothing here reads a value back to the host: how full the
index is, is bounded on the host from what was inserted since the last rebuild (an upper bound:
each insert counts its keys as if every one were taken), and a rebuild is due when that bound
could pass three quarters of the slots (``due``). With ``S >= 2 * capacity`` slots, a rebuild
(``O(S)``) comes at most once every ``capacity / 2`` inserted keys: ``O(1)`` a key amortized.

Keys may be any int64 (the slot's value, not its key, says whether it is used).
"""

from __future__ import annotations

import torch

from ..kernels import gpu

_I64 = torch.int64


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class DeviceHash:
    """An index of up to ``capacity`` keys at once, on ``device`` (CUDA, or CPU tensors under
    Triton's interpreter with ``gpu.force_on_cpu``).

    Args:
        capacity: the most keys held at once (the owner's rows or entries).
        device: where its slots live.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = int(capacity)
        self.slots = max(16, _pow2(2 * self.capacity))
        self.key = torch.zeros(self.slots + 1, dtype=_I64, device=device)  # (S + 1,)
        self.val = torch.zeros(self.slots + 1, dtype=_I64, device=device)  # (S + 1,)
        self.filled = 0  # a bound on the slots not empty (held or deleted)

    @property
    def spare(self) -> int:
        """The spare slot (index S): where masked-out writes go; no probe reaches it."""
        return self.slots

    @property
    def device(self) -> torch.device:
        return self.key.device

    def nbytes(self) -> int:
        return self.key.nbytes + self.val.nbytes

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """(n,) int64: the value of each of the (n,) int64 ``keys``, -1 where absent."""
        return gpu.hash_find(keys, self.key, self.val)

    def due(self, n: int) -> bool:
        """Whether inserting ``n`` more keys could fill more than 3/4 of the slots: rebuild
        first."""
        return self.filled + n > (3 * self.slots) // 4

    def insert(self, keys: torch.Tensor, vals: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
        """Inserts ``keys[i] -> vals[i]`` where ``take[i]``: keys absent and distinct, values >= 0.
        Returns (n,) int64 the slot each took (``spare`` where not taken). The caller checks
        ``due(n)`` first (and rebuilds)."""
        self.filled += keys.numel()
        return gpu.hash_insert(keys, vals, take, self.key, self.val)

    def delete(self, slot: torch.Tensor, gone: torch.Tensor) -> None:
        """Deletes the keys at slots ``slot`` (n,) where ``gone`` (n,) bool is set."""
        self.val.index_fill_(0, torch.where(gone, slot, self.spare), -1)

    def rebuild(self, keys: torch.Tensor, vals: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
        """Empties the index and inserts ``keys[i] -> vals[i]`` where ``take[i]`` (every key the
        owner holds). Returns ``insert``'s slots."""
        self.key.zero_()
        self.val.zero_()
        self.filled = 0
        return self.insert(keys, vals, take)

    def to(self, device: torch.device) -> None:
        self.key, self.val = self.key.to(device), self.val.to(device)
