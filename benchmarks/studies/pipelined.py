"""The engine alone with ``pipeline_execution=True`` on a standard workload (quick sizes).

    python benchmarks/studies/pipelined.py W1|W2

Each step dequeues batch i, enqueues batch i+1 (prepared, and with one process looked up, by the
pipeline's worker) and applies batch i's gradients (a fixed upstream gradient, as
benchmarks/systems/sys_embcore.py). Prints the best of 3 x 20 steps in examples/s. Run from a
checkout's root (``PYTHONPATH`` at it) to compare two builds; it reads only the public API.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import get_workload, make_batches  # noqa: E402

import embcore as ec  # noqa: E402


def main(name: str) -> None:
    w = get_workload(name, quick=True)
    torch.manual_seed(0)
    batches = make_batches(w, 8)
    opt = ec.Adagrad(learning_rate=common.LR, initial_accumulator_value=common.ACC0)
    cfgs = [ec.TableConfig(vocabulary_size=w.rows, dim=w.dim, combiner=w.combiner, name=f"t{t}")
            for t in range(w.tables)]
    emb = ec.Embedding({f"f{t}": ec.FeatureConfig(table=cfgs[t]) for t in range(w.tables)}, opt,
                       pipeline_execution=True)
    emb.build(per_replica_batch_size=w.batch)
    grads = {f"f{t}": torch.randn(w.batch, w.dim) for t in range(w.tables)}

    def feed(b):  # dense (B,) ids, or jagged bags of L
        if w.bag == 1:
            return {f"f{t}": ids for t, ids in enumerate(b.ids)}
        return {f"f{t}": torch.nested.nested_tensor_from_jagged(ids, b.offsets)
                for t, ids in enumerate(b.ids)}

    feeds = [feed(b) for b in batches]
    emb.enqueue(feeds[0])

    def steps(n: int, k0: int) -> None:
        for i in range(n):
            emb.dequeue()
            emb.enqueue(feeds[(k0 + i + 1) % len(feeds)])
            emb.apply_gradients(grads)

    steps(5, 0)  # warm-up
    best = float("inf")
    for r in range(3):
        t0 = time.perf_counter()
        steps(20, r * 20)
        best = min(best, (time.perf_counter() - t0) / 20)
    print(f"{name} pipelined: {w.batch / best / 1e3:.1f}k examples/s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "W1")
