"""Which rows changed since a publish: a flag per row, set by the step, taken by ``publish``.

Online training publishes, again and again, the rows a stream changed since the last publish
(docs/semantics.md section 13). Scanning tables for them would read every byte of every table;
instead the step records the rows it writes. ``ChangedRows`` keeps, per physical table, a byte
per shard row: every write of rows (an update's distinct rows, a dynamic table's new and used
rows) sets their flags (``mark``). A publish ``take``\\s the flagged rows, one pass over a byte a
row (never over the rows themselves), and clears the flags.

Several directories may be published to: each has a key, and when one takes the flags, the
rows it took stay pending for the others (a flag array per other key, made when there are
several). A failed publish gives its rows back (``give_back``), so nothing is lost. Tracking
starts with the first publish (before it, nothing is flagged and a step pays nothing): that
publish is a full snapshot, so no earlier change is needed.

A byte a row, not a wider stamp: the flags of a step's rows are written where the step's own
rows have just left the caches, so their cost is the cache misses, and bytes keep the array a
quarter of an int32's (W1: 2.6 MB; 0.35 ms a step against 0.55 ms for int32 stamps, benchmarks/
studies/online.py). They are set with numpy, on one thread: a torch op here would wake torch's
OpenMP workers, whose spinning afterwards (GOMP_SPINCOUNT) takes the cores from the step's own
kernels.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch


class ChangedRows:
    """Flags of the rows of every physical table on this process written since a publish.

    Args:
        rows: per physical table, its shard's rows on this process.
    """

    def __init__(self, rows: list[int]) -> None:
        # (N_p + 1,) per table: the last flag is a dynamic table's zero row (marked with the
        # rows a step resolves, never taken), so marking needs no range check
        self.rows = list(rows)
        self.flags = [np.zeros(n + 1, dtype=np.uint8) for n in rows]
        self.pending: dict[Hashable, list[np.ndarray] | None] = {}  # key -> flags it missed

    def mark(self, p: int, rows: torch.Tensor) -> None:
        """Rows ``rows`` (shard rows of physical table ``p``, or a dynamic table's zero row; any
        order, repeats allowed) were written."""
        if rows.device.type != "cpu":
            rows = rows.cpu()
        self.flags[p][rows.numpy()] = 1

    def mark_all(self, p: int | None = None) -> None:
        """Every row of physical table ``p`` (None: of every table) was written."""
        for i, flags in enumerate(self.flags):
            if p is None or i == p:
                flags.fill(1)

    def take(self, key: Hashable) -> list[torch.Tensor]:
        """The rows written since ``key``'s last ``take``, per physical table ((n,) int64 shard
        rows, ascending); clears them for ``key`` (the other keys keep them pending). The first
        take of a key is its start: what it returns then is for a snapshot to ignore."""
        mine = self.pending.get(key)
        out = []
        for p, flags in enumerate(self.flags):
            dirty = flags[:self.rows[p]] if mine is None else (flags | mine[p])[:self.rows[p]]
            out.append(torch.from_numpy(np.flatnonzero(dirty)).to(torch.int64))
            for other, theirs in self.pending.items():
                if other == key:
                    continue
                if theirs is None:
                    theirs = self.pending[other] = [np.zeros_like(f) for f in self.flags]
                theirs[p] |= flags
            flags.fill(0)
        self.pending[key] = None  # (nothing pending: it just took everything)
        return out

    def give_back(self, key: Hashable, rows: list[torch.Tensor]) -> None:
        """A publish of ``key`` failed: its rows are pending for it again."""
        mine = self.pending.get(key)
        if mine is None:
            mine = self.pending[key] = [np.zeros_like(f) for f in self.flags]
        for p, r in enumerate(rows):
            mine[p][r.numpy()] = 1

    def forget(self, key: Hashable) -> None:
        """``key`` publishes no more (its pending flags go)."""
        self.pending.pop(key, None)
