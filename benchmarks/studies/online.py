"""Online training's costs (docs/semantics.md section 13): tracking, writing deltas, freshness.

Three measurements, each printed as a table (and ``--json`` lines):

    tracking   W1 steps (26 x 100k x 64, B 4096, Adagrad, the fast path) with the record of
               written rows on and off, alternated in one process over ``--rounds`` blocks of
               ``--steps`` steps: median ms/step of each and their ratio.
    write      a delta of R changed rows (one table of 2M x 128, SGD) by ``ec.publish``, against
               writing the same rows' bytes (row numbers and values) with one sequential
               ``write`` and ``fsync`` in the same directory, alternated: seconds, ratio, and the
               bytes a changed row takes in the delta against the row's own bytes.
    freshness  a trainer process runs W1 and publishes every P seconds (P = 1 and 10); a follower
               process refreshes every 50 ms and serves lookups (512 ids per feature) from a
               thread: for every training step, the wall seconds until the follower reflects it
               (p50 / p99 / max), and the follower's lookup latency during refreshes against
               without (p50 / p99).

    python benchmarks/studies/online.py                      # all three, about 3 minutes
    python benchmarks/studies/online.py tracking --rounds 21
    python benchmarks/studies/online.py freshness --intervals 1 10 --seconds 40

Imports embcore, torch, numpy and benchmarks/core/workloads.py. Temporary files go to ``--dir``
(default: a temporary directory on the disk of the working directory) and are removed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from workloads import get_workload, make_batches, upstream_grads  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.formats import published as fmt  # noqa: E402
from embcore.state.changes import ChangedRows  # noqa: E402


def w1_engine(threads: int = 2) -> tuple[ec.Embedding, list[dict[str, torch.Tensor]],
                                         dict[str, torch.Tensor]]:
    torch.set_num_threads(threads)
    w = get_workload("W1")
    configs = [ec.TableConfig(vocabulary_size=w.rows, dim=w.dim, combiner=w.combiner,
                              name=f"t{t}") for t in range(w.tables)]
    emb = ec.Embedding({f"f{t}": ec.FeatureConfig(table=c) for t, c in enumerate(configs)},
                       ec.Adagrad(learning_rate=0.01, initial_accumulator_value=0.1))
    emb.build(per_replica_batch_size=w.batch)
    batches = [{f"f{t}": ids for t, ids in enumerate(b.ids)} for b in make_batches(w, 8)]
    grads = {f"f{t}": g for t, g in enumerate(upstream_grads(w))}
    return emb, batches, grads


def step(emb: ec.Embedding, batch: dict[str, torch.Tensor],
         grads: dict[str, torch.Tensor]) -> None:
    emb.enqueue(batch)
    emb.dequeue()
    emb.apply_gradients(grads)


def quantiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {"n": 0}
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"n": len(xs), "p50": pick(0.5), "p99": pick(0.99), "max": xs[-1]}


# ------------------------------------------------------------------------------------ tracking
def tracking(args: argparse.Namespace) -> dict:
    emb, batches, grads = w1_engine()
    store = emb._ready().store
    on = ChangedRows([store.plan.physical[p].row_counts[0] for p in range(len(store))])
    for i in range(5):
        step(emb, batches[i % 8], grads)
    times: dict[str, list[float]] = {"off": [], "on": []}
    order = ["off", "on"]
    for r in range(args.rounds):
        for mode in order if r % 2 == 0 else order[::-1]:
            store.changes = on if mode == "on" else None
            for rows in store:  # (each rows object flags its own writes)
                rows.changes = store.changes
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(emb, batches[i % 8], grads)
            times[mode].append((time.perf_counter() - t0) / args.steps * 1e3)
    store.changes = None
    off, on_ = statistics.median(times["off"]), statistics.median(times["on"])
    ratios = sorted(b / a for a, b in zip(times["off"], times["on"]))
    out = {"study": "tracking", "ms_off": off, "ms_on": on_, "ratio": on_ / off,
           "ratio_range": [ratios[0], ratios[-1]], "rounds": args.rounds, "steps": args.steps}
    print(f"tracking on W1: off {off:.2f} ms/step, on {on_:.2f} ms/step, on/off "
          f"{on_ / off:.4f} (pairs {ratios[0]:.3f}..{ratios[-1]:.3f}, {args.rounds} rounds of "
          f"{args.steps} steps)")
    return out


# ------------------------------------------------------------------------------------ write
def write(args: argparse.Namespace, root: Path) -> list[dict]:
    torch.set_num_threads(2)
    n, d = 2_000_000, 128
    t = ec.TableConfig(vocabulary_size=n, dim=d, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    pub = root / "pub"
    ec.publish(pub, emb)  # the snapshot (not timed); every later publish is a delta
    store = emb._ready().store
    results = []
    g = torch.Generator().manual_seed(0)
    for r in args.rows:
        rows = torch.randperm(n, generator=g)[:r]
        times: dict[str, list[float]] = {"publish": [], "raw": []}
        nbytes = 0
        for rep in range(args.repeats):
            for mode in ("publish", "raw") if rep % 2 == 0 else ("raw", "publish"):
                if mode == "publish":
                    store.changes.mark(0, rows)
                    t0 = time.perf_counter()
                    info = ec.publish(pub, emb, compact_ratio=1e9)
                    times[mode].append(time.perf_counter() - t0)
                    nbytes = info["bytes"]
                    assert info["rows"]["t"] == r
                else:
                    values = emb.embedding_tables[t][rows.sort().values]  # (as publish reads)
                    t0 = time.perf_counter()
                    with open(root / "raw.bin", "wb") as f:
                        f.write(rows.sort().values.numpy().tobytes())
                        f.write(values.numpy().tobytes())
                        f.flush()
                        os.fsync(f.fileno())
                    times[mode].append(time.perf_counter() - t0)
                    os.unlink(root / "raw.bin")
        p, raw = statistics.median(times["publish"]), statistics.median(times["raw"])
        out = {"study": "write", "rows": r, "dim": d, "publish_s": p, "raw_s": raw,
               "ratio": p / raw, "bytes": nbytes, "bytes_per_row": nbytes / r,
               "row_bytes": d * 4}
        print(f"delta of {r:>9,} rows x {d}: publish {p:.3f} s, raw write {raw:.3f} s, ratio "
              f"{p / raw:.2f}; {nbytes / r:.1f} bytes per changed row (the row: {d * 4} + its "
              f"number 8)")
        results.append(out)
    shutil.rmtree(pub, ignore_errors=True)
    return results


# ------------------------------------------------------------------------------------ freshness
def _trainer(pub: str, interval: float, seconds: float, log: str, ready, go) -> None:
    emb, batches, grads = w1_engine(threads=1)
    ec.publish(pub, emb)
    ready.set()
    go.wait(300)  # the follower serves the snapshot
    applied = []  # (step count after the step, wall time it was applied)
    start = last = time.time()
    i = 0
    while time.time() - start < seconds:
        step(emb, batches[i % 8], grads)
        i += 1
        applied.append((emb.step, time.time()))
        if time.time() - last >= interval:
            ec.publish(pub, emb, compact_ratio=1e9)
            last = time.time()
    ec.publish(pub, emb, compact_ratio=1e9)
    Path(log).write_text(json.dumps(applied))


def _follower(pub: str, stop, log: str, go) -> None:
    torch.set_num_threads(1)
    served = ec.load_published(pub)
    w = get_workload("W1")
    g = torch.Generator().manual_seed(5)
    probe = {f"f{t}": torch.randint(0, w.rows, (512,), generator=g) for t in range(w.tables)}
    lookups: list[tuple[float, float]] = []  # (start, seconds)
    refreshes: list[tuple[float, float, int]] = []  # (start, end, step it reflects)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            served(probe)
            lookups.append((t0, time.perf_counter() - t0))

    thread = threading.Thread(target=serve)
    thread.start()
    go.set()
    step_of = {}
    while not stop.is_set():
        t0 = time.perf_counter()
        if served.refresh():
            v = served.version
            if v not in step_of:
                m = next(e for e in fmt.entries(served.directory) if e.seq == v).manifest()
                step_of[v] = m["step"]
            refreshes.append((t0, time.perf_counter(), step_of[v], time.time()))
        time.sleep(0.05)
    done.set()
    thread.join()
    Path(log).write_text(json.dumps({"lookups": lookups, "refreshes": refreshes}))


def freshness(args: argparse.Namespace, root: Path) -> list[dict]:
    results = []
    ctx = mp.get_context("spawn")
    for interval in args.intervals:
        pub = root / f"pub-{interval}"
        ready, stop, go = ctx.Event(), ctx.Event(), ctx.Event()
        tlog, flog = root / f"t-{interval}.json", root / f"f-{interval}.json"
        trainer = ctx.Process(target=_trainer, args=(str(pub), interval, args.seconds,
                                                     str(tlog), ready, go))
        trainer.start()
        ready.wait(300)
        follower = ctx.Process(target=_follower, args=(str(pub), stop, str(flog), go))
        follower.start()
        trainer.join()
        time.sleep(max(1.0, interval * 0.2) + 1.0)  # the follower takes the last publish
        stop.set()
        follower.join()
        applied = json.loads(tlog.read_text())
        f = json.loads(flog.read_text())
        seen = [(wall, s) for _, _, s, wall in f["refreshes"]]  # when it reflected step s
        fresh = []
        j = 0
        for s, t_applied in applied:
            while j < len(seen) and seen[j][1] < s:
                j += 1
            if j < len(seen):
                fresh.append(seen[j][0] - t_applied)
        windows = [(a, b) for a, b, _, _ in f["refreshes"]]
        during, quiet = [], []
        k = 0
        for t0, dt in f["lookups"]:
            while k < len(windows) and windows[k][1] < t0:
                k += 1
            overlaps = k < len(windows) and windows[k][0] <= t0 + dt
            (during if overlaps else quiet).append(dt * 1e3)
        out = {"study": "freshness", "interval_s": interval, "steps": len(applied),
               "publishes": len(f["refreshes"]), "freshness_s": quantiles(fresh),
               "lookup_ms_during_refresh": quantiles(during),
               "lookup_ms_otherwise": quantiles(quiet)}
        fq, dq, qq = out["freshness_s"], out["lookup_ms_during_refresh"], \
            out["lookup_ms_otherwise"]
        print(f"publish every {interval:g} s: {len(applied)} steps, {len(f['refreshes'])} "
              f"refreshes; freshness p50 {fq.get('p50', float('nan')):.2f} s, p99 "
              f"{fq.get('p99', float('nan')):.2f} s, max {fq.get('max', float('nan')):.2f} s; "
              f"lookup p50/p99 {qq.get('p50', 0):.2f}/{qq.get('p99', 0):.2f} ms without a "
              f"refresh ({qq['n']}), {dq.get('p50', 0):.2f}/{dq.get('p99', 0):.2f} ms during "
              f"one ({dq['n']})")
        results.append(out)
        shutil.rmtree(pub, ignore_errors=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("studies", nargs="*", default=["tracking", "write", "freshness"])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--intervals", type=float, nargs="+", default=[1.0, 10.0])
    p.add_argument("--seconds", type=float, default=40.0)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, embcore {ec.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    root = Path(tempfile.mkdtemp(prefix="online-", dir=args.dir or os.getcwd()))
    results: list[dict] = []
    try:
        if "tracking" in args.studies:
            results.append(tracking(args))
        if "write" in args.studies:
            results += write(args, root)
        if "freshness" in args.studies:
            results += freshness(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
