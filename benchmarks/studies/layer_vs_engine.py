"""What ``ec.EmbeddingLayer`` costs over the engine it wraps, on W1 and W2 (quick by default).

Four systems run the same batches (Zipf(1.05) ids, Adagrad, 2 threads) and the same loss
``sum((act * R).sum())`` over the features' activations (R: fixed random tensors):

    (a) engine, fixed grad:  emb.enqueue(ids); emb.dequeue(); emb.apply_gradients(fixed grads)
    (b) engine + loss:       emb.enqueue(ids); acts = emb.dequeue(); loss(acts).backward();
                             emb.apply_gradients({f: acts[f].grad})
    (c) layer + loss:        loss(layer(ids)).backward()
    (d) loss alone:          loss(leaves).backward() on fixed (B, D) leaf tensors (no engine)

(b) is the fair baseline for (c): both run the loss's forward and backward. (a) + (d) is what
a step would cost if the engine's kernels and the loss's torch ops did not slow each other down
((b) - (a) - (d): what they do). The systems alternate (a b c d, d c b a, ...) over ``--rounds``
rounds of ``--steps`` steps each; the table shows the median ms/step (and the range) and
(c)/(b). ``--paths`` also reports which preprocess (the native one of
embcore/step/native_prepare.py, or preprocess.py's) each system's batches took.

    python benchmarks/studies/layer_vs_engine.py                 # W1 and W2-quick, under a minute
    python benchmarks/studies/layer_vs_engine.py --full          # W2 at 8 x 1M rows
    python benchmarks/studies/layer_vs_engine.py --workloads W1 --rounds 21 --paths --wait-idle 30
    GOMP_SPINCOUNT=2000 python benchmarks/studies/layer_vs_engine.py   # torch's OpenMP workers spin
        # ~0.05 ms instead of ~7 ms after each parallel op: (b) and (c) come down to (a) + (d)

Standalone: imports only embcore, torch and the standard library (the ids are drawn as
benchmarks/core/workloads.py draws them, with torch's generators instead of numpy's).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import embcore as ec

THREADS = 2
LR, ACC0 = 0.01, 0.1
ZIPF_ALPHA = 1.05
SEED = 2024
NUM_BATCHES = 4


@dataclass(frozen=True)
class Workload:
    name: str
    tables: int     # one feature per table
    rows: int
    dim: int
    batch: int
    bag: int        # ids per bag (1: dense ids, one per example)
    combiner: str


def workload(name: str, full: bool) -> Workload:
    if name == "W1":
        return Workload("W1", 26, 100_000, 64, 4096, 1, "sum")
    if name == "W2":
        return (Workload("W2", 8, 1_000_000, 128, 2048, 20, "mean") if full else
                Workload("W2-quick", 8, 200_000, 128, 2048, 20, "mean"))
    raise SystemExit(f"unknown workload {name!r} (W1, W2)")


def zipf_ids(n: int, size: int, seed: int, perm: torch.Tensor) -> torch.Tensor:
    """``size`` ids in [0, n): p(perm[k-1]) ~ k^-1.05 (inverse CDF), int64."""
    p = torch.arange(1, n + 1, dtype=torch.float64) ** -ZIPF_ALPHA
    cdf = torch.cumsum(p, 0)
    cdf /= cdf[-1].clone()
    u = torch.rand(size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ranks = torch.searchsorted(cdf, u, right=True).clamp_(max=n - 1)
    return perm[ranks]


def batches(w: Workload) -> list[dict[str, torch.Tensor]]:
    perms = [torch.randperm(w.rows, generator=torch.Generator().manual_seed(SEED * 31 + t))
             for t in range(w.tables)]
    offsets = torch.arange(w.batch + 1, dtype=torch.int64) * w.bag
    out = []
    for i in range(NUM_BATCHES):
        feats = {}
        for t in range(w.tables):
            ids = zipf_ids(w.rows, w.batch * w.bag, SEED + 1000 * i + t, perms[t])
            feats[f"f{t}"] = (ids if w.bag == 1 else
                              torch.nested.nested_tensor_from_jagged(ids, offsets))
        out.append(feats)
    return out


def feature_config(w: Workload) -> dict[str, ec.FeatureConfig]:
    return {f"f{t}": ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=w.rows, dim=w.dim, combiner=w.combiner, name=f"t{t}"))
        for t in range(w.tables)}


def optimizer() -> ec.Adagrad:
    return ec.Adagrad(learning_rate=LR, initial_accumulator_value=ACC0)


def systems(w: Workload) -> dict[str, Callable[[dict[str, torch.Tensor]], None]]:
    g = torch.Generator().manual_seed(SEED + 3)
    fixed = {f"f{t}": torch.randn(w.batch, w.dim, generator=g) * 0.1 for t in range(w.tables)}
    r = {f"f{t}": torch.randn(w.batch, w.dim, generator=g) for t in range(w.tables)}

    def loss(acts: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((acts[f] * r[f]).sum() for f in r)  # type: ignore[return-value]

    emb = ec.Embedding(feature_config(w), optimizer())
    emb.build(per_replica_batch_size=w.batch)
    torch.manual_seed(0)
    layer = ec.EmbeddingLayer(feature_config(w), optimizer())

    def engine_fixed(ids: dict[str, torch.Tensor]) -> None:
        emb.enqueue(ids)
        emb.dequeue()
        emb.apply_gradients(fixed)

    def engine_loss(ids: dict[str, torch.Tensor]) -> None:
        emb.enqueue(ids)
        acts = emb.dequeue()
        loss(acts).backward()
        emb.apply_gradients({f: a.grad for f, a in acts.items()})

    def layer_loss(ids: dict[str, torch.Tensor]) -> None:
        loss(layer(ids)).backward()

    leaves = {f: torch.randn(w.batch, w.dim, generator=g).requires_grad_() for f in r}

    def loss_alone(ids: dict[str, torch.Tensor]) -> None:
        loss(leaves).backward()
        for x in leaves.values():
            x.grad = None

    return {"(a) engine, fixed grad": engine_fixed, "(b) engine + loss": engine_loss,
            "(c) layer + loss": layer_loss, "(d) loss alone": loss_alone}


def paths(w: Workload) -> None:
    """Which preprocess each system's steps take: the calls of the native preprocess
    (embcore/step/native_prepare.py; "declined": it returned None and preprocess.py took the
    batch) and of the path's verbs (embcore/step/path.py), over one step of each system."""
    from embcore.step.native_prepare import NativePrepare
    from embcore.step.path import StepPath
    counts: dict[str, int] = {}
    patched: list[tuple[object, str, object]] = []

    def wrap(owner: type, name: str, label: str, declines: bool) -> None:
        f = getattr(owner, name)

        def counted(*args: object, **kwargs: object) -> object:
            out = f(*args, **kwargs)
            key = label + (" (declined)" if declines and out is None else "")
            counts[key] = counts.get(key, 0) + 1
            return out
        patched.append((owner, name, f))
        setattr(owner, name, counted)

    wrap(NativePrepare, "prepare", "native prepare", True)
    for n in ("prepare", "lookup", "apply"):
        wrap(StepPath, n, n, False)
    try:
        b = batches(w)[0]
        for label, step in systems(w).items():
            step(b)  # (the first step fixes the shapes)
            counts.clear()
            step(b)
            print(f"  {label:24s} {dict(sorted(counts.items())) or '-'}")
    finally:
        for owner, name, f in reversed(patched):
            setattr(owner, name, f)


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, idle) jiffies of all CPUs since boot (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - v[4], v[3] + v[4]


def wait_idle(most: float, share: float = 0.85, window: float = 0.5) -> float:
    """Sleeps until the CPUs were at least ``share`` idle over ``window`` seconds (nothing else
    runs: this process sleeps meanwhile), or ``most`` seconds have passed; returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < most:
        a = _cpu_ticks()
        time.sleep(window)
        b = _cpu_ticks()
        if a is None or b is None:
            break
        busy, idle = b[0] - a[0], b[1] - a[1]
        if idle >= share * max(busy + idle, 1):
            break
    return time.perf_counter() - t0


def run(w: Workload, rounds: int, steps: int, idle: float = 0.0) -> dict[str, list[float]]:
    """Per system, its ms/step in each round (systems alternate: a b c d, d c b a, ...); with
    ``idle`` > 0 each system's round first waits (up to ``idle`` s) for the CPUs to be idle."""
    data = batches(w)
    runs = systems(w)
    for step in runs.values():  # warm-up: shapes fixed, caches filled, pages touched
        for b in data[:2]:
            step(b)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for label in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            step = runs[label]
            if idle > 0:
                wait_idle(idle)
            t0 = time.perf_counter()
            for i in range(steps):
                step(data[i % len(data)])
            times[label].append((time.perf_counter() - t0) / steps * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"])
    p.add_argument("--full", action="store_true", help="W2 at 8 x 1M rows (default: 8 x 200k)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=None,
                   help="steps per round and system (default: W1 5, W2 3)")
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--paths", action="store_true", help="report the path each system takes")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                   help="on a shared machine: before each system's round, wait up to S seconds "
                        "until the CPUs are idle (Linux; default 0: do not wait)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    omp = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
           if k in os.environ}
    print(f"# layer_vs_engine  {datetime.datetime.now().isoformat(timespec='seconds')}  "
          f"embcore {ec.__version__}  torch {torch.__version__}  device cpu "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.1f})  threads {torch.get_num_threads()}"
          + (f"  {omp}" if omp else ""))
    for name in a.workloads:
        w = workload(name, a.full)
        steps = a.steps or (5 if w.bag == 1 else 3)
        print(f"## {w.name}: {w.tables} tables x {w.rows} rows x D {w.dim}, batch {w.batch}, "
              f"{'dense ids' if w.bag == 1 else f'bags of {w.bag} (jagged), {w.combiner}'}, "
              f"Adagrad; {a.rounds} rounds x {steps} steps; ms/step: median [min, max]")
        if a.paths:
            paths(w)
        times = run(w, a.rounds, steps, a.wait_idle)
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            print(f"  {k:24s} {med[k]:8.2f}  [{min(v):.2f}, {max(v):.2f}]")
        ad = [x + y for x, y in zip(times["(a) engine, fixed grad"], times["(d) loss alone"])]
        print(f"  {'(a) + (d)':24s} {statistics.median(ad):8.2f}  [{min(ad):.2f}, {max(ad):.2f}]")
        b, c = med["(b) engine + loss"], med["(c) layer + loss"]
        print(f"  (c)/(b) = {c / b:.3f}   (c)-(b) = {c - b:+.2f}   "
              f"(b)-(a)-(d) = {b - statistics.median(ad):+.2f} ms/step")


if __name__ == "__main__":
    main()
