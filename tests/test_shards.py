"""state/dtensors.py on W = 3 processes (the default group) and W = 2 (a subgroup of two of them), gloo
on CPU, every strategy, without an engine.

For each logical tensor (parameters, and a row-wise slot one column wide where the strategy can
hold one) the native rows of a known whole table go through ``to_sharded`` (a DTensor placed
``Shard(0)`` whose local block is exactly DTensor's own chunk of the table), ``dcp.save``,
``dcp.load`` into the DTensors of every strategy, and ``from_value``: each process must get back
exactly its native rows. Tables with fewer rows than processes leave some chunks empty. A last
pass reverses every process's local row order (through ``shards._held``, the one function there
that reads layouts), as a layout whose local rows are not ascending would have them.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_on

import embcore as ec
from embcore.base.comm import make_communicator
from embcore.planning.placement import STRATEGIES as PLACEMENTS
from embcore.planning.plan import STRATEGIES, make_plan
from embcore.state import dtensors as shards
from embcore.state.dtensors import from_value, gather_whole, to_sharded


def tables(world: int) -> list[tuple[str, int, int]]:
    """(name, rows, dim): one table larger than W, two with fewer rows than W (empty chunks)."""
    return [("big", 11, 5), ("few", world - 1, 3), ("one", 1, 4)]


def whole(key: str, rows: int, cols: int) -> torch.Tensor:
    """A distinct, exactly representable value per cell (the same on every process)."""
    salt = sum(map(ord, key))
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 1000 * salt


def entries(plan) -> list[tuple[str, object, object, int]]:
    """(key, placement, physical table, width) of every tensor a table of ``plan`` holds."""
    out = []
    for place in plan.tables:
        phys = plan.physical[place.physical]
        out.append((f"{place.name}/parameters", place, phys, place.dim))
        if place.strategy != "column":  # a column split cannot hold a row-wise slot
            out.append((f"{place.name}/rowwise", place, phys, 1))
    return out


def native(place, phys, w: torch.Tensor, rank: int, world: int,
           reverse: bool = False) -> torch.Tensor:
    """What ``rank`` holds of the whole ``w`` in the plan's layout (written out directly)."""
    c0, c1 = phys.columns[rank] if w.shape[1] == place.dim else (0, w.shape[1])
    rows = place.held_rows(rank)
    return w[rows.flip(0) if reverse else rows][:, c0:c1]


def _reversed_held(real):
    def held(place, phys, rank, cols):
        rows, columns = real(place, phys, rank, cols)
        return rows.flip(0), columns
    return held


def _check(comm, root, reverse=False):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    rank, world = comm.rank, comm.world_size
    spec = [(n, ec.TableConfig(vocabulary_size=v, dim=d, name=n), None)
            for n, v, d in tables(world)]
    # (A replicated table is the whole table, in order, whatever _held says.)
    strategies = [s for s in STRATEGIES if not (reverse and s == "replicated")
                  and PLACEMENTS[s].row_ids]  # (a dynamic table's "hash": test_dynamic.py)
    plans = {s: make_plan(spec, world, s) for s in strategies}
    saved = {}
    for s, plan in plans.items():
        state = {}
        for key, place, phys, width in entries(plan):
            w = whole(key, place.rows, width)
            local = from_value(place, phys, w, comm)
            assert torch.equal(local, native(place, phys, w, rank, world, reverse)), (s, key)
            assert torch.equal(gather_whole(place, phys, local, comm), w), (s, key)
            value = to_sharded(place, phys, local, width, comm)
            if s == "replicated":
                assert type(value) is torch.Tensor and torch.equal(value, w), (s, key)
            else:
                assert isinstance(value, DTensor) and value.placements == (Shard(0),), (s, key)
                assert tuple(value.shape) == (place.rows, width), (s, key)
                shape, offset = compute_local_shape_and_global_offset(
                    value.shape, value.device_mesh, value.placements)
                block = value.to_local()
                assert tuple(block.shape) == tuple(shape), (s, key, block.shape, shape)
                assert torch.equal(block, w[offset[0]:offset[0] + shape[0]]), (s, key)
                assert torch.equal(from_value(place, phys, value, comm), local), (s, key)
            state[key] = value
        dcp.save(state, checkpoint_id=f"{root}/W{world}{reverse}-{s}",
                 process_group=comm.group)
        saved[s] = set(state)
    dist.barrier(group=comm.group)
    # Every checkpoint into every strategy's to_sharded values (as ec.load fills state_dict()).
    for src in strategies:
        for s, plan in plans.items():
            fresh, want = {}, {}
            for key, place, phys, width in entries(plan):
                if key not in saved[src]:
                    continue
                w = whole(key, place.rows, width)
                want[key] = (place, phys, native(place, phys, w, rank, world, reverse))
                junk = torch.full_like(want[key][2], -1.0)
                fresh[key] = to_sharded(place, phys, junk, width, comm)
            dcp.load(fresh, checkpoint_id=f"{root}/W{world}{reverse}-{src}",
                     process_group=comm.group)
            for key, (place, phys, expect) in want.items():
                got = from_value(place, phys, fresh[key], comm)
                assert torch.equal(got, expect), (src, s, key, got, expect)


def _worker(rank, world, init, root):
    import torch.distributed as dist
    init()
    pair = dist.new_group([0, 1])  # every process takes part in creating it
    _check(make_communicator(None), root)  # W = 3, the default group
    if rank < 2:
        _check(make_communicator(pair), root)  # W = 2, a subgroup
    shards._held = _reversed_held(shards._held)  # this process only (spawned)
    _check(make_communicator(None), root, reverse=True)
    dist.barrier()


@pytest.mark.slow
def test_to_sharded_dcp_from_value_round_trip(tmp_path):
    run_on(3, _worker, str(tmp_path))
