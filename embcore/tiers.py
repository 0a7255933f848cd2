"""Tiers (pure): which tables a ``memory_budget`` sends to the slow tier, and their cache sizes.

The budget caps, per process, the bytes of the tables' rows and slots in fast memory plus the
caches (rows, slots and ``cache.INDEX_BYTES_PER_ROW`` of index each). Tables that fit change
nothing. Otherwise the largest tables (by their bytes on the process that holds most of them) go
to the slow tier, one at a time, until the rest fit; dynamic tables (raw ids) stay in fast memory.
What is left of the budget on each process becomes the caches of its offloaded tables, each
caching the same fraction of its rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from .cache import INDEX_BYTES_PER_ROW

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_budget(value: object) -> int | None:
    """``memory_budget`` in bytes: None, an int >= 0, or a string like ``"4GiB"``, ``"512MB"``,
    ``"1.5e9"``.

    Raises:
        TypeError: another type. ValueError: a negative value or an unknown unit.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"memory_budget must be None, a number of bytes or a string like "
                        f"'4GiB', got {type(value).__name__}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory_budget {value!r} is not a size; write bytes or a number "
                             f"with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, "
                             f"GiB, TiB (powers of 1024), e.g. '4GiB'")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"memory_budget must be finite, got {value}")
    if value < 0:
        raise ValueError(f"memory_budget must be >= 0 bytes, got {value}")
    return int(value)


def offloaded_tables(per_rank_bytes: Mapping[str, Sequence[int]], pinned: set[str],
                     budget: int) -> list[str]:
    """The tables sent to the slow tier, largest first, until the others fit ``budget`` on every
    process (``pinned``: tables that must stay in fast memory).

    Raises:
        ValueError: the pinned tables alone exceed the budget.
    """
    world = len(next(iter(per_rank_bytes.values()))) if per_rank_bytes else 1
    load = [sum(b[r] for b in per_rank_bytes.values()) for r in range(world)]
    order = sorted((n for n in per_rank_bytes if n not in pinned),
                   key=lambda n: (-max(per_rank_bytes[n]), n))
    out: list[str] = []
    for name in order:
        if max(load) <= budget:
            break
        out.append(name)
        load = [a - b for a, b in zip(load, per_rank_bytes[name])]
    if max(load, default=0) > budget:
        raise ValueError(f"memory_budget={budget} bytes is below what must stay in fast memory: "
                         f"{max(load)} bytes on a process (dynamic tables: {sorted(pinned)}); "
                         f"raise the budget")
    return out


def cache_rows(rows: Sequence[int], bytes_per_row: Sequence[int], free: int) -> list[int]:
    """Cache rows per offloaded table on one process, filling ``free`` bytes: every table caches
    the same fraction of its rows.

    Args:
        rows: the tables' rows on this process.
        bytes_per_row: their row + slot bytes (the index is added here).
        free: the budget left on this process.

    Returns:
        Cache rows per table, each in [1, rows] where it has rows (a step's working set grows a
        cache beyond this, cache.py).
    """
    cost = [b + INDEX_BYTES_PER_ROW for b in bytes_per_row]
    fraction = max(free, 0) / max(sum(n * c for n, c in zip(rows, cost)), 1)
    return [min(n, max(1, int(n * fraction))) for n in rows]
