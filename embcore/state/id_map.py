"""The id map of a dynamic vocabulary (raw int64 ids -> rows) as tensors: the fast path of
state/id_map_reference.py.

One ``VocabMap`` holds the ids resident in one shard of ``capacity`` rows and follows the rules of
``ReferenceVocabulary`` (the oracle; its module docstring states them) exactly: TTL expiry at the
start of a training step, counting before admission (``admit_after``), admission in ascending id
order taking the lowest free row first and then evicting the lowest score (``"lru"``: last use,
``"lfu"``: frequency; ties: the smaller id), never an id used by the step, an overflow is a
``ValueError`` that changes nothing, and ``find`` (evaluation) changes nothing.

The data structure, all tensors on one device (so it can be checkpointed, moved, and searched by
an exported serving module), with ``R`` resident ids, ``C`` rows and ``P`` counted ids:

- ``keys`` (R,) the resident ids sorted ascending, ``key_rows`` (R,) their rows: ``find`` is one
  ``searchsorted`` (of the ids sorted first when they are many). A step keeps them sorted by
  merging, never by re-sorting: the kept ids and the admitted ids are both sorted, an admitted
  id's output position is its index plus a ``searchsorted`` in the kept ids, and the kept ids
  fill the other positions in order.
- Per row: ``row_key`` (C,) the id it holds (0 when free), ``row_used`` (C,), ``last_use`` (C,)
  the training step of its last use, ``frequency`` (C,) the training steps that used it, ``born``
  (C,) the step counter value when it received its current id (-1 when free). ``valid(rows,
  since)`` uses ``born`` to tell whether a row looked up at step ``since`` still holds the same
  id (it was not reassigned in between).
- ``pending_ids`` (P,) the non-resident ids being counted, sorted, ``pending_counts`` (P,) the
  training steps each was seen in, ``pending_seen`` (P,) the last such step. Counts are kept only
  when ``admit_after > 1`` (with 1 an id is admitted the first time it is seen). Counts of ids
  not seen for a long time may be forgotten: when a step leaves more than
  ``max(4 * capacity, 1024)`` counted ids, those seen longest ago (ties: the smaller id) are
  dropped down to that bound and start counting from zero again. (The oracle never forgets; it
  agrees with this map as long as the bound is not reached.)

That is 49 bytes per row of a full map (16 for ``keys`` / ``key_rows``, 33 per row), plus 24 per
counted id.

A training step with ``U`` distinct ids is torch ops only, no Python loop over ids: ``O(U log R)``
when it admits nothing (plus ``O(C + R)`` with a TTL), ``O(C + R + U log R + P)`` when it admits.
The victims are the ``k`` smallest (score, id) among the evictable ids, chosen in ``O(R)`` with
``kthvalue`` on the scores, the ties at the k-th score going to the smaller ids (``keys`` is in
id order, so those are the first ones); only the ``k`` victims are sorted. The step computes
everything, checks the overflow, and only then changes the state (the per-row tensors in place,
at the rows that change). Every op is exact integer work: the results do not depend on torch's
thread count.

``NativeVocabMap`` (below) is the same map stepped by the fused kernels; ``train_steps`` steps
several of them at once (the members of stacked dynamic tables): two fused calls, over the
threads, for the whole batch.

>>> m = VocabMap(capacity=2)
>>> m.train_step(torch.tensor([10, 20]))[0].tolist()
[0, 1]
>>> m.train_step(torch.tensor([10]))[0].tolist()
[0]
>>> rows, new_ids, new_rows = m.train_step(torch.tensor([30]))  # 20 (least recently used) leaves
>>> rows.tolist(), new_ids.tolist(), new_rows.tolist()
([1], [30], [1])
>>> m.find(torch.tensor([20, 30, 10, 30])).tolist()
[-1, 1, 0, 1]
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

import torch

from ..config.tables import MAP_BYTES_PER_ROW
from ..kernels import cpu

_I64 = torch.int64
_EMPTY = torch.empty(0, dtype=_I64)  # (no rows freed beyond a step's needs)
_SORT_QUERIES = 16384  # find sorts this many ids or more before searching them (on the CPU)
_INT64_MAX = 2**63 - 1  # capacity, admit_after and ttl_steps are compared with int64 state
_STATE_KEYS = ("ids", "rows", "last_use", "frequency", "pending_ids", "pending_counts", "step")


def _locate(keys: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each of ``ids`` is in the sorted ``keys``.

    Args:
        keys: (K,) int64 sorted ascending, distinct.
        ids: (n,) int64, any order.

    Returns:
        ``(pos (n,) int64, found (n,) bool)``: ``keys[pos] == ids`` where found; ``pos`` is a
        valid index into ``keys`` (0 when ``keys`` is empty) so it can be gathered unmasked.
    """
    if keys.numel() == 0:
        return (torch.zeros_like(ids),
                torch.zeros(ids.shape, dtype=torch.bool, device=ids.device))
    pos = torch.searchsorted(keys, ids).clamp_(max=keys.numel() - 1)  # (n,)
    return pos, keys[pos] == ids


