"""A dynamic vocabulary's id map on the GPU: the same rules as ``VocabMap``, stepped on the device.

``DeviceVocabMap`` is the map of a raw-id table on the Triton backend (vocabulary.py's
``vocab_map``). It
follows ``ReferenceVocabulary``'s rules exactly, as ``VocabMap`` does (the same resident ids,
rows, evictions, counts and state), but holds its ids in a hash index on the device
(state/vocab/device_hash.py, Triton kernels) instead of a sorted array, and computes a training
step in tensors whose sizes the host knows: no value is read back to the host inside the step.

State, with ``C`` rows (each per-row tensor is a view of a buffer one longer: index ``C`` takes
the writes of lanes that change nothing):

- per row, as ``VocabMap``'s: ``row_key``, ``row_used``, ``last_use``, ``frequency``, ``born``;
- ``index``: id -> row, over ``row_key`` (4 bytes a slot, at least two slots a row);
- with ``admit_after > 1``, the counted ids in ``L`` entries: ``p_id``, ``p_count``, ``p_seen``,
  ``p_used``, and ``pindex``: id -> entry over ``p_id``. ``L`` starts at 1024 and grows (at least
  doubling) when a host-side bound on the entries in use, plus a step's distinct ids, passes it;
  only then is their number read back. After a step at most ``pending_limit`` are in use.

That is 33 bytes a row plus 8 to 16 for the index: at most ``MAP_BYTES_PER_ROW`` (49), as
``VocabMap``; and 33 to 41 a counted id (``VocabMap``: 24).

A step over ``U`` sorted distinct ids (``_plan``, ``_place``, then ``_apply``):

1. TTL: the rows last used before ``t - ttl_steps`` are not live;
2. the ids are found in the index (a hit: a live row); the others are counted (their entries
   found in ``pindex``) and those seen in ``admit_after`` steps are admitted, ranked in id order;
3. the j-th admitted id takes the j-th free row (ascending, a prefix sum over the rows) or, past
   the free rows, the (j - free)-th victim: ``ops/selection.py``'s ``smallest_ordered`` of the
   evictable rows (live, not hit) by (score, id), with ``k`` on the device (``_place``; where
   the step's counts were read, only what it needs: no victims while the free rows suffice);
4. overflow (more admitted than free plus evictable rows) is a device flag: the step's changes
   are all masked by it, so an overflowing step changes nothing.

``train_step`` (the ``VocabMap`` interface, what the engine calls) reads the step's three counts
back once, between the two halves, to raise the ``ValueError`` before anything changes and to
return the admitted ids as tensors of their own length. ``train_step_async`` reads nothing: it
returns tensors of the step's length and the overflow flag, and an overflow is raised later by
``confirm`` (or the next ``train_step``), which rewinds the step counter to before the step that
overflowed (that step and any after it changed nothing).

The work of a step is ``O(U)`` for the index, and ``O(C)`` elementwise for the TTL and the
counts; the free rows (a prefix sum over the rows) and the victims (two ``topk`` over the rows)
only in a step that needs them where its counts are read (``train_step``, ``train_together``),
every step in ``train_step_async`` (the host does not know whether a step admits); plus ``O(L)``
for the counted ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ...ops.selection import first_set, smallest_ordered
from .device_hash import DeviceHash, stack
from .torch_map import _I64, VocabMap

_FIRST_ENTRIES = 1024  # entries for counted ids at first (grown as they are needed)


class _Plan(NamedTuple):
    """A step's decisions, computed before anything changes."""

    t: int
    ids: torch.Tensor        # (U,) sorted distinct
    live: torch.Tensor       # (C,) rows resident after the TTL
    expire: bool             # whether the TTL frees rows this step (some may be)
    hit: torch.Tensor        # (U,) resident and live
    row: torch.Tensor        # (U,) its row where hit, else C (the buffers' spare index)
    admit: torch.Tensor      # (U,) admitted (before the overflow mask)
    new_row: torch.Tensor    # (U,) the row it takes where admitted
    from_free: torch.Tensor  # (U,) that row was free (else a victim's)
    entry: torch.Tensor | None   # (U,) its counted entry, -1 where none (admit_after > 1)
    counted: torch.Tensor | None  # (U,) its count with this step
    ok: torch.Tensor | None  # 0-d bool: no overflow (and no earlier unconfirmed one); None:
    #                          known true on the host (the counts read back before any change)
    counts: torch.Tensor     # (3,) admitted, free, evictable
    rank: torch.Tensor       # (U,) the admitted ids' ranks, in id order
    free: torch.Tensor       # (C,) the rows free after the TTL
    evictable: torch.Tensor  # (C,) live rows this step does not use


