"""``memory_budget`` as a user writes it (bytes, or a size like ``"4GiB"``) -> bytes.

The planner (planning/tiers.py) decides what the budget holds; this only reads it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_budget(value: object) -> int | None:
    """``memory_budget`` in bytes: None, a whole number of bytes >= 0, or a string like
    ``"4GiB"``, ``"512MB"``, ``"1.5e9"``.

    A float is taken when it is a whole number (``1.5e9`` is exactly 1,500,000,000 bytes); a
    string's number and unit are multiplied exactly (decimal, not binary floating point:
    ``"3.26KB"`` is 3,260 bytes) and must come to a whole number of bytes too. Nothing is
    rounded: a budget that is not a whole number of bytes is refused, as are NaN, infinities,
    negative values and ``True`` / ``False`` (docs/semantics.md section 10).

    Raises:
        TypeError: another type (a bool included). ValueError: a negative, NaN, infinite or
        fractional number of bytes, or a string that is not a size.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"memory_budget must be None, a number of bytes or a string like "
                        f"'4GiB', got {type(value).__name__}")
    exact: int | Fraction
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory_budget {value!r} is not a size; write bytes or a number "
                             f"with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, "
                             f"GiB, TiB (powers of 1024), e.g. '4GiB'")
        exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"memory_budget must be a finite number of bytes, got {value}")
        exact = Fraction(value)  # (a float's exact value)
    else:
        exact = value
    if exact < 0:
        raise ValueError(f"memory_budget must be >= 0 bytes, got {value!r}")
    if exact.denominator != 1:
        low = math.floor(exact)
        try:
            shown = repr(float(exact))
        except OverflowError:
            shown = str(exact)
        raise ValueError(f"memory_budget {value!r} is {shown} bytes, not a whole "
                         f"number of bytes; write a whole number, e.g. {low} or {low + 1}")
    return int(exact)
