"""Per-process memory and step throughput of a sharded engine at W = 1, 2 and 4 (gloo, CPU).

    python benchmarks/studies/sharded_memory.py [--quick] [--workloads W1 W2] [--worlds 1 2 4]

Each world size runs in fresh processes (torch.multiprocessing, gloo on 127.0.0.1). Every process
enqueues its own batch of the workload's per-process batch size, so W processes train on W times
the examples of one. Printed per run: the plan's parameter + slot bytes held by each process, the
peak RSS of the busiest process, and examples/s over all processes. On one machine the processes
share its cores: throughput at W > 1 shows the cost of the exchanges, not a cluster's speed-up.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import embcore as ec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # workloads.py
from workloads import get_workload, make_batches  # noqa: E402

STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _features(wl, batch) -> dict[str, torch.Tensor]:
    if wl.bag == 1:  # dense (B,) ids
        return {f"f{t}": ids for t, ids in enumerate(batch.ids)}
    return {f"f{t}": torch.nested.nested_tensor_from_jagged(ids, batch.offsets)
            for t, ids in enumerate(batch.ids)}


def _worker(rank: int, world: int, port: int, name: str, quick: bool, sharding: str,
            out: mp.Queue) -> None:
    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(minutes=10))
    wl = get_workload(name, quick)
    tables = [ec.TableConfig(vocabulary_size=wl.rows, dim=wl.dim, combiner=wl.combiner,
                             name=f"t{i}") for i in range(wl.tables)]
    fc = {f"f{i}": ec.FeatureConfig(table=t) for i, t in enumerate(tables)}
    torch.manual_seed(0)
    emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.01), sharding=sharding if world > 1 else None)
    emb.build()
    held = emb.plan.bytes_per_rank()[rank]
    batches = [_features(wl, b) for b in make_batches(wl, (STEPS + 2) * world)[rank::world]]
    grads = {k: torch.ones(wl.batch, wl.dim) for k in fc}

    def step(b):
        emb.enqueue(b)
        emb.dequeue()
        emb.apply_gradients(grads)

    for b in batches[:2]:
        step(b)
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    for b in batches[2:]:
        step(b)
    seconds = (time.perf_counter() - start) / STEPS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.put((rank, held, rss, seconds))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def run(name: str, world: int, quick: bool, sharding: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, name, quick, sharding, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    wl = get_workload(name, quick)
    seconds = max(r[3] for r in results)
    return {"held_mb": max(r[1] for r in results) / 2**20,
            "rss_mb": max(r[2] for r in results) / 2**20,
            "ex_s": world * wl.batch / seconds, "ms": seconds * 1e3}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller tables (see workloads.py)")
    ap.add_argument("--workloads", nargs="+", default=["W1", "W2"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--sharding", default="row_mod")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, embcore {ec.__version__}, {os.cpu_count()} cores, "
          f"sharding={args.sharding}, quick={args.quick}")
    print("| workload | W | tables+slots MB per process | peak RSS MB per process | "
          "ms/step | examples/s (all processes) |")
    print("|---|---|---|---|---|---|")
    for name in args.workloads:
        for world in args.worlds:
            r = run(name, world, args.quick, args.sharding)
            print(f"| {name} | {world} | {r['held_mb']:.0f} | {r['rss_mb']:.0f} | {r['ms']:.1f} | "
                  f"{r['ex_s']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
