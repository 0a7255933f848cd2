"""Preprocess (pure): canonical feature batches + plan -> one batch per physical table.

All features that read one physical table (stacked tables, shared tables) are concatenated into one
id list, their ids shifted by their table's row offset, and deduplicated once: the lookup then
gathers each unique row once, and the update sums all occurrences of a row before touching it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from functools import cached_property

import torch

from .inputs import Canonical
from .ops import native
from .plan import ShardingPlan


@dataclass(frozen=True)
class FeatureSlice:
    """Where one feature's output rows sit inside its physical table's output."""

    feature: int              # index in the flat feature list
    start: int                # first output row
    rows: int                 # R of the feature
    shape: tuple[int, ...]    # leading activation shape, prod == rows


@dataclass(frozen=True)
class TableBatch:
    """One physical table's share of a step.

    Occurrences are the concatenated ids of every feature reading the table. Sorting them
    (stably) by id gives the unique rows and, per unique row, its occurrences in their original
    order: ``order[unique_offsets[u]:unique_offsets[u+1]]``. The lookup reads rows by ``ids`` (or
    ``inverse`` into fetched unique rows); the gradient of unique row u is the scaled sum of the
    output gradients of its occurrences, in that order (deterministic).
    """

    physical: int
    ids: torch.Tensor             # (nnz,) int64 physical row of each occurrence
    offsets: torch.Tensor | None  # (R + 1,) int64 bag boundaries; None when unit
    scales: torch.Tensor | None   # (nnz,) float32 combiner scale times weight; None when unit
    unique: torch.Tensor          # (U,) int64 physical rows, ascending
    order: torch.Tensor           # (nnz,) int64 occurrences sorted by row (stable)
    unique_offsets: torch.Tensor  # (U + 1,) int64 boundaries of each row's occurrences in order
    unit: bool                    # one id per output row, scale 1: R == nnz, bag k is id k
    slices: tuple[FeatureSlice, ...]

    @property
    def num_rows(self) -> int:
        return self.ids.numel() if self.offsets is None else self.offsets.numel() - 1

    @cached_property
    def inverse(self) -> torch.Tensor:
        """(nnz,) int64, ``unique[inverse] == ids`` (for rows fetched from other processes)."""
        counts = self.unique_offsets[1:] - self.unique_offsets[:-1]  # (U,)
        rank = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device),
                                       counts, output_size=self.ids.numel())  # (nnz,) sorted
        inverse = torch.empty_like(self.ids)
        inverse[self.order] = rank
        return inverse

    @cached_property
    def bags(self) -> torch.Tensor:
        """(nnz,) int64, the output row (bag) of each occurrence."""
        if self.offsets is None:
            return torch.arange(self.ids.numel(), device=self.ids.device)
        if native.usable(self.offsets):
            return native.bag_of(self.offsets, self.ids.numel())
        lengths = self.offsets[1:] - self.offsets[:-1]  # (R,)
        return torch.repeat_interleave(torch.arange(lengths.numel(), device=self.ids.device),
                                       lengths, output_size=self.ids.numel())


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stable sort: (unique (U,), order (nnz,), unique_offsets (U + 1,)).

    The torch-ops path; with the fused kernels ``native.concat_dedup`` does this (and the
    concatenation) in one call.
    """
    sorted_ids, order = torch.sort(ids, stable=True)  # (nnz,), (nnz,)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)  # (U,), (U,)
    unique_offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(counts, 0, out=unique_offsets[1:])
    return unique, order, unique_offsets


