"""A hash index on the device over its owner's keys: key -> place, by GPU kernels.

``DeviceHash`` is an index of a ``DeviceVocabMap`` (state/device_map.py): raw id -> row over the
map's ``row_key``, and counted id -> entry over its counted ids. Its owner holds the keys (place
``v`` holds key ``owner[v]``); the index holds only places, 4 bytes a slot (8 for owners of
2**31 - 2 places or more). Open addressing with linear probing (kernels/triton_hash.py has the
layout and the kernels); deletion marks a slot deleted (a tombstone), so the index is rebuilt
from its owner's keys now and then.

Nothing here reads a value back to the host: how full the index is, is bounded on the host from
what was inserted since the last rebuild (an upper bound: each insert counts its keys as if every
one were taken), and a rebuild is due when that bound could pass three quarters of the slots
(``due``). With ``S >= 2 * capacity`` slots, a rebuild (``O(S)``) comes at most once every
``capacity / 2`` inserted keys: ``O(1)`` a key amortized.

Keys may be any int64: a slot's place, not a key, says whether it is used.
"""

from __future__ import annotations

import torch

from ..kernels import gpu

_I64 = torch.int64
_INT32_PLACES = 2**31 - 2  # places below this fit an int32 slot (v + 1 < 2**31 - 1)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def slots_for(capacity: int) -> int:
    """The slots of an index over ``capacity`` places: a power of two, at least twice it."""
    return max(16, _pow2(2 * int(capacity)))


class DeviceHash:
    """An index of up to ``capacity`` keys at once, on ``device`` (CUDA, or CPU tensors under
    Triton's interpreter).

    Args:
        capacity: the owner's places (the most keys held at once).
        device: where its slots live.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = int(capacity)
        self.slots = slots_for(self.capacity)
        dtype = torch.int32 if self.capacity < _INT32_PLACES else _I64
        self.slot = torch.zeros(self.slots + 1, dtype=dtype, device=device)  # (S + 1,)
        self.filled = 0  # a bound on the slots not empty (held or deleted)

    @property
    def device(self) -> torch.device:
        return self.slot.device

    def nbytes(self) -> int:
        return self.slot.nbytes

    def find(self, keys: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """(n,) int64: the place of each of the (n,) int64 ``keys`` (``owner[place]`` is the
        key), -1 where absent."""
        return gpu.hash_find(keys, self.slot, owner)

    def due(self, n: int) -> bool:
        """Whether inserting ``n`` more keys could fill more than 3/4 of the slots: rebuild
        first."""
        return self.filled + n > (3 * self.slots) // 4

    def insert(self, keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor) -> None:
        """Indexes ``keys[i]`` at ``places[i]`` where ``take[i]``: keys absent and distinct. The
        caller checks ``due(n)`` first (and rebuilds instead)."""
        self.filled += keys.numel()
        gpu.hash_insert(keys, places, take, self.slot)

    def delete(self, keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor) -> None:
        """Forgets ``keys[i]``, indexed at ``places[i]``, where ``take[i]``."""
        gpu.hash_delete(keys, places, take, self.slot)

    def rebuild(self, owner: torch.Tensor, held: torch.Tensor) -> None:
        """Empties the index and indexes every place ``v`` of ``owner`` where ``held[v]``."""
        self.slot.zero_()
        self.filled = 0
        self.insert(owner, torch.arange(owner.numel(), dtype=_I64, device=owner.device), held)

    def to(self, device: torch.device) -> None:
        self.slot = self.slot.to(device)
