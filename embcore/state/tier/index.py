"""The index of a write-back cache (cache.py): which cache row holds which shard row.

A shard of ``N`` rows has a cache of ``C`` rows. The index is direct: ``where`` (N,) int32 holds
each shard row's cache row, or ``-1 - v`` for a row not cached, so a step finds a row with one
read (4 bytes a shard row, the price of a hash map's probes saved on every lookup). ``v`` is the
row's **version** (0 to 2**31 - 1), which its checksum in the slow tier is keyed to (cache.py,
ops/checksum.py): the index keeps it for the cache, in ``where`` while the row is not cached and
in ``version`` (per cache row) while it is, and moves it between them (a miss takes it, an
eviction gives it back), so that versions cost no memory per shard row. Per cache row: ``owner``
(the shard row it holds, or -1), ``stamp`` (the clock of its last use; ``FREE_STAMP`` when
free), ``dirty`` (updated since read: written back before it is given to another row),
``fresh`` (given to a new id of a dynamic table and not looked up since: counted as new, not as
a hit) and ``version``. The free cache rows form a stack.

``step(rows)`` takes a step's distinct shard rows and returns their cache rows:

- a cached row (a hit) gets ``stamp = clock`` (the clock advances once per step);
- when the rows not cached (misses) outnumber the free cache rows, the least recently used cache
  rows that this step does not use are evicted, by ``(stamp, cache row)``: as many as the misses
  need plus ``spare`` more (so that the next steps admit into free rows without a scan), or every
  one there is. Their dirty ones are returned (to be written back now) and every evicted row
  joins the free stack, the lower ones on top;
- misses take cache rows from the top of the stack, in their order, and are returned (to be read).

Which rows the cache keeps decides only where a row is, never what it holds: results do not
depend on this policy. ``step`` runs on the fused kernels (``cpu.cache_step``) where the index
was made for the fused CPU backend (``CacheIndex(backend=...)``), and otherwise
on torch ops, below, which are also its specification (tests/test_cache_index.py holds them
equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...kernels import cpu
from ...ops.backend import TORCH_OPS, Backend

MAX_CAPACITY = 2**31 - 1  # cache rows (``where`` is int32)
FREE_STAMP = 2**63 - 1  # the stamp of a free cache row (never a candidate for eviction)
# (What this index and the slow tier's log take per row, which the planner charges, is
# config/tables.py's INDEX_BYTES_PER_ROW, WHERE_BYTES_PER_ROW and LOG_BYTES_PER_ROW.)


class Step(NamedTuple):
    slots: torch.Tensor       # (U,) the cache rows of the step's rows
    miss_rows: torch.Tensor   # (M,) shard rows to read ...
    miss_slots: torch.Tensor  # (M,) ... into these cache rows
    out_rows: torch.Tensor    # (O,) shard rows to write back (evicted, dirty) ...
    out_slots: torch.Tensor   # (O,) ... from these cache rows (before the reads)
    evicted: int              # cache rows evicted (dirty or not)


class CacheIndex:
    """The index of a cache of ``capacity`` rows over a shard of ``rows`` rows.

    Args:
        rows: shard rows ``N``.
        capacity: cache rows ``C`` (at most ``MAX_CAPACITY``).
        bounds: the first shard row of each member table but the first (per-table counts).
        backend: the backend of host memory (``Backend.host``): the fused kernels step the
            index where it is the fused CPU one, else torch ops (the same results).
    """

    def __init__(self, rows: int, capacity: int, bounds: Sequence[int] = (),
                 backend: Backend = TORCH_OPS) -> None:
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a cache holds 1 to {MAX_CAPACITY} rows, not {capacity}")
        self.rows, self.capacity = rows, capacity
        self.fused = backend.fused_cpu  # (bound once: no call asks again)
        self.where = torch.full((rows,), -1, dtype=torch.int32)
        self.owner = torch.full((capacity,), -1, dtype=torch.int64)
        self.stamp = torch.full((capacity,), FREE_STAMP, dtype=torch.int64)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.fresh = torch.zeros(capacity, dtype=torch.bool)
        self.version = torch.zeros(capacity, dtype=torch.int32)  # (C,) each cache row's row's
        self.free = torch.arange(capacity - 1, -1, -1, dtype=torch.int64)  # row 0 on top
        self.n_free = capacity
        self.clock = 0
        self.bounds = torch.tensor(list(bounds), dtype=torch.int64)  # (T - 1,)
        self.counts = torch.zeros(3, len(self.bounds) + 1, dtype=torch.int64)  # hits, misses, new

    def step(self, rows: torch.Tensor, count: bool = True, spare: int = 0) -> Step | None:
        """Cache rows for distinct shard rows ``rows`` (U,) int64 CPU (see the module's
        docstring; ``count``: add each row to its member table's hits, misses or new in
        ``counts``). None when U exceeds the capacity (nothing changed)."""
        if rows.numel() > self.capacity:
            return None
        self.clock += 1
        if self.fused:
            got = cpu.cache_step(rows.contiguous(), self.where, self.owner, self.stamp,
                                    self.dirty, self.fresh, self.version, self.free,
                                    self.n_free, self.clock,
                                    spare, self.bounds if count else None,
                                    self.counts if count else None)
            assert got is not None
            slots, miss_rows, miss_slots, out_rows, out_slots, n_free, evicted = got
            self.n_free = int(n_free)
            return Step(slots, miss_rows, miss_slots, out_rows, out_slots, int(evicted))
        return self._step(rows, count, spare)

    def _step(self, rows: torch.Tensor, count: bool, spare: int) -> Step:
        """``step`` in torch ops."""
        clock = self.clock
        slots = self.where[rows].to(torch.int64)  # (U,)
        hit = slots >= 0
        hit_slots = slots[hit]
        self.stamp[hit_slots] = clock
        miss_rows = rows[~hit]
        if count:
            member = torch.bucketize(rows, self.bounds, right=True)  # (U,)
            new = torch.zeros_like(hit)
            new[hit] = self.fresh[hit_slots]
            self.fresh[hit_slots] = False
            n = self.counts.shape[1]
            for i, which in enumerate((hit & ~new, ~hit, new)):
                self.counts[i] += torch.bincount(member[which], minlength=n)
        out_rows = out_slots = rows.new_empty(0)
        evicted = 0
        if miss_rows.numel() > self.n_free:
            candidates = (self.stamp < clock).nonzero().squeeze(1)  # (free rows: FREE_STAMP)
            k = min(miss_rows.numel() - self.n_free + spare, candidates.numel())
            oldest = torch.sort(self.stamp[candidates], stable=True).indices[:k]  # ties: lower
            victims = candidates[oldest].sort(descending=True).values  # (k,)
            out_slots = victims[self.dirty[victims]]
            out_rows = self.owner[out_slots]
            self.dirty[victims] = False
            self.fresh[victims] = False
            self.where[self.owner[victims]] = -1 - self.version[victims]
            self.owner[victims] = -1
            self.stamp[victims] = FREE_STAMP
            self.free[self.n_free:self.n_free + k] = victims  # the lowest ends on top
            self.n_free += k
            evicted = k
        m = miss_rows.numel()
        miss_slots = self.free[self.n_free - m:self.n_free].flip(0)  # popped from the top
        self.n_free -= m
        slots[~hit] = miss_slots
        self.version[miss_slots] = -1 - self.where[miss_rows]
        self.where[miss_rows] = miss_slots.to(torch.int32)
        self.owner[miss_slots] = miss_rows
        self.stamp[miss_slots] = clock
        self.dirty[miss_slots] = False
        self.fresh[miss_slots] = False
        return Step(slots, miss_rows, miss_slots, out_rows, out_slots, evicted)

    def versions(self, rows: torch.Tensor, advance: bool = False) -> torch.Tensor:
        """(n,) int32: the versions of distinct shard rows ``rows`` ((n,) int64 CPU), cached or
        not; ``advance``: each first advanced by one (mod 2**31) and kept (a write of the
        rows' checksums). On the kernels (``cpu.row_versions``), else torch ops."""
        if self.fused:
            return cpu.row_versions(self.where, self.version, rows.contiguous(), advance)
        w = self.where.index_select(0, rows)  # (n,) cache rows, or -1 - v
        held = self.version.index_select(0, w.clamp(min=0).to(torch.int64))
        v = torch.where(w >= 0, held, -1 - w)
        if advance:
            v = (v + 1) & 0x7FFFFFFF
            self.set_versions(rows, v)
        return v

    def set_versions(self, rows: torch.Tensor, versions: torch.Tensor) -> None:
        """Sets the versions of distinct shard rows ``rows`` ((n,) int64 CPU) to ``versions``
        ((n,) int32, 0 to 2**31 - 1)."""
        w = self.where.index_select(0, rows)
        cached = w >= 0
        if bool(cached.all()):  # (a flush's rows: all cached; an eviction's: none)
            self.version.index_copy_(0, w.to(torch.int64), versions)
        elif not bool(cached.any()):
            self.where.index_copy_(0, rows, -1 - versions)
        else:
            self.version.index_copy_(0, w[cached].to(torch.int64), versions[cached])
            self.where.index_copy_(0, rows[~cached], -1 - versions[~cached])

    def count_held(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Counts a lookup of distinct shard rows ``rows`` already held at cache rows ``slots``
        (both (U,) int64 CPU; no step): each a hit, or new when its fresh flag is set (then
        cleared), as ``step`` counts them."""
        fresh = self.fresh[slots]
        member = torch.bucketize(rows, self.bounds, right=True)
        n = self.counts.shape[1]
        if bool(fresh.any()):
            self.fresh[slots[fresh]] = False
            self.counts[2] += torch.bincount(member[fresh], minlength=n)
            member = member[~fresh]
        self.counts[0] += torch.bincount(member, minlength=n)

    def mark(self, flags: torch.Tensor, slots: torch.Tensor) -> None:
        """``flags[slots] = True`` (``dirty`` or ``fresh``; ``slots`` (n,) int64 CPU)."""
        if self.fused:
            cpu.set_flags(flags, slots.contiguous(), True)
        else:
            flags[slots] = True

    def dirty_slots(self) -> torch.Tensor:
        """(n,) the cache rows updated since read (each holds a row)."""
        return (self.dirty & (self.owner >= 0)).nonzero().squeeze(1)
