"""The plan: where every logical table lives (pure; configs + world size -> a frozen ShardingPlan).

Table stacking: logical tables of equal dim, dtype, optimizer math and strategy share one physical
table, each at its own row offset, so a step does one dedup, one lookup and one optimizer update per
physical table rather than per table or per feature. Combiners and initializers do not matter for
stacking: combining is folded into per-id scales (inputs.py) and initial values are made per table.
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


@dataclass(frozen=True)
class TablePlacement:
    """One logical table inside the plan."""

    name: str
    strategy: str
    physical: int     # index of its physical table
    row_offset: int   # first row inside the physical table
    rows: int         # N
    dim: int          # D
    slot_names: tuple[str, ...]


@dataclass(frozen=True)
class PhysicalTable:
    """Rows of one or more stacked logical tables, updated by one optimizer."""

    index: int
    tables: tuple[str, ...]
    rows: int
    dim: int
    dtype: torch.dtype
    strategy: str
    optimizer: Optimizer | None

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
                 "row_offset": t.row_offset, "rows": t.rows, "dim": t.dim} for t in self.tables]

    def __str__(self) -> str:
        lines = [f"ShardingPlan(world_size={self.world_size}, {len(self.tables)} tables in "
                 f"{len(self.physical)} physical tables)",
                 f"  {'table':<20} {'strategy':<10} {'physical':>8} {'rows':>10} {'dim':>5} "
                 f"{'MB/process':>11}"]
        for t in self.tables:
            p = self.physical[t.physical]
            mb = t.rows * p.bytes_per_row / 2**20 / (1 if t.strategy in ("replicated", "table")
                                                     else self.world_size)
            lines.append(f"  {t.name:<20} {t.strategy:<10} {t.physical:>8} {t.rows:>10} "
                         f"{t.dim:>5} {mb:>11.2f}")
        return "\n".join(lines)


def table_strategies(names: Sequence[str], world_size: int,
                     sharding: str | Mapping[str, str] | None) -> dict[str, str]:
    """Resolves ``sharding=`` into one strategy per table name.

    Raises:
        ValueError: unknown strategy names or tables.
    """
    if sharding is None:
        sharding = "table" if world_size == 1 else "auto"
    if isinstance(sharding, str):
        chosen = {n: sharding for n in names}
    elif isinstance(sharding, Mapping):
        unknown = sorted(set(sharding) - set(names))
        if unknown:
            raise ValueError(f"sharding names tables {unknown} that no feature uses; tables: "
                             f"{list(names)}")
        chosen = {n: sharding.get(n, "auto") for n in names}
    else:
        raise TypeError(f"sharding must be None, a strategy name or a dict {{table: strategy}}, "
                        f"got {type(sharding).__name__}")
    for n, s in chosen.items():
        if s != "auto" and s not in STRATEGIES:
            raise ValueError(f"table {n!r}: unknown sharding strategy {s!r}; choose one of "
                             f"{STRATEGIES} or 'auto'")
    # With one process every strategy places the whole table here; "auto" is "table".
    return {n: ("table" if s == "auto" else s) for n, s in chosen.items()}


def make_plan(tables: Sequence[tuple[str, TableConfig, Optimizer | None]], world_size: int = 1,
              sharding: str | Mapping[str, str] | None = None) -> ShardingPlan:
    """Stacks and places tables.

    Args:
        tables: (resolved name, config, effective optimizer) in first-use order.
        world_size: number of processes ``W``.
        sharding: see ``Embedding``.

    Returns:
        The frozen plan; physical tables in order of their first logical table.
    """
    if world_size != 1:
        raise NotImplementedError("sharding across processes is not implemented yet; "
                                  "use one process (world_size 1)")
    strategies = table_strategies([n for n, _, _ in tables], world_size, sharding)
    groups: dict[tuple[Any, ...], list[tuple[str, TableConfig, Optimizer | None]]] = {}
    for name, cfg, opt in tables:
        key = (cfg.dim, cfg.dtype, opt.stacking_key() if opt is not None else None,
               strategies[name])
        groups.setdefault(key, []).append((name, cfg, opt))
    placements: dict[str, TablePlacement] = {}
    physical: list[PhysicalTable] = []
    for members in groups.values():
        index, offset = len(physical), 0
        for name, cfg, opt in members:
            slots = tuple(s.name for s in opt.slots) if opt is not None else ()
            placements[name] = TablePlacement(name, strategies[name], index, offset,
                                              cfg.vocabulary_size, cfg.dim, slots)
            offset += cfg.vocabulary_size
        _, cfg0, opt0 = members[0]
        physical.append(PhysicalTable(index, tuple(n for n, _, _ in members), offset, cfg0.dim,
                                      cfg0.dtype, strategies[members[0][0]], opt0))
    return ShardingPlan(world_size, tuple(placements[n] for n, _, _ in tables), tuple(physical))
