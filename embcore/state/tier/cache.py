"""Tables beyond memory: a shard kept in a slow tier, its hot rows in a write-back cache.

A physical table the plan offloads (``memory_budget``, docs/semantics.md section 10) keeps its
shard's rows and optimizer slots in the **slow tier**: files under ``offload_dir`` mapped into
memory (``MAP_SHARED``: page cache, not the process's anonymous memory) on the CPU, pinned host
memory when the tables live on a GPU. The **cache** holds ``capacity`` of those rows, each with
its slots, in fast memory, laid out like an in-memory shard of ``capacity`` rows, so the step's
lookup and fused update run on it unchanged.

The cache's index (``CacheIndex``, state/tier/index.py) holds the cache row of every shard row:
a step's distinct rows are resolved by one index step, which admits the missing ones and, when
the cache is full, evicts the least recently used rows that this step does not use (ties: the
lower cache row), and an eighth of the cache more at once (``SPARE_SHARE``; at most
``SPARE_STEPS`` times the step's rows), so that the next
steps admit into free rows without scanning. Before a cache row is given to a new shard row,
its old row is written back to the slow tier if it was updated since it was read (write-back);
then the new row is read whole, with its slots (a static table's records on the CPU may be
written as a log instead of in place, log.py: ``slow_writes`` decides, ``CachedRows.log``
holds the places). Rows move whole, values unchanged, so a run
with a cache computes exactly what a run without one computes: the cache decides where a row
is, never what it holds.

A step whose distinct rows outnumber the cache grows the cache to hold them (with a warning):
the step's working set must be in fast memory. A cache on the CPU is faulted in when it is made
(``populate``: all of its pages resident from then on, within the budget), not page by page by
the steps that fill it.

The slow tier's files (private, locked, their disk reserved, checked before rows move) are
files.py's.
"""

from __future__ import annotations

import bisect
import threading
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from ...kernels import cpu, gpu
from ...ops.backend import TORCH_OPS, Backend
from ...ops.memory import empty_table, populate
from .device_index import DeviceCacheIndex
from .files import _SAVING, SlowFile, records, slow_file, slow_sums
from .index import MAX_CAPACITY, CacheIndex
from .log import RecordLog

# When the cache must evict, it evicts this share of its rows beyond the step's needs at once
# (the least recently used ones), so that the next steps admit into free rows without scanning;
# at most SPARE_STEPS times the step's distinct rows (a large cache would otherwise write
# back hundreds of thousands of rows in one step: W4's cache of 7.5M rows, 937k).
SPARE_SHARE = 8
SPARE_STEPS = 16

# A move of rows to or from the slow tier's files that took longer than this per row waited
# for the disk (a page fault reads 4 KiB; from the page cache a row moves in well under a
# microsecond): the next moves ask for all their rows' pages first (``madvise(MADV_WILLNEED)``,
# ``cpu.will_need``), so that the disk reads them with many requests in flight, until a move
# is fast again (the advice costs a system call per row, 0.45 us on a resident page).
SLOW_ROW_SECONDS = 2e-6
SLOW_ROW_MIN_ROWS = 64  # moves of fewer rows are not timed

# Before the moves of a step the slow tier's files are checked (``CachedRows.check_files``):
# their size every time (an ``fstat``), their path (a ``stat``, three times the cost) at most
# this often.
PATH_CHECK_SECONDS = 1.0

SEAL_ROWS = 1 << 16  # rows whose checksums are set or checked at a time (``CachedRows.seal``)


