"""Communication between the processes that hold shards: the only file importing torch.distributed.

A single process is world size 1 of the same path: ``LocalCommunicator`` answers every collective
with its own data. The process-group communicator (ids to their owners, rows back, gradients to the
owners, all_reduce for replicated tables) plugs in here.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class LocalCommunicator:
    """World size 1: every collective is the identity."""

    rank = 0
    world_size = 1
    timeout = timedelta(minutes=5)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over processes (here: the tensor itself)."""
        return tensor

    def __repr__(self) -> str:
        return "LocalCommunicator(world_size=1)"


def make_communicator(process_group: object | None) -> LocalCommunicator:
    """The communicator for ``process_group`` (None: the default group if one is initialized).

    Raises:
        NotImplementedError: for world sizes above 1, until sharding lands.
    """
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalCommunicator()
    size = dist.get_world_size(process_group) if dist.is_available() else 1
    if size == 1:
        return LocalCommunicator()
    raise NotImplementedError(f"a process group of world size {size} was given, but sharding "
                              f"across processes is not implemented yet")
