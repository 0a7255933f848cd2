"""Raw ids: a physical table of dynamic tables, whose maps turn ids into rows of its storage.

``MappedRows`` is the rows object (rows.py) of a physical table of dynamic tables on this
process: its ``DynamicStack`` (vocabulary.py: one map per stacked member, and the zero row
after them all, where ids not resident are looked up) over a storage of either kind, in memory
or offloaded (``MemoryRows``, ``OffloadedRows``). ``resolve`` is the map's step: the ids that
reach this process become shard rows, which a training step grows (admission, eviction; new
rows get their initial values and fresh slots in the storage); ``update`` drops gradients of the
zero row and of rows given to another id since they were resolved.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..base.comm import Communicator
from ..config.dtypes import SCALES
from ..config.optimizers import Optimizer
from ..numerics.rounding import Rounding
from ..ops.backend import Backend
from ..ops.bags import Bags, Dedup
from ..ops.combine import OutputGrads, row_gradients
from ..ops.workspace import Workspace
from .changes import ChangedRows
from .rows import Resolved, RoundingOf, Rows, Segments, Writer, distinct, occurrences
from .tier.cache import CachedRows
from .vocab.vocabulary import DynamicRows, DynamicStack, initialize_rows


class MappedRows(Rows):
    """The shard of a physical table of dynamic tables: its maps over ``storage``.

    Args:
        stack: the maps (one member per stacked dynamic table).
        storage: where the rows and slots are (in memory or offloaded), zero row included.
        columns: the shard's columns of the logical tables (initial values).
        fills: ``{slot: initial value}`` of the optimizer's slots (fresh rows).
        member_keys: a 16-bit stack's members' rounding keys (an updated row's identity is its
            member's key plus its raw id), else None.
    """

    maps = True
    may_refuse = True  # (a map's training step admits at most its capacity)

    def __init__(self, stack: DynamicStack, storage: Rows, columns: tuple[int, int],
                 fills: dict[str, float], member_keys: torch.Tensor | None = None) -> None:
        super().__init__(storage.p, storage.rounding, storage.workspace, storage.backend)
        self.stack, self.storage = stack, storage
        self.columns, self.fills, self.member_keys = columns, fills, member_keys

    @property
    def table(self) -> torch.Tensor:
        return self.storage.table

    @property
    def members(self) -> list[DynamicRows]:
        return self.stack.members

    def cache(self) -> CachedRows | None:
        return self.storage.cache()

    def stats(self) -> dict[str, dict[str, float | int]]:
        return self.storage.stats()

    def combine(self, index: torch.Tensor, bags: Bags, dedup: Dedup | None = None
                ) -> torch.Tensor:
        return self.storage.combine(index, bags, dedup)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.storage.gather(rows, out)

    def held(self, rows: torch.Tensor, count: bool = True, write: bool = False
             ) -> contextlib.AbstractContextManager[
                 tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
        return self.storage.held(rows, count, write)

    def renew(self, rows: torch.Tensor, write: Writer) -> None:
        self.storage.renew(rows, write)

    def full(self, key: str) -> torch.Tensor:
        return self.storage.full(key)

    def read(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        return self.storage.read(key, rows)

    def to(self, device: torch.device, workspace: Workspace, backend: Backend) -> None:
        super().to(device, workspace, backend)
        self.storage.to(device, workspace, backend)

    def track(self, changes: ChangedRows) -> None:
        super().track(changes)
        self.storage.track(changes)

    # ------------------------------------------------------------------ the maps' step
    def lookup(self, bags: Bags, dedup: Dedup, training: bool,
               segments: Segments | None = None, comm: Communicator | None = None,
               everyone: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, Resolved | None]:
        """The bags read at the rows the maps give the batch's distinct ids (a training batch:
        after their step). A replicated table's maps take the same step on every process: over
        the distinct ids of all processes (gathered: a collective, unless ``everyone`` holds
        them already), so that every replica stays identical."""
        unique = dedup.unique  # (U,)
        if comm is None or comm.world_size == 1 or not training:
            got, since = self.resolve([unique], training, segments)
            rows = got[0]
        else:
            if everyone is None:
                everyone = comm.all_to_all([unique] * comm.world_size)  # W x (U_r,)
            union = torch.unique(torch.cat(everyone), sorted=True)  # (V,)
            got, since = self.resolve([union], training)
            rows = got[0][torch.searchsorted(union, unique)]
        out = self.storage.combine(occurrences(rows, dedup, self.backend), bags)  # (R, D)
        return out, ([rows], since)

    def resolve(self, ids: list[torch.Tensor], training: bool,
                segments: Segments | None = None) -> Resolved:
        """The shard rows the maps give ``ids`` (one tensor per asking process; a single tensor
        must hold distinct ids, in any order; the zero row where not resident), after a training
        step of the maps over their distinct ids when ``training``; the new rows get their
        initial values and fresh slots.

        Stacked dynamic tables take one tensor of distinct ids, a run per member
        (``segments``), each run resolved by its member's map; or, with no ``segments``, what
        each process asked (``Route.header``: the count of each member's ids, then their runs):
        each member's map steps over the union of its runs.

        Raises:
            ValueError: a training step admitting more ids than the shard can place (the maps,
                rows and slots are unchanged).
        """
        stack = self.stack
        if segments is None and len(stack.members) > 1:
            return self._resolve_asked(ids, training)
        if len(ids) == 1:  # one process's distinct ids (a lookup's dedup.unique)
            unique, inverse = ids[0], None
        else:  # what several processes asked for: their union (in any order: the map's step
            # does not depend on it)
            unique, inverse = distinct(torch.cat(ids), self.backend)
        rows, new, since, written = stack.resolve(unique, training, segments,
                                                  self._init_target())  # (U,), per member
        if training and self.changes is not None:  # the map's state of these rows moved
            self.changes.mark(self.p, rows)
        new = [] if written else [n for n in new if n[1].numel()]  # (else: written already)
        if new and len(new[0]) == 4 and self.storage.cache() is not None:
            new = [(m, i[a], r[a]) for m, i, r, a in new]  # (a cache takes distinct rows)
        if new:  # every member's new rows in one pass: member m's ids at its run
            counts = [n[2].numel() for n in new]

            def write(table: torch.Tensor, slots: dict[str, torch.Tensor],
                      at: torch.Tensor) -> None:
                for name, value in self.fills.items():
                    slots[name].index_fill_(0, at, value)
                # (masked entries, from maps on the device: the rows not taken are the zero
                # row, whose slots keep their initial values, and whose values are not written)
                for entry, at_m in zip(new, at.split(counts)):
                    dyn = stack.members[entry[0]]  # (an 8-bit table's scales set here)
                    initialize_rows(dyn.table, dyn.name, dyn.seed, entry[1], at_m, table,
                                    self.columns, self.backend, slots.get(SCALES),
                                    entry[3] if len(entry) == 4 else None)

            self.storage.renew(torch.cat([n[2] for n in new]) if len(new) > 1
                               else new[0][2], write)
        if inverse is None:
            return [rows], since
        return list(rows[inverse].split([t.numel() for t in ids])), since

    def _runs(self, ids: list[torch.Tensor]
              ) -> tuple[list[list[torch.Tensor]], torch.Tensor, Segments, list[torch.Tensor]]:
        """What processes asked of a stack (headed runs, ``Route.header``): per process its
        runs by member, the members' distinct ids (a run each, ``segments``) and, per member,
        where each id of its runs (all processes in turn) is in its distinct run."""
        m = len(self.stack.members)
        runs = [list(t[m:].split(t[:m].tolist())) for t in ids]  # per process: M runs
        unique, inverses, segments = [], [], []
        for k in range(m):
            mine = [r[k] for r in runs]
            cat = torch.cat(mine) if len(mine) > 1 else mine[0]
            if len(mine) == 1:  # one process: its run is distinct already
                d, inv = cat, torch.arange(cat.numel(), device=cat.device)
            elif cat.numel():
                d, inv = distinct(cat, self.backend)
            else:
                d, inv = cat, cat
            unique.append(d)
            inverses.append(inv)
            segments.append((k, d.numel()))
        return runs, torch.cat(unique), tuple(segments), inverses

    def _resolve_asked(self, ids: list[torch.Tensor], training: bool) -> Resolved:
        """``resolve`` of what each process asked of a stack (headed runs): each member's map
        over the union of its runs; the rows back in each process's order."""
        runs, unique, segments, inverses = self._runs(ids)
        rows, _ = self.resolve([unique], training, segments)
        per_member = rows[0].split([c for _, c in segments])
        out: list[list[torch.Tensor]] = [[] for _ in ids]
        for k, (got, inv) in enumerate(zip(per_member, inverses)):
            back = got[inv].split([r[k].numel() for r in runs])
            for s, piece in enumerate(back):
                out[s].append(piece)
        return [torch.cat(o) for o in out], self.stack.since(None)

    def check_step(self, ids: list[torch.Tensor], segments: Segments | None = None) -> None:
        """Raises, before any map changes, the ``ValueError`` the training step over ``ids``
        would raise (``DynamicRows.check_step``; ``ids``: the tensors whose distinct ids the
        step takes, repeats allowed; ``segments``: a stack's runs, as ``resolve``'s). Free while
        a member's ids number at most its capacity."""
        stack = self.stack
        if segments is None and len(stack.members) > 1:  # what each process asked
            _, unique, segments, _ = self._runs(ids)
            stack.check_step(unique, segments)
        elif segments is not None:
            stack.check_step(ids[0], segments)
        elif sum(t.numel() for t in ids) > stack.members[0].capacity:  # (else: their distinct
            stack.check_step(ids[0] if len(ids) == 1  # fewer)
                             else distinct(torch.cat(ids), self.backend)[0])

    def _init_target(self) -> tuple[torch.Tensor, tuple[int, int],
                                    list[tuple[torch.Tensor, float]]] | None:
        """Where a fused step of the stack may write its new rows' initial values and fresh
        slots itself: ``(table, columns, [(slot, initial value)])`` when the values are the
        default's for every member, into a float32 table and float32 slots in memory
        (``DynamicStack.resolve``); else None."""
        storage = self.storage
        if storage.cache() is not None or len(self.stack.members) == 1:
            return None
        table = storage.table
        if (table.dtype != torch.float32 or not table.is_contiguous() or not table.is_cpu
                or any(m.table.initializer is not None for m in self.stack.members)):
            return None
        slots = [(storage.full(name), value) for name, value in self.fills.items()]
        if any(t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu or t.dim() != 2
               or t.shape[0] != table.shape[0] for t, _ in slots):
            return None
        return table, self.columns, slots

    # ------------------------------------------------------------------------ the update
    def update(self, rows: torch.Tensor, grad: torch.Tensor | OutputGrads,
               optimizer: Optimizer, lr: float, step: int, *,
               gradient_multiplier: float | None = None, since: Any = None,
               rounding: RoundingOf | None = None) -> None:
        """``since`` is the map step ``rows`` were resolved at: rows not resident then (the zero
        row, possibly repeated), or given to another id since, are left alone; with ``grad`` as
        ``OutputGrads``, ``rows`` are the map's rows of its ``dedup.unique``."""
        assert since is not None
        keep, kept = self.stack.valid(rows, since)  # (n,)
        if isinstance(grad, OutputGrads) and kept == rows.numel():
            # every row valid, so distinct: the backward stays fused into the update, over the
            # rows the map gave the distinct ids
            d = grad.dedup
            grad = OutputGrads(grad.parts, grad.starts, grad.bags,
                               Dedup(rows, d.order, d.unique_offsets))
        else:
            if isinstance(grad, OutputGrads):
                grad = row_gradients(grad, self.workspace, self.backend)  # (n, D)
            if kept < rows.numel():
                rows, grad = rows[keep], grad[keep]
        self.storage.update(rows, grad, optimizer, lr, step,
                            gradient_multiplier=gradient_multiplier,
                            rounding=lambda r, at: self.rounding_at(step, r, at))
        if optimizer.updates_every_row and self.storage.cache() is None:  # it moved every
            self.storage.table[self.stack.zero_row] = 0  # row, the zero row too

    def rounding_at(self, step: int, rows: torch.Tensor | None = None,
                    at: torch.Tensor | None = None,
                    ids: torch.Tensor | None = None) -> Rounding | None:
        """An updated row's identity is its raw id (a stack's: its member's key plus its raw
        id); a table alone in memory reads them from its map's row ids."""
        r = self.rounding
        if r is None or not r.stochastic:
            return r
        if at is None and self.member_keys is None:  # (the map's rows past its row_ids hold
            return r.at(step, self.stack.map.row_ids())  # no id)
        assert rows is not None, "the keys are written for the updated rows"
        if self.member_keys is not None:
            raw, member = self.stack.ids_of_rows(rows)
            ids = raw + self.member_keys.to(rows.device)[member]
        else:
            ids = self.stack.map.ids_of_rows(rows)
        return self.storage.rounding_at(step, rows, at, ids)

    # ------------------------------------------------------------------ outside the step
    def member(self, k: int) -> DynamicRows:
        return self.stack.members[k]

    def in_use(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(used (N,) bool, ids (N,) int64)``: the shard rows holding an id, and the ids."""
        return self.stack.row_state("last_use")[:, 0] > 0, self.stack.row_state("ids")[:, 0]
