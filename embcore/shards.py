"""Shards <-> whole tables: the layouts a logical table takes outside the step.

A rank holds each logical table in its plan's native layout (contiguous row blocks, strided rows
for row_mod, column slices, the whole table, or nothing). Outside the step the engine shows it as:
- whole tables (``embedding_tables``, ``state_dict`` at world size 1): ``gather_whole``;
- checkpoint shards (``state_dict`` when sharded): a ``ShardedTensor`` whose shards are contiguous
  blocks of the ``(N, C)`` table, which ``torch.distributed.checkpoint`` saves and reloads into any
  other layout. Row blocks, column slices and whole tables are already contiguous; row_mod rows are
  first moved into the row_div block layout (``to_blocks`` / ``from_blocks``).
Every function here is a collective when the world size is above 1 (collectives through comm.py).
"""

from __future__ import annotations

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from .comm import Communicator
from .plan import PhysicalTable, TablePlacement, split_sizes


def _block_owner(rel: torch.Tensor, n: int, world: int) -> torch.Tensor:
    q, rem = divmod(n, world)
    boundary = rem * (q + 1)
    return torch.where(rel < boundary, torch.div(rel, q + 1, rounding_mode="floor"),
                       rem + torch.div(rel - boundary, max(q, 1), rounding_mode="floor"))


def _exchange_rows(comm: Communicator, rel: torch.Tensor, values: torch.Tensor,
                   dest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sends each row (id ``rel``, ``values``) to rank ``dest``; returns the rows received."""
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=comm.world_size).tolist()
    ids = comm.all_to_all(list(rel[order].split(counts)))
    vals = comm.all_to_all(list(values[order].split(counts)), [t.numel() for t in ids],
                           values.shape[1])
    return torch.cat(ids), torch.cat(vals)


def to_blocks(place: TablePlacement, local: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """row_mod rows of this rank -> this rank's contiguous row_div block (ascending rows)."""
    rel = place.rank_rows(comm.rank, comm.world_size).to(local.device)
    got_rel, got = _exchange_rows(comm, rel, local, _block_owner(rel, place.rows,
                                                                   comm.world_size))
    start = sum(split_sizes(place.rows, comm.world_size)[:comm.rank])
    out = torch.empty_like(got)
    out[got_rel - start] = got
    return out


def from_blocks(place: TablePlacement, block: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Inverse of ``to_blocks``: a row_div block -> this rank's row_mod rows (local order)."""
    sizes = split_sizes(place.rows, comm.world_size)
    start = sum(sizes[:comm.rank])
    rel = torch.arange(start, start + sizes[comm.rank], device=block.device)
    got_rel, got = _exchange_rows(comm, rel, block, rel % comm.world_size)
    out = torch.empty_like(got)
    out[torch.div(got_rel, comm.world_size, rounding_mode="floor")] = got
    return out


def _blocks(place: TablePlacement, phys: PhysicalTable, cols: int,
            world: int) -> list[tuple[int, int, int, int] | None]:
    """Per rank: (row0, rows, col0, cols) of the contiguous block it writes, or None."""
    out: list[tuple[int, int, int, int] | None] = []
    sizes = split_sizes(place.rows, world)
    for r in range(world):
        if place.strategy == "table":
            out.append((0, place.rows, 0, cols) if r == place.owner else None)
        elif place.strategy == "column":
            c0, c1 = phys.columns[r]
            out.append((0, place.rows, c0, c1 - c0))
        else:  # row_div, and row_mod once moved to blocks
            out.append((sum(sizes[:r]), sizes[r], 0, cols) if sizes[r] else None)
    return out


def to_sharded(place: TablePlacement, phys: PhysicalTable, local: torch.Tensor, cols: int,
               comm: Communicator) -> ShardedTensor | torch.Tensor:
    """This rank's share of an ``(N, cols)`` table as DCP understands it (a copy).

    Replicated tables come back as plain tensors (DCP saves them once).
    """
    if place.strategy == "replicated":
        return local.clone()
    data = to_blocks(place, local, comm) if place.strategy == "row_mod" else local.clone()
    blocks = _blocks(place, phys, cols, comm.world_size)
    metas = [ShardMetadata([b[0], b[2]], [b[1], b[3]], f"rank:{r}/{local.device}")
             for r, b in enumerate(blocks) if b is not None]
    mine = blocks[comm.rank]
    shards = [Shard(data, metas[[m.placement.rank() for m in metas].index(comm.rank)])
              ] if mine is not None and data.numel() else []
    props = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    meta = ShardedTensorMetadata(metas, torch.Size([place.rows, cols]), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, meta, process_group=getattr(comm, "group", None))


def from_value(place: TablePlacement, phys: PhysicalTable, value: torch.Tensor,
               comm: Communicator) -> torch.Tensor:
    """This rank's native-layout rows from a whole ``(N, C)`` tensor or a ``to_sharded`` value."""
    rank, world = comm.rank, comm.world_size
    if isinstance(value, ShardedTensor):
        local = value.local_shards()
        block = local[0].tensor if local else torch.empty(0, value.size(1), dtype=value.dtype)
        if place.strategy == "row_mod":
            return from_blocks(place, block, comm)
        return block
    if place.strategy == "column":
        c0, c1 = phys.columns[rank]
        return value[:, c0:c1]
    return value[place.rank_rows(rank, world).to(value.device)]


def gather_whole(place: TablePlacement, phys: PhysicalTable, local: torch.Tensor,
                 comm: Communicator) -> torch.Tensor:
    """The whole ``(N, C)`` logical table from every rank's native-layout rows (a collective)."""
    world = comm.world_size
    if world == 1 or place.strategy == "replicated":
        return local
    if place.strategy == "column":
        width = max(c1 - c0 for c0, c1 in phys.columns)
        padded = torch.zeros(place.rows, width, dtype=local.dtype, device=local.device)
        padded[:, :local.shape[1]] = local
        parts = comm.all_gather(padded)
        return torch.cat([p[:, :c1 - c0] for p, (c0, c1) in zip(parts, phys.columns)], dim=1)
    most = max(place.local_rows)
    padded = torch.zeros(most, local.shape[1], dtype=local.dtype, device=local.device)
    padded[:local.shape[0]] = local
    parts = comm.all_gather(padded)
    out = torch.empty(place.rows, local.shape[1], dtype=local.dtype, device=local.device)
    for r, part in enumerate(parts):
        rows = place.rank_rows(r, world).to(local.device)
        out[rows] = part[:rows.numel()]
    return out
