"""Dynamic tables on this process: raw ids -> shard rows, admission, and how a new row starts.

A dynamic table (``TableConfig(dynamic=ec.DynamicVocabulary(...))``, docs/semantics.md section 9)
has the ``n`` rows of its placement in its physical table's shard on a process. ``DynamicRows``
holds that shard's ``VocabMap`` (its id map: state/vocab/torch_map.py) and translates the ids that
reach this process into rows (``resolve``), admitting and evicting in a training step; the store
then writes the new rows' initial values (``initial_values``: a function of the table's seed and the
id alone) and resets their optimizer slots. A physical table of dynamic tables (one alone, or
several stacked: plan.py) is a ``DynamicStack``: a ``DynamicRows`` per member over its own rows,
and one more row after them all, which stays zero: ids that are not resident are looked up there,
and gradients to it are dropped.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...base.comm import Communicator
from ...config.tables import TableConfig, default_initializer, init_seed
from ...kernels import cpu, gpu
from ...numerics import hashing
from ...numerics.normal import KERNEL as _KERNEL
from ...numerics.normal import PHI_HI as _PHI_HI
from ...numerics.normal import PHI_LO as _PHI_LO
from ...numerics.normal import inverse_normal
from ...numerics.rounding import COMPACT, quantize
from ...ops.backend import Backend
from ...planning.placement import Placement
from .device_map import DeviceVocabMap, train_together
from .native_map import NativeVocabMap, find_many, train_steps
from .torch_map import VocabMap

# Checkpoint keys of a dynamic table (besides parameters and slots): ``<table>/vocabulary/<k>``,
# row-laid ``(N, 1)`` int64 for ROW_STATE (the id held by each row of the logical table, its last
# use and frequency; last use 0: a free row) and 0-d int64 for SCALARS (the map's training steps
# and the table's seed).
VOCAB = "vocabulary/"
ROW_STATE = ("ids", "last_use", "frequency")
SCALARS = ("step", "seed")
# ``<table>/vocabulary/pending``: (P, 3) int64, the ids being counted for admission
# (``admit_after > 1``) on every process, ascending, with their counts and the last step each was
# seen in (P varies: the same on every process, written once). Absent from older checkpoints.
PENDING = "pending"



def table_seed(base_seed: int, name: str) -> int:
    """A dynamic table's seed: new rows' values depend on it and the id alone."""
    return init_seed(base_seed, name, -1)


def initial_values(table: TableConfig, name: str, seed: int, ids: torch.Tensor) -> torch.Tensor:
    """(n, D) float32 initial values of raw ids ``ids`` (n,) of a dynamic table.

    The default initializer (TF's truncated normal, stddev ``1/sqrt(D)``, cut at 2 stddevs) is
    the inverse normal CDF of counter-based uniforms of ``(seed, id, column)`` mapped into the
    cut's probabilities, in a few vectorized ops (the fused kernels write the same values:
    ``initialize_rows``). The named initializers a spec can write (``functools.partial`` of
    ``torch.nn.init``'s ``uniform_``, ``normal_``, ``trunc_normal_``, ``constant_``, ``zeros_``,
    ``ones_`` with number arguments) are computed the same way, for a whole batch of new ids at
    once: their distributions by the inverse CDF of the same counter-based uniforms
    (``_named_values``). Any other callable initializer is run once per id, on a ``(1, D)``
    block drawn from torch's CPU generator seeded by ``(seed, id)`` (``_per_id_values``): the
    only way a callable that draws from a generator gives each id values of its own, whatever
    else is admitted with it; about 6 us an id beyond the initializer's own work.
    """
    dim = table.dim
    if table.initializer is None:
        u = hashing.uniform(seed, ids, dim)  # (n, D) in (0, 1)
        p = _PHI_LO + u * (_PHI_HI - _PHI_LO)
        return (inverse_normal(p) / math.sqrt(dim)).to(torch.float32)
    named = _named_values(table.initializer, seed, ids, dim)
    if named is not None:
        return named
    init = table.initializer if callable(table.initializer) else default_initializer(dim)
    return _per_id_values(init, name, seed, ids.cpu(), dim)


def _per_id_values(init: Callable[..., Any], name: str, seed: int, ids: torch.Tensor,
                   dim: int) -> torch.Tensor:
    """(n, D) float32: ``init`` run once per id on a ``(1, D)`` block, torch's CPU generator
    seeded by ``(seed, id)`` each time (its state restored after; no other generator is
    touched), in the convention the first id's call finds (``config.tables._fill``), the values
    checked once at the end. ``ids`` on the CPU."""
    from ...config.tables import (  # one place that runs initializers and checks what they leave
        _check_filled,
        _fill,
    )
    n = ids.numel()
    out = torch.full((n, dim), float("nan"), dtype=torch.float32)  # (n, D)
    keys = hashing.splitmix64(ids ^ hashing._signed(seed & hashing.MASK64)).tolist()
    gen = torch.default_generator
    saved = gen.get_state()
    in_place = None
    try:
        for k, key in enumerate(keys):
            gen.manual_seed(key & ((1 << 63) - 1))
            in_place = _fill(init, out[k:k + 1], name, in_place, check=False)
    finally:
        gen.set_state(saved)
    _check_filled(out, name)
    return out


def _named_values(init: object, seed: int, ids: torch.Tensor,
                  dim: int) -> torch.Tensor | None:
    """(n, D) float32 values of a named ``torch.nn.init`` initializer (a ``functools.partial``
    with keyword number arguments) for raw ids ``ids``, from counter-based uniforms of
    ``(seed, id, column)``; None for any other initializer.

    ``uniform_(a, b)``: ``a + (b - a) u``; ``normal_(mean, std)``: ``mean + std Phi^-1(u)``;
    ``trunc_normal_(mean, std, a, b)``: the normal's inverse CDF over ``[Phi(a'), Phi(b')]``
    (``a' = (a - mean) / std``), clamped to ``[a, b]``; ``constant_(val)``, ``zeros_``, ``ones_``.
    """
    if not isinstance(init, functools.partial) or init.args:
        return None
    fn = getattr(init.func, "__name__", "")
    if getattr(init.func, "__module__", "") != "torch.nn.init" or fn not in (
            "uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_"):
        return None
    kw = dict(init.keywords)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in kw.values()):
        return None
    n = ids.numel()
    if fn in ("zeros_", "ones_", "constant_"):
        value = {"zeros_": 0.0, "ones_": 1.0}.get(fn, kw.get("val"))
        return None if value is None else torch.full((n, dim), float(value))
    u = hashing.uniform(seed, ids, dim)  # (n, D) float64 in (0, 1)
    if fn == "uniform_":
        a, b = float(kw.get("a", 0.0)), float(kw.get("b", 1.0))
        return (a + (b - a) * u).to(torch.float32)
    mean, std = float(kw.get("mean", 0.0)), float(kw.get("std", 1.0))
    if fn == "normal_":
        return (mean + std * inverse_normal(u)).to(torch.float32)
    a, b = float(kw.get("a", -2.0)), float(kw.get("b", 2.0))
    lo, hi = (0.5 * math.erfc(-(x - mean) / (std * math.sqrt(2))) for x in (a, b))
    p = (lo + u * (hi - lo)).clamp(1e-300, 1 - 1e-16)
    return (mean + std * inverse_normal(p)).clamp(a, b).to(torch.float32)


def initialize_rows(table: TableConfig, name: str, seed: int, ids: torch.Tensor,
                    rows: torch.Tensor, out: torch.Tensor, columns: tuple[int, int],
                    backend: Backend, scales: torch.Tensor | None = None,
                    take: torch.Tensor | None = None) -> None:
    """Writes ``initial_values`` of ids (A,) where ``take`` (A,) bool (None: all) into rows (A,)
    of ``out`` (columns ``columns`` of the table), by the fused kernels on their backend (Triton:
    one kernel on the device, ``gpu.init_rows``; elsewhere the ids taken are compacted first);
    an 8-bit table's quantized to nearest, their new scales into ``scales`` ((N, 1))."""
    if table.initializer is None and backend.triton and gpu.lookup_supported(out):
        dev = out.device
        gpu.init_rows(ids.to(dev), rows.to(dev), torch.ones_like(ids, dtype=torch.bool, device=dev)
                      if take is None else take.to(dev), out, columns[0],
                      hashing._signed(seed & hashing.MASK64), _KERNEL + (math.sqrt(table.dim),))
        return
    if take is not None:
        ids, rows = ids[take], rows[take]
    if scales is not None:
        values = initial_values(table, name, seed, ids.cpu())[:, columns[0]:columns[1]]  # (A, C)
        codes, new_scales = quantize(values, out.dtype)
        at = rows.to(out.device)
        out.view(torch.uint8).index_copy_(0, at, codes.to(out.device).view(torch.uint8))
        scales.index_copy_(0, at, new_scales.to(scales.device))
        return
    direct = out.dtype == torch.float32 and out.is_contiguous()
    if table.initializer is None and (direct or out.dtype in COMPACT) and backend.fused_cpu:
        # into the float32 table, or float32 values rounded to nearest as below
        values = out if direct else torch.empty((ids.numel(), columns[1] - columns[0]),
                                                dtype=torch.float32)
        cpu.init_normal(seed, ids.contiguous(),
                           rows.contiguous() if direct else torch.arange(ids.numel()), columns,
                           _PHI_LO, _PHI_HI - _PHI_LO, math.sqrt(table.dim), values)
        if not direct:
            out.index_copy_(0, rows, values.to(out.dtype))
        return
    c0, c1 = columns
    values = initial_values(table, name, seed, ids.cpu())[:, c0:c1]  # (A, C)
    out.index_copy_(0, rows.to(out.device), values.to(out.device, out.dtype))


def vocab_map(capacity: int, backend: Backend, **kwargs: Any) -> VocabMap:
    """A shard's id map, of its backend's kind (the one factory): ``DeviceVocabMap`` on Triton,
    ``NativeVocabMap`` on the fused CPU kernels, ``VocabMap`` on torch ops (the same rules,
    state and results). Arguments as ``VocabMap``'s."""
    kind = (DeviceVocabMap if backend.triton else NativeVocabMap if backend.fused_cpu
            else VocabMap)
    return kind(capacity, **kwargs)


class DynamicRows:
    """One dynamic table's shard on this process: its id -> row map and its seed.

    Args:
        table: the config; name: its resolved name; base_seed: the engine's seed.
        rows: the shard's rows (its capacity on this process; the zero row comes after them).
        device: where the map lives; backend: the kernels there (its map's kind).
    """

    def __init__(self, table: TableConfig, name: str, base_seed: int, rows: int,
                 device: torch.device, backend: Backend) -> None:
        assert table.dynamic is not None
        self.table, self.name = table, name
        self.seed = table_seed(base_seed, name)
        self.zero_row = rows
        dyn = table.dynamic
        self.backend = backend
        self.map = vocab_map(max(rows, 1), backend, eviction=dyn.eviction,
                             admit_after=dyn.admit_after, ttl_steps=dyn.ttl_steps,
                             name=f"table {name!r}", device=device)
        self.capacity = rows
        self.steps = 0  # training steps seen (the map's, also where the shard holds no rows)
        self.lock = threading.Lock()  # evaluation lookups may run beside a pipelined step

    def resolve(self, ids: torch.Tensor, training: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shard rows of distinct sorted raw ids ``ids`` (U,): a training step of the map, or a
        search (evaluation).

        Returns:
            ``(rows (U,), new_ids (A,), new_rows (A,))``: each id's row (``zero_row`` when not
            resident) and the ids admitted by this step with their rows (for the caller to
            initialize).

        Raises:
            ValueError: more ids to admit than rows to give them (nothing changes).
        """
        with self.lock:
            if self.capacity == 0:  # a process holding no rows of the table
                self.steps += int(training)
                empty = ids.new_empty(0)
                return torch.full_like(ids, self.zero_row), empty, empty
            if training:  # raises before any change; ids come deduplicated
                rows, new_ids, new_rows = self.map.train_step(ids, check=False,
                                                              fill=self.zero_row)
                self.steps += 1
            else:
                rows = self.map.find(ids, fill=self.zero_row)
                new_ids = new_rows = ids.new_empty(0)
        return rows, new_ids, new_rows

    def check_step(self, ids: torch.Tensor) -> None:
        """Raises the ``ValueError`` a training step over the distinct ids ``ids`` would raise
        (more ids to admit than rows to give them), changing nothing. Free when they are at most
        the capacity: a step's admissions and hits are at most its distinct ids, and it has the
        capacity less its hits for admissions, so it cannot fail; else the step runs on a copy
        of the map."""
        if self.capacity == 0 or ids.numel() <= self.capacity:
            return
        with self.lock:
            copy.deepcopy(self.map).train_step(ids, check=False, fill=self.zero_row)

    def valid(self, rows: torch.Tensor, since: int) -> tuple[torch.Tensor, int]:
        """``(keep (n,) bool, kept)``: the rows that still hold the id they held after map step
        ``since`` (never the zero row), and how many they are."""
        if self.capacity == 0:
            return torch.zeros_like(rows, dtype=torch.bool), 0
        with self.lock:  # the zero row is the map's capacity: outside its rows, never valid
            return self.map.valid_count(rows, since)

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (R,) ascending, rows (R,)) of the ids resident in this shard."""
        with self.lock:
            if self.capacity == 0:
                empty = torch.empty(0, dtype=torch.int64)
                return empty, empty
            ids, rows = self.map.resident()
            return ids.clone(), rows.clone()

    @property
    def step(self) -> int:
        return self.steps

    # ------------------------------------------------------------------------ checkpoints
    def row_state(self, key: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(n, 1) int64 over this shard's rows (or shard rows ``rows`` (n,)): ``"ids"`` (0
        where free), ``"last_use"`` (0: free) or ``"frequency"``."""
        m, n = self.map, self.capacity
        with self.lock:
            if rows is None:
                return m.row_values(key)[:n].reshape(n, 1).clone()
            return m.row_values(key, rows).reshape(-1, 1).cpu()

    def scalar(self, key: str) -> torch.Tensor:
        return torch.tensor(self.steps if key == "step" else self.seed, dtype=torch.int64)

    def pending(self) -> torch.Tensor:
        """(P, 3) int64: the ids this shard counts for admission (ascending), their counts
        and the last step each was seen in (empty with ``admit_after == 1``)."""
        with self.lock:
            if self.capacity == 0:
                return torch.empty(0, 3, dtype=torch.int64)
            m = self.map
            return torch.stack([m.pending_ids, m.pending_counts, m.pending_seen], 1).cpu()

    def rehome(self, rows_state: dict[str, torch.Tensor], floats: dict[str, torch.Tensor],
               step: int, placement: Placement, comm: Communicator,
               pending: torch.Tensor | None = None, fills: dict[str, float] | None = None
               ) -> tuple[VocabMap, dict[str, torch.Tensor]]:
        """A loaded shard made this process's map (nothing of ``self`` changes).

        Args:
            rows_state: ``{"ids", "last_use", "frequency"}``, (n,) each, over the rows this
                process holds of the checkpoint's logical table (last use 0: a free row).
            floats: ``{"parameters" or slot: (n, C)}`` over the same rows.
            step: the checkpoint's map step. placement: the table's placement. comm: the
                communicator.
            pending: None (counting starts afresh), or (P, 3) the whole table's counted ids,
                counts and last steps seen (``pending``'s rows of every process, the same on
                every process): each process keeps those it owns.
            fills: ``{slot: initial value}``: what the free rows of each slot hold (as in a
                new engine; parameters' free rows are zero).

        Every resident id goes to the process owning it under ``placement`` (one all_to_all per
        tensor when sharded). An id that stays keeps its row; the others take the lowest free
        rows in ascending id order. When more ids reach a process than it has rows, the
        lowest-scored are dropped (as eviction would) with a warning.

        Returns:
            ``(map, floats)``: the new map, and the parameters and slots laid out for it.

        Raises:
            ValueError: a malformed state (the map's checks), naming the table.
        """
        # (every tensor made here on the checkpoint's device, that of ``rows_state``: a CUDA
        # engine's loaded state is on its GPU, and its collectives exchange device tensors)
        n = self.capacity
        used = rows_state["last_use"] > 0  # (n,)
        local_rows = used.nonzero().squeeze(1)  # (k,)
        ids = rows_state["ids"][local_rows]  # (k,)
        ints = torch.stack([ids, rows_state["last_use"][local_rows],
                            rows_state["frequency"][local_rows], local_rows], 1)  # (k, 4)
        vals = {k: v[local_rows] for k, v in floats.items()}
        if not placement.held_everywhere:
            dest = placement.owner_of_ids(ids)  # (k,)
            order = torch.argsort(dest, stable=True)
            counts = torch.bincount(dest, minlength=comm.world_size).tolist()
            got = comm.all_to_all(list(ints[order].split(counts)))  # W x (k_s, 4)
            source = torch.cat([torch.full((g.shape[0],), s, dtype=torch.int64, device=g.device)
                                for s, g in enumerate(got)])
            ints = torch.cat(got)
            vals = {k: torch.cat(comm.all_to_all(list(v[order].split(counts)),
                                                 [g.shape[0] for g in got]))
                    for k, v in vals.items()}
            stays = source == comm.rank
        else:
            stays = torch.ones(ints.shape[0], dtype=torch.bool, device=ints.device)
        if ints.shape[0] > n:  # more ids than rows: drop the lowest scores (ties: smaller id)
            score = ints[:, 1] if self.map.eviction == "lru" else ints[:, 2]
            by_id = torch.argsort(ints[:, 0], stable=True)
            keep = by_id[torch.argsort(score[by_id], stable=True)][ints.shape[0] - n:]
            warnings.warn(f"table {self.name!r}: the checkpoint holds {ints.shape[0]} ids for "
                          f"this process's {n} rows; the {ints.shape[0] - n} with the lowest "
                          f"scores were dropped", RuntimeWarning, stacklevel=4)
            keep = keep.sort().values
            ints, stays = ints[keep], stays[keep]
            vals = {k: v[keep] for k, v in vals.items()}
        rows = torch.where(stays, ints[:, 3], -1)  # (m,) kept rows; -1: to place
        taken = torch.zeros(max(n, 1), dtype=torch.bool, device=rows.device)
        taken[rows[stays]] = True
        free = (~taken[:n]).nonzero().squeeze(1)
        movers = (~stays).nonzero().squeeze(1)
        movers = movers[torch.argsort(ints[movers, 0], stable=True)]
        rows[movers] = free[:movers.numel()]
        by_id = torch.argsort(ints[:, 0], stable=True)
        vmap = vocab_map(max(n, 1), self.backend, eviction=self.map.eviction,
                         admit_after=self.map.admit_after, ttl_steps=self.map.ttl_steps,
                         name=self.map.name, device=self.map.device)
        if pending is None:
            pending = torch.empty(0, 3, dtype=torch.int64, device=ints.device)
        if not placement.held_everywhere and pending.shape[0]:
            pending = pending[placement.owner_of_ids(pending[:, 0]) == comm.rank]
        if n == 0:  # a process holding no rows of the table counts nothing
            pending = pending[:0]
        vmap.load_state_dict({"ids": ints[by_id, 0], "rows": rows[by_id],
                              "last_use": ints[by_id, 1], "frequency": ints[by_id, 2],
                              "pending_ids": pending[:, 0], "pending_counts": pending[:, 1],
                              "pending_seen": pending[:, 2], "step": torch.tensor(step)})
        moved = {}
        for k, v in floats.items():
            out = torch.full_like(v, (fills or {}).get(k, 0.0))
            if out.element_size() == 1:  # 8-bit codes: moved as bytes
                out.view(torch.uint8)[rows] = vals[k].to(out.dtype).view(torch.uint8)
            else:
                out[rows] = vals[k].to(out.dtype)
            moved[k] = out
        return vmap, moved

    def install(self, vmap: VocabMap, seed: int | None) -> None:
        """Takes a map made by ``rehome`` (and the checkpoint's seed, when it has one)."""
        with self.lock:
            self.map, self.steps = vmap, vmap.step
            if seed is not None:
                self.seed = seed


def _every(rows: torch.Tensor) -> torch.Tensor:
    """(n,) bool, every entry True, for ``rows`` (n,): a broadcast view of one value (filling n
    would hand a large step's mask to torch's threads, which cost more than the mask)."""
    return torch.ones((), dtype=torch.bool, device=rows.device).expand(rows.shape)


class DynamicStack:
    """The dynamic tables of one physical table on this process: one ``DynamicRows`` per member
    (its own map over its own rows: capacity, eviction, counts and statistics), member ``m``'s
    rows at ``[starts[m], starts[m] + capacity)`` of the shard, and one zero row after them all
    (``zero_row``: the shard's row count). A table alone is a stack of one member, whose rows
    and steps are its own.

    Steps: a stacked batch names, per member it reads, the run of its distinct ids
    (``segments``); only those members' maps step. ``since`` (what ``resolve`` returns and
    ``valid`` takes) is the member's step for one member, else ``(member steps, segments)``.
    """

    def __init__(self, members: list[DynamicRows], starts: list[int], rows: int) -> None:
        self.members, self.starts = members, starts
        self.zero_row = rows

    @property
    def map(self) -> VocabMap:
        """The map of a table alone (a stacked table's: ``members[m].map``)."""
        assert len(self.members) == 1, "a stack has a map per member"
        return self.members[0].map

    def ids_of_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, member)``: the id each of the (n,) int64 shard ``rows`` holds (0: free; the
        zero row's is 0) and the member whose rows they are, both (n,) int64."""
        starts = torch.tensor(self.starts, dtype=torch.int64, device=rows.device)
        member = (torch.searchsorted(starts, rows, right=True) - 1).clamp(min=0)
        ids = torch.zeros_like(rows)
        ends = list(self.starts[1:]) + [self.zero_row]
        if rows.numel() > 1 and bool((member[1:] >= member[:-1]).all()):  # (runs by member:
            cuts = torch.searchsorted(  # a step's rows are) one slice each
                member, torch.arange(len(self.members) + 1, device=rows.device)).tolist()
            pieces = [torch.arange(cuts[m], cuts[m + 1], device=rows.device)
                      if cuts[m + 1] > cuts[m] else None for m in range(len(self.members))]
        else:
            pieces = [torch.nonzero(member == m).flatten() for m in range(len(self.members))]
        for m, (dyn, at) in enumerate(zip(self.members, pieces)):
            if at is None or at.numel() == 0:
                continue
            local = rows[at] - self.starts[m]
            inside = local < ends[m] - self.starts[m]  # (the zero row: past the last member)
            got = dyn.map.ids_of_rows(local.clamp(max=max(ends[m] - self.starts[m] - 1, 0)))
            ids[at] = torch.where(inside, got.to(rows.device), 0)
        return ids, member

    def pieces(self, ids: torch.Tensor, segments: tuple[tuple[int, int], ...] | None
               ) -> list[tuple[int, torch.Tensor]]:
        """``[(member, its ids)]``: ``ids`` split by ``segments`` (None: all member 0's)."""
        if segments is None:
            assert len(self.members) == 1, "a stack's ids come with their members"
            return [(0, ids)]
        parts = ids.split([c for _, c in segments])
        return [(m, t) for (m, _), t in zip(segments, parts)]

    def _to_shard(self, m: int, rows: torch.Tensor) -> torch.Tensor:
        """Member ``m``'s rows (its zero row: its capacity) as shard rows."""
        dyn, start = self.members[m], self.starts[m]
        if start == 0 and dyn.zero_row == self.zero_row:
            return rows
        return torch.where(rows == dyn.zero_row, self.zero_row, rows + start)

    def resolve(self, ids: torch.Tensor, training: bool,
                segments: tuple[tuple[int, int], ...] | None = None,
                init: tuple[torch.Tensor, tuple[int, int],
                            list[tuple[torch.Tensor, float]]] | None = None
                ) -> tuple[torch.Tensor, list[tuple[Any, ...]], Any, bool]:
        """``DynamicRows.resolve`` of each member's run of distinct ids ``ids`` (U,), in shard
        rows; a training step of several members checks every one first (``check_step``), so
        a batch that one member's map cannot place changes no map. Several members' steps run
        together in two fused calls where the kernels apply (``id_map.train_steps``).

        Args:
            init: None, or ``(table, columns, slots)``: the shard's float32 table (columns
                ``columns`` of the logical tables) where the fused steps may write the admitted
                ids' initial values at once (every member taking the default initializer), and
                its optimizer's slots with their initial values (``[(slot, value)]``).

        Returns:
            ``(rows (U,), [(member, new_ids (A,), new shard rows (A,))], since, written)``:
            ``written``, whether the new rows' initial values and fresh slots are in ``init``'s
            tensors already (the list of new ids is then empty: nobody needs it). Maps on the
            device give ``_train_on_device``'s entries (masked: nothing read back).
        """
        parts = self.pieces(ids, segments)
        if training and all(isinstance(self.members[m].map, DeviceVocabMap) for m, _ in parts):
            on_device = self._train_on_device(parts)
            if on_device is not None:  # (rows, new, resident)
                return (*on_device[:2], self.since(segments, resident=on_device[2]), False)
        if len(parts) == 1 and len(self.members) == 1:
            rows, new_ids, new_rows = self.members[0].resolve(ids, training)
            return rows, [(0, new_ids, new_rows)], self.members[0].step, False
        if training and len(parts) > 1:
            fused = self._train_together(ids, parts, init)
            if fused is not None:
                return (*fused, self.since(segments, resident=True), init is not None)
            for m, t in parts:
                self.members[m].check_step(t)
        elif len(parts) > 1:
            found = self._find_together(ids, parts)
            if found is not None:
                return found, [(m, ids.new_empty(0), ids.new_empty(0)) for m, _ in parts], \
                    self.since(segments), False
        out, new = [], []
        for m, t in parts:
            rows, new_ids, new_rows = self.members[m].resolve(t, training)
            out.append(self._to_shard(m, rows))
            new.append((m, new_ids, new_rows + self.starts[m]))
        return torch.cat(out) if len(out) > 1 else out[0], new, self.since(segments), False

    @contextlib.contextmanager
    def _holding(self, parts: list[tuple[int, torch.Tensor]]
                 ) -> Iterator[tuple[list[DynamicRows], list[int], list[int]] | None]:
        """``(members, their runs' lengths, their first shard rows)`` of ``parts``, every
        member's lock held, for the fused calls over them; None where one of them holds no rows
        on this process (the calls do not apply)."""
        members = [self.members[m] for m, _ in parts]
        if any(d.capacity == 0 for d in members):
            yield None
            return
        with contextlib.ExitStack() as held:
            for d in members:
                held.enter_context(d.lock)
            yield members, [t.numel() for _, t in parts], [self.starts[m] for m, _ in parts]

    def _find_together(self, ids: torch.Tensor, parts: list[tuple[int, torch.Tensor]]
                       ) -> torch.Tensor | None:
        """The shard rows of the members' runs of ``ids`` (evaluation: no map changes) in one
        fused call (``id_map.find_many``), the zero row where not resident; None where the
        kernels do not apply."""
        with self._holding(parts) as got:
            if got is None:
                return None
            members, counts, starts = got
            return find_many([d.map for d in members], ids, counts, starts, self.zero_row)

    def _train_together(self, ids: torch.Tensor, parts: list[tuple[int, torch.Tensor]],
                        init: tuple[torch.Tensor, tuple[int, int],
                                    list[tuple[torch.Tensor, float]]] | None
                        ) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor,
                                                           torch.Tensor]]] | None:
        """The training steps of the members of ``parts`` in two fused calls
        (``id_map.train_steps``): ``(rows, new)`` as ``resolve``'s, or None where they do not
        apply (nothing changed: ``resolve`` steps the members one by one)."""
        with self._holding(parts) as got:
            if got is None:
                return None
            members, counts, starts = got
            spec = None
            if init is not None:
                spec = (init[0], init[1], _PHI_LO, _PHI_HI - _PHI_LO,
                        math.sqrt(members[0].table.dim))
            stepped = train_steps([d.map for d in members], ids, counts, starts,
                                  [d.seed for d in members], spec,
                                  init[2] if init is not None else ())
            if stepped is None:
                return None
            for d in members:
                d.steps += 1
        rows, new_ids, new_rows, admitted = stepped
        if init is not None:  # the new rows are written already: nobody reads them
            return rows, []
        new = [(m, i, r) for (m, _), i, r in zip(parts, new_ids.split(admitted),
                                                new_rows.split(admitted))]
        return rows, new

    def _train_on_device(self, parts: list[tuple[int, torch.Tensor]]
                         ) -> tuple[torch.Tensor, list[tuple[Any, ...]], bool] | None:
        """The training steps of the members of ``parts`` (one or several), maps all on the
        device (``device_map.train_together``: one read back, an overflow raised before any
        change): ``(rows, new, resident)``, ``rows`` as ``resolve``'s, ``new`` ``[(member, ids
        (U,) ascending, new shard rows (U,), admitted (U,) bool)]`` (the zero row where not
        admitted), ``resident``: every id is resident after the step (no member counts ids
        before admitting them); None where a member holds no rows on this process."""
        with self._holding(parts) as got:
            if got is None:
                return None
            members = got[0]
            maps = [d.map for d in members]
            stepped = train_together([m for m in maps if isinstance(m, DeviceVocabMap)],
                                     [t for _, t in parts], masked=True)
            for d in members:
                d.steps += 1
        resident = all(d.map.admit_after == 1 for d in members)
        out, new = [], []
        for (m, _), (rows, ids, new_rows, admitted) in zip(parts, stepped):
            dyn, start = self.members[m], self.starts[m]
            if resident:  # (no row is -1: each id hit or admitted)
                out.append(rows + start if start else rows)
            else:
                out.append(self._to_shard(m, torch.where(rows < 0, dyn.zero_row, rows)))
            new.append((m, ids, torch.where(admitted, new_rows + start, self.zero_row),
                        admitted))
        return (torch.cat(out) if len(out) > 1 else out[0]), new, resident

    def since(self, segments: tuple[tuple[int, int], ...] | None,
              resident: bool = False) -> Any:
        """What ``valid`` takes of rows resolved now: the member's step (one member; ``(step,)``
        when ``resident``), else the members' steps, ``segments`` (the rows' runs; None: any
        rows) and ``resident`` (every row is a resident id's: none is the zero row)."""
        if len(self.members) == 1:
            return (self.members[0].step,) if resident else self.members[0].step
        return (tuple(m.step for m in self.members), segments, resident)

    def check_step(self, ids: torch.Tensor,
                   segments: tuple[tuple[int, int], ...] | None = None) -> None:
        """``DynamicRows.check_step`` of each member's run of ``ids``."""
        for m, t in self.pieces(ids, segments):
            self.members[m].check_step(t)

    def valid(self, rows: torch.Tensor, since: Any) -> tuple[torch.Tensor, int]:
        """``(keep (n,) bool, kept)``: the shard rows ``rows`` that still hold the id they held
        after ``since`` (never the zero row). With several members and ``since``'s segments
        ``rows`` are ``resolve``'s, in its runs; without, any shard rows."""
        if len(self.members) == 1:
            if isinstance(since, tuple):  # resident rows: every one valid while no step came
                if since[0] == self.members[0].step:
                    return _every(rows), rows.numel()
                since = since[0]
            return self.members[0].valid(rows, since)
        steps, segments, resident = since
        if steps == tuple(m.step for m in self.members):  # no map stepped since: every row
            if resident:  # (none is the zero row)
                return _every(rows), rows.numel()
            zero = rows == self.zero_row  # but the zero row holds its id still
            if not bool(zero.any()):
                return _every(rows), rows.numel()
            return ~zero, rows.numel() - int(zero.sum())
        if segments is None:  # any rows: each to its member by its place in the shard
            bounds = torch.tensor(self.starts[1:] + [self.zero_row], device=rows.device)
            member = torch.searchsorted(bounds, rows, right=True)  # (n,) M: the zero row
            keep = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
            kept = 0
            for m, dyn in enumerate(self.members):
                at = (member == m).nonzero().squeeze(1)
                if at.numel():
                    k, n = dyn.valid(rows[at] - self.starts[m], steps[m])
                    keep[at] = k
                    kept += n
            return keep, kept
        keeps: list[torch.Tensor] = []
        kept = 0
        for m, t in self.pieces(rows, segments):
            dyn, start = self.members[m], self.starts[m]
            local = torch.where(t == self.zero_row, dyn.zero_row, t - start)
            k, n = dyn.valid(local, steps[m])
            keeps.append(k)
            kept += n
        return (torch.cat(keeps) if len(keeps) > 1 else keeps[0]), kept

    def row_state(self, key: str) -> torch.Tensor:
        """(N, 1) int64 over the whole shard (every member's rows in turn; the zero row not
        included): ``DynamicRows.row_state``."""
        parts = [m.row_state(key) for m in self.members]
        return torch.cat(parts) if len(parts) > 1 else parts[0]


def whole_vocabulary(ids: torch.Tensor, rows: torch.Tensor, placement: Placement,
                     comm: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every process's resident ids of a dynamic table and their rows of the whole logical
    table, ids ascending (what serving needs), from this process's ``ids`` (R,) and ``rows``
    (R,) of its shard: an all-to-all unless every process holds the whole table."""
    if placement.held_everywhere:
        return ids, rows
    rows = placement.held_rows(comm.rank)[rows]  # (R,) rows of the logical table
    w = comm.world_size
    all_ids = torch.cat(comm.all_to_all([ids] * w))  # (sum R,)
    all_rows = torch.cat(comm.all_to_all([rows.to(ids.device)] * w))  # (sum R,)
    order = torch.argsort(all_ids)
    return all_ids[order], all_rows[order]
