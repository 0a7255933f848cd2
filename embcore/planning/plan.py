"""The plan: where every logical table lives (pure; configs + world size -> a frozen ShardingPlan).

Table stacking: logical tables of equal dim, dtype, optimizer math and placement share one physical
table, each at its own row offset, so a step does one dedup, one exchange, one lookup and one
optimizer update per physical table rather than per table or per feature. Combiners and
initializers do not matter for stacking: combining is folded into per-id scales
(inputs/canonical.py) and initial values are made per table.

Strategies (docs/semantics.md section 5), each applied to every logical table on its own:
- ``replicated``: every process holds the whole table; gradients are summed across processes.
- ``table``: the whole table on one owner process (chosen to balance memory, then lookups).
- ``row_div``: rows in W contiguous blocks, the first ``N % W`` blocks one row longer.
- ``row_mod``: row i on process ``i % W`` (local row ``i // W``).
- ``column``: every process holds all rows and a contiguous slice of the D columns (the first
  ``D % W`` slices one column wider).
- ``hash``: a dynamic table's (raw ids) rows split like ``row_div``; id x is owned by process
  ``splitmix64(x) % W``. ``row_div`` and ``row_mod`` given for a dynamic table mean this.
Dynamic tables (raw ids) stack with one another, never with tables whose ids are rows: on each
process each member keeps its own id -> row map over its own rows of the shard (its capacity,
eviction and statistics: vocabulary.py's ``DynamicStack``); one zero row follows them all; a
batch's ids travel to their owners in one exchange, by member (16-bit members with stochastic
rounding keep their identities: member key + raw id, ``MappedRows.rounding_at``). Replicated with
W > 1, a dynamic table stands alone.
On each process the shard of a physical table is its member tables' local rows one after another.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config.dtypes import SCALED, row_bytes
from ..config.optimizers import Optimizer, table_slots
from ..config.tables import (
    INDEX_BYTES_PER_ROW,
    LOG_BYTES_PER_ROW,
    MAP_BYTES_PER_ROW,
    WHERE_BYTES_PER_ROW,
    TableConfig,
)
from .placement import STRATEGIES as _PLACEMENTS
from .placement import Placement, make_placement
from .tiers import Curve, fast_rows, zipf_curve

Strategy = Literal["replicated", "table", "row_div", "row_mod", "column", "hash"]
STRATEGIES: tuple[str, ...] = tuple(_PLACEMENTS)
# "auto" replicates tables whose parameters and slots take less than this.
AUTO_REPLICATE_BYTES = 1 << 20


def where_bytes(dynamic: bool) -> int:
    """Fast-memory bytes an offloaded table holds for each row of its shard: where its cache
    has it, and for a static table where its slow tier's log has it (``config/tables.py``)."""
    return WHERE_BYTES_PER_ROW + (0 if dynamic else LOG_BYTES_PER_ROW)


