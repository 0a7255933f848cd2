"""The memory-bandwidth bound: measured copy bandwidth, and the bytes a training step must move.

    python benchmarks/core/bound.py [--mib 1024] --json     # prints {"copy_gbps": ...}

Bytes per step, per table, with U unique rows touched (mean over the workload's batches):
    exact Adagrad:    U * D * 4 * 4        read w, read a, write a, write w (float32)
    row-wise Adagrad: U * (D * 4 * 2 + 4 * 2)
plus, for all tables together, the activations written by the lookup and their gradients read by
the update (2 * T * B * D * 4) and the ids read once (T * B * L * 8).
max examples/s = B * copy bandwidth / bytes per step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

torch.set_num_threads(2)


def copy_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)`` on ``mib`` MiB, counting read + write; best of ``repeats``."""
    src = torch.ones(mib * 2**20 // 4)  # float32, touched so its pages exist
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms up
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def step_bytes(tables: int, dim: int, batch: int, bag: int, unique_rows: float,
               optimizer: str) -> float:
    """Bytes one training step must move (see the module docstring)."""
    per_row = dim * 4 * 4 if optimizer == "adagrad" else dim * 4 * 2 + 4 * 2
    return unique_rows * per_row + 2 * tables * batch * dim * 4 + tables * batch * bag * 8


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    bw = copy_bandwidth(a.mib)
    print(json.dumps({"copy_gbps": bw / 1e9, "mib": a.mib, "threads": torch.get_num_threads()})
          if a.json else f"copy bandwidth: {bw / 1e9:.2f} GB/s (read + write, {a.mib} MiB)")