def _merge(a: torch.Tensor, a_vals: tuple[torch.Tensor, ...], b: torch.Tensor,
           b_vals: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Merges two sorted, disjoint id lists and their parallel values without sorting.

    ``b[j]`` goes to ``j + (ids of a below it)`` (a ``searchsorted`` of ``b`` in ``a``); ``a``
    fills the other positions in order. ``O(n + m log n)``: meant for few ``b`` into many ``a``.

    Args:
        a: (n,) int64 sorted ascending; a_vals: tensors (n,) beside it.
        b: (m,) int64 sorted ascending, no id of ``a``; b_vals: tensors (m,) beside it.

    Returns:
        ``(ids (n + m,) sorted, values (n + m,) each)``.
    """
    if b.numel() == 0:
        return a, a_vals
    if a.numel() == 0:
        return b, b_vals
    n, m = a.numel(), b.numel()
    pb = torch.arange(m, device=a.device) + torch.searchsorted(a, b)  # (m,) output positions
    of_a = torch.ones(n + m, dtype=torch.bool, device=a.device)  # (n + m,)
    of_a[pb] = False
    out = []
    for x, y in zip((a, *a_vals), (b, *b_vals)):
        v = x.new_empty(n + m)
        v[pb] = y
        v[of_a] = x
        out.append(v)
    return out[0], tuple(out[1:])


def _smallest(score: torch.Tensor, k: int) -> torch.Tensor:
    """(n,) bool: the ``k`` entries of (n,) int64 ``score`` smallest by (score, index), in O(n).

    The k-th smallest score comes from ``kthvalue`` (a value: exact and deterministic); every
    entry below it is taken, and of those equal to it the ones of smallest index.
    """
    n = score.numel()
    if k <= 0:
        return torch.zeros(n, dtype=torch.bool, device=score.device)
    if k >= n:
        return torch.ones(n, dtype=torch.bool, device=score.device)
    kth = torch.kthvalue(score, k).values  # 0-d
    below = score < kth  # (n,)
    at = score == kth  # (n,)
    need = k - below.sum()  # 0-d: how many ties at the k-th score are taken
    return below | (at & (at.cumsum(0) <= need))


def _count_arg(value: object, arg: str, name: str) -> int:
    """``value`` as an int in ``[1, 2**63 - 1]`` (the int64 range of the state it is compared
    with), else a ``ValueError`` naming ``arg``."""
    try:
        v = operator.index(value) if isinstance(value, SupportsIndex) else None
    except TypeError:
        v = None
    if v is None or isinstance(value, bool) or not 1 <= v <= _INT64_MAX:
        raise ValueError(f"{name}: {arg} must be an int in [1, 2**63 - 1]"
                         f"{' or None' if arg == 'ttl_steps' else ''}, got {value!r}")
    return v


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def _allocating(name: str, capacity: int, device: torch.device) -> Iterator[None]:
    """Around the allocation of a map's per-row state: a ``ValueError`` naming the table and
    the bytes when it cannot be had, before trying where the state (zero-filled, so touched) is
    bigger than the machine's physical memory, and from torch's allocation error otherwise."""
    need = capacity * MAP_BYTES_PER_ROW
    what = (f"{name}: a dynamic vocabulary of capacity {capacity} needs up to {need} bytes of "
            f"fast memory for its map ({MAP_BYTES_PER_ROW} per row)")
    if device.type == "cpu":
        have = _physical_memory()
        if have is not None and need > have:
            raise ValueError(f"{what}, more than this machine's {have} bytes of memory; lower "
                             f"its vocabulary_size (the capacity) or shard it over more "
                             f"processes")
    try:
        yield
    except (RuntimeError, MemoryError) as e:  # torch's allocators (OutOfMemoryError included)
        raise ValueError(f"{what}, which could not be allocated on {device}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _as_ids(ids: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.is_complex() \
            or ids.dtype == torch.bool:
        raise ValueError(f"{what} must be an integer tensor of ids, got "
                         f"{getattr(ids, 'dtype', type(ids).__name__)}")
    return ids.to(_I64)


class VocabMap:
    """One shard's id -> row map, held as tensors (so it can be checkpointed, moved, and searched
    by an exported serving module).

    Args:
        capacity: rows of the shard (C >= 1).
        eviction: ``"lru"`` (evict the oldest last use) or ``"lfu"`` (the lowest frequency).
        admit_after: training steps an id must be seen in, while not resident, to be admitted.
        ttl_steps: None, or k >= 1: at the start of training step t, ids whose last use is more
            than k steps ago (``t - last_use > k``) are evicted.
        name: the table's name, for error messages.
        device: where the state tensors live.

    Raises:
        ValueError: a bad eviction, capacity, admit_after or ttl_steps (not an int in
            ``[1, 2**63 - 1]``), or a map whose state cannot be allocated (naming the bytes it
            needs: up to ``MAP_BYTES_PER_ROW`` per row of capacity).
    """

    def __init__(self, capacity: int, *, eviction: str = "lru", admit_after: int = 1,
                 ttl_steps: int | None = None, name: str = "table",
                 device: torch.device | str = "cpu") -> None:
        if eviction not in ("lru", "lfu"):
            raise ValueError(f"{name}: eviction must be 'lru' or 'lfu', got {eviction!r}")
        capacity, admit_after = _count_arg(capacity, "capacity", name), _count_arg(
            admit_after, "admit_after", name)
        ttl_steps = None if ttl_steps is None else _count_arg(ttl_steps, "ttl_steps", name)
        self.capacity = capacity
        self.eviction = eviction
        self.admit_after = admit_after
        self.ttl_steps = ttl_steps
        self.name = name
        self.device = torch.device(device)
        self.step = 0  # training steps so far
        self.last_freed = _EMPTY  # rows a step freed beyond its needs (train_step's spare)
        dev = self.device
        with _allocating(name, self.capacity, dev):
            self._allocate_rows()
        self._allocate_pending()

    def _allocate_pending(self) -> None:
        dev = self.device
        self.pending_ids = torch.empty(0, dtype=_I64, device=dev)      # (P,) counted ids, sorted
        self.pending_counts = torch.empty(0, dtype=_I64, device=dev)   # (P,) steps seen
        self.pending_seen = torch.empty(0, dtype=_I64, device=dev)     # (P,) last step seen

    def _allocate_rows(self) -> None:
        """The state of an empty map (the per-row tensors of ``capacity`` rows)."""
        c, dev = self.capacity, self.device
        self.keys = torch.empty(0, dtype=_I64, device=dev)             # (R,) resident ids, sorted
        self.key_rows = torch.empty(0, dtype=_I64, device=dev)         # (R,) their rows
        self.row_key = torch.zeros(c, dtype=_I64, device=dev)          # (C,) id held, 0 when free
        self.row_used = torch.zeros(c, dtype=torch.bool, device=dev)   # (C,)
        self.last_use = torch.zeros(c, dtype=_I64, device=dev)         # (C,) step of last use
        self.frequency = torch.zeros(c, dtype=_I64, device=dev)        # (C,) steps that used it
        self.born = torch.full((c,), -1, dtype=_I64, device=dev)       # (C,) step it got its id

    @property
    def n_resident(self) -> int:
        """How many ids are resident."""
        return self.keys.numel()

    def nbytes(self, pending: bool = True) -> int:
        """The bytes of every tensor the map holds (each storage once; ``pending`` False: not
        the counted ids' ``pending_*``)."""
        seen: dict[int, int] = {}
        for key, v in vars(self).items():
            if isinstance(v, torch.Tensor) and (pending or not key.startswith("pending_")):
                st = v.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def row_values(self, key: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Per row: ``"ids"`` the id it holds, ``"last_use"`` or ``"frequency"``; 0 where free.

        Args:
            key: ``"ids"``, ``"last_use"`` or ``"frequency"``.
            rows: None (every row), or (n,) int64 rows in ``[0, capacity)``.

        Returns:
            (C,) or (n,) int64, a new tensor on the map's device.
        """
        value = {"ids": self.row_key, "last_use": self.last_use,
                 "frequency": self.frequency}[key]
        if rows is None:
            return torch.where(self.row_used, value, 0)
        rows = rows.to(self.device)
        return torch.where(self.row_used[rows], value[rows], 0)

    def row_ids(self) -> torch.Tensor:
        """(n,) int64, n <= capacity: the id each row holds (0: free), rows ``[0, n)``; the rows
        from n on hold none. The map's own tensor (not a copy): read it, do not keep it beyond
        the next step."""
        return self.row_key

    def ids_of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) int64: the id each of the (n,) int64 ``rows`` in ``[0, capacity)`` holds (0:
        free), on the map's device."""
        return self.row_key.index_select(0, rows.to(self.device))

    @property
    def pending_limit(self) -> int:
        """The most counted ids kept after a step: ``max(4 * capacity, 1024)``."""
        return max(4 * self.capacity, 1024)

    def __repr__(self) -> str:
        return (f"VocabMap(name={self.name!r}, capacity={self.capacity}, "
                f"eviction={self.eviction!r}, admit_after={self.admit_after}, "
                f"ttl_steps={self.ttl_steps}, resident={self.n_resident}, step={self.step}, "
                f"device={self.device})")

    def find(self, ids: torch.Tensor, *, fill: int = -1) -> torch.Tensor:
        """The rows of ids (evaluation): changes nothing.

        Args:
            ids: (n,) int64 ids, any order, duplicates allowed.
            fill: the row given to ids that are not resident.

        Returns:
            (n,) int64 row of each id, ``fill`` where it is not resident.
        """
        ids = _as_ids(ids, f"{self.name}: ids").to(self.device).contiguous()
        if self.keys.numel() == 0:
            return torch.full_like(ids, fill)
        flat = ids.reshape(-1)  # (n,)
        if flat.numel() < _SORT_QUERIES or flat.device.type != "cpu":
            pos, found = _locate(self.keys, flat)
            return torch.where(found, self.key_rows[pos], fill).reshape(ids.shape)
        # Many ids on the CPU: searching them in ascending order walks the keys' memory in
        # order (about 4x faster for 1M ids in 10M keys); their rows go back by the permutation.
        ordered, order = torch.sort(flat)  # (n,)
        pos, found = _locate(self.keys, ordered)
        out = torch.empty_like(flat)
        out[order] = torch.where(found, self.key_rows[pos], fill)
        return out.reshape(ids.shape)

    def train_step(self, distinct: torch.Tensor, *, check: bool = True, fill: int = -1,
                   spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step over the distinct ids of a batch.

        Args:
            distinct: (U,) int64 ids, distinct, in any order (the result does not depend on it).
            check: whether to check that they are distinct (callers that deduplicated them
                already skip it).
            fill: the row given to ids that are not resident after the step.
            spare: when the step must evict, it may also evict up to this many more of the
                lowest-scored ids not used by the step (the fused kernels do; this torch
                version does not), so that later steps admit without a scan; their rows are
                in ``last_freed`` afterwards (empty otherwise). 0 keeps the rules exact (the
                raw-id maps); the cache (cache.py) uses it.

        Returns:
            ``(rows, new_ids, new_rows)``: rows (U,) int64 each id's row after the step, ``fill``
            if it is not resident (still being counted); new_ids (A,) int64 ascending, the ids
            admitted by this step; new_rows (A,) int64 their rows (the caller initializes their
            values and optimizer slots).

        Raises:
            ValueError: ``distinct`` is not distinct (when checked); or the step admits more ids
                than there are free plus evictable rows. Then nothing changes (not the step
                counter, the counts, anything).
        """
        self.last_freed = _EMPTY
        distinct = self._step_ids(distinct)
        if distinct.numel() > 1 and not bool((distinct[1:] > distinct[:-1]).all()):
            ordered, perm = torch.sort(distinct)  # (U,)
            if check and not bool((ordered[1:] > ordered[:-1]).all()):
                raise ValueError(f"{self.name}: the ids of a training step must be distinct")
            rows, new_ids, new_rows = self._sorted_step(ordered)
            out = torch.empty_like(rows)
            out[perm] = rows
        else:
            out, new_ids, new_rows = self._sorted_step(distinct)
        if fill != -1:
            out = torch.where(out < 0, fill, out)
        return out, new_ids, new_rows

    def _step_ids(self, distinct: torch.Tensor) -> torch.Tensor:
        distinct = _as_ids(distinct, f"{self.name}: distinct").to(self.device).contiguous()
        if distinct.dim() != 1:
            raise ValueError(f"{self.name}: distinct must be 1-D, got shape "
                             f"{tuple(distinct.shape)}")
        return distinct

    def _sorted_step(self, distinct: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``train_step`` of (U,) ids sorted ascending and distinct."""
        t = self.step + 1
        dev = self.device
        keys, key_rows = self.keys, self.key_rows  # (R,)

        # TTL: at the start of the step, rows last used before t - ttl are freed.
        live = self.row_used  # (C,) resident after expiry
        key_live = None  # (R,) whether each resident id stays; None: all do
        if self.ttl_steps is not None and t - self.ttl_steps > 0:  # last_use >= 0
            live = live & (self.last_use >= t - self.ttl_steps)
            key_live = live[key_rows]

        # Resident ids of the step: used (last use t, frequency + 1), not evictable.
        pos, hit = _locate(keys, distinct)  # (U,)
        if keys.numel():
            if key_live is not None:
                hit &= key_live[pos]
            rows = torch.where(hit, key_rows[pos], -1)  # (U,)
        else:
            rows = torch.full_like(distinct, -1)
        hit_rows = rows[hit]  # (H,)

        # The others are counted; those seen in admit_after steps are admitted.
        miss = (~hit).nonzero().squeeze(1)  # (M,) indices into distinct
        miss_ids = distinct[miss]  # (M,) ascending
        counted = None  # (ppos, pfound, counts) of the ids counted (admit_after > 1)
        if self.admit_after == 1:
            admit = torch.ones(miss_ids.shape, dtype=torch.bool, device=dev)
        else:
            counted = self._counts(miss_ids)
            admit = counted[2] >= self.admit_after  # (M,)
        new_ids = miss_ids[admit]  # (A,) ascending

        # Placement: the lowest free rows first, then the evictable ids' rows by (score, id).
        n_admit = new_ids.numel()
        new_rows = new_ids.new_empty(0)  # (A,)
        evicted = None  # (R,) bool: the victims, None when there are none
        if n_admit:
            free = ~live  # (C,)
            evictable = torch.ones(keys.numel(), dtype=torch.bool, device=dev) \
                if key_live is None else key_live.clone()  # (R,)
            evictable[pos[hit]] = False  # never an id of this step
            n_free, n_evictable = torch.stack([free.sum(), evictable.sum()]).tolist()
            if n_admit > n_free + n_evictable:
                raise ValueError(
                    f"{self.name}: this step admits {n_admit} new ids but the shard holds "
                    f"{self.capacity} rows, {n_free} free and {n_evictable} evictable (the "
                    f"others are used by this step)")
            from_free = min(n_admit, n_free)
            new_rows = free.nonzero().squeeze(1)[:from_free]  # (from_free,) ascending
            if n_admit > from_free:
                cand = evictable.nonzero().squeeze(1)  # (E,) positions in keys, ascending id
                score = (self.last_use if self.eviction == "lru" else self.frequency)
                score = score[key_rows[cand]]  # (E,)
                take = _smallest(score, n_admit - from_free)  # (E,)
                victims = cand[take]  # (k,) ascending id
                victims = victims[torch.sort(score[take], stable=True).indices]  # (score, id)
                evicted = torch.zeros(keys.numel(), dtype=torch.bool, device=dev)  # (R,)
                evicted[victims] = True
                new_rows = torch.cat([new_rows, key_rows[victims]])  # (A,)
            rows[miss[admit]] = new_rows

        # The new state. Nothing below can fail: the per-row tensors change in place, only
        # where rows change (O(changed rows) beside the O(C) scans above).
        if key_live is not None:  # TTL: free the expired rows
            gone = (self.row_used & ~live).nonzero().squeeze(1)  # (X,)
            self.row_key[gone], self.last_use[gone], self.frequency[gone] = 0, 0, 0
            self.born[gone] = -1
            self.row_used = live
            if gone.numel() == 0:
                key_live = None
        self.last_use[hit_rows] = t
        self.frequency[hit_rows] += 1
        self.row_key[new_rows], self.row_used[new_rows], self.born[new_rows] = new_ids, True, t
        self.last_use[new_rows], self.frequency[new_rows] = t, 1
        keep = None if evicted is None else evicted.logical_not_()  # (R,) the ids that stay
        if key_live is not None:
            if keep is None:
                keep = key_live
            else:
                keep &= key_live
        if keep is not None:  # some ids left: compact the keys
            keys, key_rows = keys[keep], key_rows[keep]
        self.keys, (self.key_rows,) = _merge(keys, (key_rows,), new_ids, (new_rows,))
        if counted is not None:
            (self.pending_ids, self.pending_counts,
             self.pending_seen) = self._count(miss_ids, *counted, admit, t)
        self.step = t
        return rows, new_ids, new_rows

    def _counts(self, miss_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ppos, pfound, counts)`` of ids not resident (M,): where each is in the pending
        counts and whether it is there, and its count with this step (admit_after > 1)."""
        ppos, pfound = _locate(self.pending_ids, miss_ids)  # (M,)
        counts = torch.ones_like(miss_ids)  # (M,) with this step
        if self.pending_ids.numel():
            counts += torch.where(pfound, self.pending_counts[ppos], 0)
        return ppos, pfound, counts

    def _count(self, miss_ids: torch.Tensor, ppos: torch.Tensor, pfound: torch.Tensor,
               counts: torch.Tensor, admit: torch.Tensor,
               t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pending lists after step ``t`` counted the (M,) non-resident ``miss_ids``.

        Args:
            miss_ids: (M,) ascending; ppos, pfound: (M,) their place in ``pending_ids``;
            counts: (M,) their counts with this step; admit: (M,) those admitted (removed).
            t: the step.

        Returns:
            ``(pending_ids (P',), pending_counts (P',), pending_seen (P',))``, forgetting the
            ids seen longest ago (ties: the smaller id) beyond ``pending_limit``.
        """
        ids, cnt, seen = self.pending_ids, self.pending_counts, self.pending_seen  # (P,)
        known = pfound & ~admit  # (M,) counted before, still counted
        cnt, seen = cnt.clone(), seen.clone()
        cnt[ppos[known]] = counts[known]
        seen[ppos[known]] = t
        drop = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)  # (P,)
        drop[ppos[pfound & admit]] = True
        fresh = ~pfound & ~admit  # (M,) first seen now
        ids, (cnt, seen) = _merge(ids[~drop], (cnt[~drop], seen[~drop]), miss_ids[fresh],
                                  (counts[fresh], torch.full_like(counts[fresh], t)))
        if ids.numel() > self.pending_limit:
            keep = ~_smallest(seen, ids.numel() - self.pending_limit)
            ids, cnt, seen = ids[keep], cnt[keep], seen[keep]
        return ids, cnt, seen

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident ids.

        Returns:
            ``(ids (R,) int64 ascending, rows (R,) int64)``.
        """
        return self.keys.clone(), self.key_rows.clone()

    def valid(self, rows: torch.Tensor, since: int) -> torch.Tensor:
        """Which rows still hold the id they held after training step ``since``.

        A row looked up by step ``since`` and reassigned by a later step (evicted, expired, or
        given to a new id) must not receive that lookup's gradient: a row is valid when it is in
        use and got its current id at or before step ``since`` (``born <= since``).

        Args:
            rows: (n,) int64 rows, -1 (not resident) allowed.
            since: the training step of the lookup.

        Returns:
            (n,) bool: ``rows >= 0 & row_used[rows] & born[rows] <= since`` (False out of range).
        """
        rows = _as_ids(rows, f"{self.name}: rows").to(self.device)
        inside = (rows >= 0) & (rows < self.capacity)
        r = rows.clamp(0, self.capacity - 1)
        return inside & self.row_used[r] & (self.born[r] <= since)

    def valid_count(self, rows: torch.Tensor, since: int) -> tuple[torch.Tensor, int]:
        """``(valid(rows, since), how many are valid)``."""
        keep = self.valid(rows, since)
        return keep, int(keep.sum())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The map's state, independent of its row layout details.

        Returns:
            ``ids`` (R,) ascending, ``rows``, ``last_use``, ``frequency`` (R,) per id;
            ``pending_ids`` (P,) ascending, ``pending_counts`` (P,), ``pending_seen`` (P,)
            the last step each was seen in; ``step`` 0-d int64. ``born`` is not saved (see
            ``load_state_dict``).
        """
        return {"ids": self.keys.clone(), "rows": self.key_rows.clone(),
                "last_use": self.last_use[self.key_rows],
                "frequency": self.frequency[self.key_rows],
                "pending_ids": self.pending_ids.clone(),
                "pending_counts": self.pending_counts.clone(),
                "pending_seen": self.pending_seen.clone(),
                "step": torch.tensor(self.step, dtype=_I64, device=self.device)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replaces the map's state by ``state`` (from ``state_dict``, any device).

        The loaded rows count as received at the loaded step (``born = step``: lookups made
        before the load are not valid for them). ``pending_seen`` may be absent (a state saved
        before it was kept): the counts then count as last seen at the loaded step. When more
        ids are counted than ``pending_limit`` (a state from a larger shard), those seen
        longest ago (ties: the smaller id) are dropped, as a step would.

        Args:
            state: the keys of ``state_dict``.

        Raises:
            ValueError: naming the key, for a missing or malformed entry: ids not sorted and
                distinct, rows not distinct or outside [0, capacity), lengths that differ,
                last_use outside [0, step], frequency or counts < 1, pending ids not sorted and
                distinct or resident, pending_seen outside [1, step], a negative step. Then
                nothing changes.
        """
        got = {}
        for key in (*_STATE_KEYS, "pending_seen"):
            if key == "pending_seen" and key not in state:
                continue
            if key not in state:
                raise ValueError(f"{self.name}: the vocabulary state has no {key!r}")
            v = state[key]
            if not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.is_complex() \
                    or v.dtype == torch.bool:
                raise ValueError(f"{self.name}: vocabulary state {key!r} must be an integer "
                                 f"tensor, got {getattr(v, 'dtype', type(v).__name__)}")
            if (v.dim() != 0 if key == "step" else v.dim() != 1):
                raise ValueError(f"{self.name}: vocabulary state {key!r} must be "
                                 f"{'0-d' if key == 'step' else '1-D'}, got shape "
                                 f"{tuple(v.shape)}")
            got[key] = v.detach().to(device=self.device, dtype=_I64).contiguous()

        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"{self.name}: vocabulary state {key!r} {why}")

        ids, rows, pids = got["ids"], got["rows"], got["pending_ids"]
        step = int(got["step"])
        if step < 0:
            raise bad("step", f"must be >= 0, got {step}")
        for key in ("rows", "last_use", "frequency"):
            if got[key].numel() != ids.numel():
                raise bad(key, f"has {got[key].numel()} entries for {ids.numel()} ids")
        seen = got.get("pending_seen")
        if seen is None:
            seen = torch.full_like(pids, step)
        for key, v in (("pending_counts", got["pending_counts"]), ("pending_seen", seen)):
            if v.numel() != pids.numel():
                raise bad(key, f"has {v.numel()} entries for {pids.numel()} pending_ids")
        for key, v in (("ids", ids), ("pending_ids", pids)):
            if v.numel() > 1 and not bool((v[1:] > v[:-1]).all()):
                raise bad(key, "must be sorted ascending and distinct")
        if rows.numel():
            if not bool(((rows >= 0) & (rows < self.capacity)).all()):
                raise bad("rows", f"must be in [0, {self.capacity}) (the capacity)")
            if torch.unique(rows).numel() != rows.numel():
                raise bad("rows", "must be distinct")
            if not bool(((got["last_use"] >= 0) & (got["last_use"] <= step)).all()):
                raise bad("last_use", f"must be in [0, step = {step}]")
            if not bool((got["frequency"] >= 1).all()):
                raise bad("frequency", "must be >= 1")
        if pids.numel():
            if not bool((got["pending_counts"] >= 1).all()):
                raise bad("pending_counts", "must be >= 1")
            if bool(_locate(ids, pids)[1].any()):
                raise bad("pending_ids", "must not hold resident ids")
            if not bool(((seen >= 1) & (seen <= step)).all()):
                raise bad("pending_seen", f"must be in [1, step = {step}]")

        counts = got["pending_counts"]
        if pids.numel() > self.pending_limit:  # as a step forgets: the longest unseen go
            keep = ~_smallest(seen, pids.numel() - self.pending_limit)
            pids, counts, seen = pids[keep], counts[keep], seen[keep]
        self._install(step, ids, rows, got["last_use"], got["frequency"])
        self.step = step
        self.pending_ids, self.pending_counts = pids.clone(), counts.clone()
        self.pending_seen = seen.clone()

    def _install(self, step: int, ids: torch.Tensor, rows: torch.Tensor,
                 last_use: torch.Tensor, frequency: torch.Tensor) -> None:
        """Replaces the resident ids by the checked (R,) ``ids`` (ascending) at ``rows`` with
        their ``last_use`` and ``frequency``, received at ``step``; raises (changing nothing)
        only when the state cannot be allocated."""
        c, dev = self.capacity, self.device
        with _allocating(self.name, c, dev):
            row_key = torch.zeros(c, dtype=_I64, device=dev)
            row_used = torch.zeros(c, dtype=torch.bool, device=dev)
            last = torch.zeros(c, dtype=_I64, device=dev)
            freq = torch.zeros(c, dtype=_I64, device=dev)
            born = torch.full((c,), -1, dtype=_I64, device=dev)
        row_key[rows], row_used[rows], born[rows] = ids, True, step
        last[rows], freq[rows] = last_use, frequency
        self.keys, self.key_rows = ids.clone(), rows.clone()
        self.row_key, self.row_used, self.born = row_key, row_used, born
        self.last_use, self.frequency = last, freq

    def to(self, device: torch.device | str) -> None:
        """Moves the state tensors to ``device`` (in place)."""
        device = torch.device(device)
        for key in ("keys", "key_rows", "row_key", "row_used", "last_use", "frequency", "born",
                    "pending_ids", "pending_counts", "pending_seen"):
            setattr(self, key, getattr(self, key).to(device))
        self.device = device


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

    def _native(self) -> bool:
        """Whether the kernels apply now (taking the compact layout if they do)."""
        if not cpu.usable(self._ids if self._compact else self.row_key):
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
        if self.device.type != "cpu" or not cpu.usable(ids):  # VocabMap's layout
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
    if not cpu.usable(ids) or len(nmaps) < len(maps) or not all(m._native() for m in nmaps):
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
    if not cpu.usable(ids) or len(nmaps) < len(maps) or not all(m._native() for m in nmaps):
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
