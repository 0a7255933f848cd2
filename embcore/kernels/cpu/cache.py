"""The cache index's kernels: a step of the cache index, flags set (csrc/cache_index.h).
"""

from __future__ import annotations

import ctypes

import torch

from .args import (
    I32,
    I64,
    INT,
    INT64,
    U8,
    Kernel,
    array,
    read,
    written,
)
from .library import threads

_CACHE_STEP = Kernel("ec_cache_step", INT64, [
    ("rows", read(I64)),              # (U,) distinct shard rows
    ("n_rows", INT64),
    ("where", written(I32)),          # (N,) the cache row of each shard row, or -1
    ("owner", written(I64)),          # (C,) the shard row of each cache row, or -1
    ("stamp", written(I64)),          # (C,)
    ("dirty", written(U8)),           # (C,)
    ("fresh", written(U8)),           # (C,)
    ("version", written(I32)),        # (C,) the version of each cache row's row
    ("free_rows", written(I64)),      # (C,) a stack of the free cache rows
    ("capacity", INT64),
    ("clock", INT64),
    ("spare", INT64),
    ("slots", written(I64)),          # (U,)
    ("miss_rows", written(I64)),      # (U,) (M used)
    ("miss_slots", written(I64)),     # (U,) (M used)
    ("out_rows", written(I64)),       # (most,) (O used)
    ("out_slots", written(I64)),      # (most,) (O used)
    ("bounds", read(I64, optional=True)),    # (T - 1,) the first row of members 1..T-1
    ("n_bounds", INT64),
    ("counts", written(I64, optional=True)),  # (3, T) hits, misses, new per member
    ("io", array(ctypes.c_int64)),    # (4,) n_free (in/out), n_miss, n_out, n_evicted
    ("nt", INT),
])


def cache_step(rows: torch.Tensor, where: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor,
               dirty: torch.Tensor, fresh: torch.Tensor, version: torch.Tensor,
               free: torch.Tensor, n_free: int, clock: int, spare: int,
               bounds: torch.Tensor | None, counts: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          int, int] | None:
    """One step of a cache's index (``ec_cache_step`` in ``csrc/cache_index.h``;
    ``CacheIndex.step`` is its torch-ops twin and documents it).

    Returns:
        ``(slots (U,), miss_rows (M,), miss_slots (M,), out_rows (O,), out_slots (O,),
        n_free, n_evicted)``, or None when ``rows`` outnumber the cache rows (nothing changed).
    """
    n, c = rows.numel(), owner.numel()
    if not 0 <= n_free <= c:
        raise ValueError(f"{_CACHE_STEP.name}: n_free must lie in [0, {c}] (the cache rows), "
                         f"got {n_free}")
    slots = torch.empty(n, dtype=torch.int64)
    miss_rows = torch.empty(n, dtype=torch.int64)
    miss_slots = torch.empty(n, dtype=torch.int64)
    most = min(n + max(spare, 0), c)  # rows an eviction may write back
    out_rows = torch.empty(most, dtype=torch.int64)
    out_slots = torch.empty(most, dtype=torch.int64)
    io = (ctypes.c_int64 * 4)(n_free, 0, 0, 0)
    n_bounds = 0 if bounds is None else bounds.numel()
    rc = _CACHE_STEP.call((rows, None), n, (where, None), (owner, None), (stamp, c),
                          (dirty, c), (fresh, c), (version, c), (free, c), c, clock, spare,
                          (slots, n),
                          (miss_rows, n), (miss_slots, n), (out_rows, most), (out_slots, most),
                          (bounds, None), n_bounds, (counts, 3 * (n_bounds + 1)), io,
                          threads())
    if rc != 0:
        return None
    m, o = io[1], io[2]
    return (slots, miss_rows[:m], miss_slots[:m], out_rows[:o], out_slots[:o], io[0], io[3])


_ROW_VERSIONS = Kernel("ec_row_versions", None, [
    ("where", written(I32)),          # (N,) cache rows, or -1 - version
    ("version", written(I32)),        # (C,)
    ("keys", read(I64)),              # (n,) distinct shard rows
    ("n", INT64),
    ("out", written(I32)),            # (n,)
    ("advance", INT),
])


def row_versions(where: torch.Tensor, version: torch.Tensor, keys: torch.Tensor,
                 advance: bool) -> torch.Tensor:
    """(n,) int32: the versions of distinct shard rows ``keys`` ((n,) int64, contiguous, in
    range) in a cache index's ``where`` and ``version`` (``ec_row_versions``; the torch-ops twin
    is ``CacheIndex.versions``); ``advance``: each first advanced by one (mod 2**31), and
    kept."""
    n = keys.numel()
    out = torch.empty(n, dtype=torch.int32)
    _ROW_VERSIONS.call((where, None), (version, None), (keys, n), n, (out, n), int(advance))
    return out


_SET_FLAGS = Kernel("ec_set_flags", None, [
    ("flags", written(U8)),           # (C,)
    ("idx", read(I64)),               # (n,)
    ("n", INT64),
    ("value", INT),
])


def set_flags(flags: torch.Tensor, idx: torch.Tensor, value: bool) -> None:
    """``flags[idx] = value``: ``flags`` a contiguous bool tensor, ``idx`` (n,) int64 in range."""
    _SET_FLAGS.call((flags, None), (idx, None), idx.numel(), int(value))
