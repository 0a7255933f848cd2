"""Running a test body on W processes (gloo on CPU) from pytest; the id of a process that ended."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    fn(rank, world, lambda timeout=60: dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=timeout)), *args)
    if dist.is_initialized():
        dist.barrier()  # processes leaving at different times can abort gloo's shutdown
        dist.destroy_process_group()
    # The body has passed. Leave without the interpreter's shutdown: with the machine busy, gloo's
    # teardown at exit sometimes aborts ("terminate called without an active exception", SIGABRT,
    # with no Python frame left) once the other process has gone, failing a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Runs ``fn(rank, world, init, *args)`` in ``world`` spawned processes; ``init()`` joins the
    gloo group (call it after any single-process reference work). Raises if any process raises."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def exited_pid() -> int:
    """The id of a process that has ended (a child that printed it and left)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)
