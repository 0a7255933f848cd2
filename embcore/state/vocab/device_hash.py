"""A hash index on the device over its owner's keys: key -> place, by GPU kernels.

``DeviceHash`` is an index of a ``DeviceVocabMap`` (state/vocab/device_map.py): raw id -> row over
the map's ``row_key``, and counted id -> entry over its counted ids. Its owner holds the keys (place
``v`` holds key ``owner[v]``); the index holds only places, 4 bytes a slot (8 for owners of 2**31 -
2 places or more). Open addressing with linear probing (kernels/gpu/index.py has the layout and the
kernels); deletion marks a slot deleted (a tombstone), so the index is rebuilt from its owner's keys
now and then.

Nothing here reads a value back to the host: how full the index is, is bounded on the host from
what was inserted since the last rebuild (an upper bound: each insert counts its keys as if every
one were taken), and a rebuild is due when that bound could pass three quarters of the slots
(``due``). With ``S >= 2 * capacity`` slots, a rebuild (``O(S)``) comes at most once every
``capacity / 2`` inserted keys: ``O(1)`` a key amortized.

Keys may be any int64: a slot's place, not a key, says whether it is used.
"""

from __future__ import annotations

import torch

from ...kernels import gpu

_I64 = torch.int64
_INT32_PLACES = 2**31 - 2  # places below this fit an int32 slot (v + 1 < 2**31 - 1)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def slots_for(capacity: int) -> int:
    """The slots of an index over ``capacity`` places: a power of two, at least twice it."""
    return max(16, _pow2(2 * int(capacity)))


class DeviceHash:
    """An index of up to ``capacity`` keys at once over ``owner``'s keys (place ``v`` holds key
    ``owner[v]``), on its device (CUDA, or CPU tensors under Triton's interpreter).

    Args:
        capacity: the owner's places (the most keys held at once).
        owner: (capacity,) int64, contiguous: the owner's keys (read, never written here).

    ``maps`` is the (1, 3) row of addresses the kernels read (its slots, its owner's keys, its
    slots less one), made once on the device; ``stacked`` concatenates several indexes' rows
    for one launch over them all. Moving the slots or the owner makes it again (``to``).
    """

    def __init__(self, capacity: int, owner: torch.Tensor) -> None:
        self.capacity = int(capacity)
        self.slots = slots_for(self.capacity)
        self.slot64 = self.capacity >= _INT32_PLACES
        dtype = _I64 if self.slot64 else torch.int32
        self.slot = torch.zeros(self.slots + 1, dtype=dtype, device=owner.device)  # (S + 1,)
        self.filled = 0  # a bound on the slots not empty (held or deleted)
        self._address(owner)

    def _address(self, owner: torch.Tensor) -> None:
        assert owner.dtype == _I64 and owner.is_contiguous() and owner.device == self.device
        self.owner = owner
        self.maps = torch.tensor([[self.slot.data_ptr(), owner.data_ptr(), self.slots - 1]],
                                 dtype=_I64, device=owner.device)  # (1, 3)

    @property
    def device(self) -> torch.device:
        return self.slot.device

    def nbytes(self) -> int:
        return self.slot.nbytes + self.maps.nbytes

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """(n,) int64: the place of each of the (n,) int64 ``keys``, -1 where absent."""
        return gpu.hash_find(keys, self.maps, None, self.slot64)

    def due(self, n: int) -> bool:
        """Whether inserting ``n`` more keys could fill more than 3/4 of the slots: rebuild
        first."""
        return self.filled + n > (3 * self.slots) // 4

    def insert(self, keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor) -> None:
        """Indexes ``keys[i]`` at ``places[i]`` where ``take[i]``: keys absent and distinct. The
        caller checks ``due(n)`` first (and rebuilds instead)."""
        self.filled += keys.numel()
        gpu.hash_insert(keys, places, take, self.maps, None, self.slot64)

    def delete(self, keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor) -> None:
        """Forgets ``keys[i]``, indexed at ``places[i]``, where ``take[i]``."""
        gpu.hash_delete(keys, places, take, self.maps, None, self.slot64)

    def rebuild(self, held: torch.Tensor) -> None:
        """Empties the index and indexes every place ``v`` of its owner where ``held[v]``."""
        self.slot.zero_()
        self.filled = 0
        self.insert(self.owner, torch.arange(self.owner.numel(), dtype=_I64,
                                             device=self.device), held)

    def to(self, owner: torch.Tensor) -> None:
        """Moves the slots to ``owner``'s device, ``owner`` its owner's keys there."""
        self.slot = self.slot.to(owner.device)
        self._address(owner)


class Stacked:
    """Several indexes, one launch over them all: ``find``, ``insert`` and ``delete`` of keys
    in runs (``counts[m]`` keys for index ``m``, in turn). Every index's slots must be of one
    width (``slot64``); see ``stack``."""

    def __init__(self, indexes: list[DeviceHash], counts: list[int]) -> None:
        self.indexes = indexes
        self.slot64 = indexes[0].slot64
        dev = indexes[0].device
        self.maps = torch.cat([h.maps for h in indexes])  # (M, 3)
        self.which = torch.empty(sum(counts), dtype=torch.int32, device=dev)  # (n,)
        at = 0
        for m, c in enumerate(counts):  # (fills on the device: nothing copied to it)
            self.which[at:at + c].fill_(m)
            at += c
        self.counts = counts

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return gpu.hash_find(keys, self.maps, self.which, self.slot64)

    def insert(self, keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor) -> None:
        for h, c in zip(self.indexes, self.counts):
            h.filled += c
        gpu.hash_insert(keys, places, take, self.maps, self.which, self.slot64)

    def delete(self, keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor) -> None:
        gpu.hash_delete(keys, places, take, self.maps, self.which, self.slot64)


def stack(indexes: list[DeviceHash], counts: list[int]) -> Stacked | None:
    """``Stacked`` over ``indexes``, or None where their slots differ in width."""
    if not indexes or len({h.slot64 for h in indexes}) > 1:
        return None
    return Stacked(indexes, counts)