@dataclass(frozen=True)
class LogicalTable:
    """One logical table inside the plan."""

    name: str
    strategy: str
    physical: int        # index of its physical table
    row_offset: int      # first row in the physical table's global row space
    rows: int            # N
    dim: int             # D
    slot_names: tuple[str, ...]
    placement: Placement  # how its rows and columns are spread over the processes
    row_counts: tuple[int, ...] = ()     # how many rows of this table each rank holds
    local_offsets: tuple[int, ...] = ()  # where they start in each rank's physical shard

    @property
    def owner(self) -> int:
        """The owner process of a ``"table"`` table (0 for the other strategies)."""
        return getattr(self.placement, "owner", 0)

    def held_rows(self, rank: int) -> torch.Tensor:
        """Row ids (0..N-1) of this table held by ``rank``, in local order."""
        return self.placement.held_rows(rank)

    def owner_and_local(self, rel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For row ids ``rel`` (0..N-1): their owner rank and their row in its physical shard."""
        owner, local = self.placement.owner_of(rel)
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
    placement: Placement  # its first member's (all members share the strategy)
    row_counts: tuple[int, ...] = ()   # how many rows the shard has on each rank
    columns: tuple[tuple[int, int], ...] = ()  # column range held by each rank
    dynamic: bool = False  # a dynamic table's (raw ids mapped to rows by each owner)
    cache_rows: tuple[int, ...] = ()  # offloaded (memory_budget): cache rows on each rank

    @property
    def offloaded(self) -> bool:
        """Whether its rows live in the slow tier, hot rows cached (``memory_budget``)."""
        return bool(self.cache_rows)

    @property
    def bytes_per_row(self) -> int:
        slots = self.optimizer.slots if self.optimizer is not None else ()
        return row_bytes(self.dim, self.dtype, [s.rowwise for s in slots])  # (scales included)

    # What the step asks of a physical table, whatever its kind (step/ reads no kind flag).

    @property
    def id_bound(self) -> int | None:
        """The bound of its batch's ids shifted to physical rows (a radix sort's range), or
        None for raw ids (a dynamic table's: any int64)."""
        return None if self.dynamic else self.rows

    @property
    def rows_dtype(self) -> torch.dtype:
        """The dtype of its rows as the exchange sends them: its own, float32 for an 8-bit
        table (rows widened with their scales)."""
        return torch.float32 if self.dtype in SCALED else self.dtype

    @property
    def by_member(self) -> bool:
        """Whether a batch's ids are deduplicated per member table (stacked dynamic tables:
        one member's raw id is not another's)."""
        return self.dynamic and len(self.tables) > 1

    @property
    def stored_rows(self) -> int:
        """Its rows as stored: ``rows``, plus a dynamic table's zero row (read by ids not
        resident)."""
        return self.rows + (1 if self.dynamic else 0)

    def rows_named(self, plan: ShardingPlan, rows: torch.Tensor, rank: int) -> str:
        """Shard rows ``rows`` of this table on ``rank`` in the user's terms (error messages):
        each logical table's rows; a dynamic table's, rows of its map on that rank."""
        rows = rows.cpu().sort().values
        if self.dynamic:
            return (f"table(s) {list(self.tables)} (dynamic: rows {_few(rows.tolist())} of the "
                    f"map on rank {rank})")
        parts = []
        for name in self.tables:
            t = plan.table(name)
            off = t.local_offsets[rank] if t.local_offsets else 0
            count = t.row_counts[rank] if t.row_counts else t.rows
            mine = rows[(rows >= off) & (rows < off + count)] - off
            if mine.numel():
                logical = t.held_rows(rank)[mine]
                parts.append(f"rows {_few(logical.tolist())} of table {name!r}")
        return ", ".join(parts)


ROWS_NAMED = 20  # rows an error message names before it cuts the list


def _few(rows: list[int]) -> str:
    """A list of rows, cut after ``ROWS_NAMED``."""
    if len(rows) <= ROWS_NAMED:
        return str(rows)
    return f"{str(rows[:ROWS_NAMED])[:-1]}, ... ({len(rows)} rows)]"


@dataclass(frozen=True)
class ShardingPlan:
    """Frozen placement of every table; ``print(plan)`` shows it."""

    world_size: int
    tables: tuple[LogicalTable, ...]
    physical: tuple[PhysicalTable, ...]
    backend: str = ""  # the kernels of the engine's device (ops/backend.py): "" not chosen yet

    def table(self, name: str) -> LogicalTable:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no table named {name!r} in the plan; tables: "
                       f"{[t.name for t in self.tables]}")

    def describe(self) -> list[dict[str, Any]]:
        """JSON-able description (goes into checkpoint manifests)."""
        return [{"table": t.name, "strategy": t.strategy, "physical": t.physical,
                 "row_offset": t.row_offset, "rows": t.rows, "dim": t.dim, "owner": t.owner,
                 "local_rows": list(t.row_counts)} for t in self.tables]

    def bytes_per_rank(self, fast: bool = False) -> list[int]:
        """Parameter + slot bytes each rank holds (``fast``: in fast memory: the offloaded
        tables' caches, with their index, in place of their rows, and the dynamic tables'
        maps)."""
        out = [0] * self.world_size
        for p in self.physical:
            for r in range(self.world_size):
                c0, c1 = p.columns[r]
                frac = (c1 - c0) / p.dim if p.dim else 0.0
                if fast and p.dynamic:
                    out[r] += p.row_counts[r] * MAP_BYTES_PER_ROW
                if fast and p.offloaded:
                    out[r] += (p.cache_rows[r] * (int(p.bytes_per_row * frac)
                                                  + INDEX_BYTES_PER_ROW)
                               + p.row_counts[r] * where_bytes(p.dynamic))
                else:
                    out[r] += int(p.row_counts[r] * p.bytes_per_row * frac)
        return out

    def __str__(self) -> str:
        w = self.world_size
        lines = [(f"ShardingPlan(world_size={w}, {len(self.tables)} tables in "
                  f"{len(self.physical)} physical tables"
                  + (f", backend: {self.backend})" if self.backend else ")")),
                 f"  {'table':<20} {'strategy':<10} {'physical':>8} {'rows':>10} {'dim':>5}  "
                 f"rows per rank / MiB per rank"
                 + ("  [tier]" if any(p.offloaded for p in self.physical) else "")]
        for t in self.tables:
            p = self.physical[t.physical]
            per_rank = []
            for r in range(w):
                c0, c1 = p.columns[r]
                mb = t.row_counts[r] * p.bytes_per_row * (c1 - c0) / max(p.dim, 1) / 2**20
                per_rank.append(f"{t.row_counts[r]}/{mb:.2f}")
            tier = "  [slow tier, cached]" if p.offloaded else ""
            lines.append(f"  {t.name:<20} {t.strategy:<10} {t.physical:>8} {t.rows:>10} "
                         f"{t.dim:>5}  {' '.join(per_rank)}{tier}")
        total = " ".join(f"{b / 2**20:.2f}" for b in self.bytes_per_rank())
        lines.append(f"  MiB per rank (parameters + slots): {total}")
        for p in self.physical:
            if p.offloaded:
                per_rank, fixed = [], []
                for r in range(w):
                    c0, c1 = p.columns[r]
                    row = int(p.bytes_per_row * (c1 - c0) / max(p.dim, 1)) + INDEX_BYTES_PER_ROW
                    mb = (p.cache_rows[r] * row
                          + p.row_counts[r] * where_bytes(p.dynamic)) / 2**20
                    per_rank.append(f"{p.cache_rows[r]}/{mb:.2f}")
                    fixed.append(f"{p.row_counts[r] * where_bytes(p.dynamic) / 2**20:.2f}")
                lines.append(f"  physical {p.index} {list(p.tables)}: slow tier, cache rows / MiB "
                             f"per rank: {' '.join(per_rank)}; of which fixed, whatever the "
                             f"cache: {' '.join(fixed)} MiB (the index: "
                             f"{where_bytes(p.dynamic)} bytes a row of the table"
                             + ("" if p.dynamic else
                                f", {WHERE_BYTES_PER_ROW} where cached + {LOG_BYTES_PER_ROW} "
                                f"where logged") + ")")
        if any(p.offloaded for p in self.physical):
            fast = " ".join(f"{b / 2**20:.2f}" for b in self.bytes_per_rank(fast=True))
            lines.append(f"  MiB per rank in fast memory (tables + caches"
                         f"{' + maps' if any(p.dynamic for p in self.physical) else ''}): {fast}")
        return "\n".join(lines)


