"""The writer's side of the publish directory (formats/published.py describes the format):
part files written and checksummed, an entry committed (its manifest written and synced, its
temporary directory renamed into place), the entries past retention and a dead writer's
temporaries removed, and the writer lock that keeps one trainer per directory. ``ec.publish``
(online.py) calls these; readers never do."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch

from .files import complete_dir, crc, kind_of, lock_exclusive, pid_alive, rename_synced, synced_file
from .published import (
    LOCK,
    MANIFEST,
    Entry,
    PublishError,
    entries,
    entry_name,
    manifest_text,
)

PART_BYTES = 256 << 20  # a part file holds at most about this many bytes of tensors
_TMP = re.compile(r"^\.tmp-(\d{8})-(\d+)-([0-9a-f]+)$")  # a temporary: .tmp-<seq>-<pid>-<hex>


# ------------------------------------------------------------------------------- part files
class _Sink:
    """A file ``torch.save`` writes to, which keeps the OSError of a failed write (torch
    reports it as a RuntimeError of its own)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, b: Any) -> int:
        try:
            return int(self.f.write(b))
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _os_error(e: BaseException) -> OSError | None:
    """The OSError a RuntimeError of ``torch.save`` stands for: one in its causes, or, where its
    message says so, a full disk; None when it says nothing of the kind."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen:
        if isinstance(at, OSError) and at.errno is not None:
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    if "No space left on device" in str(e):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def write_part(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Writes a part file (fsynced) and returns its tensors' checksums.

    Raises:
        OSError: a write failed (a full disk: errno ENOSPC), naming the file; torch's own
            error, when it stood for one, is chained.
    """
    sums = {k: crc(v) for k, v in tensors.items()}
    with synced_file(path) as f:
        sink = _Sink(f)
        try:
            torch.save(dict(tensors), cast(IO[bytes], sink))
        except (RuntimeError, OSError) as e:
            cause = sink.error or _os_error(e)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from e
    return sums


def parts(tables: Iterable[Iterator[dict[str, torch.Tensor]]]
          ) -> Iterator[dict[str, torch.Tensor]]:
    """Groups tensors into part files of about ``PART_BYTES``: ``tables`` yields, per table, its
    chunks (``{key: tensor}`` of some rows, cut to ``PART_BYTES`` by the caller); a part holds
    whole chunks, and a table's next chunk (the same keys) starts a new part."""
    part: dict[str, torch.Tensor] = {}
    size = 0
    for chunks in tables:
        for chunk in chunks:
            n = sum(v.nbytes for v in chunk.values())
            if part and (size + n > PART_BYTES or any(k in part for k in chunk)):
                yield part
                part, size = {}, 0
            part.update(chunk)
            size += n
    if part:
        yield part


def part_name(rank: int, i: int) -> str:
    return f"r{rank:05d}-{i:04d}.pt"


# ------------------------------------------------------------------------------------ commit
def temporary(directory: Path, seq: int, token: str) -> Path:
    """The temporary directory an entry is written in (``token``: the same on every process,
    starting with the writer's pid)."""
    return directory / f".tmp-{seq:08d}-{token}"


def new_id() -> str:
    return secrets.token_hex(8)


def commit(tmp: Path, directory: Path, manifest: Mapping[str, Any]) -> Entry:
    """Makes the written temporary directory ``tmp`` an entry: writes its manifest, syncs, and
    renames it into place (atomic). Raises FileExistsError: the entry exists (another writer)."""
    complete_dir(tmp, MANIFEST, manifest_text(manifest))
    final = directory / entry_name(manifest["seq"], manifest["kind"])
    if any(e.seq == manifest["seq"] for e in entries(directory)):
        raise FileExistsError(f"{directory} already holds an entry {manifest['seq']}: another "
                              f"writer publishes to this directory")
    rename_synced(tmp, final)
    return Entry(manifest["seq"], manifest["kind"], final)


# --------------------------------------------------------------------------------- retention
def remove_stale(directory: Path) -> None:
    """Removes temporaries of writers that died on this machine (what a killed publish
    leaves)."""
    for name in os.listdir(directory) if directory.is_dir() else ():
        m = _TMP.match(name)
        if m is not None and not pid_alive(int(m.group(2))):
            shutil.rmtree(directory / name, ignore_errors=True)


def retain(directory: Path, snapshots: int) -> list[Path]:
    """Removes entries older than the ``snapshots``-th newest snapshot (a reader behind them
    starts over from a newer snapshot); returns what it removed."""
    found = entries(directory)
    kept = [e for e in found if e.kind == "snapshot"][-snapshots:]
    if not kept:
        return []
    removed = []
    for e in found:
        if e.seq >= kept[0].seq:
            break
        # rename first, so that a reader never lists a half-removed entry as complete
        trash = directory / f".tmp-{e.seq:08d}-{os.getpid()}-{secrets.token_hex(4)}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(e.path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(e.path)
    return removed


# ------------------------------------------------------------------------------------- lock
class WriterLock:
    """The directory's writer lock: one trainer at a time publishes to a directory.

    ``flock`` on ``<directory>/.writer.lock``, held until ``release`` (or the process ends,
    even by ``kill -9``: the kernel drops it). The file is opened without following a symbolic
    link and must be a regular file (a link could make the trainer truncate whatever it names).
    Where ``flock`` is unavailable the sequence check of ``commit`` still refuses a second
    writer's entry.

    Raises:
        RuntimeError: another process holds the lock.
        PublishError: the lock is a symbolic link, a FIFO, a directory, ...
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK
        self._fd: int | None = None
        flags = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        refused = (f"{self.path} is {{}}; a publish directory's writer lock must be a regular "
                   f"file: remove it and publish again")
        if not hasattr(os, "O_NOFOLLOW") and os.path.islink(self.path):
            raise PublishError(refused.format("a symbolic link"))
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError:
            if os.path.islink(self.path):
                raise PublishError(refused.format("a symbolic link")) from None
            raise
        try:  # (closed again on any failure: a lock never outlives a failed publish)
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise PublishError(refused.format(kind_of(mode)))
            try:
                lock_exclusive(fd, strict=True)  # (a file system without locks: its error)
            except BlockingIOError:
                who = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
                raise RuntimeError(f"another trainer publishes to {directory} "
                                   f"({who or 'another process'}); one directory takes one "
                                   f"trainer's entries") from None
            with contextlib.suppress(OSError):  # (who holds it, for a second trainer's error;
                os.ftruncate(fd, 0)             # a full disk does not stop the lock)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                              f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __del__(self) -> None:  # (a trainer dropped: its lock goes with it)
        with contextlib.suppress(Exception):
            self.release()
