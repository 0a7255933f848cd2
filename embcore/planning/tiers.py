"""Tiers (pure): which tables a ``memory_budget`` sends to the slow tier, and their cache sizes.

The budget caps, per process, the bytes of the tables' rows and slots in fast memory plus the
caches (rows, slots and ``config.tables.INDEX_BYTES_PER_ROW`` of index each, and
``WHERE_BYTES_PER_ROW`` for each row of an offloaded table, and
``LOG_BYTES_PER_ROW`` more for a static one's: ``plan.where_bytes``). Tables that fit change
nothing. Otherwise fast memory goes where it serves the most lookups:

- What must stay in fast memory takes its bytes first: the maps of dynamic tables (raw ids;
  ``config.tables.MAP_BYTES_PER_ROW`` a row of capacity, wherever their rows are) and tables whose
  optimizer moves every row every step (``Adam(lazy_adam=False)``).
- Every other table's rows are ranked from most to least looked up, and the budget left is
  filled greedily, in blocks of rows, with the block that serves the most lookups per byte
  among all tables. A table's share of lookups held by its ``k`` hottest rows is its **curve**:
  measured by ``ec.profile`` (profile.py) when given, else a Zipf(1) prior, ``H(k) / H(N)``
  (``H`` the harmonic numbers: ids of recommendation data are heavy-tailed), weighted by the
  lookups the table serves per step (measured, or the number of features reading it).
- A table that gets all its rows stays in fast memory; the others go to the slow tier with a
  cache of the rows they got (at least one), on every process that holds some of their rows.
  The caches are then sized again with the offloaded tables' index entries (per row) charged
  first (plan.py).

So small, heavily read tables stay in memory and the largest tables are the ones offloaded, with
caches sized by how skewed their lookups are.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence

Curve = Callable[[int], float]  # share of a table's lookups in its k hottest rows


def zipf_curve(rows: int) -> Curve:
    """The prior curve of a table of ``rows`` rows: Zipf(1), ``H(k) / H(rows)``."""
    total = _harmonic(rows)
    return lambda k: _harmonic(k) / total if total else 1.0


def _harmonic(k: int) -> float:
    if k <= 0:
        return 0.0
    if k < 64:
        return sum(1.0 / i for i in range(1, k + 1))
    return math.log(k) + 0.5772156649015329 + 1 / (2 * k) - 1 / (12 * k * k)


def fast_rows(rows: Sequence[int], cost: Sequence[int], weight: Sequence[float],
              curves: Sequence[Curve], budget: int) -> list[int]:
    """Rows of each table to keep in fast memory on one process, filling ``budget`` bytes.

    Args:
        rows: each table's rows on this process.
        cost: bytes of one fast row (row, slots and cache index).
        weight: lookups per step each table serves.
        curves: each table's curve (share of lookups in its k hottest rows).
        budget: the bytes to fill.

    Returns:
        Per table, its hottest rows that fit: the greedy choice, in blocks growing by 1/8, of
        the block serving the most lookups per byte.
    """
    out = [0] * len(rows)
    heap: list[tuple[float, int, int, int]] = []

    def push(t: int) -> None:
        a = out[t]
        if a >= rows[t]:
            return
        b = min(rows[t], max(a + 1, a + a // 8))
        served = weight[t] * (curves[t](b) - curves[t](a))
        heapq.heappush(heap, (-served / ((b - a) * cost[t]), t, a, b))

    for t in range(len(rows)):
        push(t)
    left = budget
    while heap:
        _, t, a, b = heapq.heappop(heap)
        take = min(b - a, left // cost[t])
        if take <= 0:
            continue  # (a smaller block of another table may still fit)
        out[t] += take
        left -= take * cost[t]
        if take == b - a:
            push(t)
    return out


def profile_curve(points: Sequence[tuple[int, float]], rows: int) -> Curve:
    """A measured curve from ``(k, share)`` points (ascending k, profile.py), linear between
    them, 1 at ``rows``."""
    ks = [0] + [int(k) for k, _ in points] + [rows]
    vs = [0.0] + [float(v) for _, v in points] + [1.0]

    def curve(k: int) -> float:
        if k >= ks[-1]:
            return 1.0
        i = bisect.bisect_right(ks, k) - 1
        return vs[i] + (vs[i + 1] - vs[i]) * (k - ks[i]) / (ks[i + 1] - ks[i])
    return curve
