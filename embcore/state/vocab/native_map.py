"""``NativeVocabMap``: the id map of torch_map.py (``VocabMap``) stepped by the fused CPU kernels
(``csrc/vocab.h``), in a compact layout with a hash index in place of the sorted keys; and
``find_many`` / ``train_steps``, which step several of them at once (the members of stacked
dynamic tables): two fused calls, over the threads, for the whole batch. The same rules, state
and results as ``VocabMap`` (tests/test_vocab.py)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ...kernels import cpu
from .torch_map import (
    _EMPTY,
    _I64,
    VocabMap,
    _allocating,
    _as_ids,
)

_NO_CUT = -(2**63)  # ec_vocab_find's cut when no TTL applies: every resident id is live
_FIELD_STEP, _FIELD_CUT, _FIELD_START, _FIELD_SEED = (
    cpu.MAP_FIELDS.index(k) for k in ("step", "cut", "start", "seed"))
_INT32_MAX = 2**31 - 1
# VocabMap's per-row tensors and sorted view: a NativeVocabMap shows them (computed, in its
# compact layout; its own tensors where the kernels do not apply)
_LAYOUT = ("keys", "key_rows", "row_key", "row_used", "last_use", "frequency", "born")


def _slots_for(rows: int) -> int:
    """The slots of a ``NativeVocabMap``'s index over ``rows`` rows held: load at most 2/5."""
    return rows * 5 // 2 + 1


def _layout_view(key: str) -> property:
    """``VocabMap``'s tensor ``key`` on a ``NativeVocabMap``: in its compact layout a new tensor
    computed from it (reading it changes nothing; writing into it is lost), else its own."""

    def get(self: NativeVocabMap) -> torch.Tensor:
        return self._view(key) if self._compact else self.__dict__["_f_" + key]

    def put(self: NativeVocabMap, value: torch.Tensor) -> None:
        assert not self._compact, f"{key} is set in VocabMap's layout only"
        self.__dict__["_f_" + key] = value

    return property(get, put, doc=f"VocabMap's ``{key}`` (computed in the compact layout)")