def _check_scaled(name: str, cfg: TableConfig, split: bool, offloaded: bool) -> None:
    """Refuses what an 8-bit table (float8_e4m3fn, float8_e5m2) does not take yet: the
    slow tier (a memory_budget that offloads it), a column split over several processes (its
    scales are row-wise, as a row-wise optimizer's slot)."""
    if cfg.dtype not in SCALED:
        return
    kind = str(cfg.dtype).removeprefix("torch.")
    what = ("the slow tier (its rows beyond the memory_budget)" if offloaded else
            "a column split over several processes" if split else None)
    if what is not None:
        raise ValueError(f"table {name!r}: {kind} rows do not take {what} yet; give it "
                         f"dtype=torch.float16 or torch.bfloat16, or "
                         + ("a larger memory_budget" if offloaded else
                            "a row strategy (row_div, row_mod, table, replicated)"))


def _row_bytes(cfg: TableConfig, opt: Optimizer | None) -> int:
    """Parameter + slot bytes of one whole row of a table."""
    slots = opt.slots if opt is not None else ()
    return row_bytes(cfg.dim, cfg.dtype, [s.rowwise for s in slots])


def _table_bytes(cfg: TableConfig, opt: Optimizer | None) -> int:
    return cfg.vocabulary_size * _row_bytes(cfg, opt)


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
        chosen = dict.fromkeys(names, sharding)
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
    dynamic = {n for n, c, _ in tables if c.dynamic is not None}
    for n in dynamic:  # a dynamic table's rows are split by a hash of the id
        if chosen[n] in ("row_div", "row_mod"):
            chosen[n] = "hash"
    for n, s in chosen.items():
        if s == "auto":
            continue
        cls = _PLACEMENTS[s]
        if not (cls.raw_ids if n in dynamic else cls.row_ids):
            fits = [k for k, c in _PLACEMENTS.items() if (c.raw_ids if n in dynamic else c.row_ids)]
            kind = "dynamic (raw ids)" if n in dynamic else "not dynamic (ids are rows)"
            raise ValueError(f"table {n!r} is {kind}, which strategy {s!r} cannot place; "
                             f"choose one of {fits} or 'auto'")
    sizes = {n: _table_bytes(c, o) for n, c, o in tables}
    auto = [n for n in names if chosen[n] == "auto"]
    if world_size == 1:
        return {n: ("table" if s == "auto" else s) for n, s in chosen.items()}
    big = [n for n in auto if sizes[n] >= AUTO_REPLICATE_BYTES]
    share = sum(sizes[n] for n in big) / world_size
    for n in auto:
        split = "hash" if n in dynamic else "row_mod"
        chosen[n] = ("replicated" if sizes[n] < AUTO_REPLICATE_BYTES
                     else split if sizes[n] > share else "table")
    return chosen


