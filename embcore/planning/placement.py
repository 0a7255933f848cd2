"""Placements: how one logical table's rows and columns are spread over W processes.

One small class per sharding strategy (docs/semantics.md section 5). Everything that depends on a
strategy is a method here, so the plan, the routing of ids, the exchange and the checkpoint layout
ask the placement instead of testing strategy names:

- ``span(rank)``: the table's rows held by ``rank`` as arithmetic, ``(first, stride, count)``:
  its local row i is row ``first + i * stride`` (every strategy holds evenly spaced rows), so
  the planner counts rows of tables of any size without making a tensor per row;
- ``held_rows(rank)`` / ``held_block(rank, start, stop)``: those row ids as a tensor, all of them
  or local rows ``start .. stop`` only (to go over a large shard in bounded blocks);
- ``columns(rank)``: the column range ``[c0, c1)`` held by ``rank``;
- ``owner_of(rows)``: the rank holding each row and its index in that rank's rows of the table;
- ``held_everywhere`` / ``splits_columns``: whether a lookup needs no exchange (every process
  holds every row) or asks every process for a column slice of every row;
- ``owner_of_ids(ids)``: for a dynamic table (raw ids), the rank that owns each id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..numerics import hashing


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """``n`` split in ``parts`` contiguous blocks, the first ``n % parts`` one longer."""
    q, rem = divmod(n, parts)
    return tuple(q + 1 if i < rem else q for i in range(parts))


@dataclass(frozen=True)
class Placement:
    """Base: a table of ``rows`` x ``dim`` over ``world`` processes (every rank holds it all)."""

    rows: int
    dim: int
    world: int
    strategy = "replicated"
    replicated = True        # every rank holds every row and column
    splits_columns = False   # every rank holds every row, a slice of the columns
    row_ids = True           # places a table whose ids are rows
    raw_ids = True           # places a dynamic table (raw ids, owners by owner_of_ids)

    @property
    def held_everywhere(self) -> bool:
        """Whether every process holds every row and column (no exchange for a lookup)."""
        return self.replicated or self.world == 1

    @classmethod
    def check(cls, table: str, dim: int, optimizer: Any, world: int) -> None:
        """Raises ValueError when the strategy cannot hold this table (at plan time)."""

    def span(self, rank: int) -> tuple[int, int, int]:
        """``(first, stride, count)`` of the rows ``rank`` holds: its local row i is row
        ``first + i * stride``, for i in ``0 .. count - 1``."""
        return 0, 1, self.rows

    def held_count(self, rank: int) -> int:
        """How many rows ``rank`` holds (``len(held_rows(rank))``, without making the ids: the
        planner counts rows of tables it must not materialize)."""
        return self.span(rank)[2]

    def held_rows(self, rank: int) -> torch.Tensor:
        """(n_r,) int64 row ids held by ``rank``, in local order (8 bytes a row: for a large
        shard, ``held_block`` or ``span``)."""
        return self.held_block(rank, 0, self.held_count(rank))

    def held_block(self, rank: int, start: int, stop: int) -> torch.Tensor:
        """Row ids of ``rank``'s local rows ``start .. stop - 1`` (clipped to its rows)."""
        first, stride, count = self.span(rank)
        start, stop = max(0, min(start, count)), max(0, min(stop, count))
        return torch.arange(max(0, stop - start), dtype=torch.int64) * stride + (
            first + start * stride)

    def columns(self, rank: int) -> tuple[int, int]:
        return 0, self.dim

    def owner_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For row ids ``rows``: (owner rank, index among the owner's ``held_rows``)."""
        return torch.zeros_like(rows), rows

    def owner_of_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """For raw ids of a dynamic table: the rank owning each (its map places it)."""
        return self.owner_of(ids)[0]


class Replicated(Placement):
    """Every process holds the whole table; gradients are summed across processes."""


@dataclass(frozen=True)
class WholeTable(Placement):
    """The whole table on one process, ``owner``."""

    owner: int = 0
    strategy = "table"
    replicated = False

    def span(self, rank: int) -> tuple[int, int, int]:
        return 0, 1, self.rows if rank == self.owner else 0

    def owner_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full_like(rows, self.owner), rows


def _block_span(p: Placement, rank: int) -> tuple[int, int, int]:
    """The rows ``rank`` holds of ``p``'s rows in W contiguous blocks (``RowDiv``, ``Hashed``),
    the first ``rows % W`` one row longer: ``(first, 1, count)``."""
    q, rem = divmod(p.rows, p.world)
    return rank * q + min(rank, rem), 1, q + (1 if rank < rem else 0)


def _block_owner(p: Placement, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``owner_of`` of ``p``'s rows in W contiguous blocks (``RowDiv``, ``Hashed``)."""
    q, rem = divmod(p.rows, p.world)
    boundary = rem * (q + 1)
    big = rows < boundary
    owner = torch.where(big, torch.div(rows, q + 1, rounding_mode="floor"),
                        rem + torch.div(rows - boundary, max(q, 1), rounding_mode="floor"))
    start = torch.where(big, owner * (q + 1), boundary + (owner - rem) * q)
    return owner, rows - start


class RowDiv(Placement):
    """Rows in W contiguous blocks, the first ``rows % W`` blocks one row longer."""

    strategy = "row_div"
    replicated = False

    raw_ids = False

    def span(self, rank: int) -> tuple[int, int, int]:
        return _block_span(self, rank)

    def owner_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _block_owner(self, rows)


class RowMod(Placement):
    """Row i on process ``i % W``, at local index ``i // W`` (TF's "mod")."""

    strategy = "row_mod"
    replicated = False
    raw_ids = False

    def span(self, rank: int) -> tuple[int, int, int]:
        return rank, self.world, max(0, -(-(self.rows - rank) // self.world))  # 0: rank >= rows

    def owner_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows % self.world, torch.div(rows, self.world, rounding_mode="floor")


class ColumnSplit(Placement):
    """Every process holds every row and a contiguous slice of the D columns (the first
    ``dim % W`` slices one column wider)."""

    strategy = "column"
    replicated = False
    splits_columns = True
    raw_ids = False

    @classmethod
    def check(cls, table: str, dim: int, optimizer: Any, world: int) -> None:
        if dim < world:
            raise ValueError(f"table {table!r}: a column split over {world} processes needs "
                             f"dim >= {world}, but dim is {dim}; choose another strategy for it")
        if world > 1 and optimizer is not None and any(s.rowwise for s in optimizer.slots):
            raise ValueError(f"table {table!r}: {type(optimizer).__name__} keeps one accumulator "
                             f"per row over all D columns, which a column split cannot hold; "
                             f"choose another strategy for it")

    def columns(self, rank: int) -> tuple[int, int]:
        widths = split_sizes(self.dim, self.world)
        return sum(widths[:rank]), sum(widths[:rank + 1])


class Hashed(Placement):
    """A dynamic table's rows in W blocks like ``RowDiv`` (``rows`` is its capacity); raw id x
    is owned by process ``splitmix64(x) % W``, whose map gives it a row of its block."""

    strategy = "hash"
    replicated = False

    row_ids = False

    def span(self, rank: int) -> tuple[int, int, int]:
        return _block_span(self, rank)

    def owner_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _block_owner(self, rows)

    def owner_of_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return hashing.owner(ids, self.world)


STRATEGIES: dict[str, type[Placement]] = {
    cls.strategy: cls for cls in (Replicated, WholeTable, RowDiv, RowMod, ColumnSplit, Hashed)}


def make_placement(strategy: str, rows: int, dim: int, world: int,
                   owner: int = 0) -> Placement:
    """The placement of a ``rows`` x ``dim`` table by ``strategy`` over ``world`` processes.

    With one process every strategy holds the whole table, so it is ``Replicated`` in effect;
    the strategy's name is kept for the plan's description.
    """
    cls = STRATEGIES[strategy]
    if cls is WholeTable:
        return WholeTable(rows, dim, world, owner)
    return cls(rows, dim, world)
