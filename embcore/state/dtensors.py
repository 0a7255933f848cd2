"""Shards <-> whole tables: the layouts a logical table takes outside the step.

A rank holds each logical table in its plan's native layout: some of its rows, in local order,
and a range of its columns (contiguous row blocks, strided rows for row_mod, column slices, the
whole table, or nothing). ``_held`` is the one function here that reads a layout; the rest is
generic. Outside the step the engine shows a table as:
- whole tables (``embedding_tables``, ``state_dict`` at world size 1): ``gather_whole``;
- checkpoint shards (``state_dict`` when sharded): a ``DTensor`` placed ``Shard(0)`` on the
  communicator's process group, so that rank ``r`` holds chunk ``r`` of the ``(N, C)`` table as
  ``torch.chunk`` cuts it (``ceil(N / W)`` full rows each, the last chunks smaller or empty).
  ``torch.distributed.checkpoint`` saves that and reloads it into any other layout or world size.
  ``to_sharded`` moves the native rows and columns into the chunks with one all_to_all, and
  ``from_value`` moves them back.
Every function here is a collective when the world size is above 1 (collectives through comm.py).
"""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ..base.comm import Communicator
from ..base.compat import shard_chunk
from ..planning.plan import LogicalTable, PhysicalTable

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _held(place: LogicalTable, phys: PhysicalTable, rank: int,
          cols: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """What ``rank`` holds of a logical table's ``(N, cols)`` tensor: (the row ids 0..N-1, in
    its local order; the column range ``(c0, c1)``). The only facts about layouts used here.

    ``phys.columns`` splits the D columns of the parameters and of D-wide slots; a tensor of
    another width (a row-wise slot, one column per row) is held whole wherever its rows are
    (plans never split those by columns).
    """
    rows = place.placement.held_rows(rank)
    c0, c1 = place.placement.columns(rank)
    if cols != phys.dim:
        if (c0, c1) != (0, phys.dim):
            raise ValueError(f"table {place.name!r}: a tensor {cols} columns wide cannot follow "
                             f"a split of its {phys.dim} columns")
        c0, c1 = 0, cols
    return rows, (c0, c1)


@functools.cache
def _dt() -> SimpleNamespace:
    """torch.distributed.tensor, imported on first use (it takes about half a second, more than
    the rest of ``import embcore``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    return SimpleNamespace(DTensor=DTensor, Shard=Shard, DeviceMesh=DeviceMesh)


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    # No DTensor can exist before torch.distributed.tensor is imported.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(value, mod.DTensor)


def _chunks(n: int, world: int) -> list[tuple[int, int]]:
    """Per rank: (first row, rows) of its ``Shard(0)`` chunk of ``n`` rows, as DTensor has it."""
    return [shard_chunk(n, world, r) for r in range(world)]


def _chunk_of(rows: torch.Tensor, chunks: list[tuple[int, int]]) -> torch.Tensor:
    """The rank whose chunk holds each of ``rows``."""
    ends = torch.tensor([s + k for s, k in chunks], dtype=rows.dtype, device=rows.device)
    return torch.bucketize(rows, ends, right=True)  # empty chunks hold nothing


def to_sharded(place: LogicalTable, phys: PhysicalTable, local: torch.Tensor, cols: int,
               comm: Communicator) -> Any:
    """This rank's share of an ``(N, cols)`` table as DCP understands it (a copy): a ``DTensor``
    placed ``Shard(0)`` whose local tensor is this rank's ``torch.chunk`` block of full rows.

    Every rank sends each other rank its column slice of the rows of that rank's chunk it holds
    (one all_to_all); the receiver assembles its full rows. Replicated tables, and any table at
    world size 1, come back as plain tensors (DCP saves them once).
    """
    rank, world = comm.rank, comm.world_size
    if place.placement.held_everywhere:
        return local.clone()
    dev = local.device
    chunks = _chunks(place.rows, world)
    start, size = chunks[rank]
    held = [_held(place, phys, r, cols) for r in range(world)]
    # Send: per destination, my rows in its chunk (in my local order, my columns).
    dest = _chunk_of(held[rank][0].to(dev), chunks)
    counts = torch.bincount(dest, minlength=world).tolist()
    send = list(local[torch.argsort(dest, stable=True)].split(counts))
    # Receive: from each source, its rows in my chunk (in its local order, its columns).
    picks = [rows[(rows >= start) & (rows < start + size)].to(dev) - start for rows, _ in held]
    widths = [c1 - c0 for _, (c0, c1) in held]
    if sum(p.numel() * w for p, w in zip(picks, widths)) != size * cols:
        raise RuntimeError(f"table {place.name!r}: the ranks' shards do not tile the rows "
                           f"{start}..{start + size - 1} of its {cols} columns exactly once")
    got = comm.all_to_all(send, [p.numel() for p in picks], widths)
    block = torch.empty(size, cols, dtype=local.dtype, device=dev)
    for p, (_, (c0, c1)), g in zip(picks, held, got):
        block[p, c0:c1] = g
    dt = _dt()
    mesh = dt.DeviceMesh.from_group(comm.group, dev.type)
    return dt.DTensor.from_local(block, mesh, [dt.Shard(0)], run_check=False,
                                 shape=torch.Size([place.rows, cols]), stride=(cols, 1))


def from_value(place: LogicalTable, phys: PhysicalTable, value: torch.Tensor,
               comm: Communicator) -> torch.Tensor:
    """This rank's native-layout rows from a whole ``(N, C)`` tensor, or from a ``to_sharded``
    DTensor (e.g. filled by ``dcp.load``: then the inverse exchange of ``to_sharded``)."""
    rank, world = comm.rank, comm.world_size
    if not _is_dtensor(value):
        rows, (c0, c1) = _held(place, phys, rank, value.shape[1])
        return value[:, c0:c1][rows.to(value.device)]
    block = value.to_local()
    n, cols = value.shape
    dev = block.device
    chunks = _chunks(n, world)
    start, size = chunks[rank]
    held = [_held(place, phys, r, cols) for r in range(world)]
    # Send: per destination, the rows of my chunk it holds (in its local order, its columns).
    send = []
    for rows, (c0, c1) in held:
        rows = rows.to(dev)
        send.append(block[rows[(rows >= start) & (rows < start + size)] - start, c0:c1])
    # Receive: from each source, my rows in its chunk (in my local order, my columns).
    rows, (c0, c1) = held[rank]
    src = _chunk_of(rows.to(dev), chunks)
    got = comm.all_to_all(send, torch.bincount(src, minlength=world).tolist(), c1 - c0)
    out = torch.empty(rows.numel(), c1 - c0, dtype=block.dtype, device=dev)
    out[torch.argsort(src, stable=True)] = torch.cat(got)
    return out


def gather_whole(place: LogicalTable, phys: PhysicalTable, local: torch.Tensor,
                 comm: Communicator) -> torch.Tensor:
    """The whole ``(N, C)`` logical table from every rank's native-layout rows (a collective)."""
    rank, world = comm.rank, comm.world_size
    if place.placement.held_everywhere:
        return local
    _, (c0, c1) = _held(place, phys, rank, phys.dim)
    cols = phys.dim if local.shape[1] == c1 - c0 else local.shape[1]  # else a row-wise slot
    held = [_held(place, phys, r, cols) for r in range(world)]
    most = max(rows.numel() * (c1 - c0) for rows, (c0, c1) in held)
    flat = torch.zeros(most, dtype=local.dtype, device=local.device)
    flat[:local.numel()] = local.reshape(-1)
    parts = comm.all_gather(flat)
    out = torch.empty(place.rows, cols, dtype=local.dtype, device=local.device)
    for part, (rows, (c0, c1)) in zip(parts, held):
        k = rows.numel()
        out[rows.to(local.device), c0:c1] = part[:k * (c1 - c0)].view(k, c1 - c0)
    return out