class NativeVocabMap(VocabMap):
    """``VocabMap`` stepped by the fused kernels (``csrc/vocab.h``, ``ec_vocab_*``): the same
    rules, state and results, in a compact layout with a hash index in place of the sorted keys.

    The layout holds the first ``A`` rows of the ``C`` of the capacity (``A <= C``; the rows from
    ``A`` on were never used, so they are free): rows are given lowest free first, so the rows in
    use lie below the highest row ever used, and ``A`` grows (by half at least, up to ``C``)
    before a step that could need more, never while rows below it are free. Per held row:
    ``_ids`` int64 the id it holds (0 when free), ``_last`` (last use), ``_freq`` (frequency) and
    ``_born`` (-1 when free: a row is used iff ``born >= 0``), these three int32 while every step
    and frequency fits (an exact bound is kept; they widen to int64 once before a step that could
    pass 2**31 - 1). The index is ``slots`` (S,), S = 5A/2 + 1, int32 (int64 from a capacity of
    2**31 rows): each slot holds -1 or a row, with a fingerprint of its id in the bits above the
    row's (a probe reads the row's ``_ids`` only where the fingerprint matches): open addressing,
    linear probing from the multiply-shift reduction of ``splitmix64``'s finalizer of the id to
    ``[0, S)``, removal shifting entries back (no tombstones), load at most 2/5 (at 1/2, hits
    probed 15% slower than the old index's); it is rebuilt when ``A`` grows.

    That is 30 bytes per held row (20 of rows, 10 of index; 42 with int64 steps), so 30 per
    resident id in a full map and at most 45 (30 x 1.5) while it fills or after a load, beside
    the 24 per counted id (``pending_*``) and, for LRU once every row is held, an eviction queue
    of 3 bytes a row (the lowest ``capacity / 8`` candidates of the last scan: the steps
    after it take their victims there, without scanning every row, while its entries last).
    (Ids expired by a TTL leave their rows held.)

    A training step with ``U`` distinct ids and ``A`` admissions costs ``O(U + A)`` (hash probes,
    no merge of the resident ids), plus ``O(A)`` rows scanned when it evicts or with a TTL, plus
    a growth (``O(A)``, geometric: amortized ``O(1)`` per admitted id); ``find`` is ``O(n)``
    probes over the threads. ``VocabMap``'s tensors (``keys``, ``key_rows``, ``row_key``,
    ``row_used``, ``last_use``, ``frequency``, ``born``) are computed when read.

    Where the kernels do not apply (switched off, or the state moved off the CPU) the map takes
    ``VocabMap``'s layout (its own tensors, of the capacity) and every method is ``VocabMap``'s;
    it takes the compact layout again when the kernels apply again.
    """

    min_rows = 1  # the rows held at least (at most the capacity)

    keys = _layout_view("keys")
    key_rows = _layout_view("key_rows")
    row_key = _layout_view("row_key")
    row_used = _layout_view("row_used")
    last_use = _layout_view("last_use")
    frequency = _layout_view("frequency")
    born = _layout_view("born")

    def _allocate_rows(self) -> None:
        self._compact = True
        for key in _LAYOUT:
            self.__dict__["_f_" + key] = None
        self._slot_dtype = torch.int32 if self.capacity <= _INT32_MAX else _I64
        self._resident = 0  # resident ids
        self._hint = 0  # no row below it is free
        self._top = 0  # every step and frequency held is at most this (and self.step <= it)
        # The compact layout's tensors: empty (none held) while VocabMap's layout is taken
        self._ids = self._last = self._freq = self._born = self.slots = _EMPTY
        self._queue: torch.Tensor | None = None  # an LRU map's eviction queue (ec_vocab_step)
        # its entries held, its next entry (0 held: refilled when needed)
        self._queued: tuple[int, int] = (0, 0)
        self._fields: tuple[tuple[Any, ...], list[int]] | None = None  # (_map_fields' memo)
        if self.device.type != "cpu":  # the kernels do not apply there
            self._compact = False
            super()._allocate_rows()
            return
        a = min(self.capacity, max(self.min_rows, 1))
        self._ids = torch.zeros(a, dtype=_I64)                         # (A,) id held, 0: free
        self._last = torch.zeros(a, dtype=torch.int32)                 # (A,) step of last use
        self._freq = torch.zeros(a, dtype=torch.int32)                 # (A,) steps that used it
        self._born = torch.full((a,), -1, dtype=torch.int32)           # (A,) step it got its id
        self.slots = torch.full((_slots_for(a),), -1, dtype=self._slot_dtype)  # the index

    # ---- the layouts
    def _held_for(self, high: int) -> int:
        """The rows to hold for rows ``[0, high)`` in use (a step's growth: half more)."""
        return min(self.capacity, max(self.min_rows, 1, high + high // 2))

    def _view(self, key: str) -> torch.Tensor:
        """``VocabMap``'s tensor ``key`` computed from the compact layout."""
        if key in ("keys", "key_rows"):
            rows = (self._born >= 0).nonzero().squeeze(1)  # (R,)
            ids, order = torch.sort(self._ids[rows])
            return ids if key == "keys" else rows[order]
        src = {"row_key": self._ids, "row_used": self._born >= 0, "last_use": self._last,
               "frequency": self._freq, "born": self._born}[key]
        out = torch.full((self.capacity,), -1 if key == "born" else 0,
                         dtype=torch.bool if key == "row_used" else _I64)
        out[:src.numel()] = src
        return out

    def _expand(self) -> None:
        """Takes ``VocabMap``'s layout (where the kernels do not apply)."""
        if not self._compact:
            return
        with _allocating(self.name, self.capacity, self.device):
            full = {key: self._view(key) for key in _LAYOUT}
        self._compact = False
        for key, v in full.items():
            self.__dict__["_f_" + key] = v
        self._ids = self._last = self._freq = self._born = self.slots = _EMPTY

    def _compress(self) -> None:
        """Takes the compact layout from ``VocabMap``'s (on the CPU, the kernels applying)."""
        if self._compact:
            return
        # (VocabMap's tensors, its own in this layout)
        used = self.row_used.nonzero()
        a = self._held_for(int(used[-1]) + 1 if used.numel() else 0)
        top = max(self.step, int(self.frequency.max()))
        steps = torch.int32 if top <= _INT32_MAX else _I64
        with _allocating(self.name, self.capacity, self.device):
            ids = self.row_key[:a].clone()
            last = self.last_use[:a].to(steps, copy=True)
            freq = self.frequency[:a].to(steps, copy=True)
            born = self.born[:a].to(steps, copy=True)
            slots = torch.empty(_slots_for(a), dtype=self._slot_dtype)
        self._resident = cpu.vocab_index(slots, ids, born)
        self._ids, self._last, self._freq, self._born, self.slots = ids, last, freq, born, slots
        self._top, self._hint, self._compact, self._queued = top, 0, True, (0, 0)
        for key in _LAYOUT:
            self.__dict__["_f_" + key] = None

    def _resize(self, rows: int, steps: torch.dtype | None = None) -> None:
        """Holds ``rows`` rows (at least those held now), the step values of dtype ``steps``
        (None: as now), the index rebuilt over them."""
        steps = self._last.dtype if steps is None else steps
        with _allocating(self.name, self.capacity, self.device):
            new = (torch.empty(rows, dtype=_I64), torch.empty(rows, dtype=steps),
                   torch.empty(rows, dtype=steps), torch.empty(rows, dtype=steps))
            slots = torch.empty(_slots_for(rows), dtype=self._slot_dtype)
        # (one kernel, one thread: torch's copies would each wait for a second thread)
        self._resident = cpu.vocab_grow((self._ids, self._last, self._freq, self._born), new,
                                           slots)
        (self._ids, self._last, self._freq, self._born), self.slots = new, slots
        self._queued = (0, 0)

    def _reserve(self, n_new: int) -> None:
        """Before a step admitting ``n_new`` ids: holds the rows they may take (every free row
        of the capacity is then held, or enough free rows for them are) and step values that
        fit the step's."""
        held = self._ids.numel()
        need = min(self.capacity, self._resident + n_new)
        if need > held:
            self._resize(min(self.capacity, max(need, held + held // 2)))
        if self._top >= _INT32_MAX and self._last.dtype != _I64:  # t or a frequency + 1
            self._resize(self._ids.numel(), _I64)

    def _kernels_apply(self) -> bool:
        """Whether the kernels apply to this map now: the one check of the fused CPU backend's
        map, whose layout also serves torch ops (a call traced by torch.compile, or the
        kernels switched off by ``cpu.set_enabled`` since the map was made)."""
        return cpu.usable(self._ids if self._compact else self.row_key)

    def _native(self) -> bool:
        """Whether the kernels apply now (taking the compact layout if they do)."""
        if not self._kernels_apply():
            return False
        self._compress()
        return True

    def _eviction_queue(self) -> torch.Tensor | None:
        """An LRU map's queue of eviction candidates, once it holds every row of its capacity
        (it evicts only then): ``capacity / 8`` entries of 24 bytes, at least 16 (3 bytes a
        row; ``ec_vocab_step``; at 50k rows evicting 243 ids a step, W1-raw's 26 maps stepped
        in 1.9-2.0 ms against 2.2-2.6 with ``capacity / 32``); None for LFU (a new id's
        frequency, 1, may rank below the queue's)."""
        if self.eviction != "lru" or self._ids.numel() < self.capacity:
            return None
        if self._queue is None:
            self._queue = torch.zeros(max(16, self.capacity // 8), 3, dtype=_I64)
            self._queued = (0, 0)
        return self._queue

    def _map_fields(self, t: int, cut: int, start: int, seed: int) -> list[int]:
        """``cpu.map_fields`` of this map for step ``t`` at ``cut`` (its first shard row
        ``start``, its table's seed ``seed``), made again only when what it reads changed."""
        q = self._eviction_queue()
        key = (self.slots.data_ptr(), self._ids.data_ptr(), self._ids.numel(),
               self._last.data_ptr(), self._last.dtype, self._freq.data_ptr(),
               self._born.data_ptr(), 0 if q is None else q.data_ptr())
        if self._fields is None or self._fields[0] != key:
            self._fields = key, cpu.map_fields(
                self.slots, self._ids, self._last, self._freq, self._born, self.capacity, t, cut,
                self.eviction == "lfu", start, seed, q)
        row = self._fields[1].copy()
        row[_FIELD_STEP], row[_FIELD_CUT] = t, cut
        row[_FIELD_START], row[_FIELD_SEED] = start, cpu.map_fields_seed(seed)
        return row

    def _cut(self, t: int) -> int:
        """Rows last used before this step expire at the start of training step ``t``."""
        if self.ttl_steps is not None and t - self.ttl_steps > 0:
            return t - self.ttl_steps
        return _NO_CUT

    # ---- VocabMap's methods
    @property
    def n_resident(self) -> int:
        return self._resident if self._compact else super().n_resident

    def row_values(self, key: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        if not self._compact:
            return super().row_values(key, rows)
        value = {"ids": self._ids, "last_use": self._last, "frequency": self._freq}[key]
        held = value.numel()
        if rows is None:
            out = torch.zeros(self.capacity, dtype=_I64)
            out[:held] = torch.where(self._born >= 0, value, 0)
            return out
        rows = rows.to(self.device)
        r = rows.clamp(max=held - 1)
        return torch.where((rows < held) & (self._born[r] >= 0), value[r], 0).to(_I64)

    def row_ids(self) -> torch.Tensor:
        return self._ids if self._compact else super().row_ids()

    def ids_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        if not self._compact:
            return super().ids_of_rows(rows)
        rows = rows.to(self.device)
        held = self._ids.numel()
        return torch.where(rows < held, self._ids[rows.clamp(max=held - 1)], 0)

    def find(self, ids: torch.Tensor, *, fill: int = -1) -> torch.Tensor:
        if not self._native():
            self._expand()
            return super().find(ids, fill=fill)
        ids = _as_ids(ids, f"{self.name}: ids").contiguous()
        if ids.device != self.device:
            ids = ids.to(self.device)
        return cpu.vocab_find(self.slots, self._ids, self._last, _NO_CUT,
                                 ids.reshape(-1), fill)[0].reshape(ids.shape)

    def valid(self, rows: torch.Tensor, since: int) -> torch.Tensor:
        return self.valid_count(rows, since)[0]

    def valid_count(self, rows: torch.Tensor, since: int) -> tuple[torch.Tensor, int]:
        """``(valid(rows, since), how many are valid)``."""
        if not self._native():
            self._expand()
            return super().valid_count(rows, since)
        rows = _as_ids(rows, f"{self.name}: rows").contiguous()
        return cpu.vocab_valid(rows.reshape(-1), self._born, since)

    def train_step(self, distinct: torch.Tensor, *, check: bool = True, fill: int = -1,
                   spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self._native():
            self._expand()
            return super().train_step(distinct, check=check, fill=fill)
        self.last_freed = _EMPTY
        distinct = self._step_ids(distinct)
        if check and cpu.dedup_raw(distinct)[0].numel() != distinct.numel():
            raise ValueError(f"{self.name}: the ids of a training step must be distinct")
        t = self.step + 1
        cut = self._cut(t)
        rows, missing = cpu.vocab_find(self.slots, self._ids, self._last, cut,
                                          distinct)  # (U,)
        if missing:  # (H,) rows found; (M,) the other ids ascending, their positions
            hit_rows, miss_ids, miss = cpu.vocab_split(distinct, rows)
        else:  # every id resident (the common step of a warm map)
            miss = miss_ids = distinct.new_empty(0)
            hit_rows = rows
        if self.admit_after == 1:
            new_ids, admitted = miss_ids, miss
        else:
            ppos, pfound, counts = self._counts(miss_ids)
            admit = counts >= self.admit_after  # (M,)
            new_ids, admitted = miss_ids[admit], miss[admit]
        if new_ids.numel() <= self.capacity - hit_rows.numel():  # (else an overflow, below)
            self._reserve(new_ids.numel())
        freed = torch.empty(max(spare, 0), dtype=_I64) if spare > 0 else None
        new_rows, n_free, n_evictable, hint, n_freed, resident, queued = cpu.vocab_step(
            self.slots, self._ids, self._last, self._freq, self._born, self.capacity,
            self._resident, hit_rows, new_ids, t, cut, self.eviction == "lfu", self._hint,
            max(spare, 0), freed, self._eviction_queue(), self._queued)
        if new_rows is None:
            raise ValueError(
                f"{self.name}: this step admits {new_ids.numel()} new ids but the shard holds "
                f"{self.capacity} rows, {n_free} free and {n_evictable} evictable (the "
                f"others are used by this step)")
        self._hint, self._resident, self._top = hint, resident, self._top + 1
        self._queued = queued
        if freed is not None and n_freed:
            self.last_freed = freed[:n_freed]
        if new_rows.numel():
            rows[admitted] = new_rows
        if fill != -1 and missing > new_rows.numel():  # ids still not resident
            rows.masked_fill_(rows < 0, fill)
        if self.admit_after > 1:
            (self.pending_ids, self.pending_counts,
             self.pending_seen) = self._count(miss_ids, ppos, pfound, counts, admit, t)
        self.step = t
        return rows, new_ids, new_rows

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._compact:
            return super().resident()
        rows = (self._born >= 0).nonzero().squeeze(1)  # (R,)
        ids, order = torch.sort(self._ids[rows])
        return ids, rows[order]

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self._compact:
            return super().state_dict()
        ids, rows = self.resident()
        return {"ids": ids, "rows": rows, "last_use": self._last[rows].to(_I64),
                "frequency": self._freq[rows].to(_I64),
                "pending_ids": self.pending_ids.clone(),
                "pending_counts": self.pending_counts.clone(),
                "pending_seen": self.pending_seen.clone(),
                "step": torch.tensor(self.step, dtype=_I64, device=self.device)}

    def _install(self, step: int, ids: torch.Tensor, rows: torch.Tensor,
                 last_use: torch.Tensor, frequency: torch.Tensor) -> None:
        if not (ids.is_cpu and self._kernels_apply()):  # VocabMap's layout
            compact, self._compact = self._compact, False
            try:
                super()._install(step, ids, rows, last_use, frequency)
            except BaseException:
                self._compact = compact
                raise
            self._ids = self._last = self._freq = self._born = self.slots = _EMPTY
            return
        a = self._held_for(int(rows.max()) + 1 if rows.numel() else 0)
        top = max(step, int(frequency.max()) if frequency.numel() else 0)
        steps = torch.int32 if top <= _INT32_MAX else _I64
        with _allocating(self.name, self.capacity, self.device):
            row_ids = torch.zeros(a, dtype=_I64)
            last = torch.zeros(a, dtype=steps)
            freq = torch.zeros(a, dtype=steps)
            born = torch.full((a,), -1, dtype=steps)
            slots = torch.empty(_slots_for(a), dtype=self._slot_dtype)
        row_ids[rows], last[rows], freq[rows] = ids, last_use.to(steps), frequency.to(steps)
        born[rows] = step
        self._resident = cpu.vocab_index(slots, row_ids, born)
        self._ids, self._last, self._freq, self._born, self.slots = row_ids, last, freq, born, slots
        self._top, self._hint, self._compact, self._queued = top, 0, True, (0, 0)
        for key in _LAYOUT:
            self.__dict__["_f_" + key] = None

    def to(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if self._compact and device.type == "cpu":  # (the compact layout is on the CPU)
            self.device = device
            return
        self._expand()
        super().to(device)


def _check_runs(what: str, maps: Sequence[VocabMap], ids: torch.Tensor, counts: Sequence[int],
                *per_map: Sequence[int]) -> None:
    """A run of ``ids`` per map (``counts``, none negative, summing to the ids) and one of each
    of ``per_map`` per map, else a ValueError naming the maps (before anything changes)."""
    if (ids.dim() != 1 or len(counts) != len(maps) or any(c < 0 for c in counts)
            or sum(counts) != ids.numel() or any(len(v) != len(maps) for v in per_map)):
        raise ValueError(f"{what} of {[m.name for m in maps]}: ids must be 1-D runs of the "
                         f"counts' lengths ({list(counts)}, {ids.numel()} ids in shape "
                         f"{tuple(ids.shape)}), with a count, start and seed per map")


def find_many(maps: Sequence[VocabMap], ids: torch.Tensor, counts: Sequence[int],
              starts: Sequence[int], fill: int) -> torch.Tensor | None:
    """``find`` of several maps at once (evaluation of stacked dynamic tables: nothing
    changes), in one fused call over the threads: map ``k``'s ids are the run of ``counts[k]``
    in ``ids`` (int64, contiguous); each id's row plus its map's ``starts[k]`` (a shard row), or
    ``fill`` where not resident. None where the kernels do not step every map (a map not a
    ``NativeVocabMap`` on the CPU)."""
    nmaps = [m for m in maps if isinstance(m, NativeVocabMap)]
    if not ids.is_cpu or len(nmaps) < len(maps) or not all(m._native() for m in nmaps):
        return None
    if not nmaps:
        return _EMPTY
    _check_runs("find_many", nmaps, ids, counts, starts)
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=_I64)
    table = torch.tensor([m._map_fields(m.step + 1, _NO_CUT, start, 0)
                          for m, start in zip(nmaps, starts)], dtype=_I64)
    return cpu.vocab_find_many(table, ids, offsets, fill)[0]  # (the shift and fill there:
    # torch ops this large would run on torch's threads, slowing the kernels after them)


def train_steps(maps: Sequence[VocabMap], ids: torch.Tensor, counts: Sequence[int],
                starts: Sequence[int], seeds: Sequence[int],
                init: tuple[torch.Tensor, tuple[int, int], float, float, float] | None = None,
                slots: Sequence[tuple[torch.Tensor, float]] = ()
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """A training step of each of several maps at once (the members of stacked dynamic tables
    in a batch), in two fused calls over the threads: map ``k`` over its distinct ids, the run of
    ``counts[k]`` in ``ids`` (int64, contiguous: every map's run in turn), every id not resident
    admitted. The same steps as ``train_step`` of each map in turn.

    Args:
        starts: each map's first row in the shard its rows are part of (the rows returned are
            shard rows: a map's row plus its start). seeds: each map's table seed.
        init: None, or ``(table, columns, lo, width, div)``: the admitted ids' default initial
            values written into their shard rows of ``table`` (``cpu.vocab_step_many``);
            with it, ``slots``: ``(slot, value)``, each slot's admitted rows set to ``value``.

    Returns:
        ``(rows (n,), new_ids (A,), new_rows (A,), admitted per map)``: every id's shard row,
        and each map's admitted ids (ascending) and shard rows in turn; or None where this does
        not apply, nothing changed: a map the kernels do not step (not a ``NativeVocabMap`` on
        the CPU, or ``admit_after > 1``), or one whose admissions would not fit (its
        ``train_step`` raises the error).
    """
    nmaps = [m for m in maps if isinstance(m, NativeVocabMap) and m.admit_after == 1]
    if not ids.is_cpu or len(nmaps) < len(maps) or not all(m._native() for m in nmaps):
        return None
    if not nmaps:
        return _EMPTY, _EMPTY, _EMPTY, []
    maps = nmaps
    _check_runs("train_steps", maps, ids, counts, starts, seeds)
    offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=_I64)
    steps = [m.step + 1 for m in maps]
    cuts = [m._cut(t) for m, t in zip(maps, steps)]

    def fields() -> torch.Tensor:
        return torch.tensor([m._map_fields(t, cut, start, seed)
                             for m, t, cut, start, seed in zip(maps, steps, cuts, starts, seeds)],
                            dtype=_I64)

    table = fields()
    rows, missing = cpu.vocab_find_many(table, ids, offsets)
    miss = missing.tolist()
    if any(a > m.capacity - (n - a) for m, n, a in zip(maps, counts, miss)):
        return None  # an overflow: nothing changed
    held = [m._ids for m in maps]
    for m, a in zip(maps, miss):
        m._reserve(a)
    if any(m._ids is not h for m, h in zip(maps, held)):  # a map grew: its arrays moved
        table = fields()
    info = torch.tensor([[0, 0, m._hint, 0, m._resident, *m._queued] for m in maps],
                        dtype=_I64)
    new_ids, new_rows, _ = cpu.vocab_step_many(table, ids, offsets, rows, missing, info, init,
                                                  slots)
    for m, t, (_, _, hint, _, resident, *queued) in zip(maps, steps, info.tolist()):
        m.last_freed = _EMPTY
        m._hint, m._resident, m._top, m.step = hint, resident, m._top + 1, t
        m._queued = (queued[0], queued[1])
    return rows, new_ids, new_rows, miss
