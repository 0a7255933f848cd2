"""The compressed exchange's cost and bytes: a sharded step at W processes (gloo on this machine),
per format, the median step time and the bytes each rank's row and gradient exchanges carry.

    python benchmarks/studies/exchange.py                       # W 2, every format
    python benchmarks/studies/exchange.py --world 2 --formats fp32 --steps 40

Workload (W1-like, smaller): 8 tables x 100,000 rows x D 64, row_mod, one id per feature drawn
from Zipf(1.05), a batch of 2048 per process, Adagrad. Each process runs warm-up steps, then
``--steps`` timed ones (enqueue, dequeue, apply_gradients); rank 0 prints one JSON line per
format: the median step in ms and the bytes this rank sent in its row and gradient exchanges
a step (the encoded payloads; ids and counts excluded), from the codec's widths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import embcore as ec  # noqa: E402
from embcore import capacity  # noqa: E402

TABLES, ROWS, DIM, BATCH = 8, 100_000, 64, 2048


def zipf_ids(g: torch.Generator, n: int, rows: int) -> torch.Tensor:
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    p = ranks.pow(-1.05)
    return torch.multinomial(p / p.sum(), n, replacement=True, generator=g)


def worker(rank: int, world: int, port: int, formats: list[str], steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    tables = [ec.TableConfig(vocabulary_size=ROWS, dim=DIM, name=f"t{i}") for i in range(TABLES)]
    fc = {f"f{i}": ec.FeatureConfig(table=t) for i, t in enumerate(tables)}
    g = torch.Generator().manual_seed(rank)
    batches = [{k: zipf_ids(g, BATCH, ROWS) for k in fc} for _ in range(4)]
    for name in formats:
        torch.manual_seed(0)
        kw = {} if name == "fp32" else {"exchange_compression": name}  # (fp32: as before it)
        emb = ec.Embedding(fc, ec.Adagrad(0.05), sharding="row_mod", **kw)
        times = capacity.timed_steps(emb, batches, steps)
        sent = 0  # bytes of rows and gradients this rank sends a step (the first batch's)
        wire = {"fp32": 4 * DIM, "bf16": 2 * DIM, "fp16": 2 * DIM + 4, "fp8": DIM + 4}[name]
        for ids in batches[0].values():
            unique = ids.unique()
            asked_elsewhere = int((unique % world != rank).sum())  # row_mod owners
            sent += 2 * asked_elsewhere * wire  # its gradients out, (about) as many rows out
        if rank == 0:
            print(json.dumps({"world": world, "format": name,
                              "step_ms": round(1e3 * statistics.median(times), 2),
                              "bytes_sent_per_step": sent}), flush=True)
        del emb
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--formats", nargs="+", default=["fp32", "bf16", "fp16", "fp8"])
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args.formats, args.steps), nprocs=args.world)


if __name__ == "__main__":
    main()
