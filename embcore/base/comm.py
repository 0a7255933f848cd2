"""Communication between the processes that hold shards: where embcore issues its collectives.

Every collective of embcore's own (the exchanges of a step, the gathers of whole tables and
checkpoint shards, the agreements of a save) is issued here and nowhere else, each waited on with
a timeout. Other files import ``torch.distributed`` without issuing collectives of their own:
state/dtensors.py for ``DTensor`` (the checkpoint shards), checkpoint.py for
``torch.distributed.checkpoint``, whose ``save`` / ``load`` run their own collectives over the
same group (under the process group's timeout, not this module's).

Two communicators with one interface:
- ``LocalCommunicator``: world size 1; every collective returns its own data. A single process runs
  the same engine code through it.
- ``ProcessGroupCommunicator``: a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).
  Every collective is issued asynchronously and waited on with a timeout, so a process that died
  or stalls makes the others raise ``CollectiveError`` (naming the collective, this rank and the
  timeout) instead of hanging.

What users can rely on (timeouts, ``CollectiveError``): docs/semantics.md section 5.

``ProcessGroupCommunicator.counters`` counts, per collective's ``count`` (a physical table's ids,
rows or gradients; None: anything else), the bytes sent to and received from the other processes
and the host's seconds inside it: sizes the collective knows already, so counting synchronizes
nothing (``Embedding.exchange_stats`` reads them).

Exchanges are of flat chunks: ``all_to_all(chunks)`` sends ``chunks[d]`` to rank ``d`` and returns
what each rank sent here, so ids, rows and gradients of any width travel the same way.
"""

from __future__ import annotations

import math
import numbers
import time
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=5)

# What a collective carries, for ``Communicator.counters``: (the physical table's member tables,
# "ids" | "rows" | "gradients"); None: a collective of no table's exchange ("other").
Count = tuple[tuple[str, ...], str] | None
# Per count: [bytes sent to other processes, bytes received from them, seconds, collectives].
Counters = dict[Count, list[float]]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another process probably died or stalls."""


class Communicator(Protocol):
    rank: int
    world_size: int
    group: Any  # the torch.distributed group (None for the local communicator)
    # a sharded step's compressed exchange (step/exchange.py); None: rows and gradients exact
    codec: Any  # the exchange's codec (step/codec.py ExchangeCodec), or None: exact
    counters: Counters  # what its collectives carried and took (none when W = 1)

    def all_to_all(self, chunks: list[torch.Tensor], recv_rows: list[int] | None = None,
                   recv_cols: list[int] | int | None = None,
                   count: Count = None) -> list[torch.Tensor]: ...

    def all_reduce_sum(self, tensor: torch.Tensor, count: Count = None) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def shared_seed(comm: Communicator, device: torch.device) -> int:
    """One draw from torch's global RNG, rank 0's on every process (a collective when W > 1):
    ``torch.manual_seed`` before an engine's construction fixes its tables, whatever the world
    size and plan."""
    return from_rank0(comm, [int(torch.randint(0, 2**62, (1,), dtype=torch.int64))], device)[0]


# Small agreements between processes (each one collective when W > 1, none at W = 1).
def from_rank0(comm: Communicator, values: list[int], device: torch.device) -> list[int]:
    """Process 0's int64 ``values`` on every process."""
    if comm.world_size == 1:
        return list(values)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    return [int(v) for v in comm.all_gather(mine)[0].cpu()]


def summed(comm: Communicator, values: list[int], device: torch.device) -> list[int]:
    """The int64 ``values`` summed over every process."""
    if comm.world_size == 1:
        return list(values)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    return [int(v) for v in torch.stack(comm.all_gather(mine)).sum(0).cpu()]


