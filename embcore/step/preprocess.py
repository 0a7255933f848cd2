"""Preprocess (pure): the features' bags + the plan -> one ``TableBatch`` per physical table.

The first verb of a step (docs/architecture.md). All features that read one physical table (stacked
tables, shared tables) are concatenated into one ``Bags``, their ids shifted by their table's row
offset, and deduplicated once: the lookup then reads each distinct row once, and the update sums all
occurrences of a row before touching it. When the table is sharded, the distinct rows are routed to
the processes holding them (``Route``), as the table's placement says. A dynamic table's ids are
raw ids, not rows: they are deduplicated as they are and sent to the processes owning them, whose
maps turn them into rows at the lookup (vocabulary.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..kernels import cpu
from ..ops.backend import Backend
from ..ops.bags import Bags, Dedup
from ..planning.plan import ShardingPlan


@dataclass
class FeatureSlice:
    """Where one feature's output rows sit inside its physical table's output."""

    feature: int              # index in the flat feature list
    start: int                # first output row
    rows: int                 # R of the feature
    shape: tuple[int, ...]    # leading activation shape, prod == rows


class Slices(tuple[FeatureSlice, ...]):
    """A physical table's feature slices, in output order, with what every step reads of them
    made once: ``starts`` (each slice's first output row, then R) and ``sizes`` (each slice's
    rows). The native preprocess keeps one per batch layout."""

    starts: list[int]
    sizes: list[int]

    def __new__(cls, items: Iterable[FeatureSlice]) -> Slices:
        self = super().__new__(cls, items)
        self.sizes = [s.rows for s in self]
        self.starts = [s.start for s in self] + [sum(self.sizes)]
        return self


@dataclass
class Route:
    """Where the distinct rows of one sharded physical table are looked up."""

    send_ids: list[torch.Tensor]  # per rank d: (n_d,) rows of d's shard to ask d for (raw ids
    #                               of a dynamic table: d's map gives their rows)
    order: torch.Tensor | None    # (U,) positions in ``unique`` in send order; None: all to all
    header: int = 0               # stacked dynamic tables: each ``send_ids[d]`` starts with the
    #                               count of ids of each member (M values), then their runs

    @property
    def counts(self) -> list[int]:
        """How many ids (rows) go to each rank (its header not counted)."""
        return [t.numel() - self.header for t in self.send_ids]


@dataclass
class TableBatch:
    """One physical table's share of a step (made every step: a plain dataclass, never written
    once made; ops/bags.py ``Bags`` says why)."""

    physical: int
    bags: Bags                      # the concatenated bags of every feature reading the table
    dedup: Dedup                    # their distinct rows
    slices: Slices                  # where each feature's output rows sit
    route: Route | None             # None: every row is held by this process
    # dynamic tables stacked in one physical table: per member of the batch (in member order)
    # ``(member index, distinct ids)``, its ids a run of ``dedup.unique`` (deduplicated per member:
    # the same raw id of two members is two entries); None: one table
    segments: tuple[tuple[int, int], ...] | None = None


@dataclass
class Prepared:
    """A batch ready for ``lookup`` and ``apply_gradients``: one ``TableBatch`` per physical table
    that at least one given feature reads, in physical table order (the same on every process)."""

    training: bool
    tables: tuple[TableBatch, ...]
    num_features: int               # F: the length of the flat activations and gradients


def preprocess(features: Sequence[Bags | None], feature_tables: Sequence[str],
               plan: ShardingPlan, training: bool, backend: Backend,
               padded: Collection[int] = ()) -> Prepared:
    """Groups, deduplicates and routes a batch (pure: reads its arguments only).

    Args:
        features: each feature's bags (``shape`` its resolved activation shape); None skips the
            feature (a serving subset).
        feature_tables: each feature's table name (flat feature order).
        plan: the sharding plan.
        training: whether ``apply_gradients`` will follow.
        backend: the engine's backend (ops/backend.py), which deduplicates.
        padded: the physical tables whose kernels take a dedup of fixed capacity
            (``Rows.takes_padded``), which the backend may then give (``Backend.dedup``).
    """
    members: dict[int, list[int]] = {}
    for f, b in enumerate(features):
        if b is not None:
            members.setdefault(plan.table(feature_tables[f]).physical, []).append(f)
    tables = []
    for p in sorted(members):
        phys = plan.physical[p]
        fs, of = members[p], None
        if phys.by_member:  # stacked dynamic tables: by member
            member = {n: k for k, n in enumerate(phys.tables)}
            of, fs = (list(t) for t in zip(*sorted((member[feature_tables[f]], f) for f in fs)))
        (bags, dd), slices, segments = _concatenate(
            [(f, features[f]) for f in fs], [plan.table(feature_tables[f]).row_offset
                                            for f in fs],
            phys.id_bound, backend, of, p in padded)
        tables.append(TableBatch(p, bags, dd, slices, route(plan, p, dd.unique, segments),
                                 segments))
    return Prepared(training, tuple(tables), len(features))


def _concatenate(parts: list[tuple[int, Bags | None]], adds: list[int], num_rows: int | None,
                 backend: Backend, of: list[int] | None = None, padded: bool = False
                 ) -> tuple[tuple[Bags, Dedup], Slices,
                            tuple[tuple[int, int], ...] | None]:
    """One physical table's features as one ``Bags`` (ids shifted by ``adds``), deduplicated;
    for stacked dynamic tables (``of``: each part's member index, ascending) the raw ids are
    deduplicated per member (``dedup_members``), which also gives the segments."""
    unit = all(b is not None and b.unit for _, b in parts)
    offsets, scales, slices = [], [], []
    shifts: list[int] = []
    nnz = rows = 0
    for f, b in parts:
        assert b is not None
        if not unit:
            b_offsets, b_scales = b.offsets_and_scales()
            offsets.append(b_offsets)  # (R_f + 1,)
            shifts.append(nnz)
            scales.append(b_scales)
        slices.append(FeatureSlice(f, rows, b.num_rows, b.shape))
        nnz += b.ids.numel()
        rows += b.num_rows
    id_parts = [b.ids for _, b in parts if b is not None]
    segments = None
    if of is None:
        ids, dd = backend.dedup(id_parts, adds, num_rows, padded)
    else:
        ids, dd, segments = dedup_members(id_parts, of, backend)
    verdict = parts[0][1].verdict if parts[0][1] is not None else None  # (the batch's)
    if unit:
        return (Bags(ids, None, None, verdict=verdict), dd), Slices(slices), segments
    return ((Bags(ids, backend.concat_offsets(offsets, shifts, nnz), cpu.concat(scales),
                  verdict=verdict), dd),
            Slices(slices), segments)


def dedup_members(parts: list[torch.Tensor], of: list[int], backend: Backend
                  ) -> tuple[torch.Tensor, Dedup, tuple[tuple[int, int], ...]]:
    """The raw ids of stacked dynamic tables' features (``of``: each part's member, ascending),
    deduplicated per member (one member's id is not another's): ``(ids (nnz,), dedup,
    segments)``, ``dedup.unique`` a run of distinct ids per member and ``segments`` the
    ``(member, run length)`` pairs."""
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for m, t in zip(of, parts):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    got = backend.dedup_runs(parts, [len(ts) for _, ts in runs]) if len(runs) > 1 else None
    if got is not None:  # one call for every run
        ids, dd, counts = got
        return ids, dd, tuple((m, c) for (m, _), c in zip(runs, counts))
    done = [backend.dedup(ts, [0] * len(ts), None) for _, ts in runs]
    segments = tuple((m, d.unique.numel()) for (m, _), (_, d) in zip(runs, done))
    if len(done) == 1:
        return done[0][0], done[0][1], segments
    at = u = 0
    orders: list[torch.Tensor] = []
    uoffs: list[torch.Tensor] = []
    inverses: list[torch.Tensor] = []
    for i, d in done:  # each run's positions shifted past the runs before it
        orders.append(d.order + at if at else d.order)
        uoffs.append(d.unique_offsets[:-1] + at if at else d.unique_offsets[:-1])
        inverses.append(d.inverse + u if u else d.inverse)
        at, u = at + i.numel(), u + d.unique.numel()
    ids = torch.cat([i for i, _ in done])
    dd = Dedup(torch.cat([d.unique for _, d in done]), torch.cat(orders),
               torch.cat(uoffs + [ids.new_tensor([at])]))
    dd.__dict__["inverse"] = torch.cat(inverses)  # (the cached_property's value, known)
    return ids, dd, segments


def route(plan: ShardingPlan, physical: int, unique: torch.Tensor,
          segments: tuple[tuple[int, int], ...] | None = None) -> Route | None:
    """Which process holds each distinct row of a physical table, and its row in that shard.

    Args:
        segments: stacked dynamic tables: the runs of ``unique`` by member
            (``TableBatch.segments``).

    Returns:
        None when every row is held here (one process, or a replicated table); for a column
        split every row goes to every process (order None); otherwise rows grouped by owner
        (stacked dynamic tables: by owner, then member, each rank's ids after a header of the
        count of each member's).
    """
    p = plan.physical[physical]
    w = plan.world_size
    if p.placement.held_everywhere:
        return None
    if p.placement.splits_columns:  # every rank holds every row, in the global row layout
        return Route([unique] * w, None)
    if segments is not None:  # stacked dynamic tables (``by_member``): by owner, then member
        m = len(p.tables)
        member = torch.repeat_interleave(
            torch.tensor([k for k, _ in segments], dtype=torch.int64, device=unique.device),
            torch.tensor([c for _, c in segments], device=unique.device),
            output_size=unique.numel())  # (U,)
        key = p.placement.owner_of_ids(unique) * m + member  # (U,)
        order = torch.argsort(key, stable=True)  # (U,)
        per = torch.bincount(key, minlength=w * m).view(w, m)  # (W, M)
        runs = unique[order].split(per.sum(1).tolist())
        return Route([torch.cat([per[d], runs[d]]) for d in range(w)], order, header=m)
    if p.id_bound is None:  # raw ids go to their owners, whose maps turn them into rows
        owner = p.placement.owner_of_ids(unique)  # (U,)
        order = torch.argsort(owner, stable=True)  # (U,)
        counts = torch.bincount(owner, minlength=w).tolist()
        return Route(list(unique[order].split(counts)), order)
    members = [plan.table(n) for n in p.tables]
    starts = torch.tensor([m.row_offset for m in members] + [p.rows], dtype=unique.dtype,
                          device=unique.device)
    bounds = torch.searchsorted(unique, starts).tolist()  # unique is sorted: members are ranges
    owners, locals_ = [], []
    for k, logical in enumerate(members):
        o, loc = logical.owner_and_local(unique[bounds[k]:bounds[k + 1]]
                                         - logical.row_offset)  # (n_k,)
        owners.append(o)
        locals_.append(loc)
    owner = torch.cat(owners)  # (U,)
    local = torch.cat(locals_)  # (U,)
    order = torch.argsort(owner, stable=True)  # (U,)
    counts = torch.bincount(owner, minlength=w).tolist()
    return Route(list(local[order].split(counts)), order)
