"""W4: Criteo Kaggle's 26 tables (33.8M rows), D 128, exact Adagrad, beyond this machine's memory.

    python benchmarks/studies/w4.py [--budget 8GiB] [--steps 30] [--warmup 30] [--batch 4096]
                                    [--offload-dir DIR] [--scale 1.0] [--peer plain] [--raw]
                                    [--optimizer adagrad|rowwise] [--dtype float32|float16]

Rows + Adagrad accumulators take 33.8M x 128 x 4 x 2 bytes = 34.6 GB, more than the 24 GiB of
this machine. embcore trains them under ``--budget`` of fast memory (the rest in files under
``--offload-dir``, 34.6 GB of disk, removed at the end). Each feature takes one id per example,
Zipf(1.05) over its table's rows through a fixed permutation (benchmarks/core/workloads.py's rule).
Tables are initialized uniform in [-0.05, 0.05] (fast to draw; the default truncated normal
costs minutes at this size). Prints setup time, ex/s, the cache hit rate, rows read and written
per step, the process's anonymous and file-backed resident memory, and disk traffic
(/proc/self/io).

``--raw``: every table dynamic (raw 63-bit ids: each id times an odd constant, modulo 2^64,
xor a per-table constant, one to one), its capacity the table's rows, the default initializer;
the maps (``MAP_BYTES_PER_ROW`` a row of capacity charged to the budget) stay in fast memory, the rows and slots go to the slow tier.

``--optimizer rowwise``: RowwiseAdagrad (one accumulator a row: 135 MB). ``--dtype float16`` (or
bfloat16): compact rows, stochastic rounding; with rowwise Adagrad the whole W4 is 8.8 GB, in
memory here (``--budget none``), where float32 rows (17.4 GB) need the budget and the slow tier.

``--peer plain`` instead asks plain PyTorch (``nn.EmbeddingBag`` tables with Adagrad state, in
memory, as FBGEMM's CPU TBE and TorchRec's CPU sharding hold them) for the same tables, under an
address-space limit of this machine's memory, and reports what happens.
"""

from __future__ import annotations

import argparse
import functools
import resource
import time

import numpy as np
import torch
from tiers_util import KAGGLE, fmt_bytes, proc_io, rss

import embcore as ec
from embcore.config.budget import parse_budget


def raw(ids: torch.Tensor, t: int) -> torch.Tensor:
    """Raw 63-bit-looking ids, one to one with ``ids`` (int64 arithmetic wraps)."""
    return ids * -7046029254386353131 ^ ((t + 1) * 0x2545F4914F6CDD1D % (1 << 63))