def everywhere(comm: Communicator, ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every process."""
    if comm.world_size == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int64, device=device)
    return all(bool(f.item()) for f in comm.all_gather(flag))


class LocalCommunicator:
    """World size 1: every collective is the identity."""

    rank = 0
    world_size = 1
    group: Any = None
    codec: Any = None  # (one process exchanges nothing)

    def __init__(self) -> None:
        self.counters: Counters = {}  # (stays empty)

    def all_to_all(self, chunks: list[torch.Tensor], recv_rows: list[int] | None = None,
                   recv_cols: list[int] | int | None = None,
                   count: Count = None) -> list[torch.Tensor]:
        return list(chunks)

    def all_reduce_sum(self, tensor: torch.Tensor, count: Count = None) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def __repr__(self) -> str:
        return "LocalCommunicator(world_size=1)"


class ProcessGroupCommunicator:
    """Collectives over a ``torch.distributed`` group, each waited on with ``timeout``."""

    def __init__(self, group: Any, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        self.backend = dist.get_backend(group)
        self._checkpoint_group: Any = None
        self.codec: Any = None  # step/codec.py ExchangeCodec (set by the engine), or None
        self.counters: Counters = {}

    def _count(self, count: Count, sent: int, received: int, start: float,
               calls: int = 1) -> None:
        """Adds ``calls`` collectives to ``counters`` (bytes to and from the other processes;
        the seconds since ``start``, on the host)."""
        c = self.counters.get(count)
        if c is None:
            c = self.counters[count] = [0, 0, 0.0, 0]
        c[0] += sent
        c[1] += received
        c[2] += time.perf_counter() - start
        c[3] += calls

    def checkpoint_group(self) -> Any:
        """A gloo group of the same processes whose collectives time out after ``timeout``, for
        ``torch.distributed.checkpoint`` (which issues its own collectives on the group it is
        given): a process that dies or stalls inside ``ec.save`` / ``ec.load`` then makes the
        others fail within the timeout instead of the default group's (30 minutes). Created on
        first use, by every process of the group (``ec.save`` / ``ec.load`` are collectives)."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(
                ranks=dist.get_process_group_ranks(self.group), timeout=self.timeout,
                backend="gloo", use_local_synchronization=True)
        return self._checkpoint_group

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except Exception as e:  # every backend failure becomes one clear error
            raise CollectiveError(
                f"embcore: {what} failed on rank {self.rank} of {self.world_size} "
                f"(timeout {self.timeout.total_seconds():.0f}s): another process probably died "
                f"or stalls. Cause: {type(e).__name__}: {str(e)[:300]}") from e
        if ok is False:
            raise CollectiveError(f"embcore: {what} timed out after "
                                  f"{self.timeout.total_seconds():.0f}s on rank {self.rank}")

    def all_to_all(self, chunks: list[torch.Tensor], recv_rows: list[int] | None = None,
                   recv_cols: list[int] | int | None = None,
                   count: Count = None) -> list[torch.Tensor]:
        """Sends ``chunks[d]`` (rows x cols, any cols) to rank d; returns the chunks received.

        Args:
            chunks: W tensors of one dtype, each 1-D or 2-D.
            recv_rows: rows to expect from each rank; None exchanges the counts first.
            recv_cols: columns of what each rank sends here (int: the same for all); default the
                width of this rank's own chunks.
            count: what ``counters`` counts it as (the counts' exchange included).
        """
        begin = time.perf_counter()
        assert len(chunks) == self.world_size
        ref = chunks[0]
        cols = ref.shape[1] if ref.dim() == 2 else 1
        if recv_cols is None:
            recv_cols = cols
        rc = [recv_cols] * self.world_size if isinstance(recv_cols, int) else list(recv_cols)
        if recv_rows is None:
            sent = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64,
                                device=ref.device)  # NCCL exchanges device tensors only
            got = torch.empty_like(sent)
            self._wait(dist.all_to_all_single(got, sent, group=self.group, async_op=True),
                       "all_to_all (counts)")
            recv_rows = got.tolist()
            counts_bytes = 8 * (self.world_size - 1)  # (int64 counts, to and from each other)
        else:
            counts_bytes = 0
        send = torch.cat([c.reshape(-1) for c in chunks])
        if send.element_size() == 1 and send.is_floating_point():  # 8-bit floats: as bytes
            send = send.view(torch.uint8)  # (the backends have no 8-bit float type)
        in_splits = [c.numel() for c in chunks]
        out_splits = [r * c for r, c in zip(recv_rows, rc)]
        recv = torch.empty(sum(out_splits), dtype=send.dtype, device=send.device)
        self._wait(dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group,
                                          async_op=True), "all_to_all")
        if recv.dtype != ref.dtype:
            recv = recv.view(ref.dtype)
        out, start = [], 0
        for r, c, n in zip(recv_rows, rc, out_splits):
            piece = recv[start:start + n]
            out.append(piece.view(r, c) if ref.dim() == 2 else piece)
            start += n
        size, me = send.element_size(), self.rank
        self._count(count, counts_bytes + size * (sum(in_splits) - in_splits[me]),
                    counts_bytes + size * (sum(out_splits) - out_splits[me]), begin,
                    2 if counts_bytes else 1)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor, count: Count = None) -> torch.Tensor:
        """Sums ``tensor`` over every process, in place (``counters``: its bytes once each way,
        whatever the backend's algorithm moves)."""
        start = time.perf_counter()
        self._wait(dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                   "all_reduce")
        nbytes = tensor.numel() * tensor.element_size()
        self._count(count, nbytes, nbytes, start)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gathers equally shaped tensors from every rank."""
        start = time.perf_counter()
        if tensor.element_size() == 1 and tensor.is_floating_point():  # 8-bit floats: as bytes
            return [t.view(tensor.dtype) for t in self.all_gather(tensor.view(torch.uint8))]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._wait(dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True),
                   "all_gather")
        nbytes = tensor.numel() * tensor.element_size()
        self._count(None, nbytes * (self.world_size - 1), nbytes * (self.world_size - 1), start)
        return out

    def __repr__(self) -> str:
        return (f"ProcessGroupCommunicator(rank={self.rank}, world_size={self.world_size}, "
                f"backend={self.backend}, timeout={self.timeout.total_seconds():.0f}s)")


def make_communicator(process_group: Any, timeout: timedelta | float | None = None
                      ) -> LocalCommunicator | ProcessGroupCommunicator:
    """The communicator for ``process_group`` (None: the default group when one is initialized).

    Args:
        process_group: a ``torch.distributed`` group, or None.
        timeout: seconds (or a timedelta) every collective may take before raising
            ``CollectiveError``; default 5 minutes.

    Raises:
        TypeError: ``timeout`` is neither a real number nor a timedelta.
        ValueError: ``timeout`` is not a finite number of seconds > 0.
    """
    timeout = _as_timeout(timeout)
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalCommunicator()
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return LocalCommunicator()
    return ProcessGroupCommunicator(group, timeout)


def _as_timeout(timeout: timedelta | float | None) -> timedelta:
    """``timeout`` as a positive timedelta (None: ``DEFAULT_TIMEOUT``)."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be a number of seconds or a datetime.timedelta, got "
                        f"{type(timeout).__name__} {timeout!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return timeout if isinstance(timeout, timedelta) else timedelta(seconds=seconds)
