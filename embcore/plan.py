"""The plan: where every logical table lives (pure; configs + world size -> a frozen ShardingPlan).

Table stacking: logical tables of equal dim, dtype, optimizer math and placement share one physical
table, each at its own row offset, so a step does one dedup, one exchange, one lookup and one
optimizer update per physical table rather than per table or per feature. Combiners and
initializers do not matter for stacking: combining is folded into per-id scales (inputs.py) and
initial values are made per table.

Strategies (DESIGN 2.5), each applied to every logical table on its own:
- ``replicated``: every process holds the whole table; gradients are summed across processes.
- ``table``: the whole table on one owner process (chosen to balance memory, then lookups).
- ``row_div``: rows in W contiguous blocks, the first ``N % W`` blocks one row longer.
- ``row_mod``: row i on process ``i % W`` (local row ``i // W``).
- ``column``: every process holds all rows and a contiguous slice of the D columns (the first
  ``D % W`` slices one column wider).
On each process the shard of a physical table is its member tables' local rows one after another.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .config import TableConfig
from .optimizers import Optimizer

Strategy = Literal["replicated", "table", "row_div", "row_mod", "column"]
STRATEGIES: tuple[str, ...] = ("replicated", "table", "row_div", "row_mod", "column")
# "auto" replicates tables whose parameters and slots take less than this.
AUTO_REPLICATE_BYTES = 1 << 20


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """``n`` split in ``parts`` contiguous blocks, the first ``n % parts`` one longer."""
    q, rem = divmod(n, parts)
    return tuple(q + 1 if i < rem else q for i in range(parts))


@dataclass(frozen=True)
class TablePlacement:
    """One logical table inside the plan."""

    name: str
    strategy: str
    physical: int        # index of its physical table
    row_offset: int      # first row in the physical table's global row space
    rows: int            # N
    dim: int             # D
    slot_names: tuple[str, ...]
    owner: int = 0       # the owner process for "table"
    local_rows: tuple[int, ...] = ()     # rows of this table held by each rank
    local_offsets: tuple[int, ...] = ()  # where they start in each rank's physical shard

    def rank_rows(self, rank: int, world_size: int) -> torch.Tensor:
        """Row ids (0..N-1) of this table held by ``rank``, in local order."""
        n = self.rows
        if self.strategy in ("replicated", "column") or world_size == 1:
            return torch.arange(n)
        if self.strategy == "table":
            return torch.arange(n) if rank == self.owner else torch.arange(0)
        if self.strategy == "row_mod":
            return torch.arange(min(rank, n), n, world_size)  # none when rank >= n
        sizes = split_sizes(n, world_size)
        start = sum(sizes[:rank])
        return torch.arange(start, start + sizes[rank])

    def owner_and_local(self, rel: torch.Tensor, world_size: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
        """For row ids ``rel`` (0..N-1): their owner rank and their row in its physical shard.

        Only for "table", "row_div" and "row_mod" (the others are held by every rank).
        """
        if self.strategy == "table":
            owner = torch.full_like(rel, self.owner)
            local = rel
        elif self.strategy == "row_mod":
            owner, local = rel % world_size, torch.div(rel, world_size, rounding_mode="floor")
        else:  # row_div
            q, rem = divmod(self.rows, world_size)
            boundary = rem * (q + 1)
            big = rel < boundary
            owner_big = torch.div(rel, q + 1, rounding_mode="floor")
            owner_small = rem + torch.div(rel - boundary, max(q, 1), rounding_mode="floor")
            owner = torch.where(big, owner_big, owner_small)
            start = torch.where(big, owner * (q + 1), boundary + (owner - rem) * q)
            local = rel - start
        offsets = torch.tensor(self.local_offsets, dtype=rel.dtype, device=rel.device)
        return owner, local + offsets[owner]


@dataclass(frozen=True)
class PhysicalTable:
    """Rows of one or more stacked logical tables, updated by one optimizer."""

    index: int
    tables: tuple[str, ...]
    rows: int            # global rows (all member tables)
    dim: int             # D
    dtype: torch.dtype
    strategy: str
    optimizer: Optimizer | None
    local_rows: tuple[int, ...] = ()   # rows of the shard on each rank
    columns: tuple[tuple[int, int], ...] = ()  # column range held by each rank

    @property
    def bytes_per_row(self) -> int:
        slots = self.optimizer.slots if self.optimizer is not None else ()
        slot_cols = sum(1 if s.rowwise else self.dim for s in slots)
        return self.dim * self.dtype.itemsize + slot_cols * 4


@dataclass(frozen=True)
class ShardingPlan:
    """Frozen placement of every table; ``print(plan)`` shows it."""

    world_size: int
    tables: tuple[TablePlacement, ...]
    physical: tuple[PhysicalTable, ...]

    def table(self, name: str) -> TablePlacement:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table named {name!r} in the plan; tables: "
                       f"{[t.name for t in self.tables]}")

    def describe(self) -> list[dict[str, Any]]:
        """JSON-able description (goes into checkpoint manifests)."""
        return [{"table": t.name, "strategy": t.strategy, "physical": t.physical,
                 "row_offset": t.row_offset, "rows": t.rows, "dim": t.dim, "owner": t.owner,
                 "local_rows": list(t.local_rows)} for t in self.tables]

    def bytes_per_rank(self) -> list[int]:
        """Parameter + slot bytes each rank holds."""
        out = [0] * self.world_size
        for p in self.physical:
            for r in range(self.world_size):
                c0, c1 = p.columns[r]
                frac = (c1 - c0) / p.dim if p.dim else 0.0
                out[r] += int(p.local_rows[r] * p.bytes_per_row * frac)
        return out

    def __str__(self) -> str:
        w = self.world_size
        lines = [f"ShardingPlan(world_size={w}, {len(self.tables)} tables in "
                 f"{len(self.physical)} physical tables)",
                 f"  {'table':<20} {'strategy':<10} {'physical':>8} {'rows':>10} {'dim':>5}  "
                 f"rows per rank / MB per rank"]
        for t in self.tables:
            p = self.physical[t.physical]
            per_rank = []
            for r in range(w):
                c0, c1 = p.columns[r]
                mb = t.local_rows[r] * p.bytes_per_row * (c1 - c0) / max(p.dim, 1) / 2**20
                per_rank.append(f"{t.local_rows[r]}/{mb:.2f}")
            lines.append(f"  {t.name:<20} {t.strategy:<10} {t.physical:>8} {t.rows:>10} "
                         f"{t.dim:>5}  {' '.join(per_rank)}")
        total = " ".join(f"{b / 2**20:.2f}" for b in self.bytes_per_rank())
        lines.append(f"  MB per rank (parameters + slots): {total}")
        return "\n".join(lines)


def _table_bytes(cfg: TableConfig, opt: Optimizer | None) -> int:
    slots = opt.slots if opt is not None else ()
    cols = cfg.dim * cfg.dtype.itemsize + sum(4 if s.rowwise else 4 * cfg.dim for s in slots)
    return cfg.vocabulary_size * cols


def table_strategies(tables: Sequence[tuple[str, TableConfig, Optimizer | None]],
                     world_size: int,
                     sharding: str | Mapping[str, str] | None) -> dict[str, str]:
    """Resolves ``sharding=`` into one strategy per table name ("auto" decided here).

    "auto": tables under ``AUTO_REPLICATE_BYTES`` are replicated; a table larger than an even
    share of the sharded bytes is split by ``row_mod``; the rest are placed whole (``table``).

    Raises:
        ValueError / TypeError: unknown strategies or table names.
    """
    names = [n for n, _, _ in tables]
    if sharding is None:
        sharding = "table" if world_size == 1 else "auto"
    if isinstance(sharding, str):
        chosen = {n: sharding for n in names}
    elif isinstance(sharding, Mapping):
        unknown = sorted(set(sharding) - set(names))
        if unknown:
            raise ValueError(f"sharding names tables {unknown} that no feature uses; tables: "
                             f"{names}")
        chosen = {n: sharding.get(n, "auto") for n in names}
    else:
        raise TypeError(f"sharding must be None, a strategy name or a dict {{table: strategy}}, "
                        f"got {type(sharding).__name__}")
    for n, s in chosen.items():
        if s != "auto" and s not in STRATEGIES:
            raise ValueError(f"table {n!r}: unknown sharding strategy {s!r}; choose one of "
                             f"{STRATEGIES} or 'auto'")
    sizes = {n: _table_bytes(c, o) for n, c, o in tables}
    auto = [n for n in names if chosen[n] == "auto"]
    if world_size == 1:
        return {n: ("table" if s == "auto" else s) for n, s in chosen.items()}
    big = [n for n in auto if sizes[n] >= AUTO_REPLICATE_BYTES]
    share = sum(sizes[n] for n in big) / world_size
    for n in auto:
        chosen[n] = ("replicated" if sizes[n] < AUTO_REPLICATE_BYTES
                     else "row_mod" if sizes[n] > share else "table")
    return chosen


def _owners(tables: Sequence[tuple[str, TableConfig, Optimizer | None]],
            strategies: Mapping[str, str], world_size: int,
            lookups: Mapping[str, int]) -> dict[str, int]:
    """Greedy balance of "table" tables: largest first onto the least loaded rank."""
    load = [0] * world_size
    calls = [0] * world_size
    owners = {}
    whole = [(n, _table_bytes(c, o)) for n, c, o in tables if strategies[n] == "table"]
    for name, size in sorted(whole, key=lambda x: (-x[1], x[0])):
        r = min(range(world_size), key=lambda i: (load[i], calls[i], i))
        owners[name] = r
        load[r] += size
        calls[r] += lookups.get(name, 1)
    return owners


def make_plan(tables: Sequence[tuple[str, TableConfig, Optimizer | None]], world_size: int = 1,
              sharding: str | Mapping[str, str] | None = None,
              lookups: Mapping[str, int] | None = None) -> ShardingPlan:
    """Stacks and places tables.

    Args:
        tables: (resolved name, config, effective optimizer) in first-use order.
        world_size: number of processes ``W``.
        sharding: None (everything here when W = 1, "auto" when W > 1), "auto", a strategy name
            for all tables, or ``{table_name: strategy}`` (tables not named get "auto").
        lookups: expected lookups per table (e.g. features reading it), to break balance ties.

    Returns:
        The frozen plan; physical tables in order of their first logical table.

    Raises:
        ValueError: unknown strategies, or a column split wider than a table's dim.
    """
    strategies = table_strategies(tables, world_size, sharding)
    for name, cfg, opt in tables:
        if strategies[name] == "column" and cfg.dim < world_size:
            raise ValueError(f"table {name!r}: a column split over {world_size} processes needs "
                             f"dim >= {world_size}, but dim is {cfg.dim}; choose another strategy "
                             f"for it")
        if (strategies[name] == "column" and world_size > 1 and opt is not None
                and any(s.rowwise for s in opt.slots)):
            raise ValueError(f"table {name!r}: {type(opt).__name__} keeps one accumulator per "
                             f"row over all D columns, which a column split cannot hold; "
                             f"choose another strategy for it")
    owners = _owners(tables, strategies, world_size, lookups or {})
    groups: dict[tuple[Any, ...], list[tuple[str, TableConfig, Optimizer | None]]] = {}
    for name, cfg, opt in tables:
        key = (cfg.dim, cfg.dtype, opt.stacking_key() if opt is not None else None,
               strategies[name], owners.get(name, 0))
        groups.setdefault(key, []).append((name, cfg, opt))
    placements: dict[str, TablePlacement] = {}
    physical: list[PhysicalTable] = []
    for members in groups.values():
        index, offset = len(physical), 0
        shard_rows = [0] * world_size
        strategy = strategies[members[0][0]]
        for name, cfg, opt in members:
            slots = tuple(s.name for s in opt.slots) if opt is not None else ()
            draft = TablePlacement(name, strategy, index, offset, cfg.vocabulary_size, cfg.dim,
                                   slots, owners.get(name, 0))
            rows = tuple(len(draft.rank_rows(r, world_size)) for r in range(world_size))
            placements[name] = TablePlacement(name, strategy, index, offset, cfg.vocabulary_size,
                                              cfg.dim, slots, owners.get(name, 0), rows,
                                              tuple(shard_rows))
            shard_rows = [a + b for a, b in zip(shard_rows, rows)]
            offset += cfg.vocabulary_size
        _, cfg0, opt0 = members[0]
        if strategy == "column":
            widths = split_sizes(cfg0.dim, world_size)
            columns = tuple((sum(widths[:r]), sum(widths[:r + 1])) for r in range(world_size))
        else:
            columns = tuple((0, cfg0.dim) for _ in range(world_size))
        physical.append(PhysicalTable(index, tuple(n for n, _, _ in members), offset, cfg0.dim,
                                      cfg0.dtype, strategy, opt0, tuple(shard_rows), columns))
    return ShardingPlan(world_size, tuple(placements[n] for n, _, _ in tables), tuple(physical))
