"""``memory_budget`` as a user writes it (bytes, or a size like ``"4GiB"``) -> bytes.

The planner (planning/tiers.py) decides what the budget holds; this only reads it.
"""

from __future__ import annotations

import math
import re

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
