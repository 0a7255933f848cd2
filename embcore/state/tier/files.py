"""The slow tier's files: mapped, private, locked, reserved and checked.

The slow tier's files are private, and their faults become errors: each is created mode 0600
and locked, its disk reserved (``reserve``: a disk too small is an OSError ``ENOSPC`` when the
tier is built, naming the directory and the bytes, not a SIGBUS at the first write into a page
the disk cannot back), and checked before rows move (``SlowFile``: a file truncated, removed or
replaced by another process is a RuntimeError naming it; only a truncation by a process that
ignores the lock, between a check and the accesses after it, can still fault).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import re
import socket
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ...formats.files import lock_exclusive, pid_alive
from ...ops.memory import advise_random
from .log import RecordLog, places_for

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
            lock_exclusive(fd)
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
    write rows back: ``"log"`` (appended, log.py) or ``"in-place"`` (each row over its
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
    """``slow_records`` written as a log (log.py): a file of ``places_for(rows)`` records,
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
        if lock_exclusive(fd):
            return fd
    except BlockingIOError:
        os.close(fd)
        raise
    os.close(fd)
    return None
