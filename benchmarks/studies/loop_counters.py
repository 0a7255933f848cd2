"""Counters a step for the loop with an MLP against its parts, in fresh processes.

    python benchmarks/studies/loop_counters.py [--rounds 3] [--steps 6] [--threads 2]

Three systems, each in its own fresh process, alternated (engine, mlp, loop; loop, mlp, engine;
...): the engine alone (W1 tables, enqueue, dequeue and apply with fixed gradients), the MLP alone
(1664-512-256-1, forward, backward and SGD on a fixed input that requires its gradient) and the
loop (dequeue, the concatenation of the 26 activations, the MLP, apply), batch 4096, exact mode,
``--threads`` torch threads. The loop is the one of pipeline.py --parts.

Per step, after three warm-up steps, each process reads, counters that the machine's load moves
far less than wall time:
- the CPU time of each thread (its per-thread CPU clock, nanoseconds), grouped as the caller,
  torch's intra-op workers (threads that exist after a parallel torch op, before the engine) and
  the kernels' pool helpers (threads that appear with the engine's first step);
- the caller's CPU time inside the engine's calls (enqueue, dequeue, apply) and, in the loop,
  inside the concatenation of the activations;
- the process's minor page faults (getrusage) and each group's voluntary and involuntary context
  switches (/proc/self/task/*/status);
- the ops that allocate from torch's CPU allocator in a step (a separate profiled step: the
  events whose own memory use is positive), and the bytes they allocate.
Prints the median over rounds of each counter, and every round's value of the caller's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEMS = ("engine", "mlp", "loop")


def _tids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _thread_cpu_ns(tid: int) -> int:
    try:  # Linux: the per-thread CPU clock of any thread of this process
        return time.clock_gettime_ns(((~tid) << 3) | 6)
    except OSError:
        return 0


def _switches(tid: int) -> tuple[int, int]:
    vol = inv = 0
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    inv = int(line.split()[1])
    except OSError:
        pass
    return vol, inv


def _snapshot(groups: dict[str, set[int]]) -> dict[str, float]:
    out: dict[str, float] = {"minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                             "majflt": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}
    for name, tids in groups.items():
        cpu = vol = inv = 0
        for tid in tids:
            cpu += _thread_cpu_ns(tid)
            v, i = _switches(tid)
            vol += v
            inv += i
        out[f"{name} cpu ms"] = cpu / 1e6
        out[f"{name} vol"] = vol
        out[f"{name} invol"] = inv
    return out


def child(system: str, steps: int, threads: int, batch_size: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    torch.ones(1 << 22).mul_(2).sum()  # starts torch's intra-op team
    caller = threading.get_native_id()
    torch_workers = _tids() - {caller}

    import embcore as ec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # workloads.py
    from workloads import get_workload, make_batches

    wl = get_workload("W1")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(wl.tables * wl.dim, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    target = torch.randn(batch_size)

    def mlp_step(x: torch.Tensor) -> None:
        loss = torch.nn.functional.mse_loss(mlp(x).squeeze(1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()

    step: Callable[[], None]
    if system == "mlp":
        x_fixed = torch.randn(batch_size, wl.tables * wl.dim, requires_grad=True)

        def dense() -> None:
            mlp_step(x_fixed)
            x_fixed.grad = None
        step = dense
    else:
        fc = {f"f{i}": ec.FeatureConfig(table=ec.TableConfig(
            vocabulary_size=wl.rows, dim=wl.dim, combiner="sum", name=f"t{i}"))
            for i in range(wl.tables)}
        emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.01))
        batches = [{f"f{t}": ids[:batch_size] for t, ids in enumerate(b.ids)}
                   for b in make_batches(wl, 8)]
        fixed = {f"f{t}": torch.randn(batch_size, wl.dim) * 0.01 for t in range(wl.tables)}
        done = [0]
        in_calls, in_cat = [0], [0]  # the caller's CPU ns in the engine's calls, in the cat

        def engine() -> None:
            emb.enqueue(batches[done[0] % len(batches)])
            done[0] += 1
            emb.dequeue()
            emb.apply_gradients(fixed)

        def both() -> None:
            t0 = time.thread_time_ns()
            emb.enqueue(batches[done[0] % len(batches)])
            done[0] += 1
            acts = emb.dequeue()
            t1 = time.thread_time_ns()
            x = torch.cat([acts[f"f{t}"] for t in range(wl.tables)], dim=1)
            t2 = time.thread_time_ns()
            mlp_step(x)
            t3 = time.thread_time_ns()
            emb.apply_gradients({k: a.grad for k, a in acts.items()})
            in_calls[0] += t1 - t0 + time.thread_time_ns() - t3
            in_cat[0] += t2 - t1
        step = engine if system == "engine" else both
    for _ in range(3):
        step()
    if system == "loop":
        in_calls[0] = in_cat[0] = 0
    pool = _tids() - torch_workers - {caller}
    groups = {"caller": {caller}, "torch workers": torch_workers, "pool helpers": pool}
    wall0 = time.perf_counter()
    before = _snapshot(groups)
    for _ in range(steps):
        step()
    after = _snapshot(groups)
    wall = time.perf_counter() - wall0
    if system == "engine":
        after["caller cpu ms in engine calls"] = after["caller cpu ms"]
        before["caller cpu ms in engine calls"] = before["caller cpu ms"]
    elif system == "loop":
        after["caller cpu ms in engine calls"] = in_calls[0] / 1e6
        after["caller cpu ms in the cat"] = in_cat[0] / 1e6
        before["caller cpu ms in engine calls"] = before["caller cpu ms in the cat"] = 0.0
    out: dict[str, Any] = {k: (after[k] - before[k]) / steps for k in before}
    out["wall ms"] = wall / steps * 1e3
    out["threads"] = {k: len(v) for k, v in groups.items()}
    # allocations a step: one profiled step (the profiler slows it; counts only)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocs = [e for e in prof.events() if e.self_cpu_memory_usage > 0]  # ops that allocate
    out["allocating ops"] = len(allocs)
    out["allocated MiB"] = sum(e.self_cpu_memory_usage for e in allocs) / 2**20
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="print every round as JSON too")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.threads, args.batch)))
        return
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        for system in (SYSTEMS if r % 2 == 0 else tuple(reversed(SYSTEMS))):
            res = subprocess.run(
                [sys.executable, __file__, "--child", system, "--steps", str(args.steps),
                 "--threads", str(args.threads), "--batch", str(args.batch)],
                capture_output=True, text=True, check=True)
            runs[system].append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds of {args.steps} steps, "
          f"{args.threads} torch threads; medians a step")
    keys = [k for k in runs["loop"][0] if k != "threads"]  # (the loop's has every key)
    print(f"| counter | {' | '.join(SYSTEMS)} | loop - (engine + mlp) |")
    print("|---|" + "---|" * (len(SYSTEMS) + 1))
    for k in keys:
        med = {s: statistics.median(float(r.get(k, 0.0)) for r in runs[s]) for s in SYSTEMS}
        extra = med["loop"] - med["engine"] - med["mlp"]
        print(f"| {k} | " + " | ".join(f"{med[s]:.1f}" for s in SYSTEMS) + f" | {extra:+.1f} |")
    for s in SYSTEMS:
        print(f"{s}: caller cpu ms by round " +
              ", ".join(f"{r['caller cpu ms']:.1f}" for r in runs[s]) +
              f"; threads {runs[s][0]['threads']}")
    if args.json:
        print(json.dumps(runs))


if __name__ == "__main__":
    main()
