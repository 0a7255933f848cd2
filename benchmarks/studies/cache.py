"""Tables beyond memory: hit rate and throughput against cache size (the curve nobody publishes).

    python benchmarks/studies/cache.py [--workload W1|W2] [--alphas 1.05,1.2] [--raw]
                               [--fractions 0.01,0.05,0.1,0.25,0.5] [--steps 30] [--warmup 200]
                               [--shape T,N,D,B] [--optimizer adagrad|rowwise] [--budget 1GiB]

``--shape T,N,D,B``: T tables of N rows, D wide, batch B (one id per example, sum) instead of a
standard workload (e.g. ``4,10000000,32,4096``: 4 x 10M x 32). ``--optimizer rowwise``:
``RowwiseAdagrad`` (one accumulator a row) instead of exact Adagrad. ``--budget``: one
``memory_budget`` (``"1GiB"``) instead of ``--fractions`` (the fraction of rows it caches is
printed).

``--raw``: every table dynamic (raw 63-bit ids, ``workloads.raw_ids``; capacity the workload's
rows), its map in fast memory and its rows behind the cache; the budget adds the maps' bytes.

For each Zipf exponent, trains the workload (exact Adagrad through ``ec.Embedding``, the same
batches and gradients for every run) in memory, then with a ``memory_budget`` whose caches hold
the given fraction of the rows (every table offloaded: equal tables get equal shares; at 100%
the tables fit and stay in memory: that is the in-memory run). After ``--warmup`` steps that
fill the caches, it times ``--repeats`` loops of ``--steps`` steps on new batches and prints, per
run: ex/s (the median loop), the ratio to the in-memory run, the cache hit rate over the timed
steps (rows found in the cache over all rows looked up; with ``--raw`` the rows given to new ids,
nothing read for them, are counted apart: new/st), rows read from and written to the slow tier
per step, and the process's anonymous and file-backed resident memory (RssAnon / RssFile). Every run's final tables are checked equal to the in-memory run's.

Each run is its own process (memory figures of one run only); the final tables' SHA-256 is
compared with the in-memory run's. The slow tier's files go to ``--offload-dir`` (default: a
temporary directory), removed after each run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # workloads.py
from cache_workloads import batches_for  # noqa: E402
from workloads import Workload, get_workload, raw_ids  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.config.budget import parse_budget  # noqa: E402
from embcore.config.tables import (
    INDEX_BYTES_PER_ROW,  # noqa: E402
    MAP_BYTES_PER_ROW,  # noqa: E402
)
from embcore.planning.plan import where_bytes  # noqa: E402
from embcore.state.tier.files import WRITES_ENV  # noqa: E402

LR, ACC0 = 0.01, 0.1


def rss() -> dict[str, float]:
    """RssAnon and RssFile of this process, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) / 1024
    return out


def optimizer(name: str) -> ec.Adagrad:
    """The study's optimizer: exact Adagrad, or ``RowwiseAdagrad`` (``"rowwise"``)."""
    kind = ec.RowwiseAdagrad if name == "rowwise" else ec.Adagrad
    return kind(learning_rate=LR, initial_accumulator_value=ACC0)


def workload(args: argparse.Namespace) -> Workload:
    """``--workload`` (``--quick``), or the ``--shape T,N,D,B`` given."""
    if args.shape is None:
        return get_workload(args.workload, quick=args.quick)
    t, n, d, b = (int(x) for x in args.shape.split(","))
    return Workload(f"{t}x{n}xD{d}", t, n, d, b, 1, "sum", args.steps)


def run(w, alpha: float, budget: int | None, warmup: int, steps: int,
        offload_dir: str | None, repeats: int = 3, raw: bool = False,
        opt: str = "adagrad") -> dict:
    dyn = ec.DynamicVocabulary() if raw else None
    tables = [ec.TableConfig(vocabulary_size=w.rows, dim=w.dim, combiner=w.combiner,
                             name=f"t{t}", dynamic=dyn) for t in range(w.tables)]
    raw_maps = [raw_ids(w.rows, t) for t in range(w.tables)] if raw else None

    def batch(i: int) -> dict[str, torch.Tensor]:
        feats = batches_for(w, alpha, i)
        if raw_maps is None:
            return feats
        return {k: raw_maps[t][v] if not v.is_nested else torch.nested.nested_tensor_from_jagged(
            raw_maps[t][v.values()], v.offsets()) for t, (k, v) in enumerate(feats.items())}

    fc = {f"f{t}": ec.FeatureConfig(table=tables[t]) for t in range(w.tables)}
    torch.manual_seed(0)
    emb = ec.Embedding(fc, optimizer(opt), memory_budget=budget, offload_dir=offload_dir)
    t0 = time.perf_counter()
    emb.build(per_replica_batch_size=w.batch)
    emb.state_dict() if budget is None else emb.cache_stats()  # tables made now
    setup = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    grads = {f"f{t}": torch.randn(w.batch, w.dim, generator=g) * 0.1 for t in range(w.tables)}

    def step(feats):
        emb.enqueue(feats)
        emb.dequeue()
        emb.apply_gradients(grads)

    for i in range(warmup):
        step(batch(i))
    stores = list(emb._store.caches()) if emb._store is not None else []
    before = [(c.hits.sum().item(), c.misses.sum().item(), c.read_rows, c.written_rows,
               c.new.sum().item()) for c in stores]
    times = []
    for r in range(repeats):  # the median of ``repeats`` loops, each on new batches
        timed = [batch(warmup + r * steps + i) for i in range(steps)]
        t0 = time.perf_counter()
        for feats in timed:
            step(feats)
        times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    steps_all = steps * repeats
    mem = rss()
    out = {"alpha": alpha, "budget": budget, "ex_per_s": steps * w.batch / dt,
           "ms_per_step": 1000 * dt / steps, "setup_s": setup, **mem}
    if stores:
        new = sum(c.new.sum().item() - b[4] for c, b in zip(stores, before))  # new ids' rows
        hits = sum(c.hits.sum().item() - b[0] for c, b in zip(stores, before))
        misses = sum(c.misses.sum().item() - b[1] for c, b in zip(stores, before))
        out.update(cache_rows=sum(c.capacity for c in stores),
                   rows=sum(c.rows for c in stores),
                   hit_rate=hits / max(hits + misses + new, 1),
                   new_per_step=new / steps_all,
                   read_per_step=sum(c.read_rows - b[2] for c, b in zip(stores, before))
                   / steps_all,
                   written_per_step=sum(c.written_rows - b[3] for c, b in zip(stores, before))
                   / steps_all)
    digest = hashlib.sha256()
    for k, v in sorted(emb.state_dict().items()):
        if k != "step":
            digest.update(v.contiguous().numpy().tobytes())
    out["sha256"] = digest.hexdigest()
    return out