def _buffer(n: int, fill: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((n + 1,), fill, dtype=dtype, device=device)


def _computed(method: str, index: int, doc: str) -> property:
    """A ``VocabMap`` tensor that this map computes from its state (read-only; reading it reads
    the state back: not for a steady step)."""

    def get(self: DeviceVocabMap) -> torch.Tensor:
        return getattr(self, method)()[index]

    return property(get, doc=f"{doc} (computed from the map's state)")


class DeviceVocabMap(VocabMap):
    """``VocabMap`` stepped on the device (module docstring). Arguments as ``VocabMap``'s; the
    device is a CUDA device, or the CPU under Triton's interpreter (tests,
    ``kernels.gpu.force_on_cpu``)."""

    # ---------------------------------------------------------------------------- the state
    def _allocate_rows(self) -> None:
        c, dev = self.capacity, self.device
        self._key_buf = _buffer(c, 0, _I64, dev)
        self._used_buf = _buffer(c, False, torch.bool, dev)
        self._last_buf = _buffer(c, 0, _I64, dev)
        self._freq_buf = _buffer(c, 0, _I64, dev)
        self._born_buf = _buffer(c, -1, _I64, dev)
        self._views()
        self.index = DeviceHash(c, self.row_key)
        self._bad = torch.zeros((), dtype=torch.bool, device=dev)  # an unconfirmed overflow
        self._bad_info = torch.zeros(4, dtype=_I64, device=dev)    # its step and counts
        self._unconfirmed = False

    def _views(self) -> None:
        c = self.capacity
        self.row_key, self.row_used = self._key_buf[:c], self._used_buf[:c]
        self.last_use, self.frequency = self._last_buf[:c], self._freq_buf[:c]
        self.born = self._born_buf[:c]

    def _allocate_pending(self, entries: int = _FIRST_ENTRIES) -> None:
        """``entries`` empty entries for counted ids (none with ``admit_after == 1``)."""
        self._p_bound = 0  # a bound on the entries in use
        if self.admit_after == 1:
            self._plen = 0
            return
        n, dev = entries, self.device
        self._plen = n
        self.p_id = _buffer(n, 0, _I64, dev)
        self.p_count = _buffer(n, 0, _I64, dev)
        self.p_seen = _buffer(n, 0, _I64, dev)
        self.p_used = _buffer(n, False, torch.bool, dev)
        self.pindex = DeviceHash(n, self.p_id[:n])

    def _room_for(self, u: int) -> None:
        """Enough free entries for the counted ids of a step of ``u`` distinct ids (it adds at
        most ``u``). The entries in use are bounded on the host (``_p_bound``: at most
        ``pending_limit`` after a step); only when that bound says they might not fit is their
        number read back, and the entries grown (at least doubled) if they do not."""
        if self.admit_after == 1 or self._p_bound + u <= self._plen:
            return
        n = self._plen
        used = int(self.p_used[:n].sum())  # (the one read, while the counted ids grow)
        self._p_bound = used
        if used + u <= n:
            return
        ids, counts, seen, held = (self.p_id[:n], self.p_count[:n], self.p_seen[:n],
                                   self.p_used[:n])
        self._allocate_pending(min(max(2 * n, used + u), self.pending_limit + u))
        self.p_id[:n], self.p_count[:n], self.p_seen[:n], self.p_used[:n] = (ids, counts, seen,
                                                                             held)
        self._p_bound = used
        self.pindex.rebuild(self.p_used[:self._plen])

    keys = _computed("_sorted", 0, "(R,) the resident ids, ascending")
    key_rows = _computed("_sorted", 1, "(R,) their rows")

    def _sorted(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.row_used.nonzero().squeeze(1)
        ids, order = torch.sort(self.row_key[rows])
        return ids, rows[order]

    def _pending_sorted(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.admit_after == 1:
            empty = torch.empty(0, dtype=_I64, device=self.device)
            return empty, empty, empty
        n = self._plen
        at = self.p_used[:n].nonzero().squeeze(1)
        ids, order = torch.sort(self.p_id[at])
        at = at[order]
        return ids, self.p_count[at], self.p_seen[at]

    pending_ids = _computed("_pending_sorted", 0, "(P,) the counted ids, ascending")
    pending_counts = _computed("_pending_sorted", 1, "(P,) their counts")
    pending_seen = _computed("_pending_sorted", 2, "(P,) the last step each was seen in")

    @property
    def n_resident(self) -> int:
        return int(self.row_used.sum())

    def nbytes(self, pending: bool = True) -> int:
        n = sum(t.nbytes for t in (self._key_buf, self._used_buf, self._last_buf, self._freq_buf,
                                   self._born_buf)) + self.index.nbytes()
        if pending and self._plen:
            n += sum(t.nbytes for t in (self.p_id, self.p_count, self.p_seen, self.p_used)) \
                + self.pindex.nbytes()
        return n

    def __repr__(self) -> str:
        return "Device" + super().__repr__()

    # ------------------------------------------------------------------------------ lookups
    def find(self, ids: torch.Tensor, *, fill: int = -1) -> torch.Tensor:
        """The rows of ids (evaluation): changes nothing (``VocabMap.find``)."""
        from .torch_map import _as_ids
        ids = _as_ids(ids, f"{self.name}: ids").to(self.device).contiguous()
        rows = self.index.find(ids.reshape(-1))
        return torch.where(rows >= 0, rows, fill).reshape(ids.shape)

    # ------------------------------------------------------------------------------- a step
    def _plan(self, u: torch.Tensor, found: torch.Tensor | None = None,
              counted: torch.Tensor | None = None, read: bool = False) -> _Plan:
        """The decisions of training step ``step + 1`` over (U,) sorted distinct ids (their
        rows and counted entries found already where given: ``train_together``); ``read``: the
        caller reads the counts back and raises an overflow before any change (``ok`` None)."""
        t, c, dev = self.step + 1, self.capacity, self.device
        live = self.row_used
        cut = None if self.ttl_steps is None else t - self.ttl_steps  # last uses below expire
        expire = cut is not None and cut > 0
        if cut is not None and cut > 0:
            live = live & (self.last_use >= cut)
        row = self.index.find(u) if found is None else found  # (U,)
        hit = (row >= 0) & live[row.clamp(min=0)]
        row = torch.where(hit, row, c)  # (U,) c: no row used
        miss = ~hit
        entry = counted = None
        if self.admit_after == 1:
            admit = miss
        else:
            entry = self.pindex.find(u) if counted is None else counted  # (U,) -1: none
            counted = 1 + torch.where(miss & (entry >= 0), self.p_count[entry.clamp(min=0)], 0)
            admit = miss & (counted >= self.admit_after)
        n_admit = admit.sum()
        rank = admit.cumsum(0) - 1  # (U,) the admitted ids' ranks, in id order
        free = ~live
        n_free = free.sum()
        used = torch.zeros(c + 1, dtype=torch.bool, device=dev)
        used.index_fill_(0, row, True)
        evictable = live & ~used[:c]
        n_evictable = evictable.sum()
        ok = None if read else ~(n_admit > n_free + n_evictable) & ~self._bad
        counts = torch.stack([n_admit, n_free, n_evictable])
        return _Plan(t, u, live, expire, hit, row, admit, rank, rank, entry, counted, ok,
                     counts, rank, free, evictable)

    def _place(self, p: _Plan, known: list[int] | None = None) -> _Plan:
        """The rows a plan's admitted ids take (``new_row``, ``from_free``): the j-th the j-th
        free row, past the free rows the (j - free)-th victim (``smallest_ordered``). With the
        plan's counts ``known`` on the host (admitted, free, evictable), only the part a step
        needs is computed: nothing where it admits none, no victims where the free rows suffice,
        no free rows where there are none; else (``train_step_async``) both, every step."""
        c, n = self.capacity, p.ids.numel()
        score = self.last_use if self.eviction == "lru" else self.frequency
        if known is not None:
            n_admit, n_free = known[0], known[1]
            if n_admit == 0:  # (nothing taken: ``new_row`` is never read)
                return p
            if n_admit <= n_free:  # every admitted id takes a free row
                new_row = first_set(p.free, n)[p.rank.clamp(0, n)]
                return p._replace(new_row=new_row, from_free=p.admit)
            if n_free == 0:  # every admitted id takes a victim
                kmax = min(n_admit, c)
                victims = smallest_ordered(score, self.row_key, p.evictable, kmax,
                                           kmax)  # (kmax,)
                return p._replace(new_row=victims[p.rank.clamp(0, kmax - 1)],
                                  from_free=~p.admit)
        admitted, free = p.counts[0], p.counts[1]  # (0-d)
        free_rows = first_set(p.free, n)  # (U + 1,)
        kmax = min(n, c) if known is None else min(known[0] - known[1], c)
        k = (admitted - free).clamp(0, kmax) if known is None else kmax
        victims = smallest_ordered(score, self.row_key, p.evictable, k, kmax)  # (kmax,)
        from_free = p.rank < free
        new_row = torch.where(from_free, free_rows[p.rank.clamp(0, n)],
                              victims[(p.rank - free).clamp(0, max(kmax - 1, 0))]
                              if kmax else p.rank)
        return p._replace(new_row=new_row, from_free=from_free)

    def _apply(self, p: _Plan, later: list[tuple[torch.Tensor, ...]] | None = None) -> None:
        """Makes a plan's changes, masked by ``p.ok`` (an overflow changes nothing; None: no
        mask). With
        ``later``, the index's deletions and insertions are appended to it instead (``(keys,
        places, take)`` of each), for one launch over several maps: the deletions first."""
        c, t, ok, u = self.capacity, p.t, p.ok, p.ids
        if p.expire:  # the TTL's rows are freed
            gone = self.row_used & ~p.live  # (C,)
            if ok is not None:
                gone &= ok
            self.index.delete(self.row_key, torch.arange(c, device=self.device), gone)
            self.row_key.masked_fill_(gone, 0)
            self.last_use.masked_fill_(gone, 0)
            self.frequency.masked_fill_(gone, 0)
            self.born.masked_fill_(gone, -1)
            self.row_used.masked_fill_(gone, False)
        hits = p.row if ok is None else torch.where(p.hit & ok, p.row, c)  # (U,) used (c: none)
        self._last_buf.index_fill_(0, hits, t)
        self._freq_buf.index_put_((hits,), self._freq_buf[hits] + 1)
        adm = p.admit if ok is None else p.admit & ok
        new = torch.where(adm, p.new_row, c)  # (U,) the rows taken (c: none)
        old, out = self._key_buf[new], adm & ~p.from_free  # the victims' ids leave
        if later is None:
            self.index.delete(old, new, out)
        self._key_buf.index_put_((new,), u)
        self._used_buf.index_fill_(0, new, True)
        self._born_buf.index_fill_(0, new, t)
        self._last_buf.index_fill_(0, new, t)
        self._freq_buf.index_fill_(0, new, 1)
        if self.index.due(u.numel()):
            self.index.rebuild(self.row_used)  # (from the rows as they are now)
            if later is not None:
                none = torch.zeros_like(adm)
                later.append((old, new, none, u, p.new_row, none))
        elif later is None:
            self.index.insert(u, p.new_row, adm)
        else:
            later.append((old, new, out, u, p.new_row, adm))
        if p.entry is not None:
            self._count_step(p, adm)
        self.step = t

    def _count_step(self, p: _Plan, adm: torch.Tensor) -> None:
        """The counted ids after the plan's step (admit_after > 1), masked by ``p.ok``."""
        assert p.entry is not None and p.counted is not None
        n, ok, u, t = self._plen, p.ok, p.ids, p.t
        counted = ~p.hit & (p.entry >= 0)  # (U,) counted before this step
        entry = p.entry.clamp(min=0)
        stay = counted & ~p.admit if ok is None else counted & ~p.admit & ok
        known = torch.where(stay, entry, n)  # still counted
        self.p_count.index_put_((known,), p.counted)
        self.p_seen.index_fill_(0, known, t)
        leave = counted & adm  # admitted: no longer counted
        left = torch.where(leave, entry, n)
        self.pindex.delete(u, left, leave)
        self.p_used.index_fill_(0, left, False)
        fresh = ~p.hit & (p.entry < 0) & ~p.admit  # (U,) first counted now
        if ok is not None:
            fresh &= ok
        spot = first_set(~self.p_used[:n], u.numel())  # (U + 1,)
        at = torch.where(fresh, spot[(fresh.cumsum(0) - 1).clamp(min=0)], n)  # (U,)
        self.p_id.index_put_((at,), u)
        self.p_count.index_put_((at,), p.counted)
        self.p_seen.index_fill_(0, at, t)
        self.p_used.index_fill_(0, at, True)
        if self.pindex.due(u.numel()):
            self.pindex.rebuild(self.p_used[:n])
        else:
            self.pindex.insert(u, at, fresh)
        # the bound: those seen longest ago (ties: the smaller id) are forgotten
        used = self.p_used[:n]
        excess = (used.sum() - self.pending_limit).clamp(min=0)
        kmax = min(u.numel(), n)
        drop = smallest_ordered(self.p_seen[:n], self.p_id[:n], used, excess, kmax)
        out = torch.arange(kmax, device=self.device) < excess
        drop = torch.where(out, drop, n)
        self.pindex.delete(self.p_id[drop], drop, out)
        self.p_used.index_fill_(0, drop, False)
        self._p_bound = min(self._p_bound + u.numel(), self.pending_limit)

    def _overflow_error(self, t: int, counts: list[int]) -> ValueError:
        n_admit, n_free, n_evictable = counts
        return ValueError(
            f"{self.name}: this step admits {n_admit} new ids but the shard holds "
            f"{self.capacity} rows, {n_free} free and {n_evictable} evictable (the others are "
            f"used by this step)")

    def _sorted_step(self, distinct: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``VocabMap.train_step`` of sorted distinct ids: the plan, one read of its counts
        (the overflow's error before any change), the changes."""
        self.confirm()
        self._room_for(distinct.numel())
        p = self._plan(distinct, read=True)
        counts = p.counts.tolist()
        if counts[0] > counts[1] + counts[2]:
            raise self._overflow_error(p.t, counts)
        p = self._place(p, counts)
        self._apply(p)
        rows = torch.where(p.hit, p.row, torch.where(p.admit, p.new_row, -1))
        return rows, distinct[p.admit], p.new_row[p.admit]

    def train_step_async(self, distinct: torch.Tensor, *, fill: int = -1
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A training step that reads nothing back to the host.

        Args:
            distinct: (U,) integer distinct ids, any order (not checked for being distinct:
                a float or 2-D tensor is a ``ValueError``).
            fill: the row of ids not resident after the step.

        Returns:
            ``(rows (U,), admitted (U,) bool, new_rows (U,), overflow 0-d bool)``: each id's row
            after the step (``fill`` where not resident), whether this step admitted it and
            its row where it did (``fill`` elsewhere), and whether the step overflowed: then it
            and every step after it change nothing until ``confirm`` raises.
        """
        self._room_for(distinct.numel())
        ordered, perm = torch.sort(self._step_ids(distinct))  # (an integer 1-D tensor)
        p = self._place(self._plan(ordered))
        assert p.ok is not None  # (not read: masked by the device's flag)
        overflow = ~p.ok & ~self._bad
        step = torch.full((1,), p.t, dtype=_I64, device=self.device)
        self._bad_info.copy_(torch.where(overflow, torch.cat([step, p.counts]), self._bad_info))
        self._bad |= overflow
        self._unconfirmed = True
        self._apply(p)
        adm = p.admit & p.ok
        rows = torch.where(p.hit & p.ok, p.row, torch.where(adm, p.new_row, fill))
        out = torch.empty_like(rows)
        out[perm] = rows
        admitted = torch.empty_like(adm)
        admitted[perm] = adm
        new_rows = torch.where(admitted, out, fill)
        return out, admitted, new_rows, overflow

    def confirm(self) -> None:
        """Reads the flag of the steps made by ``train_step_async`` since the last call: raises
        the ``ValueError`` of the first that overflowed, the step counter rewound to before it
        (it and the steps after it changed nothing)."""
        if not self._unconfirmed:
            return
        self._unconfirmed = False
        if not bool(self._bad):
            return
        t, *counts = self._bad_info.tolist()
        self._bad.fill_(False)
        self.step = t - 1
        raise self._overflow_error(t, counts)

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, torch.Tensor]:
        self.confirm()
        return super().state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """``VocabMap.load_state_dict``: checked and normalized by a ``VocabMap``, then held
        here."""
        plain = VocabMap(self.capacity, eviction=self.eviction, admit_after=self.admit_after,
                         ttl_steps=self.ttl_steps, name=self.name, device=self.device)
        plain.load_state_dict(state)
        self._adopt(plain)

    def _adopt(self, plain: VocabMap) -> None:
        """Takes ``plain``'s state (resident ids, rows, scores, counts, step)."""
        self._unconfirmed = False
        self._bad.fill_(False)
        for buf, value, fill in ((self._key_buf, plain.row_key, 0),
                                 (self._used_buf, plain.row_used, False),
                                 (self._last_buf, plain.last_use, 0),
                                 (self._freq_buf, plain.frequency, 0),
                                 (self._born_buf, plain.born, -1)):
            buf.fill_(fill)
            buf[:self.capacity] = value
        self.index.rebuild(self.row_used)
        self.step = plain.step
        if self.admit_after > 1:
            pids, counts, seen = plain.pending_ids, plain.pending_counts, plain.pending_seen
            m = pids.numel()
            self._allocate_pending(max(_FIRST_ENTRIES, 2 * m))
            self.p_id[:m], self.p_count[:m], self.p_seen[:m] = pids, counts, seen
            self.p_used[:m] = True
            self._p_bound = m
            self.pindex.rebuild(self.p_used[:self._plen])

    def to(self, device: torch.device | str) -> None:
        device = torch.device(device)
        for key in ("_key_buf", "_used_buf", "_last_buf", "_freq_buf", "_born_buf", "_bad",
                    "_bad_info", *(("p_id", "p_count", "p_seen", "p_used") if self._plen
                                   else ())):
            setattr(self, key, getattr(self, key).to(device))
        self.device = device
        self._views()
        self.index.to(self.row_key)
        if self._plen:
            self.pindex.to(self.p_id[:self._plen])


def train_together(maps: list[DeviceVocabMap], runs: list[torch.Tensor], *,
                   masked: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """``train_step`` of each map over its run of distinct ids (the members of stacked dynamic
    tables in a batch), with one read back for them all: every step is planned first, their
    counts read at once, and the first overflow's ``ValueError`` raised before any map changes;
    else every step is placed (``_place``: victims chosen only for the maps that need them)
    and applied. The indexes' kernels launch once over all the maps: the ids found (and their
    counted entries), then the evicted ids deleted and the admitted inserted
    (state/vocab/device_hash.py's ``stack``). Returns each map's ``(rows, new_ids, new_rows)`` as
    ``train_step``'s (``-1`` where not resident); with ``masked``, ``(rows, ids, new_rows,
    admitted)`` instead, of the step's length (nothing read back for them): ``ids`` (U,) the
    run's ids ascending, ``admitted`` (U,) bool whether this step admitted each, ``new_rows``
    (U,) its row where it did (``-1`` elsewhere)."""
    ordered, perms = [], []
    for m, ids in zip(maps, runs):
        m.confirm()
        m._room_for(ids.numel())
        o, perm = torch.sort(m._step_ids(ids))
        ordered.append(o)
        perms.append(perm)
    counts = [o.numel() for o in ordered]
    every = torch.cat(ordered) if ordered else torch.empty(0, dtype=_I64)
    rows_index = stack([m.index for m in maps], counts)
    found = list(rows_index.find(every).split(counts)) if rows_index is not None else \
        [None] * len(maps)
    counting = [k for k, m in enumerate(maps) if m.admit_after > 1]
    entries: list[torch.Tensor | None] = [None] * len(maps)
    counted_index = stack([maps[k].pindex for k in counting], [counts[k] for k in counting])
    if counted_index is not None:
        got = counted_index.find(torch.cat([ordered[k] for k in counting]))
        for k, e in zip(counting, got.split([counts[k] for k in counting])):
            entries[k] = e
    plans = [m._plan(o, f, e, read=True) for m, o, f, e in zip(maps, ordered, found, entries)]
    read = torch.stack([p.counts for p in plans]).tolist() if plans else []
    for m, p, c in zip(maps, plans, read):
        if c[0] > c[1] + c[2]:
            raise m._overflow_error(p.t, c)
    plans = [m._place(p, c) for m, p, c in zip(maps, plans, read)]
    later: list[tuple[torch.Tensor, ...]] | None = [] if rows_index is not None else None
    for m, p in zip(maps, plans):
        m._apply(p, later)
    if rows_index is not None and later:
        parts = list(zip(*later))  # old ids, their rows, taken; new ids, their rows, taken
        rows_index.delete(*(torch.cat(x) for x in parts[:3]))  # (before any insert)
        rows_index.insert(*(torch.cat(x) for x in parts[3:]))
    out: list[tuple[torch.Tensor, ...]] = []
    for o, perm, p in zip(ordered, perms, plans):
        new_rows = torch.where(p.admit, p.new_row, -1)  # (U,)
        rows = torch.empty_like(p.row)
        rows[perm] = torch.where(p.hit, p.row, new_rows)
        out.append((rows, o, new_rows, p.admit) if masked
                   else (rows, o[p.admit], p.new_row[p.admit]))
    return out
