"""The index of a write-back cache on the device: ``CacheIndex``'s structure, stepped on the GPU.

A cache over a shard of ``N`` rows in a slow tier (state/tier/cache.py) keeps ``C`` of them in fast
memory. ``DeviceCacheIndex`` holds ``CacheIndex``'s state (state/tier/index.py) on the device,
each per-cache-row tensor a view of a buffer one longer (index ``C`` takes the writes of lanes
that change nothing), and steps it in tensors whose sizes the host knows, so that a step reads
nothing back to the host:

- ``where`` (N,) int32 the cache row of each shard row (-1: not cached); per cache row ``owner``
  (-1: free), ``stamp`` (the clock of its last use, ``FREE_STAMP`` when free), ``dirty`` and
  ``fresh``; ``counts`` (3, T) hits, misses and new rows per member table.
- ``step(rows)`` of a step's U distinct shard rows: hits get ``stamp = clock``; when the misses
  outnumber the free cache rows, the least recently used cache rows not used by the step are
  evicted, by (stamp, cache row) (``ops/selection.py``, k on the device), as many as the misses
  need plus ``spare`` (or every one there is); the misses take the lowest free cache rows, in
  their order. Returned with masks: the cache rows of the step's rows, which of them to read,
  and the evicted dirty cache rows with their shard rows, to write back before the reads.

The policy differs from ``CacheIndex``'s in which free cache row a miss takes (the lowest, not
the top of a stack): which rows the cache keeps and where decides only where a row is, never
what it holds, so a run's results do not depend on it (docs/semantics.md section 10). A step
costs ``O(U)`` plus ``O(C)`` elementwise (the free rows, a ``topk`` for the victims).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...ops.selection import first_set, smallest_ordered
from .index import FREE_STAMP, MAX_CAPACITY

_I64 = torch.int64


class DeviceStep(NamedTuple):
    slots: torch.Tensor      # (U,) the cache rows of the step's rows
    miss: torch.Tensor       # (U,) bool: read shard row rows[i] into slots[i]
    out_slots: torch.Tensor  # (K,) evicted cache rows ...
    out_rows: torch.Tensor   # (K,) ... and the shard rows they held
    out: torch.Tensor        # (K,) bool: write that one back (evicted and dirty)
    evicted: torch.Tensor    # 0-d int64: 1 when the step evicted, else 0


class DeviceCacheIndex:
    """``CacheIndex`` on ``device`` (module docstring). Arguments as ``CacheIndex``'s, and the
    device (CUDA, or CPU tensors under Triton's interpreter)."""

    def __init__(self, rows: int, capacity: int, bounds: Sequence[int] = (),
                 device: torch.device | str = "cuda") -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a cache holds 1 to {MAX_CAPACITY} rows, not {capacity}")
        dev = self.device = torch.device(device)
        self.rows, self.capacity = rows, capacity
        c = capacity
        self._where_buf = torch.full((rows + 1,), -1, dtype=torch.int32, device=dev)
        self.where = self._where_buf[:rows]
        self._owner = torch.full((c + 1,), -1, dtype=_I64, device=dev)
        self._stamp = torch.full((c + 1,), FREE_STAMP, dtype=_I64, device=dev)
        self._dirty = torch.zeros(c + 1, dtype=torch.bool, device=dev)
        self._fresh = torch.zeros(c + 1, dtype=torch.bool, device=dev)
        self.owner, self.stamp = self._owner[:c], self._stamp[:c]
        self.dirty, self.fresh = self._dirty[:c], self._fresh[:c]
        self.clock = 0
        self.bounds = torch.tensor(list(bounds), dtype=_I64, device=dev)  # (T - 1,)
        self.counts = torch.zeros(3, len(self.bounds) + 1, dtype=_I64, device=dev)

    def step(self, rows: torch.Tensor, count: bool = True, spare: int = 0) -> DeviceStep:
        """Cache rows for the (U,) distinct int64 shard ``rows`` on the device, U at most the
        capacity (the caller grows the cache first)."""
        assert rows.numel() <= self.capacity
        self.clock += 1
        clock, c, u, dev = self.clock, self.capacity, rows.numel(), self.device
        slots = self.where[rows].to(_I64)  # (U,)
        hit = slots >= 0
        held = torch.where(hit, slots, c)  # (U,) c: none
        if count:
            self._count(rows, hit, self._fresh[held])
        self._fresh.index_fill_(0, held, False)
        self._stamp.index_fill_(0, held, clock)
        miss = ~hit
        n_miss = miss.sum()
        free = self.owner < 0
        n_free = free.sum()
        candidates = self.stamp < clock  # (C,) in use, not used by this step
        kmax = min(u + spare, c)
        k = torch.where(n_miss > n_free,
                        torch.minimum(n_miss - n_free + spare, candidates.sum()), 0)
        victims = smallest_ordered(self.stamp, torch.arange(c, device=dev), candidates,
                                   k.clamp(max=kmax), kmax)  # (K,)
        gone = torch.arange(kmax, device=dev) < k  # (K,)
        out_rows = self._owner[victims]
        out = gone & self._dirty[victims]
        at = torch.where(gone, victims, c)  # (K,) c: none
        self._where_buf.index_fill_(0, torch.where(gone, out_rows, self.rows), -1)
        self._owner.index_fill_(0, at, -1)
        self._stamp.index_fill_(0, at, FREE_STAMP)
        self._dirty.index_fill_(0, at, False)
        self._fresh.index_fill_(0, at, False)
        spots = first_set(self.owner < 0, u)  # (U + 1,) the lowest free cache rows
        taken = spots[(miss.cumsum(0) - 1).clamp(min=0)]  # (U,)
        slots = torch.where(hit, slots, taken)
        put = torch.where(miss, taken, c)  # (U,) c: none
        self._where_buf.index_put_((torch.where(miss, rows, self.rows),),
                                   taken.to(torch.int32))
        self._owner.index_put_((put,), rows)
        self._stamp.index_fill_(0, put, clock)
        self._dirty.index_fill_(0, put, False)
        self._fresh.index_fill_(0, put, False)
        return DeviceStep(slots, miss, victims, out_rows, out, (k > 0).to(_I64))

    def _count(self, rows: torch.Tensor, hit: torch.Tensor, fresh: torch.Tensor) -> None:
        """Adds each row to its member table's hits, misses or new rows."""
        member = torch.bucketize(rows, self.bounds, right=True)  # (U,)
        new = hit & fresh
        for i, which in enumerate((hit & ~new, ~hit, new)):
            self.counts[i].index_add_(0, member, which.to(_I64))

    def count_held(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Counts a lookup of distinct shard rows ``rows`` already held at cache rows ``slots``
        (no step): each a hit, or new when its fresh flag is set (then cleared)."""
        self._count(rows, torch.ones_like(rows, dtype=torch.bool), self.fresh[slots])
        self.fresh.index_fill_(0, slots, False)

    def mark(self, flags: torch.Tensor, slots: torch.Tensor) -> None:
        """``flags[slots] = True`` (``dirty`` or ``fresh``)."""
        flags.index_fill_(0, slots.to(self.device), True)

    def dirty_slots(self) -> torch.Tensor:
        """(n,) the cache rows updated since read (each holds a row)."""
        return (self.dirty & (self.owner >= 0)).nonzero().squeeze(1)