def spawn(args: argparse.Namespace, alpha: float, budget: int | None,
          writes: str = "log") -> dict:
    """One run in a fresh process (``writes``: how its slow tier writes rows back)."""
    cmd = [sys.executable, __file__, "--single", f"{alpha},{budget}", "--workload", args.workload,
           "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--repeats", str(args.repeats)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--shape", args.shape] if args.shape else []
    cmd += ["--optimizer", args.optimizer]
    cmd += ["--raw"] if args.raw else []
    cmd += ["--offload-dir", args.offload_dir] if args.offload_dir else []
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, WRITES_ENV: writes})
    if proc.returncode != 0:
        sys.exit(f"run alpha={alpha} budget={budget} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--workload", default="W1", choices=["W1", "W2"])
    ap.add_argument("--quick", action="store_true", help="W2's quick shape (8 x 200k)")
    ap.add_argument("--alphas", default="1.05,1.2")
    ap.add_argument("--fractions", default="0.01,0.05,0.1,0.25,0.5")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--raw", action="store_true", help="dynamic tables with raw 63-bit ids")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--writes", default="log",
                    help="how static tables' slow tiers write rows back: log, in-place, or both "
                         "(log,in-place: each fraction run with each)")
    ap.add_argument("--shape", default=None, help="T,N,D,B: T tables of N x D, batch B")
    ap.add_argument("--optimizer", default="adagrad", choices=["adagrad", "rowwise"])
    ap.add_argument("--budget", default=None, help="one memory_budget instead of --fractions")
    ap.add_argument("--single", default=None, help=argparse.SUPPRESS)  # alpha,budget: one run
    args = ap.parse_args()
    w = workload(args)
    if args.single is not None:
        alpha, budget = args.single.split(",")
        print(json.dumps(run(w, float(alpha), None if budget == "None" else int(budget),
                             args.warmup, args.steps, args.offload_dir, args.repeats,
                             args.raw, args.optimizer)))
        return
    slot = 1 if args.optimizer == "rowwise" else w.dim
    row_bytes = (w.dim + slot) * 4  # parameters + Adagrad accumulators
    print(f"# {w.name}{'-raw' if args.raw else ''}: {w.tables} x {w.rows} x D{w.dim}, B{w.batch}, "
          f"L{w.bag}; {'row-wise' if slot == 1 else 'exact'} Adagrad; "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads", flush=True)
    print(f"{'alpha':>5} {'cache':>6} {'writes':>8} {'ex/s':>9} {'vs mem':>6} {'hit':>6} {'new/st':>7} "
          f"{'read/st':>8} "
          f"{'write/st':>8} {'anon MiB':>8} {'file MiB':>8} {'setup s':>7}", flush=True)
    results = []
    for alpha in [float(a) for a in args.alphas.split(",")]:
        base = spawn(args, alpha, None)
        results.append(base)
        print(f"{alpha:>5} {'memory':>6} {'':>8} {base['ex_per_s']:>9.0f} {1.0:>6.2f} {'':>6} {'':>7} "
              f"{'':>8} "
              f"{'':>8} {base['RssAnon']:>8.0f} {base['RssFile']:>8.0f} "
              f"{base['setup_s']:>7.1f}", flush=True)
        fixed = (w.tables * w.rows * where_bytes(args.raw)
                 + (w.tables * w.rows * MAP_BYTES_PER_ROW if args.raw else 0))
        per_row = w.tables * w.rows * (row_bytes + INDEX_BYTES_PER_ROW)
        fractions = ([(parse_budget(args.budget) - fixed) / per_row] if args.budget else
                     [float(x) for x in args.fractions.split(",")])
        for f, writes in [(f, wr) for f in fractions for wr in args.writes.split(",")]:
            budget = (parse_budget(args.budget) if args.budget else int(f * per_row + fixed))
            res = spawn(args, alpha, budget, writes)
            same = res["sha256"] == base["sha256"]
            res.update(fraction=f, writes=writes, vs_memory=res["ex_per_s"] / base["ex_per_s"],
                       exact=same)
            results.append(res)
            print(f"{alpha:>5} {f:>6.0%} {writes:>8} {res['ex_per_s']:>9.0f} {res['vs_memory']:>6.2f} "
                  f"{res['hit_rate']:>6.1%} {res['new_per_step']:>7.0f} "
                  f"{res['read_per_step']:>8.0f} "
                  f"{res['written_per_step']:>8.0f} {res['RssAnon']:>8.0f} "
                  f"{res['RssFile']:>8.0f} {res['setup_s']:>7.1f}"
                  f"{'' if same else '  NOT EXACT'}", flush=True)
            if not same:
                sys.exit("a cached run differs from the in-memory run")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
