"""Pipelined vs exact execution on W1 + a dense MLP (docs/semantics.md section 6).

    python benchmarks/studies/pipeline.py [--steps 20] [--batch 4096] [--cache-fraction 0.1]

One training loop for both modes: dequeue batch i, enqueue batch i+1, run the MLP forward and
backward, apply the embedding gradients. With ``pipeline_execution=True`` the enqueue of batch i+1
hands its grouping, deduplication and lookup to a background worker, which runs while the MLP
does; its activations are then one step stale. Exact mode does the same work at dequeue time.
Prints ms/step and examples/s of both, and their ratio.

``--parts`` instead times exact mode against its parts, on the torch threads given: (i) W1 + the
MLP (the loop above), (ii) W1 alone (the same steps with fixed gradients, no MLP), (iii) the MLP
alone (forward, backward and SGD step on a fixed input that requires its gradient, as the
activations do): the systems alternate (i ii iii,
iii ii i, ...) over ``--rounds`` rounds of ``--steps`` steps; it prints each median [min, max]
and (i) / ((ii) + (iii)), what the engine's kernels and the MLP's torch ops cost each other;
"(i) its W1 calls" is the part of (i) spent in the engine's calls (enqueue, dequeue, apply).

``--cache-fraction F`` runs the tables beyond memory (docs/semantics.md section 10): a
``memory_budget`` whose caches hold F of the rows, and a new batch every step (Zipf 1.05), so that
every step reads missing rows from the slow tier; pipelined, that reading is the lookahead, done
in the background while the MLP runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import embcore as ec
from embcore.config.tables import INDEX_BYTES_PER_ROW, WHERE_BYTES_PER_ROW

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # workloads.py
from cache_workloads import batches_for  # noqa: E402
from workloads import get_workload, make_batches  # noqa: E402


def run(pipelined: bool, steps: int, batch_size: int, cache_fraction: float | None = None
        ) -> float:
    wl = get_workload("W1")
    torch.manual_seed(0)
    tables = [ec.TableConfig(vocabulary_size=wl.rows, dim=wl.dim, combiner="sum", name=f"t{i}")
              for i in range(wl.tables)]
    fc = {f"f{i}": ec.FeatureConfig(table=t) for i, t in enumerate(tables)}
    budget = (None if cache_fraction is None else
              int(cache_fraction * wl.tables * wl.rows * (wl.dim * 8 + INDEX_BYTES_PER_ROW)
                  + wl.tables * wl.rows * WHERE_BYTES_PER_ROW))
    emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.01), pipeline_execution=pipelined,
                       memory_budget=budget)
    mlp = torch.nn.Sequential(torch.nn.Linear(wl.tables * wl.dim, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    if cache_fraction is None:
        batches = [{f"f{t}": ids[:batch_size] for t, ids in enumerate(b.ids)}
                   for b in make_batches(wl, 8)]
    else:  # new batches every step: misses every step (the first 60 fill the caches)
        batches = [{k: v[:batch_size] for k, v in batches_for(wl, 1.05, i).items()}
                   for i in range(steps + 64)]
    target = torch.randn(batch_size)

    done = [0]

    def loop(n: int) -> None:
        emb.enqueue(batches[done[0] % len(batches)])
        for i in range(n):
            acts = emb.dequeue()
            done[0] += 1
            if i + 1 < n:
                emb.enqueue(batches[done[0] % len(batches)])  # overlaps the MLP when pipelined
            x = torch.cat([acts[f"f{t}"] for t in range(wl.tables)], dim=1)  # (B, T*D)
            loss = torch.nn.functional.mse_loss(mlp(x).squeeze(1), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            emb.apply_gradients({k: a.grad for k, a in acts.items()})

    loop(3 if cache_fraction is None else 60)  # warm-up
    start = time.perf_counter()
    loop(steps)
    return (time.perf_counter() - start) / steps


def parts(rounds: int, steps: int, batch_size: int) -> dict[str, list[float]]:
    """ms/step of (i) W1 + MLP, (ii) W1 alone, (iii) MLP alone, per round (exact mode)."""
    wl = get_workload("W1")
    torch.manual_seed(0)
    fc = {f"f{i}": ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=wl.rows, dim=wl.dim, combiner="sum", name=f"t{i}"))
        for i in range(wl.tables)}
    emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.01))
    mlp = torch.nn.Sequential(torch.nn.Linear(wl.tables * wl.dim, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
    batches = [{f"f{t}": ids[:batch_size] for t, ids in enumerate(b.ids)}
               for b in make_batches(wl, 8)]
    target = torch.randn(batch_size)
    fixed = {f"f{t}": torch.randn(batch_size, wl.dim) * 0.01 for t in range(wl.tables)}
    x_fixed = torch.randn(batch_size, wl.tables * wl.dim, requires_grad=True)  # as (i)'s x
    done = [0]
    w1_in_both = [0.0]  # seconds of (i) spent in the engine's calls

    def mlp_step(x: torch.Tensor) -> None:
        loss = torch.nn.functional.mse_loss(mlp(x).squeeze(1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()

    def both() -> None:
        t0 = time.perf_counter()
        emb.enqueue(batches[done[0] % len(batches)])
        done[0] += 1
        acts = emb.dequeue()
        t1 = time.perf_counter()
        mlp_step(torch.cat([acts[f"f{t}"] for t in range(wl.tables)], dim=1))
        t2 = time.perf_counter()
        emb.apply_gradients({k: a.grad for k, a in acts.items()})
        w1_in_both[0] += t1 - t0 + time.perf_counter() - t2

    def engine() -> None:
        emb.enqueue(batches[done[0] % len(batches)])
        done[0] += 1
        emb.dequeue()
        emb.apply_gradients(fixed)

    def dense() -> None:
        mlp_step(x_fixed)
        x_fixed.grad = None

    systems = {"(i) W1 + MLP": both, "(ii) W1 alone": engine, "(iii) MLP alone": dense}
    for f in systems.values():  # warm-up
        for _ in range(3):
            f()
    times: dict[str, list[float]] = {k: [] for k in [*systems, "(i) its W1 calls"]}
    for r in range(rounds):
        for label in (list(systems) if r % 2 == 0 else list(reversed(systems))):
            w1_in_both[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                systems[label]()
            times[label].append((time.perf_counter() - t0) / steps * 1e3)
            if label == "(i) W1 + MLP":
                times["(i) its W1 calls"].append(w1_in_both[0] / steps * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--cache-fraction", type=float, default=None,
                    help="tables beyond memory: caches holding this share of the rows")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch intra-op threads to try (the background worker uses its own)")
    ap.add_argument("--parts", action="store_true",
                    help="exact mode against its parts: W1 alone, the MLP alone (see above)")
    ap.add_argument("--rounds", type=int, default=9, help="with --parts: alternated rounds")
    args = ap.parse_args(argv)
    if args.parts:
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = parts(args.rounds, max(1, args.steps // 4), args.batch)
            print(f"torch {torch.__version__}, {os.cpu_count()} cores, load "
                  f"{os.getloadavg()[0]:.1f}, torch threads {threads}, batch {args.batch}, "
                  f"{args.rounds} rounds; ms/step median [min, max]")
            med = {k: statistics.median(v) for k, v in times.items()}
            for k, v in times.items():
                print(f"  {k:18s} {med[k]:8.2f}  [{min(v):.2f}, {max(v):.2f}]")
            ratio = med["(i) W1 + MLP"] / (med["(ii) W1 alone"] + med["(iii) MLP alone"])
            w1 = med["(i) its W1 calls"] / med["(ii) W1 alone"]
            print(f"  (i) / ((ii) + (iii)) = {ratio:.3f}   (i)'s W1 calls / (ii) = {w1:.3f}",
                  flush=True)
        return
    print(f"torch {torch.__version__}, embcore {ec.__version__}, {os.cpu_count()} cores, "
          f"W1 tables + MLP 1664-512-256-1, batch {args.batch}"
          + (f", caches of {args.cache_fraction:.0%} of the rows" if args.cache_fraction else ""))
    print("| mode | torch threads | ms/step | examples/s |\n|---|---|---|---|")
    best = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for pipelined in (False, True):
            t = run(pipelined, args.steps, args.batch, args.cache_fraction)
            best[pipelined] = min(best.get(pipelined, t), t)
            mode = "pipelined" if pipelined else "exact"
            print(f"| {mode} | {threads} | {t * 1e3:.1f} | {args.batch / t:,.0f} |", flush=True)
    print(f"best pipelined / best exact throughput: {best[False] / best[True]:.2f}x")


if __name__ == "__main__":
    main()
