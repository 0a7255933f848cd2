"""Batches of the standard workloads with a chosen Zipf exponent (benchmarks/studies/cache.py).

As workloads.py (inverse-CDF sampling over ranks, a fixed random permutation of each table's
rows), with ``alpha`` in place of its fixed 1.05.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from workloads import SEED, Workload, _permutation


@functools.lru_cache(maxsize=8)
def _cdf(n: int, alpha: float) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -alpha  # (N,)
    c = np.cumsum(p)
    return c / c[-1]


def batches_for(w: Workload, alpha: float, i: int) -> dict[str, torch.Tensor]:
    """Batch ``i``: ``{f<t>: ids}``, (B,) for one id per example, else jagged bags of L."""
    out = {}
    for t in range(w.tables):
        rng = np.random.default_rng([SEED, 21, i, t, int(alpha * 1000)])
        ranks = np.searchsorted(_cdf(w.rows, alpha), rng.random(w.batch * w.bag), side="right")
        ids = torch.from_numpy(_permutation(w.rows, t)[np.minimum(ranks, w.rows - 1)]
                               .astype(np.int64))
        if w.bag == 1:
            out[f"f{t}"] = ids
        else:
            offsets = torch.arange(w.batch + 1, dtype=torch.int64) * w.bag
            out[f"f{t}"] = torch.nested.nested_tensor_from_jagged(ids, offsets)
    return out