def zipf_batch(rows: list[int], batch: int, step: int, perms: list[np.ndarray]) -> dict:
    out = {}
    for t, n in enumerate(rows):
        rng = np.random.default_rng([2024, 41, step, t])
        # inverse CDF of Zipf(1.05) over ranks, by the continuous approximation (n is large)
        u = rng.random(batch)
        a = 1.05
        hi = (n + 1) ** (1 - a)
        ranks = np.floor(((1 - u) + u * hi) ** (1 / (1 - a))).astype(np.int64) - 1
        out[f"C{t + 1}"] = torch.from_numpy(perms[t][np.clip(ranks, 0, n - 1)])
    return out


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def embcore_run(args: argparse.Namespace, rows: list[int]) -> None:
    budget = None if args.budget == "none" else args.budget
    if args.raw:  # (the default initializer: a callable one runs per admitted id)
        tables = [ec.TableConfig(vocabulary_size=n, dim=args.dim, name=f"C{t + 1}",
                                 dtype=DTYPES[args.dtype], dynamic=ec.DynamicVocabulary())
                  for t, n in enumerate(rows)]
    else:
        tables = [ec.TableConfig(vocabulary_size=n, dim=args.dim, name=f"C{t + 1}",
                                 dtype=DTYPES[args.dtype],
                                 initializer=functools.partial(torch.nn.init.uniform_, a=-0.05,
                                                               b=0.05))
                  for t, n in enumerate(rows)]
    fc = {f"C{t + 1}": ec.FeatureConfig(table=tables[t]) for t in range(len(rows))}
    item = DTYPES[args.dtype].itemsize
    rowwise = args.optimizer == "rowwise"
    total = sum(rows) * (args.dim * item + (4 if rowwise else args.dim * 4))
    print(f"# W4{'-raw' if args.raw else ''}: {len(rows)} tables, {sum(rows):,} rows, "
          f"D{args.dim} {args.dtype}, {'row-wise' if rowwise else 'exact'} Adagrad: "
          f"{fmt_bytes(total)} of rows + slots; budget {args.budget}; batch {args.batch}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    io0, t0 = proc_io(), time.perf_counter()
    torch.manual_seed(0)
    opt = (ec.RowwiseAdagrad if rowwise else ec.Adagrad)(learning_rate=0.01)
    emb = ec.Embedding(fc, opt, memory_budget=budget, offload_dir=args.offload_dir)
    emb.build(per_replica_batch_size=args.batch)
    emb.cache_stats()  # the store (and the slow tier) made now
    setup = time.perf_counter() - t0
    io1 = proc_io()
    print(emb.plan, flush=True)
    print(f"setup {setup:.0f} s, written {fmt_bytes(io1['write_bytes'] - io0['write_bytes'])}, "
          f"{rss()}", flush=True)
    perms = [np.random.default_rng([2024, 7, n, t]).permutation(n) for t, n in enumerate(rows)]
    g = torch.Generator().manual_seed(5)
    grads = {f"C{t + 1}": torch.randn(args.batch, args.dim, generator=g) * 0.1
             for t in range(len(rows))}

    def step(i: int) -> None:
        batch = zipf_batch(rows, args.batch, i, perms)
        if args.raw:
            batch = {k: raw(v, t) for t, (k, v) in enumerate(batch.items())}
        emb.enqueue(batch)
        emb.dequeue()
        emb.apply_gradients(grads)

    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    warm = time.perf_counter() - t0
    caches = list(emb._store.caches())
    before = [(int(c.hits.sum()), int(c.misses.sum()), c.read_rows, c.written_rows,
               int(c.new.sum())) for c in caches]
    io2, t0 = proc_io(), time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    dt = time.perf_counter() - t0
    io3 = proc_io()
    new = sum(int(c.new.sum()) - b[4] for c, b in zip(caches, before))  # new ids' rows
    hits = sum(int(c.hits.sum()) - b[0] for c, b in zip(caches, before))
    misses = sum(int(c.misses.sum()) - b[1] for c, b in zip(caches, before))
    read = sum(c.read_rows - b[2] for c, b in zip(caches, before)) / args.steps
    written = sum(c.written_rows - b[3] for c, b in zip(caches, before)) / args.steps
    print(f"warm-up {args.warmup} steps {warm:.1f} s; timed {args.steps} steps: "
          f"{args.steps * args.batch / dt:,.0f} ex/s ({1000 * dt / args.steps:.0f} ms/step), "
          f"hit rate {hits / max(hits + misses + new, 1):.1%} (new ids' rows "
          f"{new / args.steps:,.0f} a step), rows read / written per step "
          f"{read:,.0f} / {written:,.0f}, disk read "
          f"{fmt_bytes(io3['read_bytes'] - io2['read_bytes'])} written {fmt_bytes(io3['write_bytes'] - io2['write_bytes'])}; {rss()}", flush=True)


def plain_run(args: argparse.Namespace, rows: list[int]) -> None:
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    limit = avail - (2 << 30)  # what this machine can give, less room for the system
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(f"# plain PyTorch: {len(rows)} tables of D{args.dim} + Adagrad accumulators in memory "
          f"(as nn.EmbeddingBag + torch Adagrad, FBGEMM's CPU TBE and TorchRec's CPU sharding "
          f"hold them), address space limited to the memory available less 2 GiB: "
          f"{fmt_bytes(limit)}", flush=True)
    held, made = [], 0
    try:
        for n in sorted(rows, reverse=True):
            held.append(torch.empty(n, args.dim).uniform_(-0.05, 0.05))
            made += held[-1].nbytes
            held.append(torch.full((n, args.dim), 0.1))
            made += held[-1].nbytes
        print(f"allocated all {fmt_bytes(made)}", flush=True)
    except RuntimeError as e:
        print(f"failed after {fmt_bytes(made)} of {fmt_bytes(sum(rows) * args.dim * 8)}: "
              f"{str(e).splitlines()[0][:200]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--budget", default="8GiB", help="fast memory; 'none': every table in memory")
    ap.add_argument("--optimizer", choices=["adagrad", "rowwise"], default="adagrad")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--scale", type=float, default=1.0, help="rows x scale (a smaller W4)")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--peer", choices=["plain"], default=None)
    ap.add_argument("--raw", action="store_true", help="dynamic tables, raw 63-bit ids")
    args = ap.parse_args()
    if args.budget != "none":
        parse_budget(args.budget)
    rows = [max(2, round(n * args.scale)) for n in KAGGLE]
    (plain_run if args.peer == "plain" else embcore_run)(args, rows)


if __name__ == "__main__":
    main()