def group_by_physical(plan: ShardingPlan, feature_tables: Sequence[str],
                      batches: Sequence[Canonical | None],
                      shapes: Sequence[tuple[int, ...]]) -> list[TableBatch]:
    """Concatenates features per physical table and deduplicates their ids.

    Args:
        plan: the sharding plan.
        feature_tables: each feature's table name (flat feature order).
        batches: each feature's canonical batch; None skips the feature (serving subsets).
        shapes: each feature's resolved leading activation shape.

    Returns:
        One TableBatch per physical table that at least one given feature reads, in physical
        table order (the same order on every process).
    """
    members: dict[int, list[int]] = {}
    for f, b in enumerate(batches):
        if b is not None:
            members.setdefault(plan.table(feature_tables[f]).physical, []).append(f)
    out = []
    for p in sorted(members):
        feats = members[p]
        parts = [batches[f] for f in feats]
        unit = all(b is not None and b.unit for b in parts)
        ids, adds, offsets, scales, slices = [], [], [], [], []
        nnz = rows = 0
        for f, b in zip(feats, parts):
            assert b is not None
            ids.append(b.ids)  # (nnz_f,)
            adds.append(plan.table(feature_tables[f]).row_offset)
            if not unit:
                b_offsets, b_scales = _bags(b)
                offsets.append(b_offsets[:-1] + nnz if nnz else b_offsets[:-1])  # (R_f,)
                scales.append(b_scales)
            slices.append(FeatureSlice(f, rows, b.num_rows, shapes[f]))
            nnz += b.ids.numel()
            rows += b.num_rows
        if native.usable(*ids):  # shift, concatenate and deduplicate in one kernel call
            all_ids, unique, order, unique_offsets = native.concat_dedup(
                [t.contiguous() for t in ids], adds, plan.physical[p].rows)
        else:
            shifted = [t + a if a else t for t, a in zip(ids, adds)]
            all_ids = torch.cat(shifted) if len(shifted) > 1 else shifted[0]  # (nnz,)
            unique, order, unique_offsets = dedup(all_ids)
        if unit:
            out.append(TableBatch(p, all_ids, None, None, unique, order, unique_offsets, True,
                                  tuple(slices)))
            continue
        offsets.append(torch.tensor([nnz], dtype=torch.int64, device=all_ids.device))
        out.append(TableBatch(p, all_ids, torch.cat(offsets), torch.cat(scales), unique, order,
                              unique_offsets, False, tuple(slices)))
    return out


def _bags(b: Canonical) -> tuple[torch.Tensor, torch.Tensor]:
    """A canonical batch's offsets and scales, materialized for unit batches."""
    if b.offsets is not None and b.scales is not None:
        return b.offsets, b.scales
    n = b.ids.numel()
    return (torch.arange(n + 1, dtype=torch.int64, device=b.ids.device),
            torch.ones(n, dtype=torch.float32, device=b.ids.device))


@dataclass(frozen=True)
class Route:
    """Where the unique ids of one physical table are looked up when it is sharded."""

    send_ids: list[torch.Tensor]  # per rank d: (n_d,) rows of d's shard to ask d for
    order: torch.Tensor | None    # (U,) positions in ``unique`` in send order; None: all to all

    @property
    def counts(self) -> list[int]:
        return [t.numel() for t in self.send_ids]


def route(plan: ShardingPlan, physical: int, unique: torch.Tensor) -> Route | None:
    """Which rank holds each unique id of a physical table, and its row in that rank's shard.

    Returns:
        None when every id is held here (world size 1, or a replicated table); for a column
        split every id goes to every rank (order None); otherwise ids grouped by owner.
    """
    p = plan.physical[physical]
    w = plan.world_size
    if w == 1 or p.strategy == "replicated":
        return None
    if p.strategy == "column":  # every rank holds every row, in the global row layout
        return Route([unique] * w, None)
    members = [plan.table(n) for n in p.tables]
    starts = torch.tensor([m.row_offset for m in members] + [p.rows], dtype=unique.dtype,
                          device=unique.device)
    bounds = torch.searchsorted(unique, starts).tolist()  # unique is sorted: members are ranges
    owners, locals_ = [], []
    for k, m in enumerate(members):
        rel = unique[bounds[k]:bounds[k + 1]] - m.row_offset  # (n_k,)
        o, loc = m.owner_and_local(rel, w)
        owners.append(o)
        locals_.append(loc)
    owner = torch.cat(owners)  # (U,)
    local = torch.cat(locals_)  # (U,)
    order = torch.argsort(owner, stable=True)  # (U,)
    counts = torch.bincount(owner, minlength=w).tolist()
    return Route(list(local[order].split(counts)), order)
