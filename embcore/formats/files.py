"""Small file-system steps that the checkpoint, publish and slow-tier code share, each written
once: a durable write (a file written and fsynced, its directory synced, an atomic rename), the
CRC-32 of bytes and tensors, an exclusive ``flock``, the kind of a file that is not a regular
one (for errors), telling whether a writer's process still runs, and a name suffix every process
agrees on."""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import stat
import types
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from ..base.comm import Communicator, from_rank0

fcntl: types.ModuleType | None
try:
    fcntl = importlib.import_module("fcntl")
except ImportError:  # (not a POSIX system: no locks)
    fcntl = None


# ------------------------------------------------------------------------------ durable writes
@contextlib.contextmanager
def synced_file(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """``open(path, mode)`` (text: UTF-8), whose content is flushed and fsynced when the block
    ends without an error (on an error the file is closed as it is)."""
    with open(path, mode, encoding=None if "b" in mode else "utf-8") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def complete_dir(directory: Path, name: str, text: str) -> None:
    """Writes the last file of ``directory``, ``name`` (``text``, UTF-8; a manifest), fsynced,
    then syncs the directory's entries: it is whole on disk, ready to be renamed into place."""
    with synced_file(directory / name, "w") as f:
        f.write(text)
    fsync_dir(directory)


def rename_synced(src: Path, dst: Path) -> None:
    """Renames ``src`` to ``dst`` (atomic: a reader finds the one or the other) and syncs
    ``dst``'s directory, so that the new name outlives a crash."""
    os.rename(src, dst)
    fsync_dir(dst.parent)


def fsync_dir(p: Path) -> None:
    """Makes ``p``'s entries (names created, renamed, removed) durable; a no-op where
    directories cannot be opened (Windows) or synced."""
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is that is not a regular file, for an error message
    (``"a FIFO"``, ``"a directory"``, ...)."""
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (another user's counts; when it cannot be
    told, it is taken to run: what it left is kept)."""
    try:
        os.kill(pid, 0)  # signal 0: does the process exist?
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def agreed_token(comm: Communicator, device: torch.device) -> str:
    """``<pid>-<random hex>`` of process 0, the same on every process (a temporary's name: the
    pid lets a later writer tell a dead writer's leftovers)."""
    pid, rand = from_rank0(comm, [os.getpid(), secrets.randbits(62)], device)
    return f"{pid}-{rand:016x}"


# ------------------------------------------------------------------------------------- CRC-32
def crc32(data: Any) -> int:
    """zlib's CRC-32 of ``data`` (bytes, or anything that exposes its bytes: a ``memoryview``,
    a numpy array); 0 for no bytes. Every checksum of the publish and checkpoint formats is
    this one."""
    return zlib.crc32(data)


def crc(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (row-major)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    return crc32(flat.view(torch.uint8).numpy().data)


# -------------------------------------------------------------------------------------- locks
def lock_exclusive(fd: int, *, strict: bool = False) -> bool:
    """``flock(fd, LOCK_EX | LOCK_NB)``: an exclusive, advisory lock on ``fd``'s file, taken
    without waiting, held until the descriptor is closed (or the process ends, even by
    ``kill -9``: the kernel drops it).

    Args:
        fd: an open descriptor of the file (or directory) to lock.
        strict: whether a file system that refuses the lock (NFS without locks: ENOLCK,
            EOPNOTSUPP) raises its ``OSError``; False: it returns False.

    Returns:
        True: held. False: there are no such locks here (not a POSIX system; without
        ``strict``, a file system without them).

    Raises:
        BlockingIOError: another descriptor holds it.
        OSError: with ``strict``, the file system refused the lock.
    """
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError:
        if strict:
            raise
        return False
    return True