class CachedRows:
    """One physical table's shard in the slow tier, and its write-back cache in fast memory.

    Args:
        name: the physical table's name (its first member), for messages.
        slow: ``{"parameters": (N, C) tensor, slot name: (N, c) tensor}`` in the slow tier,
            initialized.
        capacity: cache rows.
        device: where the cache lives.
        bounds: (T + 1,) first local row of each member table, then N (per-table statistics).
        members: the member tables' names.
        mapped: whether the slow tier is mapped files (reads may wait for the disk).
        log: where the rows' records are, when ``slow`` is the views of a ``slow_log`` (rows
            written back are then appended, and ``slow``'s first N records are the rows in
            order only after ``drop``).
        logical: ``(member, row) -> logical row`` of a static member's row, for messages.
        backend: the kernels of ``device`` (ops/backend.py): where the GPU's kernels run, the
            index lives on the device and the GPU moves the rows (a tier in host memory).

    The files under the slow tier (``SlowFile``: those of ``slow_tensor`` and ``slow_records``)
    are checked before every move of rows to or from them, and before a read of them or the
    cache emptied (``check_files``): a file truncated, removed or replaced by another process
    is a RuntimeError naming it, not a SIGBUS. Their rows carry checksums (ops/checksum.py),
    set when written, checked when read, each keyed to its row's version, which the index keeps
    in fast memory and a write advances (``_versions``): bytes changed in a file, or put back
    to what they were before a write (a lost write), are a RuntimeError naming the row.
    """

    def __init__(self, name: str, slow: dict[str, torch.Tensor], capacity: int,
                 device: torch.device, bounds: Sequence[int], members: Sequence[str],
                 mapped: bool = False, log: RecordLog | None = None,
                 logical: Callable[[int, int], int] | None = None,
                 backend: Backend = TORCH_OPS) -> None:
        self.name, self.slow, self.device, self.backend = name, slow, device, backend
        self.host = backend.host()  # the slow tier's own work (host memory): its moves, its index
        self.log = log
        # the rows' checksums in the files (ops/checksum.py), or None (no files)
        self.sums = slow_sums(slow["parameters"])
        self.sealed = False  # every row's checksum is set (``seal``: at the first move)
        self._checked_whole = False  # every row checked since the last move (``drop``)
        self.broken: str | None = None  # the error of a row that failed its checksum
        self._logical = logical  # (member, its shard row) -> its logical row, for messages
        self.rows = log.rows if log is not None else slow["parameters"].shape[0]
        if log is not None:  # (each array's byte offset in a record)
            self._field_at = dict(zip(slow, records(list(slow.values()))[1]))
        self.members = list(members)
        self._bounds = list(bounds)[1:-1]  # the first row of members 1..T-1
        self._read = 0      # rows read from the slow tier
        self._written = 0   # rows written back
        self._evictions = 0  # steps that evicted rows
        # the same three counted on the device (``on_device``: the host does not know them)
        self._moves = torch.zeros(3, dtype=torch.int64, device=device)
        self._grew = False
        self.mapped = mapped
        self.read_ahead = False  # moves ask for their pages first (SLOW_ROW_SECONDS)
        self.lock = threading.RLock()  # held by the store across a resolve and its use
        files = {id(f): f for f in map(slow_file, slow.values()) if f is not None}
        self.files: list[SlowFile] = list(files.values())
        # the index on the device, the rows moved by the GPU (a tier in host memory: no files,
        # no log, no checksums), where the GPU kernels apply
        self.on_device = (not self.files and log is None and self.sums is None
                          and backend.triton)
        self._path_checked = time.monotonic()
        self._allocate(max(1, min(int(capacity), self.rows, MAX_CAPACITY)))

    def _allocate(self, capacity: int) -> None:
        """An empty cache of ``capacity`` rows (the statistics carry over)."""
        self.generation = getattr(self, "generation", 0) + 1
        self._recent: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (rows, slots, gen.)
        self.capacity = capacity
        self.table = empty_table((capacity,) + tuple(self.slow["parameters"].shape[1:]),
                                 self.slow["parameters"].dtype, self.device)
        self.slots = {k: empty_table((capacity,) + tuple(v.shape[1:]), v.dtype, self.device)
                      for k, v in self.slow.items() if k != "parameters"}
        for t in (self.table, *self.slots.values()):  # (its pages now, not while it fills)
            populate(t)
        old = getattr(self, "index", None)
        self.index: CacheIndex | DeviceCacheIndex = (
            DeviceCacheIndex(self.rows, capacity, self._bounds, self.device) if self.on_device
            else CacheIndex(self.rows, capacity, self._bounds, self.host))
        if old is not None:
            self.index.counts.copy_(old.counts)
        if isinstance(old, CacheIndex) and isinstance(self.index, CacheIndex):
            # the rows' versions carry over (all out of the new cache: in ``where``)
            self.index.where.copy_(old.where)
            held = torch.nonzero(old.owner >= 0).flatten()
            if held.numel():
                self.index.where.index_copy_(0, old.owner.index_select(0, held),
                                             -1 - old.version.index_select(0, held))

    @property
    def read_rows(self) -> int:
        """Rows read from the slow tier so far."""
        return self._read + (int(self._moves[0]) if self.on_device else 0)

    @property
    def written_rows(self) -> int:
        """Rows written back to the slow tier so far."""
        return self._written + (int(self._moves[1]) if self.on_device else 0)

    @property
    def evictions(self) -> int:
        """Steps that evicted rows so far."""
        return self._evictions + (int(self._moves[2]) if self.on_device else 0)

    @property
    def hits(self) -> torch.Tensor:
        """(T,) distinct rows of lookups found in the cache, per member table."""
        return self.index.counts[0]

    @property
    def misses(self) -> torch.Tensor:
        """(T,) distinct rows of lookups read from the slow tier, per member table."""
        return self.index.counts[1]

    @property
    def new(self) -> torch.Tensor:
        """(T,) distinct rows of lookups given to new ids since the last lookup (``renew``)."""
        return self.index.counts[2]

    # ---------------------------------------------------------------- the step's rows
    def resolve(self, rows: torch.Tensor, count: bool = True, read: bool = True) -> torch.Tensor:
        """(U,) cache rows of distinct shard rows ``rows`` (U,), brought in as needed
        (``count``: a lookup, counted in the statistics; ``read`` False: rows not cached get
        cache rows but are not read, for values about to be written there).

        The answers to the last two calls are kept: the same ``rows`` tensor asked again (the
        update of a lookup's distinct rows) gets the same answer without an index step while
        no cached row has left since (the cache's generation), or while its rows are all still
        in the cache rows it gave (one comparison: with pipelining the next batch's lookup
        comes between, and evicts other rows)."""
        if self.on_device:
            return self._resolve_on_device(rows, count, read)
        asked = rows
        for r, s, g in self._recent:  # the update of a lookup's rows, still where they were
            if r is asked and (g == self.generation or torch.equal(
                    self.index.owner[s.cpu() if s.device.type != "cpu" else s],
                    r.cpu() if r.device.type != "cpu" else r)):
                if count:  # (counted again: hits, as the index would)
                    self.index.count_held(r.cpu(), s.cpu())
                return s
        rows = rows.to(torch.int64)
        cpu_rows = rows.cpu() if rows.device.type != "cpu" else rows
        self._ready()
        if cpu_rows.numel() > self.capacity:
            self._grow(cpu_rows.numel())
        spare = min(self.capacity // SPARE_SHARE, SPARE_STEPS * cpu_rows.numel())
        self.check_files(moving=True)  # (before the index changes: an error leaves it as it was)
        self._checked_whole = False
        index = self.index
        assert isinstance(index, CacheIndex)
        step = index.step(cpu_rows, count, spare=spare)
        assert step is not None  # (the cache holds the step's rows)
        if step.evicted:  # rows left: older answers may be stale
            self.generation += 1
            self._evictions += 1
        if step.out_rows.numel():  # evicted updates, written back before any reads
            self._copy_out(step.out_slots, step.out_rows)
        if step.miss_rows.numel() and read:
            self._move(True, step.miss_rows, step.miss_slots)
            self._read += step.miss_rows.numel()
        out = step.slots.to(self.device) if self.device.type != "cpu" else step.slots
        self._recent = [(asked, out, self.generation)] + self._recent[:1]
        return out

    def _resolve_on_device(self, rows: torch.Tensor, count: bool, read: bool) -> torch.Tensor:
        """``resolve`` by the index on the device, the rows moved by the GPU: nothing is read
        back to the host. Every step may have evicted (the host does not know), so the last
        answer is kept only until the next step."""
        index = self.index
        assert isinstance(index, DeviceCacheIndex)
        for r, s, g in self._recent:
            if r is rows and g == self.generation:
                if count:
                    index.count_held(r.to(torch.int64), s)
                return s
        asked = rows
        rows = rows.to(device=self.device, dtype=torch.int64)
        self._ready()
        if rows.numel() > self.capacity:
            self._grow(rows.numel())
            index = self.index
            assert isinstance(index, DeviceCacheIndex)
        spare = min(self.capacity // SPARE_SHARE, SPARE_STEPS * rows.numel())
        step = index.step(rows, count, spare=spare)
        self.generation += 1
        self._move_on_device(False, step.out_rows, step.out_slots, step.out)  # before reads
        moved = [step.miss.sum() if read else torch.zeros_like(self._moves[0]), step.out.sum(),
                 step.evicted]
        self._moves += torch.stack(moved)
        if read:
            self._move_on_device(True, rows, step.slots, step.miss)
        self._recent = [(asked, step.slots, self.generation)]
        return step.slots

    def _move_on_device(self, to_cache: bool, rows: torch.Tensor, slots: torch.Tensor,
                        take: torch.Tensor) -> None:
        """Copies shard rows ``rows`` of the slow tier to cache rows ``slots`` (``to_cache``),
        or back, where ``take``: the parameters and every slot, by the GPU (the tier in pinned
        host memory: read and written over the bus)."""
        for key, slow in self.slow.items():
            cache = self.table if key == "parameters" else self.slots[key]
            if to_cache:
                gpu.move_rows(slow, rows, cache, slots, take)
            else:
                gpu.move_rows(cache, slots, slow, rows, take)

    def renew(self, rows: torch.Tensor,
              write: Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor], None]
              ) -> None:
        """Gives distinct shard rows ``rows`` new values and slots (a dynamic table's rows given
        to new ids): ``write(table, slots, at)`` writes them at cache rows ``at`` of the cache's
        table and slots. Their old values are not read; the new ones reach the slow tier when
        they leave the cache."""
        at = self.resolve(rows, count=False, read=False)
        write(self.table, self.slots, at)
        cpu_at = at.cpu() if at.device.type != "cpu" and not self.on_device else at
        self.index.mark(self.index.dirty, cpu_at)
        self.index.mark(self.index.fresh, cpu_at)  # (counted as new by the next lookup)

    def touched(self, slots: torch.Tensor) -> None:
        """Marks cache rows ``slots`` as updated (written back before their eviction)."""
        self.index.mark(self.index.dirty, slots.cpu() if slots.device.type != "cpu"
                        and not self.on_device else slots)

    def _move(self, to_cache: bool, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Copies shard rows ``rows`` of the slow tier to cache rows ``slots`` (``to_cache``), or
        back; the parameters and every slot, whole rows. One pass per array on the CPU kernels
        (``cpu.copy_rows``), else a gather and a scatter. From mapped files, while moves wait
        for the disk, the rows' pages are asked for first (``SLOW_ROW_SECONDS``)."""
        direct = self.backend.fused_cpu
        timed = direct and self.mapped and rows.numel() >= SLOW_ROW_MIN_ROWS
        if direct:
            rows, slots = rows.contiguous(), slots.contiguous()
        if timed and self.read_ahead:
            self._advise(rows)
        start = time.perf_counter()
        self._copy(to_cache, rows, slots)
        if timed:
            self.read_ahead = time.perf_counter() - start > SLOW_ROW_SECONDS * rows.numel()

    def check_files(self, moving: bool = False) -> None:
        """Raises RuntimeError, naming the file, when a slow-tier file was truncated, removed or
        replaced (``SlowFile.check``). Before a step resolves its rows (``moving``) the size always
        (one ``fstat`` per file: 1.2 us), the path at most every ``PATH_CHECK_SECONDS`` (a
        ``stat``: 3 us); else both. Inside ``saving()`` (``ec.save``) a path removed or replaced
        is a warning: the rows are read through the files still open."""
        if not self.files:
            return
        now = time.monotonic()
        path = not moving or now - self._path_checked >= PATH_CHECK_SECONDS
        rescue = _SAVING.get()
        for f in self.files:
            note = f.check(self.members, path, rescue)
            if note is not None:
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        if path:
            self._path_checked = now

    # ---------------------------------------------------------------- the rows' checksums
    def _ready(self) -> None:
        """Before rows move: raises the error of a row that failed its checksum (the engine
        stops there), and sets every row's checksum when they are not all set (``seal``)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if not self.sealed:
            self.seal()

    def seal(self) -> None:
        """Sets every row's checksum from its bytes as they are now: at the first move of rows,
        and after the tier was handed out whole (``drop``: a write through the view is the
        caller's); one pass over the tier, ``SEAL_ROWS`` rows at a time."""
        self._whole(verify=False)
        self.sealed = True

    def _whole(self, verify: bool) -> None:
        """Sets (``verify``: checks) the checksums of every row, from the tier."""
        if self.sums is None:
            return
        slow = list(self.slow.values())
        for a in range(0, self.rows, SEAL_ROWS):
            keys = torch.arange(a, min(a + SEAL_ROWS, self.rows))
            places = self.log.at(keys) if self.log is not None else keys
            bad = self.host.move_summed(slow, places, None, None, keys, self.sums, verify,
                                        self._versions(keys, write=not verify))
            if bad >= 0:
                self._corrupt(int(keys[bad]))

    def _corrupt(self, row: int) -> None:
        """Raises (and keeps raising at every later move) the error of shard row ``row``, whose
        bytes in the tier fail their checksum."""
        f = slow_file(self.slow["parameters"])
        m = bisect.bisect_right(self._bounds, row)
        local = row - (self._bounds[m - 1] if m else 0)
        what = (f"row {self._logical(m, local)} of table {self.members[m]!r}"
                if self._logical is not None else
                f"the row at {local} of table {self.members[m]!r}'s shard on this process (a "
                f"dynamic table's row: it holds one of its ids)")
        self.broken = (
            f"the slow tier's file {f.path if f is not None else '(in memory)'} is corrupt: "
            f"{what} does not match its checksum: its bytes were changed outside the engine (a "
            f"failing disk, or another process writing into the file). Its rows cannot be "
            f"trusted and the engine stops here: restore the tables from the last checkpoint "
            f"(ec.load into a new engine) and train on from there")
        raise RuntimeError(self.broken)

    def _check_read(self, places: torch.Tensor, keys: torch.Tensor) -> None:
        """Checks the rows at ``places`` of the tier (shard rows ``keys``) against their
        checksums (while every row's is set)."""
        if self.sums is None or not self.sealed or keys.numel() == 0:
            return
        bad = self.host.move_summed(list(self.slow.values()), places, None, None, keys,
                                    self.sums, True, self._versions(keys))
        if bad >= 0:
            self._corrupt(int(keys[bad]))

    def _versions(self, keys: torch.Tensor, write: bool = False) -> torch.Tensor | None:
        """(n,) int32: the versions of shard rows ``keys`` (n,) int64, which their checksums are
        keyed to (ops/checksum.py), kept by the index (state/tier/index.py), or None (no
        checksums). ``write``: for checksums about to be set (distinct rows), each advanced by
        one (mod 2**31) first, so that the row's earlier bytes, with the checksum they had, no
        longer match (a lost write)."""
        if self.sums is None:
            return None
        index = self.index
        assert isinstance(index, CacheIndex)  # (a tier with checksums: the index on the CPU)
        return index.versions(keys, advance=write)

    def _advise(self, rows: torch.Tensor) -> None:
        """Asks for the pages of shard rows ``rows`` of every slow-tier file (a record's whole
        stride: the parameters come first in it)."""
        seen = set()
        if self.log is not None:
            rows = self.log.at(rows)
        for slow in self.slow.values():
            mapping = slow.untyped_storage().data_ptr()
            if mapping not in seen:
                seen.add(mapping)
                cpu.will_need(slow, rows)

    def _copy(self, to_cache: bool, rows: torch.Tensor, slots: torch.Tensor) -> None:
        keys = rows  # (the shard rows: the checksums' keys)
        if self.log is not None:  # reads at the rows' places; writes appended
            if not to_cache:
                self.log.append(rows, {self._field_at[key]: (
                    self.table if key == "parameters" else self.slots[key], slots)
                    for key in self.slow}, self.backend, self.sums,
                    self._versions(keys, write=True))
                return
            rows = self.log.at(rows)
        if self.sums is not None:  # moved with their checksums: set, or checked when read
            fast = [self.table if key == "parameters" else self.slots[key] for key in self.slow]
            tier = list(self.slow.values())
            if not to_cache:
                self.backend.move_summed(fast, slots, tier, rows, keys, self.sums, False,
                                         self._versions(keys, write=True))
                return
            bad = self.backend.move_summed(tier, rows, fast, slots, keys, self.sums, True,
                                           self._versions(keys))
            if bad >= 0:
                self._corrupt(int(keys[bad]))
            return
        for key, slow in self.slow.items():
            cache = self.table if key == "parameters" else self.slots[key]
            src, src_rows, dst, dst_rows = ((slow, rows, cache, slots) if to_cache
                                            else (cache, slots, slow, rows))
            self.backend.copy_rows(src, src_rows, dst, dst_rows)

    def _copy_out(self, slots: torch.Tensor, owners: torch.Tensor) -> None:
        self._move(False, owners, slots)
        self._written += owners.numel()

    def _grow(self, needed: int) -> None:
        """Makes room for a step of ``needed`` distinct rows: flush, then a larger cache."""
        grown = min(max(needed, self.capacity + self.capacity // 2), self.rows)
        if not self._grew:
            warnings.warn(f"table {self.name!r}: a step touches {needed} distinct rows but its "
                          f"cache holds {self.capacity}; the cache grows to {grown} rows, beyond "
                          f"memory_budget (a step's rows must be in fast memory). Raise "
                          f"memory_budget or lower the batch size to avoid this.", stacklevel=6)
            self._grew = True
        self.flush()
        self._allocate(grown)

    # ---------------------------------------------------------------- outside the step
    def flush(self) -> None:
        """Writes every updated cache row back; the cache keeps its rows (now clean)."""
        slots = self.index.dirty_slots()
        if slots.numel():
            self._ready()
            self.check_files(moving=True)
            self._checked_whole = False
            if self.on_device:
                self._move_on_device(False, self.index.owner[slots], slots,
                                     torch.ones_like(slots, dtype=torch.bool))
                self._written += slots.numel()
            else:
                self._copy_out(slots, self.index.owner[slots])
            self.index.dirty[slots] = False

    def read(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """(n, C) copies of shard rows ``rows`` (n,) of ``key`` (``"parameters"`` or a slot):
        from the cache where it holds them, else from the slow tier; nothing moves."""
        rows = rows.to(torch.int64).cpu()
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self.check_files()
        slow = self.slow[key]
        cache = self.table if key == "parameters" else self.slots[key]
        where = self.index.where
        at = where[rows.to(where.device)].to(torch.int64).cpu()  # (n,) cache rows, -1: none
        cached = at >= 0
        out = torch.empty((rows.numel(),) + tuple(slow.shape[1:]), dtype=slow.dtype)
        away = rows[~cached]
        places = self.log.at(away) if self.log is not None else away
        self._check_read(places, away)
        out[~cached] = slow[places]
        out[cached] = cache[at[cached].to(cache.device)].cpu()
        return out

    def drop(self, write_back: bool = True) -> None:
        """Empties the cache (after writing updated rows back, unless ``write_back`` is
        False: the slow tier is about to be overwritten); its files are checked first (the
        tier is then handed out whole: ``RowStore.local``). A log is compacted: the first N
        records of ``slow``'s arrays are then the shard's rows in order, until the next step
        writes rows back.

        The tier handed out may be written through the view: the rows' checksums are set again
        at the next move (``seal``). Inside ``saving()`` (``ec.save`` reads the view, writes
        nothing) every row is checked against its checksum instead (once between moves), so
        that a checkpoint never holds a row that fails it."""
        self.check_files()
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if write_back:
            self.flush()
        if self.log is not None:
            self.log.compact(self.host)
        if not _SAVING.get():
            self.sealed = False
        elif not self.sealed:
            self.seal()  # (written through an earlier view: the caller's rows)
        elif not self._checked_whole:
            self._whole(verify=True)
        self._checked_whole = self.sealed
        self._allocate(self.capacity)

    def stats(self) -> dict[str, dict[str, float | int]]:
        """``{member table: {"hits", "misses", "new", "hit_rate"}}`` over the steps so far:
        distinct rows of each lookup found in the cache, read from the slow tier, or given to a
        new id in that step (a dynamic table's: written in the cache, nothing read);
        ``hit_rate`` is hits over all three."""
        out = {}
        for i, name in enumerate(self.members):
            h, m, n = int(self.hits[i]), int(self.misses[i]), int(self.new[i])
            out[name] = {"hits": h, "misses": m, "new": n,
                         "hit_rate": h / (h + m + n) if h + m + n else 0.0}
        return out

    def to(self, device: torch.device, backend: Backend) -> None:
        """Moves the cache (the slow tier stays where it is) to ``device``, whose backend
        says where its index lives."""
        self.flush()
        on_device = (not self.files and self.log is None and self.sums is None
                     and backend.triton)
        self.backend, self.host = backend, backend.host()
        if on_device or self.on_device:  # an index of another kind, or on another device:
            self._read, self._written, self._evictions = (  # a new cache (the rows are all
                self.read_rows, self.written_rows, self.evictions)  # in the tier, flushed)
            self.on_device, self.device = on_device, device
            self._moves = torch.zeros(3, dtype=torch.int64, device=device)
            counts = self.index.counts.to(device)
            self._allocate(self.capacity)
            self.index.counts.copy_(counts)
            return
        self.device = device
        self.table = self.table.to(device)
        self.slots = {k: v.to(device) for k, v in self.slots.items()}
