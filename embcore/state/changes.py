"""Which rows changed since a publish: a stamp per row, written by the step, read by ``publish``.

Online training publishes, again and again, the rows a stream changed since the last publish
(docs/semantics.md section 13). Scanning tables for them would read every byte of every table;
instead the step records the rows it writes. ``ChangedRows`` keeps, per physical table, an int32
**stamp** per shard row: every write of rows (an update's distinct rows, a dynamic table's new
rows) stamps them with the current **epoch**. A publish ``cut``\\s: it takes the epoch as its
mark and advances it, so writes after the cut carry a later epoch. The rows changed since a
publish that cut at ``c`` are those stamped above ``c`` (``since``): one pass over 4 bytes a
row, never over the rows themselves.

One set of stamps serves any number of publish directories, each remembering its own last cut,
and a failed publish loses nothing (its directory keeps its previous cut, so the next publish
takes those rows again). Tracking starts with the first publish (before it, nothing is stamped
and a step pays nothing): that publish is a full snapshot, so no earlier change is needed.
"""

from __future__ import annotations

import torch

_STAMP = torch.int32
MAX_EPOCH = 2**31 - 1


class ChangedRows:
    """Stamps of the rows of every physical table on this process.

    Args:
        rows: per physical table, its shard's rows on this process.
    """

    def __init__(self, rows: list[int]) -> None:
        self.epoch = 1  # what writes stamp now; 0: never written since tracking began
        self.stamps = [torch.zeros(n, dtype=_STAMP) for n in rows]  # (N_p,) per table

    def mark(self, p: int, rows: torch.Tensor) -> None:
        """Rows ``rows`` (shard rows of physical table ``p``, any order, repeats allowed;
        out-of-range rows, such as a dynamic table's zero row, are ignored) were written."""
        stamps = self.stamps[p]
        if rows.device.type != "cpu":
            rows = rows.cpu()
        index = rows.numpy()
        if index.size and int(index.max()) >= stamps.numel():
            index = index[index < stamps.numel()]
        # numpy, one thread: a torch op here would wake torch's OpenMP workers, whose spinning
        # afterwards (GOMP_SPINCOUNT) takes the cores from the step's own kernels
        stamps.numpy()[index] = self.epoch

    def mark_all(self, p: int | None = None) -> None:
        """Every row of physical table ``p`` (None: of every table) was written."""
        for i, stamps in enumerate(self.stamps):
            if p is None or i == p:
                stamps.fill_(self.epoch)

    def cut(self) -> int:
        """Starts a publish: returns its cut (every write so far is stamped at or below it) and
        moves later writes to the next epoch."""
        if self.epoch >= MAX_EPOCH:  # (2^31 publishes: 68 years at one a second)
            raise OverflowError("2^31 publishes from one engine; build a new one (ec.load the "
                                "directory) to go on")
        cut = self.epoch
        self.epoch += 1
        return cut

    def since(self, p: int, cut: int) -> torch.Tensor:
        """(n,) int64 shard rows of physical table ``p`` written after the publish that cut at
        ``cut``, ascending."""
        return (self.stamps[p] > cut).nonzero().squeeze(1)
