"""Running the job on several processes (``torchrun --nproc-per-node N train.py ...``).

torchrun sets WORLD_SIZE / RANK / LOCAL_RANK; with them the job joins a process group, shards the
embedding tables across the processes (``--sharding``), gives each process its slice of every
global batch and sums the MLP's gradients across processes, so a step is the single-process step
on the same global batch (up to float summation order and dropout draws). Without torchrun all of
this is a no-op and the job runs on one process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init(device: str, timeout_s: float = 300) -> tuple[int, int, str]:
    """Joins the process group when launched by torchrun; returns (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    use_cuda = device.startswith("cuda")
    if use_cuda:
        device = f"cuda:{one_gpu_each(int(os.environ.get('LOCAL_RANK', '0')))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def one_gpu_each(local_rank: int) -> int:
    """This process's GPU: NCCL, which runs a CUDA job's collectives, needs one GPU per process
    (two on one GPU fail inside NCCL, or hang). More processes on this machine than GPUs is a
    ``SystemExit`` saying so, before any collective."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise SystemExit(f"process {local_rank} of this machine has no GPU of its own (the "
                         f"machine has {count}; NCCL needs one per process): run "
                         f"--nproc-per-node {max(count, 1)} or fewer, or --device cpu (gloo)")
    return local_rank


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def my_share(index: torch.Tensor) -> torch.Tensor:
    """This process's share of a global batch's example indices (every world-th one)."""
    if not active():
        return index
    return index[dist.get_rank()::dist.get_world_size()]


def sum_(*tensors: torch.Tensor) -> None:
    """Sums tensors over the processes, in place (no-op on one process)."""
    if active():
        for t in tensors:
            dist.all_reduce(t)


def sum_grads(module: torch.nn.Module) -> None:
    """Sums the gradients of a data-parallel module over the processes."""
    sum_(*[p.grad for p in module.parameters() if p.grad is not None])


def is_main() -> bool:
    return not active() or dist.get_rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    if active():
        dist.barrier()
        dist.destroy_process_group()
