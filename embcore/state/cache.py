"""Tables beyond memory: a shard kept in a slow tier, its hot rows in a write-back cache.

A physical table the plan offloads (``memory_budget``, docs/semantics.md section 10) keeps its
shard's rows and optimizer slots in the **slow tier**: files under ``offload_dir`` mapped into
memory (``MAP_SHARED``: page cache, not the process's anonymous memory) on the CPU, pinned host
memory when the tables live on a GPU. The **cache** holds ``capacity`` of those rows, each with
its slots, in fast memory, laid out like an in-memory shard of ``capacity`` rows, so the step's
lookup and fused update run on it unchanged.

The cache's index (``CacheIndex``, state/cache_index.py) holds the cache row of every shard row:
a step's distinct rows are resolved by one index step, which admits the missing ones and, when
the cache is full, evicts the least recently used rows that this step does not use (ties: the
lower cache row), and an eighth of the cache more at once (``SPARE_SHARE``; at most
``SPARE_STEPS`` times the step's rows), so that the next
steps admit into free rows without scanning. Before a cache row is given to a new shard row,
its old row is written back to the slow tier if it was updated since it was read (write-back);
then the new row is read whole, with its slots (a static table's records on the CPU may be
written as a log instead of in place, slow_log.py: ``slow_writes`` decides, ``CachedRows.log``
holds the places). Rows move whole, values unchanged, so a run
with a cache computes exactly what a run without one computes: the cache decides where a row
is, never what it holds.

A step whose distinct rows outnumber the cache grows the cache to hold them (with a warning):
the step's working set must be in fast memory. A cache on the CPU is faulted in when it is made
(``populate``: all of its pages resident from then on, within the budget), not page by page by
the steps that fill it.

The slow tier's files are private, and their faults become errors: each is created mode 0600
and locked, its disk reserved (``reserve``: a disk too small is an OSError ``ENOSPC`` when the
tier is built, naming the directory and the bytes, not a SIGBUS at the first write into a page
the disk cannot back), and checked before rows move (``SlowFile``: a file truncated, removed or
replaced by another process is a RuntimeError naming it; only a truncation by a process that
ignores the lock, between a check and the accesses after it, can still fault).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import errno
import importlib
import os
import re
import socket
import tempfile
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..formats.files import pid_alive
from ..kernels import cpu, gpu
from ..ops.backend import TORCH_OPS, Backend
from ..ops.checksum import move_summed
from ..ops.memory import advise_random, empty_table, populate
from .cache_index import MAX_CAPACITY, CacheIndex
from .device_cache_index import DeviceCacheIndex
from .slow_log import RecordLog, places_for

fcntl: types.ModuleType | None
try:
    fcntl = importlib.import_module("fcntl")
except ImportError:  # (not a POSIX system: no locks)
    fcntl = None

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

# Inside ``saving()``: the tier is handed out to ``ec.save``, which reads it and writes nothing
_SAVING: contextvars.ContextVar[bool] = contextvars.ContextVar("embcore_saving", default=False)


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """The tiers handed out inside it are read by a checkpoint's save (``ec.save``): every row
    is checked against its checksum, and a file whose path was removed or replaced is a warning,
    not an error: its rows are read through the file still open (docs/semantics.md, tables
    beyond memory)."""
    token = _SAVING.set(True)
    try:
        yield
    finally:
        _SAVING.reset(token)


class SlowFile:
    """A slow-tier file held open while its mapping lives: its descriptor, locked (``flock``
    ``LOCK_EX``: an embcore process, or any tool that takes the lock, cannot take it while this one
    runs), the path and inode it was created as, and the bytes mapped.

    The mapping faults (``SIGBUS``, the process dies without a Python error) when it touches a
    page past the file's end: ``check`` raises instead when the file was truncated, or its path
    removed or given another file, since it was created. ``CachedRows`` checks its files before
    it moves rows to or from them (a step's moves, a flush), reads them, or hands the tier out
    (``drop``, before ``RowStore.local``): ``CachedRows.check_files``.

    What it cannot do: the lock is advisory, so a process that ignores it can still truncate the
    file; a truncation between a check and the accesses that follow it (the same step) still
    faults. That cannot be turned into a Python error: a ``SIGBUS`` from a page fault is
    synchronous, and a Python signal handler only runs after the C handler returns, which makes
    the faulting access run again (and fault again) before any Python code can run; only a C
    handler that jumps out of the faulting copy could recover, unsafe inside torch's and the
    kernels' threads. ``faulthandler.enable()`` at least prints the Python stack on the way out.
    A file truncated and extended again to its size (``cp x file`` onto it, for one) reads
    zeros where the rows were: no fault, and only caught when a check falls between the two.
    """

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path, self.nbytes = Path(path), nbytes
        flags = (os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NOFOLLOW", 0))
        fd = os.open(self.path, flags, 0o600)  # private: the owner's alone, whatever umask
        try:
            _flock(fd)
            self.reserved = reserve(fd, nbytes, self.path)
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            _unlink(self.path)
            raise
        self.fd, self.device, self.inode = fd, st.st_dev, st.st_ino
        self._finalizer = weakref.finalize(self, os.close, fd)

    def map(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The file mapped shared, ``numel`` elements of ``dtype`` (its ``nbytes``): through the
        descriptor held (``/proc/self/fd``), so the mapping is this file whatever its path holds
        since; where that is not available, through the path, checked against the inode."""
        via = f"/proc/self/fd/{self.fd}"
        if not os.path.exists(via):
            via = str(self.path)
        t = torch.from_file(via, shared=True, size=numel, dtype=dtype)
        self.check()
        return t

    def check(self, tables: Sequence[str] = (), path: bool = True, rescue: bool = False
              ) -> str | None:
        """Raises unless the file still holds its bytes and (``path``) its path still names it.
        ``rescue`` (``ec.save``, which reads the rows through the open file): a path removed or
        replaced is returned, as what to warn of, not raised.

        Raises:
            RuntimeError: the file was truncated, or its path removed or replaced (naming the
                file, and the ``tables`` it holds).
        """
        st = os.fstat(self.fd)
        of = (f" (table {tables[0]!r})" if len(tables) == 1 else
              f" (tables {list(tables)})" if tables else "")
        if st.st_size < self.nbytes:
            raise RuntimeError(
                f"the slow tier's file {self.path}{of} was truncated to {st.st_size} bytes while "
                f"the engine ran; it must hold {self.nbytes} bytes: rows past its end are lost "
                f"(the engine stops here rather than die of SIGBUS). Nothing may write, truncate "
                f"or replace the files under offload_dir while an engine uses them")
        if not path:
            return None
        try:
            at = os.stat(self.path)
        except FileNotFoundError:
            if rescue:
                return (f"the slow tier's file {self.path}{of} was removed while the engine ran: "
                        f"its rows are saved from the file still open. Load the checkpoint into "
                        f"a new engine; this one stops at its next step")
            raise RuntimeError(
                f"the slow tier's file {self.path}{of} was removed while the engine ran (its "
                f"rows are still in the open file, no longer under offload_dir: ec.save still "
                f"saves them, to load into a new engine). Nothing may write, truncate, remove "
                f"or replace the files under offload_dir while an engine uses them") from None
        if (at.st_dev, at.st_ino) != (self.device, self.inode):
            if rescue:
                return (f"the slow tier's file {self.path}{of} was replaced by another file while "
                        f"the engine ran: its rows are saved from the file it created, still "
                        f"open. Load the checkpoint into a new engine; this one stops at its "
                        f"next step")
            raise RuntimeError(
                f"the slow tier's file {self.path}{of} was replaced by another file while the "
                f"engine ran (its rows are in the file it created, no longer at that path: "
                f"ec.save still saves them, to load into a new engine). "
                f"Nothing may write, truncate, remove or replace the files under offload_dir "
                f"while an engine uses them")
        return None

    def close(self) -> None:
        """Closes the descriptor (its lock goes; a mapping stays valid)."""
        self._finalizer()


def _flock(fd: int) -> bool:
    """``flock(fd, LOCK_EX | LOCK_NB)``; False where the file system has no such locks (NFS
    without them, for one). Raises BlockingIOError: another holds it."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError:  # (ENOLCK, EOPNOTSUPP, EBADF: no locks there; they are advisory anyway)
        return False
    return True


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged process may still write under ``directory`` (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _unwritten_bytes(directory: Path, but: Path) -> int:
    """Bytes of the slow-tier files under ``directory`` (but ``but``) that have no disk yet."""
    total = 0
    for f in directory.glob("*.bin"):
        if f == but:
            continue
        try:
            st = os.stat(f)
        except OSError:
            continue
        total += max(0, st.st_size - st.st_blocks * 512)
    return total


def reserve(fd: int, nbytes: int, path: Path) -> str:
    """Gives the new, empty file ``fd`` (at ``path``) ``nbytes`` bytes that read as zeros, their
    disk reserved, so that no later write into its mapping can fault for want of space.

    ``os.posix_fallocate``: blocks reserved, no data written (a dynamic table's parameters stay
    unwritten: they read as zeros until rows are admitted; glibc itself writes a byte per block
    where the file system has no ``fallocate``, e.g. NFSv3). Where ``os.posix_fallocate`` is
    missing (macOS) or the file system refuses it (``EOPNOTSUPP``, ``EINVAL``, ``ENOSYS``: ZFS on
    FreeBSD, for one), the fallback is a check of free space (``os.statvfs``), not zeros
    written (that would write every byte of every table once more at construction): the file is
    extended sparse if the disk has room for it and for the bytes of the directory's other
    files not yet written; that is a check, not a reservation (a disk that others fill later
    can still fault). Copy-on-write file systems (btrfs, ZFS) may need new blocks for writes
    into reserved ones: ``fallocate`` cannot guarantee them.

    Returns:
        ``"reserved"``, or ``"checked"`` (the fallback).

    Raises:
        OSError: errno ``ENOSPC`` (or ``EDQUOT``: a quota) when the disk cannot hold the file,
            naming the file, its directory, the bytes needed and the bytes free when known;
            other errnos (``EFBIG``: beyond the file system's largest file) naming the file.
    """
    fallocate = getattr(os, "posix_fallocate", None)
    how = "reserved"
    error: OSError | None = None
    if fallocate is not None and nbytes > 0:
        try:
            fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOSYS", -1),
                           getattr(errno, "ENOTSUP", -1)):
                how = "checked"
            else:
                error = e
    else:
        how = "checked"
    directory = path.parent
    if error is not None:
        if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            os.ftruncate(fd, 0)  # (what it reserved before failing goes back)
            free = _free_bytes(directory)
            raise OSError(error.errno, _no_space(path, nbytes, 0, free)) from error
        raise OSError(error.errno, f"cannot reserve {nbytes} bytes for the slow tier's file "
                                   f"{path}: {error.strerror}") from error
    if how == "checked":
        free = _free_bytes(directory)
        others = _unwritten_bytes(directory, path)
        if free is not None and nbytes + others > free:
            raise OSError(errno.ENOSPC, _no_space(path, nbytes, others, free))
    os.ftruncate(fd, nbytes)  # (the size posix_fallocate set already, or a sparse file)
    return how


def _no_space(path: Path, nbytes: int, others: int, free: int | None) -> str:
    also = (f" (and {others} bytes the directory's other slow-tier files have not written "
            f"yet)" if others else "")
    there = f"{free} bytes are free there" if free is not None else "free bytes unknown"
    return (f"no space for the slow tier under {path.parent}: its file {path.name} needs {nbytes} "
            f"bytes{also}, {there}. offload_dir must hold the offloaded tables' rows and slots: "
            f"give it a larger disk, or the engine a larger memory_budget (fewer rows offloaded)")


# slow-tier tensors carry their file as this attribute (``CachedRows`` checks it)
FILE_ATTR = "_embcore_slow_file"


def slow_file(t: torch.Tensor) -> SlowFile | None:
    """The file under a tensor ``slow_tensor`` or ``slow_records`` returned, if any."""
    return getattr(t, FILE_ATTR, None)


# a slow-tier tensor's file may carry its rows' checksums after its rows (``slow_tensor``'s
# ``sums``): this attribute holds them, an (N,) int32 view of the file (ops/checksum.py)
SUMS_ATTR = "_embcore_slow_sums"
SUMS_ALIGN = 4096  # bytes: the checksums start on a page of their own


def slow_sums(t: torch.Tensor) -> torch.Tensor | None:
    """The rows' checksums in the file under a ``slow_tensor`` / ``slow_records`` tensor, if
    it has them."""
    return getattr(t, SUMS_ATTR, None)


def slow_tensor(path: Path | None, shape: tuple[int, ...], dtype: torch.dtype,
                pin: bool = False, sums: int = 0) -> torch.Tensor:
    """An uninitialized CPU tensor in the slow tier: a file mapped shared (``path``), or pinned
    host memory (``path`` None and ``pin``), or plain host memory.

    The file is new (an existing ``path`` is an error), mode 0600, locked and its disk reserved
    (``SlowFile``, ``reserve``): it reads as zeros. When the disk cannot hold it, nothing is left:
    the file is removed, and so is its ``OffloadDir`` with the files made before it. With
    ``sums`` (a file only), the file holds ``sums`` int32 checksums after the tensor's bytes
    (from the next multiple of ``SUMS_ALIGN``), the tensor's ``slow_sums``.

    Raises:
        OSError: errno ``ENOSPC`` / ``EDQUOT``, the disk too small (``reserve``), or another
            error creating the file.
    """
    if path is None:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    numel = 1
    for s in shape:
        numel *= s
    size = max(numel, 1)
    at = -(-size * dtype.itemsize // SUMS_ALIGN) * SUMS_ALIGN  # (the checksums' first byte)
    try:
        f = SlowFile(Path(path), at + 4 * sums if sums else size * dtype.itemsize)
    except OSError:
        owner = _DIRS.get(str(Path(path).parent))
        if owner is not None:  # (a construction that fails leaves nothing behind)
            owner.remove()
        raise
    if not sums:
        t = f.map(size, dtype)
    else:  # (the file as bytes: the tensor's, then the checksums')
        whole = f.map(at + 4 * sums, torch.uint8)
        t = whole[:size * dtype.itemsize].view(dtype)
    advise_random(t)
    out = t[:numel].view(shape)
    setattr(out, FILE_ATTR, f)
    if sums:
        setattr(out, SUMS_ATTR, whole[at:].view(torch.int32))
    return out


RECORD_ALIGN = 64  # bytes: a slow-tier record's size is a multiple of this

WRITES_ENV = "EMBCORE_SLOW_WRITES"  # "auto" (the default), "log" or "in-place"


def slow_writes(record_bytes: int) -> str:
    """How the CPU slow tiers of a process's static tables, ``record_bytes`` of records in all,
    write rows back: ``"log"`` (appended, slow_log.py) or ``"in-place"`` (each row over its
    record).

    Written in place, rows dirty pages of the page cache that later writes dirty again: while
    the kernel lets all of the files' pages stay dirty (``dirty_limit``), nothing waits for the
    disk, and that is the fastest. Beyond it, the kernel writes the dirty pages back as they
    come and the process waits for the disk, a 4 KiB page for each row: a log then writes
    whole pages in order, 4x less time a step under full-size W2's misses (RESULTS.md). So by
    default (``"auto"``): a log when the records exceed ``dirty_limit()``, else in place. The
    environment variable ``EMBCORE_SLOW_WRITES`` (``auto``, ``log`` or ``in-place``, read when
    an engine is built) overrides it: both compute the same values.

    Raises:
        ValueError: the variable holds another value.
    """
    how = os.environ.get(WRITES_ENV, "auto") or "auto"
    if how not in ("auto", "log", "in-place"):
        raise ValueError(f"{WRITES_ENV}={how!r}: must be 'auto' (the default), 'log' or "
                         f"'in-place'")
    if how != "auto":
        return how
    limit = dirty_limit()
    return "log" if limit is not None and record_bytes > limit else "in-place"


def dirty_limit() -> int | None:
    """Bytes of dirty file pages beyond which Linux writes them back while processes run
    (``vm.dirty_background_bytes``, else ``vm.dirty_background_ratio`` percent of the memory
    available); None where that is not known (not Linux)."""
    try:
        fixed = int(Path("/proc/sys/vm/dirty_background_bytes").read_text())
        if fixed > 0:
            return fixed
        ratio = int(Path("/proc/sys/vm/dirty_background_ratio").read_text())
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 * ratio // 100
    except (OSError, ValueError):
        return None
    return None


def record_layout(fields: Sequence[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """``(offsets, record)``: each field's byte offset in a ``slow_records`` record (aligned to
    its dtype) and the record's bytes (padded to ``RECORD_ALIGN``)."""
    offsets, at = [], 0
    for dtype, width in fields:
        at = -(-at // dtype.itemsize) * dtype.itemsize
        offsets.append(at)
        at += width * dtype.itemsize
    return offsets, max(-(-at // RECORD_ALIGN) * RECORD_ALIGN, RECORD_ALIGN)


def slow_records(path: Path, rows: int, fields: Sequence[tuple[torch.dtype, int]],
                 places: int | None = None) -> list[torch.Tensor]:
    """One mapped file (sparse until written) of ``rows`` records (``places``: that many), each
    holding one row of every field ``(dtype, width)`` side by side (aligned to its dtype; a
    record padded to ``RECORD_ALIGN`` bytes); returns each field's ``(rows, width)`` view, rows
    ``record`` bytes apart. A row of a table and its slots are then one record: moving it reads
    or dirties one or two pages of the file, not one or two per array (a page fault reads, and a
    dirtied page writes, 4 KiB: a file per array doubled both). ``records(views)`` gives the
    file's ``(places, record)`` bytes and each view's offset in a record."""
    offsets, record = record_layout(fields)
    raw = slow_tensor(path, (rows if places is None else places, record), torch.uint8,
                      sums=rows)
    views = [raw[:, o:o + w * d.itemsize].view(d) for o, (d, w) in zip(offsets, fields)]
    for v in views:
        setattr(v, FILE_ATTR, slow_file(raw))
        setattr(v, SUMS_ATTR, slow_sums(raw))
        setattr(v, RECORDS_ATTR, (raw, v.data_ptr() - raw.data_ptr()))
    return views


RECORDS_ATTR = "_embcore_records"  # a ``slow_records`` view's (records, offset)


def records(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """``(raw, offsets)``: the ``(places, record)`` uint8 records under the ``slow_records``
    views ``views`` and each view's byte offset in a record."""
    raw = getattr(views[0], RECORDS_ATTR)[0]
    return raw, [getattr(v, RECORDS_ATTR)[1] for v in views]


def slow_log(path: Path, rows: int, fields: Sequence[tuple[torch.dtype, int]]
             ) -> tuple[list[torch.Tensor], RecordLog]:
    """``slow_records`` written as a log (slow_log.py): a file of ``places_for(rows)`` records,
    the views over all of them, and the ``RecordLog`` of their places (compact: row ``r`` at
    place ``r``, where the caller initializes it)."""
    places, segment = places_for(rows)
    views = slow_records(path, rows, fields, places)
    raw, _ = records(views)
    f = slow_file(raw)
    return views, RecordLog(raw, f.fd if f is not None else None, rows, segment)


class OffloadDir:
    """The directory of an engine's slow-tier files, ``embcore-offload-<host>-p<pid>-r<rank>-*``
    under ``offload_dir`` (default: the system's temporary directory), mode 0700, its files 0600.
    The files and the directory are removed when the engine is collected or at exit; those that a
    killed process of this host left behind are removed when the next one starts (its pid no
    longer runs).

    The directory is locked while the engine lives (``flock`` ``LOCK_EX`` on it, and on each of
    its files, ``SlowFile``): another engine's sweep leaves it alone even when its pid looks dead
    (a process of another pid namespace on a shared disk), and so does ``systemd-tmpfiles``'
    cleaning of old files in ``/tmp``. A construction that fails for want of disk removes the
    directory at once (``slow_tensor``)."""

    def __init__(self, offload_dir: str | os.PathLike | None, rank: int) -> None:
        base = Path(offload_dir) if offload_dir is not None else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())
        self._sweep(base, host)
        self.path = Path(tempfile.mkdtemp(prefix=f"embcore-offload-{host}-p{os.getpid()}-r{rank}-",
                                          dir=base))
        self.files: list[Path] = []
        self._lock = [_lock_dir(self.path)]  # (the directory's descriptor, or None)
        self._finalizer = weakref.finalize(self, OffloadDir._remove, self.path, self.files,
                                           self._lock)
        _DIRS[str(self.path)] = self

    @staticmethod
    def check(offload_dir: object) -> None:
        """Raises unless ``offload_dir`` is None or a path that is (or can become) a directory.

        Raises:
            TypeError: not a path. ValueError: an empty path (not a directory name: it would
                put the files in the working directory), or an existing file.
        """
        if offload_dir is None:
            return
        if not isinstance(offload_dir, (str, os.PathLike)):
            raise TypeError(f"offload_dir must be a path or None, got "
                            f"{type(offload_dir).__name__}")
        if os.fspath(offload_dir) in ("", b""):
            raise ValueError("offload_dir='' is not a directory name; give a directory, or None "
                             "for the system's temporary directory")
        if os.path.exists(offload_dir) and not os.path.isdir(offload_dir):
            raise ValueError(f"offload_dir={str(offload_dir)!r} exists and is not a directory")

    @staticmethod
    def _sweep(base: Path, host: str) -> None:
        """Removes the slow-tier directories of dead processes of this host under ``base``
        (not one whose lock is held: its process lives, whatever its pid says)."""
        pattern = re.compile(rf"embcore-offload-{re.escape(host)}-p(\d+)-r\d+-")
        for entry in base.iterdir():
            m = pattern.match(entry.name)
            if m is None or not entry.is_dir() or pid_alive(int(m.group(1))):
                continue
            try:
                held = _lock_dir(entry)
            except BlockingIOError:  # in use
                continue
            for f in entry.glob("*.bin"):
                _unlink(f)
            try:
                entry.rmdir()
            except OSError:
                pass
            if held is not None:
                os.close(held)

    def file(self, name: str) -> Path:
        path = self.path / name
        self.files.append(path)
        return path

    def remove(self) -> None:
        """Removes the files and the directory now (the mappings of those made stay valid)."""
        self._finalizer()

    @staticmethod
    def _remove(path: Path, files: list[Path], lock: list[int | None]) -> None:
        for f in files:
            _unlink(f)
        try:
            path.rmdir()
        except OSError:
            pass
        if lock[0] is not None:
            os.close(lock[0])
            lock[0] = None


# the live OffloadDirs by path (a failed slow_tensor removes its directory)
_DIRS: weakref.WeakValueDictionary[str, OffloadDir] = weakref.WeakValueDictionary()


def _lock_dir(path: Path) -> int | None:
    """A descriptor of directory ``path`` holding ``flock`` ``LOCK_EX`` on it (None: it cannot be
    opened or locked there; the lock is advisory). Raises BlockingIOError: another holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if _flock(fd):
            return fd
    except BlockingIOError:
        os.close(fd)
        raise
    os.close(fd)
    return None


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
            else CacheIndex(self.rows, capacity, self._bounds))
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
        self._copy(to_cache, rows, slots, direct)
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
            bad = move_summed(slow, places, None, None, keys, self.sums, verify,
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
        bad = move_summed(list(self.slow.values()), places, None, None, keys, self.sums, True,
                          self._versions(keys))
        if bad >= 0:
            self._corrupt(int(keys[bad]))

    def _versions(self, keys: torch.Tensor, write: bool = False) -> torch.Tensor | None:
        """(n,) int32: the versions of shard rows ``keys`` (n,) int64, which their checksums are
        keyed to (ops/checksum.py), kept by the index (state/cache_index.py), or None (no
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

    def _copy(self, to_cache: bool, rows: torch.Tensor, slots: torch.Tensor,
              direct: bool) -> None:
        keys = rows  # (the shard rows: the checksums' keys)
        if self.log is not None:  # reads at the rows' places; writes appended
            if not to_cache:
                self.log.append(rows, {self._field_at[key]: (
                    self.table if key == "parameters" else self.slots[key], slots)
                    for key in self.slow}, self.sums, self._versions(keys, write=True))
                return
            rows = self.log.at(rows)
        if self.sums is not None:  # moved with their checksums: set, or checked when read
            fast = [self.table if key == "parameters" else self.slots[key] for key in self.slow]
            tier = list(self.slow.values())
            if not to_cache:
                move_summed(fast, slots, tier, rows, keys, self.sums, False,
                            self._versions(keys, write=True))
                return
            bad = move_summed(tier, rows, fast, slots, keys, self.sums, True, self._versions(keys))
            if bad >= 0:
                self._corrupt(int(keys[bad]))
            return
        for key, slow in self.slow.items():
            cache = self.table if key == "parameters" else self.slots[key]
            src, src_rows, dst, dst_rows = ((slow, rows, cache, slots) if to_cache
                                            else (cache, slots, slow, rows))
            if direct:
                cpu.copy_rows(src, src_rows, dst, dst_rows)
            else:
                dst.index_copy_(0, dst_rows.to(dst.device),
                                src.index_select(0, src_rows.to(src.device)).to(dst.device))

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
            self.log.compact()
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
        self.backend = backend
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
