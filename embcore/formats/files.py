"""Small file-system steps that the checkpoint, publish and slow-tier code share: syncing a
directory's entries, telling whether a writer's process still runs, and a name suffix every
process agrees on."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch

from ..base.comm import Communicator, from_rank0


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
