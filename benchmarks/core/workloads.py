"""The standard workloads (benchmarks/README.md), and their deterministic batches.

Every system script builds the same batches from the same seeds, so all systems see identical ids
and identical upstream gradients. Ids follow Zipf(1.05) over the vocabulary (inverse CDF over ranks
1..N with p(k) ~ k^-1.05), then go through a fixed random permutation per table so that hot ids are
spread over the table instead of all sitting in its first rows.

Legend: T tables (one feature per table), N rows, D dim, B batch, L ids per bag.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

ZIPF_ALPHA = 1.05
SEED = 2024


@dataclass(frozen=True)
class Workload:
    name: str
    tables: int        # T, one feature per table
    rows: int          # N
    dim: int           # D
    batch: int         # B
    bag: int           # L, ids per feature per example (1: a plain lookup)
    combiner: str      # "sum" | "mean"
    steps: int         # timed steps per repeat
    note: str = ""

    @property
    def per_step_unit(self) -> str:
        return "ms/step" if self.name.startswith("W3") else "examples/s"


WORKLOADS = ("W1", "W2", "W3-B16", "W3-B1024")


def get_workload(name: str, quick: bool = False) -> Workload:
    """The workload ``name``; ``quick`` shrinks W2's tables and every timed loop."""
    if name == "W1":
        return Workload("W1", 26, 100_000, 64, 4096, 1, "sum", 10 if quick else 30)
    if name == "W2":
        if quick:
            return Workload("W2", 8, 200_000, 128, 2048, 20, "mean", 5,
                            note="quick: 8 x 200k rows instead of 8 x 1M")
        return Workload("W2", 8, 1_000_000, 128, 2048, 20, "mean", 15)
    if name == "W3-B16":
        return Workload("W3-B16", 2, 2048, 64, 16, 1, "sum", 200 if quick else 1000)
    if name == "W3-B1024":
        return Workload("W3-B1024", 2, 2048, 64, 1024, 1, "sum", 100 if quick else 500)
    raise ValueError(f"unknown workload {name!r}; choose one of {WORKLOADS}")


@functools.lru_cache(maxsize=4)
def _zipf_cdf(n: int) -> np.ndarray:
    p = np.arange(1, n + 1, dtype=np.float64) ** -ZIPF_ALPHA  # (N,) unnormalized p(rank)
    cdf = np.cumsum(p)
    return cdf / cdf[-1]


@functools.lru_cache(maxsize=64)
def _permutation(n: int, table: int) -> np.ndarray:
    return np.random.default_rng([SEED, 7, n, table]).permutation(n)  # (N,) rank -> id


def zipf_ids(rng: np.random.Generator, n: int, size: int, perm: np.ndarray) -> np.ndarray:
    """``size`` ids in [0, n) with p(id = perm[k-1]) ~ k^-1.05 (inverse CDF sampling)."""
    ranks = np.searchsorted(_zipf_cdf(n), rng.random(size), side="right")  # (size,) 0-based
    return perm[np.minimum(ranks, n - 1)]


# W1-raw trains on a stream of new batches (``stream_batch``), after RAW_FILL untimed steps: the
# union of W1's Zipf ids reaches about 61k per table after 160 batches of 4096 (33k after 50, 49k
# after 100, 68k after 200), so a 50k-row map is full and evicts at every step from then on, and a
# 100k-row one (every id fits) still admits new ids without evicting.
RAW_FILL = 160


@functools.lru_cache(maxsize=64)
def raw_ids(n: int, table: int) -> torch.Tensor:
    """(n,) int64: W1-raw's fixed one-to-one map of table ``table``'s ids [0, n) to random values
    in [0, 2^63) (distinct; the same Zipf frequencies as the ids they replace)."""
    rng = np.random.default_rng([SEED, 11, n, table])
    while True:
        v = rng.integers(0, 2**63 - 1, size=n, dtype=np.int64, endpoint=True)
        if np.unique(v).size == n:
            return torch.from_numpy(v)


@dataclass(frozen=True)
class Batch:
    ids: list[torch.Tensor]   # T x (B*L,) int64, feature t reads table t
    offsets: torch.Tensor     # (B + 1,) int64, bag b = ids[offsets[b]:offsets[b+1]] (all features)


def make_batches(w: Workload, count: int) -> list[Batch]:
    """``count`` distinct batches; timed loops cycle through them."""
    return [stream_batch(w, i) for i in range(count)]


def stream_batch(w: Workload, i: int) -> Batch:
    """Batch ``i`` of the workload's stream (seeded by ``i``: ``make_batches`` is its first
    ``count``). W1-raw trains on the stream itself, every step a new batch (common.main)."""
    offsets = torch.arange(w.batch + 1, dtype=torch.int64) * w.bag  # (B + 1,)
    ids = [torch.from_numpy(zipf_ids(np.random.default_rng([SEED, 1, i, t]), w.rows,
                                     w.batch * w.bag, _permutation(w.rows, t)).astype(np.int64))
           for t in range(w.tables)]  # T x (B*L,)
    return Batch(ids, offsets)


def upstream_grads(w: Workload) -> list[torch.Tensor]:
    """The fixed gradient of the loss w.r.t. each feature's activation: T x (B, D)."""
    g = torch.Generator().manual_seed(SEED + 3)
    return [torch.randn(w.batch, w.dim, generator=g) * 0.1 for _ in range(w.tables)]


def initial_tables(w: Workload) -> list[torch.Tensor]:
    """Shared initial tables for the cross-system check: T x (N, D) float32."""
    g = torch.Generator().manual_seed(SEED + 5)
    return [torch.rand(w.rows, w.dim, generator=g) * 0.2 - 0.1 for _ in range(w.tables)]


def unique_rows(batches: list[Batch]) -> float:
    """Mean number of unique rows touched per step, summed over tables."""
    return float(np.mean([sum(int(torch.unique(ids).numel()) for ids in b.ids) for b in batches]))
