"""``memory_budget`` as a user writes it (bytes, or a size like ``"4GiB"``) -> bytes.

The planner (planning/tiers.py) decides what the budget holds; this only reads it.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_BUDGET = 2**63 - 1  # bytes (8 EiB): more is refused (None means no budget)
_LONGEST = 100  # characters of a budget string; a longer one is refused unread
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
    negative values, more than ``MAX_BUDGET`` bytes and ``True`` / ``False`` (docs/semantics.md
    section 10). A string's size is bounded before it is expanded exactly (``"1e999999999"`` is
    refused at once), and a string of more than 100 characters is refused unread.

    Raises:
        TypeError: another type (a bool included). ValueError: a negative, NaN, infinite or
        fractional number of bytes, more than ``MAX_BUDGET``, or a string that is not a size.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"memory_budget must be None, a number of bytes or a string like "
                        f"'4GiB', got {type(value).__name__}")
    exact: int | Fraction
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*",
                         value) if len(value) <= _LONGEST else None
        if m is None or m.group(2).lower() not in _UNITS:
            shown = repr(value) if len(value) <= _LONGEST else \
                f"{value[:40]!r}... (of {len(value)} characters)"
            raise ValueError(f"memory_budget {shown} is not a size; write bytes or a number "
                             f"with a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, "
                             f"GiB, TiB (powers of 1024), e.g. '4GiB'")
        exact = _exact(value, m.group(1), _UNITS[m.group(2).lower()])
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"memory_budget must be a finite number of bytes, got {value}")
        exact = Fraction(value)  # (a float's exact value)
    else:
        exact = value
    if exact < 0:
        raise ValueError(f"memory_budget must be >= 0 bytes, got {_shown(value)}")
    if exact > MAX_BUDGET:
        raise _too_large(value)
    if exact.denominator != 1:
        low = math.floor(exact)
        try:
            shown = repr(float(exact))
        except OverflowError:
            shown = str(exact)
        raise ValueError(f"memory_budget {value!r} is {shown} bytes, not a whole "
                         f"number of bytes; write a whole number, e.g. {low} or {low + 1}")
    return int(exact)


def _shown(value: object) -> str:
    """``repr(value)``, or for an integer of hundreds of digits its size (``repr`` of one of
    thousands raises)."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"
    return repr(value)


def _too_large(value: object) -> ValueError:
    return ValueError(f"memory_budget {_shown(value)} is more than {MAX_BUDGET} bytes "
                      f"(2**63 - 1), more than any machine holds; write the bytes this "
                      f"process may use, or None for no budget")


def _exact(value: str, number: str, unit: int) -> int | Fraction:
    """``number`` (digits, a point, an exponent: the budget's regex) times ``unit``, exactly,
    once its size is known to lie between 10**-30 and 10**21 (beyond: refused, or 0 bytes);
    ``Fraction`` would expand ``1e999999999`` digit by digit."""
    mantissa, _, exponent = number.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    if not digits:  # (zero, whatever its exponent)
        return 0
    top = len(digits) + int(exponent or 0) - len(fraction)  # 10**(top - 1) <= number < 10**top
    if top > 21:  # (at least 10**21 bytes: more than MAX_BUDGET whatever the unit)
        raise _too_large(value)
    if top < -30:  # (more than 0 and less than a byte whatever the unit: not a whole number)
        raise ValueError(f"memory_budget {value!r} is less than one byte but more than 0, not a "
                         f"whole number of bytes; write a whole number, e.g. 0 or 1")
    return Fraction(number) * unit