def _owners(tables: Sequence[tuple[str, TableConfig, Optimizer | None]],
            strategies: Mapping[str, str], world_size: int,
            lookups: Mapping[str, float]) -> dict[str, int]:
    """Greedy balance of "table" tables: largest first onto the least loaded rank."""
    load = [0] * world_size
    calls = [0.0] * world_size
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
              lookups: Mapping[str, float] | None = None,
              memory_budget: int | None = None,
              curves: Mapping[str, Curve] | None = None) -> ShardingPlan:
    """Stacks and places tables.

    Args:
        tables: (resolved name, config, effective optimizer) in first-use order.
        world_size: number of processes ``W``.
        sharding: None (everything here when W = 1, "auto" when W > 1), "auto", a strategy name
            for all tables, or ``{table_name: strategy}`` (tables not named get "auto").
        lookups: expected lookups per table (e.g. features reading it), to break balance ties.
        memory_budget: None, or the bytes of fast memory per process for tables, slots and
            caches (tiers.py): tables beyond it go to the slow tier, with caches.
        curves: per table, the share of its lookups its k hottest rows serve (a profile);
            tables without one get tiers.py's prior.

    Returns:
        The frozen plan; physical tables in order of their first logical table.

    Raises:
        ValueError: unknown strategies, a column split wider than a table's dim, or what 8-bit
            tables do not take yet (``_check_scaled``).
    """
    strategies = table_strategies(tables, world_size, sharding)
    for name, cfg, opt in tables:
        _PLACEMENTS[strategies[name]].check(name, cfg.dim, opt, world_size)
    owners = _owners(tables, strategies, world_size, lookups or {})
    placed = {name: make_placement(strategies[name], cfg.vocabulary_size, cfg.dim, world_size,
                                   owners.get(name, 0)) for name, cfg, _ in tables}
    caches = _tiers(tables, placed, world_size, memory_budget, lookups or {}, curves or {})
    offloaded = set(caches)
    for name, cfg, _ in tables:
        _check_scaled(name, cfg, placed[name].splits_columns and world_size > 1,
                      name in offloaded)
    groups: dict[tuple[Any, ...], list[tuple[str, TableConfig, Optimizer | None]]] = {}
    for name, cfg, opt in tables:
        rounds = cfg.dtype.itemsize <= 2 and cfg.stochastic_rounding
        alone = cfg.dynamic is not None and world_size > 1 and strategies[name] == "replicated"
        key = (cfg.dim, cfg.dtype, rounds, opt.stacking_key() if opt is not None else None,
               strategies[name], owners.get(name, 0),
               cfg.dynamic is not None,  # raw ids and row ids do not mix
               name if alone else None,  # (see the module docstring)
               name in offloaded)  # tiers do not mix
        groups.setdefault(key, []).append((name, cfg, opt))
    placements: dict[str, LogicalTable] = {}
    physical: list[PhysicalTable] = []
    for members in groups.values():
        index, offset = len(physical), 0
        shard_rows = [0] * world_size
        strategy = strategies[members[0][0]]
        first = placed[members[0][0]]  # (all members share the strategy)
        for name, cfg, opt in members:
            slots = tuple(s.name for s in table_slots(opt, cfg.dtype))
            placement = placed[name]
            rows = tuple(placement.held_count(r) for r in range(world_size))
            placements[name] = LogicalTable(name, strategy, index, offset, cfg.vocabulary_size,
                                            cfg.dim, slots, placement, rows, tuple(shard_rows))
            shard_rows = [a + b for a, b in zip(shard_rows, rows)]
            offset += cfg.vocabulary_size
        _, cfg0, opt0 = members[0]
        columns = tuple(first.columns(r) for r in range(world_size))
        physical.append(PhysicalTable(index, tuple(n for n, _, _ in members), offset, cfg0.dim,
                                      cfg0.dtype, strategy, opt0, first, tuple(shard_rows),
                                      columns, cfg0.dynamic is not None,
                                      tuple(sum(caches[n][r] for n, _, _ in members)
                                            for r in range(world_size))
                                      if members[0][0] in offloaded else ()))
    return ShardingPlan(world_size, tuple(placements[n] for n, _, _ in tables), tuple(physical))


