"""The row store: this process's rows of every physical table and their optimizer slots.

The step reads and writes rows only through three methods, so that other stores (a raw-id map,
a cache over a slow tier) can stand behind the same verbs:

- ``combine(p, index, bags, dedup=None)``: rows out, combined into bags (the lookup of rows
  held here);
- ``gather(p, rows)``: rows out, as they are (answers to other processes' lookups);
- ``update(p, rows, grad, optimizer, lr, step)``: the optimizer applied to rows, in place.

A dynamic table (raw ids) adds a fourth, ``resolve(p, ids, training)``: the ids that reach this
process become rows of its shard through the table's map (vocabulary.py), which a training step
grows (admission, eviction; new rows get their initial values and fresh slots here). Its shard
has one more row at the end that stays zero, where ids not resident are looked up, and ``update``
drops gradients of that row and of rows given to another id since they were resolved.

A table the plan offloads (``memory_budget``) keeps its shard in a slow tier with its hot rows
in a write-back cache (cache.py): the three verbs take shard rows as always and resolve them to
cache rows inside, reading misses and writing evicted updates back, so nothing else changes. A
dynamic table can be offloaded too: its map stays here, and the rows it gives new ids get their
initial values in the cache (``CachedRows.renew``).

``RowStore`` keeps every other row in memory (host memory on the CPU, on huge pages where the
system allows; device memory on a GPU). It also owns what the rows look like outside the step: a logical
table's rows on this process (``local``), whole tables (``whole``) and the checkpoint view
(``state_dict`` / ``load_state_dict``), through the plan's placements and ``dtensors.py``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..base.comm import Communicator
from ..config.optimizers import Optimizer
from ..config.tables import TableConfig, initial_rows
from ..ops import native
from ..ops.bags import Bags, Dedup
from ..ops.combine import OutputGrads, combine, row_gradients
from ..ops.memory import empty_table
from ..ops.rounding import COMPACT, Rounding, Segments, shard_segments, table_key
from ..ops.update import update
from ..ops.workspace import Workspace
from ..planning.plan import PhysicalTable, ShardingPlan
from .cache import (CachedRows, OffloadDir, record_layout, slow_log, slow_records, slow_tensor,
                    slow_writes)
from .changes import ChangedRows
from .dtensors import from_value, gather_whole, to_sharded
from .vocabulary import (PENDING, ROW_STATE, SCALARS, VOCAB, DynamicRows, DynamicStack,
                         initialize_rows, whole_vocabulary)

INIT_ROWS = 1 << 16  # an offloaded table's rows are initialized this many at a time


class RowStore:
    """Every physical table's shard on this process, with its slots, in fast memory.

    Args:
        plan: the sharding plan.
        configs: ``{table name: TableConfig}`` (initializers).
        seed: the engine's seed (initial values depend on it, the table and the row only).
        comm: the communicator (its rank picks the shard).
        device: where tables and slots live.
        offload_dir: where the slow tier's files go (tables the plan offloads; None: a
            temporary directory).
    """

    def __init__(self, plan: ShardingPlan, configs: Mapping[str, TableConfig], seed: int,
                 comm: Communicator, device: torch.device,
                 offload_dir: str | os.PathLike | None = None) -> None:
        self.plan, self.comm, self.device = plan, comm, device
        self.workspace = Workspace()  # the update's temporaries, kept across steps
        self.tables: list[torch.Tensor] = []
        self.slots: list[dict[str, torch.Tensor]] = []
        self.dynamic: dict[int, DynamicStack] = {}  # physical table -> its maps on this process
        self.cached: dict[int, CachedRows] = {}  # physical table -> its slow tier and cache
        self.configs = dict(configs)
        self.changes: ChangedRows | None = None  # rows written since publishes (``track``)
        rank = comm.rank
        self._offload = (OffloadDir(offload_dir, rank) if any(p.offloaded for p in plan.physical)
                         else None)
        # how the static tables' files write rows back: a log or in place (cache.slow_writes)
        self._writes = slow_writes(sum(
            p.row_counts[rank] * record_layout(self._fields(p))[1]
            for p in plan.physical if p.offloaded and not p.dynamic)) \
            if device.type == "cpu" and self._offload is not None else "in-place"
        # float16 / bfloat16 tables: how their updates round (ops/rounding.py); a stack of
        # dynamic tables' member keys (its rows' identities: member key + raw id)
        self._member_keys: dict[int, torch.Tensor] = {}
        self.rounding: dict[int, Rounding] = {
            p.index: self._rounding(p, seed) for p in plan.physical if p.dtype in COMPACT}
        for p in plan.physical:
            try:
                self._allocate(p, seed, device)
            except RuntimeError as e:  # torch's allocator: out of memory
                if "alloc" not in str(e).lower() and "memory" not in str(e).lower():
                    raise
                held = sum(t.numel() * t.element_size() for t in self.tables) + sum(
                    v.numel() * v.element_size() for s in self.slots for v in s.values())
                raise ValueError(
                    f"tables {list(p.tables)}: their rows and slots on this process could not "
                    f"be allocated in {device} memory ({e}; {held} bytes were allocated for "
                    f"the tables before them). Give the engine a memory_budget (their rows then "
                    f"go to a slow tier, hot rows cached), shard them over more processes, or "
                    f"make them smaller") from None

    def _rounding(self, p: PhysicalTable, seed: int) -> Rounding:
        """How updates of a 16-bit physical table round: the rows' identities (per member, its
        key plus the logical row; a dynamic table's key plus the raw id), its first column.

        A stack of dynamic tables has one segment of base 0 and stride 1, and each updated row's
        key is its member's key plus its raw id (``rounding_at``): the identity the member has
        alone (its key as the base, the raw id as the row)."""
        rank = self.comm.rank
        if p.dynamic and len(p.tables) > 1:
            self._member_keys[p.index] = torch.tensor([table_key(seed, n) for n in p.tables],
                                                      dtype=torch.int64)
            i64 = torch.int64
            return Rounding(self.configs[p.tables[0]].stochastic_rounding,
                            Segments(torch.tensor([0, p.row_counts[rank] + 1], dtype=i64),
                                     torch.zeros(1, dtype=i64), torch.ones(1, dtype=i64)),
                            col0=p.columns[rank][0])
        if p.dynamic:
            members = [(p.tables[0], 0, torch.arange(0))]
        else:
            members = [(name, self.plan.table(name).local_offsets[rank],
                        self.plan.table(name).held_rows(rank)) for name in p.tables]
        return Rounding(self.configs[p.tables[0]].stochastic_rounding,
                        shard_segments(members, seed, p.row_counts[rank]),
                        col0=p.columns[rank][0])

    def rounding_at(self, p: int, step: int, rows: torch.Tensor | None = None,
                  at: torch.Tensor | None = None) -> Rounding | None:
        """The rounding of an update of physical table ``p`` at ``step`` (None: not 16-bit). An
        offloaded table's kernel writes cache rows ``at``: their identities come from the shard
        rows ``rows`` (a dynamic table's: from their ids). A stack of dynamic tables needs the
        updated shard ``rows``: their keys (member key + raw id) are written for them."""
        r = self.rounding.get(p)
        if r is None or not r.stochastic:
            return r
        dyn = self.dynamic.get(p)
        members = self._member_keys.get(p)  # (a stack of dynamic tables)
        if at is None and members is None:  # (the map's rows past its row_ids hold no id)
            return r.at(step, None if dyn is None else dyn.map.row_ids())
        assert rows is not None, "the keys are written for the updated rows"
        if members is not None:
            ids, member = dyn.ids_of_rows(rows)
            ids = ids + members.to(rows.device)[member]
        else:
            ids = rows if dyn is None else dyn.map.ids_of_rows(rows)
        # written where the kernel reads them: the cache rows (the cache may have grown), or
        # the stack's shard rows
        n = self.cached[p].table.shape[0] if at is not None else dyn.zero_row + 1
        keys = self.workspace.get("round_keys", (n,), torch.int64, rows.device)
        keys.index_copy_(0, at if at is not None else rows, ids)
        return r.at(step, keys)

    def _allocate(self, p: PhysicalTable, seed: int, device: torch.device) -> None:
        """Physical table ``p``'s shard and slots on this process, initialized."""
        configs, plan, rank = self.configs, self.plan, self.comm.rank
        c0, c1 = p.columns[rank]
        n_local = p.row_counts[rank]
        if p.dynamic:  # rows get values at admission; one more row stays zero
            members = [plan.table(name) for name in p.tables]
            self.dynamic[p.index] = DynamicStack(
                [DynamicRows(configs[m.name], m.name, seed, m.row_counts[rank], device)
                 for m in members], [m.local_offsets[rank] for m in members], n_local)
        if p.offloaded:
            cache = self._offloaded(p, seed, device)
            self.cached[p.index] = cache
            self.tables.append(cache.table)
            self.slots.append(cache.slots)
            return
        if p.dynamic:
            n_local += 1
        w = empty_table((n_local, c1 - c0), p.dtype, device)  # (N_r, D_r)
        if p.dynamic:
            w.zero_()
        for name in (p.tables if not p.dynamic else ()):
            place = plan.table(name)
            rows = place.held_rows(rank)
            start = place.local_offsets[rank]
            if (c0, c1) == (0, p.dim):  # whole rows: initialised in place
                initial_rows(configs[name], name, seed, rows, out=w[start:start + len(rows)])
            else:
                values = initial_rows(configs[name], name, seed, rows)  # (n, D)
                w[start:start + len(rows)] = values[:, c0:c1].to(device)
        slot_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        opt = p.optimizer
        self.tables.append(w)
        self.slots.append(opt.init_slots(n_local, c1 - c0, dtype=slot_dtype, device=device,
                                         allocate=empty_table) if opt is not None else {})

    def _fields(self, p: PhysicalTable) -> list[tuple[torch.dtype, int]]:
        """``(dtype, width)`` of physical table ``p``'s parameters and slots on this process:
        the fields of its slow tier's records (``slow_records``)."""
        c0, c1 = p.columns[self.comm.rank]
        slot_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        specs = list(p.optimizer.slots) if p.optimizer is not None else []
        return [(p.dtype, c1 - c0)] + [(slot_dtype, 1 if s.rowwise else c1 - c0) for s in specs]

    def _offloaded(self, p: PhysicalTable, seed: int, device: torch.device) -> CachedRows:
        """Physical table ``p``'s shard in the slow tier and its empty cache.

        On the CPU a static table's rows and slots are one file of records (``slow_records``: a
        row and its slots side by side), initialized in one pass in blocks of rows (memory stays
        bounded; each page written once). A dynamic table keeps a file per array: its rows are
        zeros until ids are admitted (the parameters' file is reserved on disk, unwritten) and its
        zero row comes after them. For a GPU: pinned host memory, an array each."""
        rank = self.comm.rank
        c0, c1 = p.columns[rank]
        n_local = p.row_counts[rank] + (1 if p.dynamic else 0)
        assert self._offload is not None
        pin = device.type == "cuda"
        files = device.type == "cpu"
        slot_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        opt = p.optimizer
        specs = list(opt.slots) if opt is not None else []
        slots: dict[str, torch.Tensor]
        log = None
        if files and not p.dynamic:
            path = self._offload.file(f"p{p.index}.bin")
            fields = self._fields(p)
            if self._writes == "log":
                views, log = slow_log(path, n_local, fields)
            else:
                views = slow_records(path, n_local, fields)
            w, slots = views[0], {s.name: v for s, v in zip(specs, views[1:])}
        else:
            def allocate(shape: tuple[int, ...], dtype: torch.dtype, _: Any = None,
                         key: list[int] = [0]) -> torch.Tensor:
                key[0] += 1
                path = self._offload.file(f"p{p.index}-{key[0]}.bin") if files else None
                return slow_tensor(path, shape, dtype, pin)

            w = allocate((n_local, c1 - c0), p.dtype)
            if p.dynamic and not files:  # (a new file reads as zeros)
                w.zero_()
            slots = (opt.init_slots(n_local, c1 - c0, dtype=slot_dtype, device="cpu",
                                    allocate=allocate) if opt is not None else {})
        for name in (p.tables if not p.dynamic else ()):
            place = self.plan.table(name)
            rows = place.held_rows(rank)
            start = place.local_offsets[rank]
            for i in range(0, len(rows), INIT_ROWS):
                block = rows[i:i + INIT_ROWS]
                at = slice(start + i, start + i + len(block))
                w[at] = initial_rows(self.configs[name], name, seed, block)[:, c0:c1]  # (n, C)
                if files:  # (the records' slots, in the same pass)
                    for spec in specs:
                        slots[spec.name][at].fill_(spec.initial_value)
        bounds = [self.plan.table(n).local_offsets[rank] for n in p.tables] + [n_local]
        return CachedRows(p.tables[0], {"parameters": w, **slots}, p.cache_rows[rank], device,
                          bounds, p.tables, mapped=files, log=log)

    # ------------------------------------------------------------------------ the step's rows
    def combine(self, p: int, index: torch.Tensor, bags: Bags,
                dedup: Dedup | None = None) -> torch.Tensor:
        """(R, D) bags of rows ``index`` (shard rows of physical table ``p``) combined
        (``dedup``: the batch's distinct rows, when ``index`` is its ids: an offloaded table
        then brings in each distinct row once)."""
        cache = self.cached.get(p)
        if cache is None:
            return combine(self.tables[p], index, bags)
        if dedup is None:
            with cache.lock:  # (a background lookup may run beside a main-thread one)
                slots = self._cache_rows(cache, index)  # (first: it may grow the cache)
                return combine(cache.table, slots, bags)
        with self.held(p, dedup.unique) as (table, _, at):
            return combine(table, occurrences(at, dedup), bags)

    @contextlib.contextmanager
    def held(self, p: int, rows: torch.Tensor, count: bool = True, write: bool = False
             ) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
        """``(table, slots, at)``: where distinct shard rows ``rows`` of physical table ``p``
        are, for the block's reads (``write``: and writes). In memory: the shard's table and
        slots, and ``rows``. Offloaded: the cache's table and slots and the cache rows of
        ``rows``, brought in (``count``: a lookup, counted in the statistics) and held there
        under the cache's lock; with ``write`` they are marked updated (written back when they
        leave)."""
        cache = self.cached.get(p)
        if cache is None:
            yield self.tables[p], self.slots[p], rows
            return
        with cache.lock:
            at = cache.resolve(rows, count=count)
            try:
                yield cache.table, cache.slots, at
            finally:
                if write:
                    cache.touched(at)

    def gather(self, p: int, rows: torch.Tensor) -> torch.Tensor:
        """(n, D_r) the shard rows ``rows`` of physical table ``p``."""
        cache = self.cached.get(p)
        if cache is None:
            return self.tables[p][rows]
        with cache.lock:
            slots = self._cache_rows(cache, rows)  # (first: it may grow the cache)
            return cache.table[slots]

    @staticmethod
    def _cache_rows(cache: CachedRows, rows: torch.Tensor) -> torch.Tensor:
        """The cache rows of shard rows ``rows`` (repeats allowed), brought in as needed."""
        if rows.numel() == 0:
            return rows
        distinct, inverse = _distinct(rows)
        return cache.resolve(distinct).index_select(0, inverse)

    def member(self, name: str) -> DynamicRows:
        """A dynamic table's map on this process (its member of its physical table's stack)."""
        place = self.plan.table(name)
        dyn = self.dynamic.get(place.physical)
        if dyn is None:
            raise ValueError(f"table {name!r} is not dynamic: its ids are its rows (give it "
                             f"TableConfig(dynamic=ec.DynamicVocabulary()) for raw ids)")
        return dyn.members[self.plan.physical[place.physical].tables.index(name)]

    def resolve(self, p: int, ids: list[torch.Tensor], training: bool,
                segments: tuple[tuple[int, int], ...] | None = None
                ) -> tuple[list[torch.Tensor], Any]:
        """The shard rows of ``ids`` (one tensor per asking process; a single tensor must hold
        distinct ids, in any order) of physical table ``p``.

        For a table whose ids are rows, ``ids`` as they are. For a dynamic table, the rows its
        map gives them (the zero row when not resident), after a training step of the map over
        their distinct ids when ``training``; the new rows get their initial values and fresh
        slots.

        Stacked dynamic tables take one tensor of distinct ids, a run per member
        (``segments``: ``TableBatch.segments``), each run resolved by its member's map; or, with
        no ``segments``, what each process asked (``Route.header``: the count of each member's
        ids, then their runs): each member's map steps over the union of its runs.

        Returns:
            ``(rows, since)``: rows like ``ids``; ``since`` the map step(s) they are valid at
            (None for a static table), for ``update``.

        Raises:
            ValueError: a training step admitting more ids than the shard can place (the maps,
                rows and slots are unchanged).
        """
        dyn = self.dynamic.get(p)
        if dyn is None:
            return ids, None
        if segments is None and len(dyn.members) > 1:
            return self._resolve_asked(p, dyn, ids, training)
        if len(ids) == 1:  # one process's distinct ids (a lookup's dedup.unique)
            distinct, inverse = ids[0], None
        else:  # what several processes asked for: their union (in any order: the map's step
            # does not depend on it)
            distinct, inverse = _distinct(torch.cat(ids))
        rows, new, since, written = dyn.resolve(distinct, training, segments,
                                                self._init_target(p, dyn))  # (U,), per member
        if training and self.changes is not None:  # the map's state of these rows moved
            self.changes.mark(p, rows)
        new = [] if written else [n for n in new if n[1].numel()]  # (else: written already)
        cache = self.cached.get(p)
        if cache is not None and new:  # the new rows are written in the cache (their old
            # values are not read), every member's in one pass: member m's ids at its run
            counts = [r.numel() for _, _, r in new]

            def write(table: torch.Tensor, slots: dict[str, torch.Tensor],
                      at: torch.Tensor) -> None:
                for (m, new_ids, _), at_m in zip(new, at.split(counts)):
                    self._renew(p, m, new_ids, at_m, table, slots, fresh=False)
                self._fresh_slots(p, at, slots)

            with cache.lock:
                cache.renew(torch.cat([r for _, _, r in new]) if len(new) > 1 else new[0][2],
                            write)
            new = []
        for m, new_ids, new_rows in new:  # (A,) ids admitted by member m, (A,) their rows
            self._renew(p, m, new_ids, new_rows.to(self.device), self.tables[p], self.slots[p])
        if inverse is None:
            return [rows], since
        return list(rows[inverse].split([t.numel() for t in ids])), since

    def _runs(self, dyn: DynamicStack, ids: list[torch.Tensor]
              ) -> tuple[list[list[torch.Tensor]], torch.Tensor, tuple[tuple[int, int], ...],
                         list[torch.Tensor]]:
        """What processes asked of a stack (headed runs, ``Route.header``): per process its
        runs by member, the members' distinct ids (a run each, ``segments``) and, per member,
        where each id of its runs (all processes in turn) is in its distinct run."""
        m = len(dyn.members)
        runs = [list(t[m:].split(t[:m].tolist())) for t in ids]  # per process: M runs
        distinct, inverses, segments = [], [], []
        for k in range(m):
            mine = [r[k] for r in runs]
            cat = torch.cat(mine) if len(mine) > 1 else mine[0]
            if len(mine) == 1:  # one process: its run is distinct already
                d, inv = cat, torch.arange(cat.numel(), device=cat.device)
            elif cat.numel():
                d, inv = _distinct(cat)
            else:
                d, inv = cat, cat
            distinct.append(d)
            inverses.append(inv)
            segments.append((k, d.numel()))
        return runs, torch.cat(distinct), tuple(segments), inverses

    def _resolve_asked(self, p: int, dyn: DynamicStack, ids: list[torch.Tensor],
                       training: bool) -> tuple[list[torch.Tensor], Any]:
        """``resolve`` of what each process asked of a stack (headed runs): each member's map
        over the union of its runs; the rows back in each process's order."""
        runs, distinct, segments, inverses = self._runs(dyn, ids)
        rows, _ = self.resolve(p, [distinct], training, segments)
        per_member = rows[0].split([c for _, c in segments])
        out: list[list[torch.Tensor]] = [[] for _ in ids]
        for k, (got, inv) in enumerate(zip(per_member, inverses)):
            back = got[inv].split([r[k].numel() for r in runs])
            for s, piece in enumerate(back):
                out[s].append(piece)
        return [torch.cat(o) for o in out], dyn.since(None)

    def check_steps(self, tables: list[tuple[int, list[torch.Tensor],
                                             tuple[tuple[int, int], ...] | None]]) -> None:
        """Raises, before any map changes, the ``ValueError`` the training step of any of the
        dynamic tables ``[(p, ids, segments)]`` would raise (``DynamicRows.check_step``;
        ``ids``: the tensors whose distinct ids the step takes, repeats allowed; ``segments``:
        a stack's runs, as ``resolve``'s), so that a batch failing at one table changes no
        other table's map. Free while a member's ids number at most its capacity."""
        for p, ids, segments in tables:
            dyn = self.dynamic[p]
            if segments is None and len(dyn.members) > 1:  # what each process asked
                _, distinct, segments, _ = self._runs(dyn, ids)
                dyn.check_step(distinct, segments)
                continue
            if segments is not None:
                dyn.check_step(ids[0], segments)
                continue
            if sum(t.numel() for t in ids) <= dyn.members[0].capacity:
                continue  # (their distinct ids fewer still: the step cannot fail)
            dyn.check_step(ids[0] if len(ids) == 1 else _distinct(torch.cat(ids))[0])

    def _renew(self, p: int, m: int, ids: torch.Tensor, at: torch.Tensor, table: torch.Tensor,
               slots: dict[str, torch.Tensor], fresh: bool = True) -> None:
        """Writes the initial values of member ``m``'s new ``ids`` (A,) and (``fresh``) fresh
        slots into rows ``at`` (A,) of ``table`` and ``slots``."""
        dyn = self.dynamic[p].members[m]
        initialize_rows(dyn.table, dyn.name, dyn.seed, ids, at, table,
                        self.plan.physical[p].columns[self.comm.rank])
        if fresh:
            self._fresh_slots(p, at, slots)

    def _fresh_slots(self, p: int, at: torch.Tensor, slots: dict[str, torch.Tensor]) -> None:
        """Resets rows ``at`` of physical table ``p``'s ``slots`` to their initial values."""
        opt = self.plan.physical[p].optimizer
        for spec in (opt.slots if opt is not None else ()):
            slots[spec.name].index_fill_(0, at, spec.initial_value)

    def _init_target(self, p: int, dyn: DynamicStack
                     ) -> tuple[torch.Tensor, tuple[int, int],
                                list[tuple[torch.Tensor, float]]] | None:
        """Where a fused step of stack ``dyn`` (physical table ``p``) may write its new rows'
        initial values and fresh slots itself: ``(table, columns, [(slot, initial value)])``
        when the values are the default's for every member, into a float32 table and float32
        slots in memory (``DynamicStack.resolve``); else None."""
        table = self.tables[p]
        if (p in self.cached or len(dyn.members) == 1 or table.dtype != torch.float32
                or not table.is_contiguous() or not table.is_cpu
                or any(m.table.initializer is not None for m in dyn.members)):
            return None
        opt = self.plan.physical[p].optimizer
        slots = [(self.slots[p][spec.name], spec.initial_value)
                 for spec in (opt.slots if opt is not None else ())]
        if any(t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu or t.dim() != 2
               or t.shape[0] != table.shape[0] for t, _ in slots):
            return None
        return table, self.plan.physical[p].columns[self.comm.rank], slots

    def update(self, p: int, rows: torch.Tensor, grad: torch.Tensor | OutputGrads,
               optimizer: Optimizer, lr: float, step: int, *,
               gradient_multiplier: float | None = None, since: int | None = None) -> None:
        """Applies ``optimizer`` to distinct shard rows ``rows`` of ``p`` (ops/update.py;
        ``gradient_multiplier``: the optimizer's, already evaluated for ``step``). For a dynamic
        table, ``since`` is the map step ``rows`` were resolved at: rows not resident then (the
        zero row, possibly repeated), or given to another id since, are left alone; with
        ``grad`` as ``OutputGrads``, ``rows`` are the map's rows of its ``dedup.unique``."""
        dyn = self.dynamic.get(p)
        if dyn is not None:
            assert since is not None
            keep, kept = dyn.valid(rows, since)  # (n,)
            if isinstance(grad, OutputGrads) and kept == rows.numel():
                # every row valid, so distinct: the backward stays fused into the update, over
                # the rows the map gave the distinct ids
                d = grad.dedup
                grad = OutputGrads(grad.parts, grad.starts, grad.bags,
                                   Dedup(rows, d.order, d.unique_offsets))
            else:
                if isinstance(grad, OutputGrads):
                    grad = row_gradients(grad, self.workspace)  # (n, D)
                if kept < rows.numel():
                    rows, grad = rows[keep], grad[keep]
        if p in self.cached:  # distinct shard rows -> their cache rows (hits, unless evicted
            # since the lookup)
            with self.held(p, rows, count=False, write=True) as (table, slots, at):
                if isinstance(grad, OutputGrads):
                    d = grad.dedup
                    grad = OutputGrads(grad.parts, grad.starts, grad.bags,
                                       Dedup(at, d.order, d.unique_offsets))
                update(table, slots, at, grad, optimizer, lr, step, self.workspace,
                       gradient_multiplier=gradient_multiplier,
                       round_to=self.rounding_at(p, step, rows, at))
            self.written(p, rows, every=optimizer.updates_every_row)
            return
        update(self.tables[p], self.slots[p], rows, grad, optimizer, lr, step, self.workspace,
               gradient_multiplier=gradient_multiplier, round_to=self.rounding_at(p, step, rows))
        if dyn is not None and optimizer.updates_every_row:  # it moved every row, the zero row too
            self.tables[p][dyn.zero_row] = 0
        self.written(p, rows, every=optimizer.updates_every_row)

    def written(self, p: int, rows: torch.Tensor, every: bool = False) -> None:
        """Records that shard rows ``rows`` of physical table ``p`` (``every``: all its rows)
        were written, for the next publish (changes.py; nothing while nobody publishes)."""
        if self.changes is not None:
            if every:
                self.changes.mark_all(p)
            else:
                self.changes.mark(p, rows)

    def track(self) -> ChangedRows:
        """The record of written rows, started now if it was not (``publish``)."""
        if self.changes is None:
            self.changes = ChangedRows([self.plan.physical[p].row_counts[self.comm.rank]
                                        for p in range(len(self.tables))])
        return self.changes

    def to(self, device: torch.device) -> None:
        """Moves every table and slot to ``device`` (the workspaces are dropped); an offloaded
        table moves its cache (its slow tier stays in host memory or files)."""
        for p, cache in self.cached.items():
            cache.to(device)
        self.tables = [self.cached[i].table if i in self.cached else t.to(device)
                       for i, t in enumerate(self.tables)]
        self.slots = [self.cached[i].slots if i in self.cached else
                      {k: v.to(device) for k, v in s.items()} for i, s in enumerate(self.slots)]
        self.device, self.workspace = device, Workspace()

    def cache_stats(self) -> dict[str, dict[str, float | int]]:
        """``{table: {"hits", "misses", "new", "hit_rate"}}`` of the offloaded tables on this
        process (``CachedRows.stats``)."""
        out: dict[str, dict[str, float | int]] = {}
        for cache in self.cached.values():
            out.update(cache.stats())
        return out

    # ------------------------------------------------------------------------ outside the step
    def local(self, name: str, key: str = "parameters") -> torch.Tensor:
        """This process's rows of a logical table's parameters or slot ``key`` (a view), or of
        a dynamic table's ``vocabulary/<ids, last_use or frequency>`` (a copy, ``(n, 1)``)."""
        place = self.plan.table(name)
        if key.startswith(VOCAB):
            return self.member(name).row_state(key[len(VOCAB):])
        cache = self.cached.get(place.physical)
        if cache is not None:  # the slow tier, every row current: the cache written back and
            with cache.lock:   # emptied (a write through the view is then seen by the step)
                cache.drop()
            full = cache.slow[key]
        else:
            full = self.tables[place.physical] if key == "parameters" else \
                self.slots[place.physical][key]
        start = place.local_offsets[self.comm.rank]
        return full[start:start + place.row_counts[self.comm.rank]]

    def read(self, name: str, key: str, rows: torch.Tensor) -> torch.Tensor:
        """(n, C) copies of rows ``rows`` (n,) of this process's rows of a logical table (as
        ``local`` numbers them) in its parameters, a slot, or a dynamic table's
        ``vocabulary/<ids, last_use or frequency>``. An offloaded table's rows come from its
        cache where they are there (updated or not) and from the slow tier otherwise; the cache
        is left as it was."""
        place = self.plan.table(name)
        shard = rows + place.local_offsets[self.comm.rank]
        if key.startswith(VOCAB):
            return self.member(name).row_state(key[len(VOCAB):], rows)
        cache = self.cached.get(place.physical)
        if cache is not None:
            with cache.lock:
                return cache.read(key, shard)
        full = self.tables[place.physical] if key == "parameters" else \
            self.slots[place.physical][key]
        return full[shard.to(full.device)].cpu()

    def whole(self, name: str, key: str = "parameters") -> torch.Tensor:
        """The whole ``(N, C)`` logical table: a view with one process, else a gathered copy (a
        collective)."""
        place = self.plan.table(name)
        return gather_whole(place, self.plan.physical[place.physical], self.local(name, key),
                            self.comm)

    def vocabulary(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic table's resident ids on this process and their rows in its shard
        (``Embedding.vocabulary``).

        Raises:
            ValueError: the table is not dynamic.
        """
        return self.member(name).resident()

    def whole_vocabulary(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic table's resident ids on every process and their rows of the whole logical
        table (a collective when sharded)."""
        ids, rows = self.vocabulary(name)
        return whole_vocabulary(ids, rows, self.plan.table(name).placement, self.comm)

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"<table>/<parameters or slot>": (N, C)}`` of every logical table."""
        out: dict[str, tuple[int, ...]] = {}
        for place in self.plan.tables:
            opt = self.plan.physical[place.physical].optimizer
            out[f"{place.name}/parameters"] = (place.rows, place.dim)
            for spec in (opt.slots if opt is not None else ()):
                out[f"{place.name}/{spec.name}"] = (place.rows, 1 if spec.rowwise else place.dim)
            if place.physical in self.dynamic:
                for k in ROW_STATE:
                    out[f"{place.name}/{VOCAB}{k}"] = (place.rows, 1)
                for k in SCALARS:
                    out[f"{place.name}/{VOCAB}{k}"] = ()
        return out

    def pending(self, name: str) -> torch.Tensor:
        """A dynamic table's ``vocabulary/pending``: (P, 3) int64, the ids counted for
        admission on every process, ascending, their counts and last steps seen (a collective
        when sharded)."""
        place = self.plan.table(name)
        mine = self.member(name).pending()  # (P_r, 3)
        if place.placement.held_everywhere:
            return mine
        got = torch.cat(self.comm.all_to_all([mine] * self.comm.world_size))  # (P, 3)
        return got[torch.argsort(got[:, 0])]

    def state_dict(self) -> dict[str, Any]:
        """Views of whole logical tables with one process; checkpoint shards when sharded (a
        collective: see ``Embedding.state_dict``)."""
        out: dict[str, Any] = {}
        for key, shape in self.state_shapes().items():
            name, slot = key.split("/", 1)
            if not shape:  # a dynamic table's step or seed, the same on every process
                out[key] = self.member(name).scalar(slot[len(VOCAB):])
                continue
            local = self.local(name, slot)
            if self.comm.world_size == 1:
                out[key] = local
            else:
                place = self.plan.table(name)
                out[key] = to_sharded(place, self.plan.physical[place.physical], local,
                                      shape[1], self.comm)
        for place in self.plan.tables:  # dynamic tables' counted ids (P varies: not a shape)
            if place.physical in self.dynamic:
                out[f"{place.name}/{VOCAB}{PENDING}"] = self.pending(place.name)
        return out

    def load_state_dict(self, values: Mapping[str, Any], strict: bool = True) -> None:
        """Copies ``{key: whole tensor or state_dict() value}`` in (``"step"`` is the caller's).

        Keys and shapes are checked and every value is converted (collectives included) before
        the first write: an error changes nothing.

        Raises:
            KeyError: with ``strict``, missing keys; always, unknown keys.
            ValueError: a shape mismatch, or negative accumulated squares, naming the key.
        """
        shapes = {**self.state_shapes(), "step": ()}
        optional = {f"{p.name}/{VOCAB}{PENDING}" for p in self.plan.tables
                    if p.physical in self.dynamic}  # (P, 3), any P; absent: counting afresh
        unknown = sorted(set(values) - set(shapes) - optional)
        if unknown:
            raise KeyError(f"unexpected keys {unknown}; this engine has "
                           f"{sorted({*shapes, *optional})}")
        missing = sorted(set(shapes) - set(values))
        if strict and missing:
            raise KeyError(f"missing keys {missing} (load with strict=False for a partial load)")
        for k, v in values.items():
            got = tuple(v.size()) if k != "step" else tuple(torch.as_tensor(v).shape)
            if k in optional:
                if not isinstance(v, torch.Tensor) or v.dim() != 2 or got[1] != 3 or \
                        v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                    raise ValueError(f"{k!r}: must be an integer tensor of shape [P, 3] (ids, "
                                     f"counts, last steps seen), got {getattr(v, 'dtype', '')} "
                                     f"{list(got)}")
            elif got != shapes[k]:
                raise ValueError(f"{k!r}: shape {list(got)} does not match the engine's "
                                 f"{list(shapes[k])}")
        new: dict[str, torch.Tensor] = {}
        for k, v in values.items():
            if k in optional:
                new[k] = v.detach().cpu().to(torch.int64)
            elif k != "step" and shapes[k]:
                name, _ = k.split("/", 1)
                place = self.plan.table(name)
                new[k] = from_value(place, self.plan.physical[place.physical], v, self.comm)
        maps = self._load_maps(values, new)  # dynamic tables: entries rehomed, maps checked
        for k, v in new.items():  # accumulated squares must stay >= 0 (the rules take roots)
            name, slot = k.split("/", 1)
            opt = self.plan.physical[self.plan.table(name).physical].optimizer
            spec = next((sp for sp in (opt.slots if opt is not None else ()) if sp.name == slot),
                        None)
            if spec is not None and spec.nonnegative and v.numel() and bool((v < 0).any()):
                raise ValueError(f"{k!r} holds negative values (min {v.min().item()}); "
                                 f"{type(opt).__name__}'s {slot} are sums of squares, >= 0")
        for k, v in new.items():
            name, slot = k.split("/", 1)
            if not slot.startswith(VOCAB):
                self.local(name, slot).copy_(v)
        for name, (vmap, seed) in maps.items():
            self.member(name).install(vmap, seed)
        if self.changes is not None and new:
            self.changes.mark_all()

    def _load_maps(self, values: Mapping[str, Any],
                   new: dict[str, torch.Tensor]) -> dict[str, tuple[Any, int | None]]:
        """For each dynamic table in ``values``: moves each resident id's entry (map state,
        parameters, slots) to the process owning it now (a collective when sharded), rewrites
        ``new``'s parameters and slots in place, and returns the checked new maps and seeds."""
        out = {}
        for place in self.plan.tables:
            if place.physical not in self.dynamic:
                continue
            dyn = self.member(place.name)
            prefix = f"{place.name}/{VOCAB}"
            if not any(k.startswith(prefix) for k in values):
                continue
            missing = [k for k in (*ROW_STATE, "step") if prefix + k not in values]
            if missing:
                raise KeyError(f"table {place.name!r} is dynamic but the state lacks "
                               f"{[prefix + k for k in missing]}")
            rows_state = {k: new.pop(prefix + k)[:, 0] for k in ROW_STATE}
            pending = new.pop(prefix + PENDING, None)
            floats = {k: new[f"{place.name}/{k}"] for k in ("parameters", *self.slots[
                place.physical]) if f"{place.name}/{k}" in new}
            step = int(torch.as_tensor(values[prefix + "step"]))
            seed = int(torch.as_tensor(values[prefix + "seed"])) if prefix + "seed" in values \
                else None
            opt = self.plan.physical[place.physical].optimizer
            fills = {sp.name: sp.initial_value for sp in (opt.slots if opt is not None else ())}
            vmap, moved = dyn.rehome(rows_state, floats, step, place.placement, self.comm,
                                     pending, fills)
            new.update({f"{place.name}/{k}": v for k, v in moved.items()})
            out[place.name] = (vmap, seed)
        return out


def occurrences(at: torch.Tensor, dedup: Dedup) -> torch.Tensor:
    """(nnz,) ``at`` (U,), given per distinct row of ``dedup``, at each of its occurrences (on
    the kernels' threads where they apply: a torch op this large runs on torch's, whose workers
    then spin for milliseconds on the cores the next kernels use; benchmarks/RESULTS.md,
    W1-raw)."""
    if native.usable(at, dedup.order):
        return native.expand(at, dedup.order, dedup.unique_offsets)
    return at.index_select(0, dedup.inverse)


def _distinct(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(distinct, inverse)`` of int64 ``ids``: hashing on the kernels (first-occurrence
    order), else ``torch.unique`` (ascending); ``distinct[inverse] == ids``."""
    if native.usable(ids):
        return native.dedup_raw(ids.contiguous())[:2]
    return torch.unique(ids, return_inverse=True)
