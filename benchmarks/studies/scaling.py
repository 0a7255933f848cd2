"""Measured scaling on this machine (gloo), and the capacity model's check against it.

    python benchmarks/studies/scaling.py                    # W 1, 2, 4; both workloads
    python benchmarks/studies/scaling.py --worlds 1,2 --workloads w1 --steps 6

Workloads (weak scaling: each process keeps its batch; ids from Zipf(1.05), fixed seeds; Adagrad;
``sharding="auto"``):
- ``w1``: W1's tables (26 x 100,000 rows x D 64, one id per feature, sum), a batch of 2048 a
  process;
- ``dlrm``: DLRM-like: 26 tables of the Criteo cardinalities (examples/criteo/spec.json) capped
  at 100,000 rows, D 128, one id per feature, a batch of 2048 a process.
Each process runs 3 warm-up steps and ``--steps`` timed ones (enqueue, dequeue, apply_gradients,
one thread a process), for the exchange in fp32 and in fp8 (both directions). One JSON line per
run: the median step (ms, the slowest process's), the seconds a step spends inside the
exchange's collectives (``Embedding.exchange_stats``: the slowest process's), and the bytes a
process sends and receives a step (the most loaded process's).

The model (embcore/capacity.py) then projects each run from the same spec, with the compute
rates of ``--rates`` (default: the shipped ones), each scaled by the processes sharing this
machine's cores (W / cores when W > cores), a profile of the workload's batches (ec.profile),
and this machine's loopback network as gloo sees it (measured here: an 8-byte and an 8 MiB
all_to_all at W = 2), and prints measured / projected side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import embcore as ec
from embcore import capacity
from tests.distributed import free_port

BATCH = 2048
CRITEO = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
          14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def features(workload: str) -> dict[str, ec.FeatureConfig]:
    if workload == "w1":
        sizes, dim = [100_000] * 26, 64
    else:
        sizes, dim = [min(n, 100_000) for n in CRITEO], 128
    return {f"f{i}": ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=n, dim=dim,
                                                           combiner="sum", name=f"t{i}"))
            for i, n in enumerate(sizes)}


def batches(workload: str, rank: int, count: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        b = {}
        for k, f in features(workload).items():
            n = f.table.vocabulary_size
            p = torch.arange(1, n + 1, dtype=torch.float64).pow(-1.05)
            b[k] = torch.multinomial(p / p.sum(), BATCH, replacement=True, generator=g)
        out.append(b)
    return out


def worker(rank: int, world: int, port: int, workload: str, formats: list[str], steps: int,
           out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=300))
    mine = batches(workload, rank)
    lines = []
    for name in formats if world > 1 else ["fp32"]:
        torch.manual_seed(0)
        emb = ec.Embedding(features(workload), ec.Adagrad(0.05), exchange_compression=name)
        took = capacity.timed_steps(emb, mine, steps, stats=True)
        stats = emb.exchange_stats()
        kinds = ("ids", "rows", "gradients")
        sent = sum(v[f"{k}_sent"] for v in stats.values() for k in kinds) / steps
        got = sum(v[f"{k}_received"] for v in stats.values() for k in kinds) / steps
        calls = sum(v["collectives"] for v in stats.values()) / steps
        secs = sum(v["seconds"] for v in stats.values()) / steps
        mine_row = torch.tensor([statistics.median(took), secs, sent, got, calls],
                                dtype=torch.float64)
        rows = [mine_row]
        if world > 1:
            gathered = [torch.empty(5, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(gathered, mine_row)
            rows = gathered
        top = torch.stack(rows).max(0).values
        lines.append({"workload": workload, "world": world, "format": name,
                      "step_ms": 1e3 * float(top[0]), "exchange_ms": 1e3 * float(top[1]),
                      "sent": int(top[2]), "received": int(top[3]),
                      "collectives": float(top[4])})
        del emb
    if rank == 0:
        with open(out, "a") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _loopback(rank: int, world: int, port: int, out: str) -> None:
    """gloo's loopback between 2 processes: an 8-byte all_to_all's time (latency) and an 8 MiB
    one's (bandwidth)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    res = {}
    for size in (1, 1 << 20):  # float64 values per peer
        x = torch.ones(size * world, dtype=torch.float64)
        y = torch.empty_like(x)
        took = []
        for _ in range(12):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(y, x)
            took.append(time.perf_counter() - start)
        res[size] = statistics.median(took[2:])
    if rank == 0:
        per_peer = (1 << 20) * 8
        bandwidth = per_peer / max(res[1 << 20] - res[1], 1e-9)
        Path(out).write_text(json.dumps({"latency": res[1], "bandwidth": bandwidth}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--workloads", default="w1,dlrm")
    ap.add_argument("--formats", default="fp32,fp8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rates", default=None)
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    formats = args.formats.split(",")
    cores = os.cpu_count() or 1
    print(f"# torch {torch.__version__}, {cores} CPU cores, gloo, one thread a process")
    tmp = tempfile.mkdtemp()
    net_file = os.path.join(tmp, "net.json")
    mp.spawn(_loopback, args=(2, free_port(), net_file), nprocs=2, join=True)
    net = json.loads(Path(net_file).read_text())
    network = capacity.Network(net["bandwidth"], net["latency"])
    print(f"# loopback (gloo, 2 processes): {network.bandwidth / 1e9:.2f} GB/s, latency "
          f"{network.latency * 1e6:.0f} us")
    out = os.path.join(tmp, "runs.jsonl")
    for workload in args.workloads.split(","):
        for w in worlds:
            mp.spawn(worker, args=(w, free_port(), workload, formats, args.steps, out),
                     nprocs=w, join=True)
    rates = capacity.Rates.load(args.rates) if args.rates else capacity.DEFAULT_RATES
    print(f"# model rates: {rates}")
    print(f"{'workload':<8} {'W':>2} {'format':<6} {'step ms':>15} {'exchange ms':>15} "
          f"{'sent KiB':>15} {'recv KiB':>15}   (measured / model)")
    for line in Path(out).read_text().splitlines():
        m = json.loads(line)
        profile = ec.profile(batches(m["workload"], 0), features(m["workload"]))
        spec = ec.EmbeddingSpec(features(m["workload"]), ec.Adagrad(0.05),
                                exchange_compression=m["format"])
        share = max(1.0, m["world"] / cores)  # processes sharing this machine's cores
        scaled = dataclasses.replace(rates, lookup=rates.lookup * share,
                                     update=rates.update * share, table=rates.table * share)
        (p,) = capacity.project(spec, [m["world"]], network, batch=BATCH, rates=scaled,
                                profile=profile)
        print(f"{m['workload']:<8} {m['world']:>2} {m['format']:<6} "
              f"{m['step_ms']:>7.1f} / {p.step_s * 1e3:<5.1f} "
              f"{m['exchange_ms']:>7.1f} / {p.exchange_s * 1e3:<5.1f} "
              f"{m['sent'] / 1024:>7.0f} / {p.sent_bytes / 1024:<5.0f} "
              f"{m['received'] / 1024:>7.0f} / {p.received_bytes / 1024:<5.0f}"
              f"  collectives {m['collectives']:.0f} / {p.collectives}")
        print("  " + json.dumps(m))


if __name__ == "__main__":
    main()