def _local_bytes(placement: Placement, cfg: TableConfig, opt: Optimizer | None, rank: int,
                 rows: int) -> int:
    """Parameter + slot bytes of a table's ``rows`` rows on ``rank`` (integers: exact at any
    size; a column slice's share of a row rounded down)."""
    c0, c1 = placement.columns(rank)
    return rows * _row_bytes(cfg, opt) * (c1 - c0) // cfg.dim


def _tiers(tables: Sequence[tuple[str, TableConfig, Optimizer | None]],
           placed: Mapping[str, Placement], world_size: int, budget: int | None,
           lookups: Mapping[str, float], curves: Mapping[str, Curve]) -> dict[str, list[int]]:
    """``{offloaded table: cache rows per rank}`` under ``budget`` (tiers.py); empty when
    everything fits.

    Raises:
        ValueError: the tables that must stay in fast memory exceed the budget.
    """
    if budget is None:
        return {}
    cfg = {n: c for n, c, _ in tables}
    local = {n: [placed[n].held_count(r) for r in range(world_size)] for n in cfg}  # counted
    per_rank = {name: [_local_bytes(placed[name], c, opt, r, local[name][r])
                       for r in range(world_size)] for name, c, opt in tables}
    # a dynamic table's map stays in fast memory, wherever its rows are
    maps = [sum(local[n][r] * MAP_BYTES_PER_ROW for n, c, _ in tables if c.dynamic is not None)
            for r in range(world_size)]
    if all(sum(b[r] for b in per_rank.values()) + maps[r] <= budget
           for r in range(world_size)):
        return {}  # what fits changes nothing
    pinned = {name for name, cfg, opt in tables  # rules moving every row every step
              if opt is not None and opt.updates_every_row}

    def fill(fixed: set[str], indexed: Collection[str] = ()) -> dict[str, list[int]]:
        """Fast rows per rank of the tables not in ``fixed`` (whose bytes are taken first, as
        are the cache indexes of the tables ``indexed``)."""
        out = {n: [0] * world_size for n in cfg if n not in fixed}
        for r in range(world_size):
            here = [n for n in out if local[n][r]]
            cost = [max(1, per_rank[n][r] // local[n][r]) + INDEX_BYTES_PER_ROW for n in here]
            index = sum(local[n][r] * where_bytes(cfg[n].dynamic is not None)
                        for n in indexed)
            floor = [1 if n in indexed else 0 for n in here]  # a cache row each, first
            least = sum(c * f for c, f in zip(cost, floor))
            left = budget - maps[r] - index - sum(per_rank[n][r] for n in fixed)
            if left < least:
                dyn = sorted(n for n, c, _ in tables if c.dynamic is not None and local[n][r])
                what = ([(f"the maps of dynamic tables {dyn} ({MAP_BYTES_PER_ROW} bytes a row): "
                          f"{maps[r]}")] if maps[r] else []) + [
                    f"Adam(lazy_adam=False) table {n!r}: {per_rank[n][r]}"
                    for n in sorted(pinned) if per_rank[n][r]] + (
                    [(f"the cache indexes of the offloaded tables {sorted(indexed)} "
                      f"({WHERE_BYTES_PER_ROW} bytes a row, {where_bytes(False)} for a "
                      f"static table's) and a cache row of each: "
                      f"{index + least}")] if indexed else [])
                raise ValueError(
                    f"memory_budget={budget} bytes is below what must stay in fast memory on "
                    f"process {r}: {budget - left + least} bytes ({'; '.join(what)}); raise "
                    f"the budget")
            got = fast_rows([local[n][r] - f for n, f in zip(here, floor)], cost,
                            [float(lookups.get(n, 1)) for n in here],
                            [curves.get(n) or zipf_curve(cfg[n].vocabulary_size) for n in here],
                            left - least)
            for n, k, f in zip(here, got, floor):
                out[n][r] = k + f
        return out

    # Pass 1 decides the tiers, every table's index entries charged as if it were offloaded
    # (when the budget allows; else none), so that pass 2 fits; pass 2 sizes the caches, the
    # tables kept whole charged their own bytes (no cache index), the offloaded ones their
    # index's entry per row first.
    try:
        first = fill(pinned, set(cfg) - pinned)
    except ValueError:
        first = fill(pinned)
    whole = pinned | {n for n, f in first.items() if f == local[n]}
    return {n: [min(k, max(1, f)) for f, k in zip(fast_r, local[n])]
            for n, fast_r in fill(whole, set(first) - whole).items()}
