"""The id map of a dynamic vocabulary (raw int64 ids -> rows) as tensors: the fast path of
state/vocab/reference.py.

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

``NativeVocabMap`` (native_map.py) is the same map stepped by the fused kernels; its
``train_steps`` steps several of them at once (the members of stacked dynamic tables): two fused
calls, over the threads, for the whole batch.

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
import operator
import os
from collections.abc import Iterator, Mapping
from typing import SupportsIndex

import torch

from ...config.tables import MAP_BYTES_PER_ROW

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
    bigger than the device's memory (the machine's physical memory, a GPU's own), and from
    torch's allocation error otherwise."""
    need = capacity * MAP_BYTES_PER_ROW
    what = (f"{name}: a dynamic vocabulary of capacity {capacity} needs up to {need} bytes of "
            f"fast memory for its map ({MAP_BYTES_PER_ROW} per row)")
    have, where = ((_physical_memory(), "this machine's") if device.type == "cpu" else
                   (torch.cuda.get_device_properties(device).total_memory, f"{device}'s")
                   if device.type == "cuda" else (None, ""))
    if have is not None and need > have:  # (not tried: the host or the GPU could not recover)
        raise ValueError(f"{what}, more than {where} {have} bytes of memory; lower its "
                         f"vocabulary_size (the capacity) or shard it over more processes")
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
                raw-id maps); the cache (state/tier/cache.py) uses it.

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
