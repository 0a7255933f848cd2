"""The dtype rules of a table, written once: what its rows are stored in, what its optimizer
slots are kept in, what an update computes in, and what one row costs in bytes.

Every other module asks here (the optimizers' math, the builder that allocates rows and slots,
the planner that counts bytes, the update and the gradients' conversion), so the planner and the
builder cannot disagree (tests/test_dtypes.py holds them together, float64 slots included).

- Rows: ``ROW_DTYPES`` (float32, float64, float16, bfloat16, and the 8-bit ``SCALED``:
  float8_e4m3fn, float8_e5m2).
- Slots and the working dtype: float64 for a float64 table, float32 for every other (16-bit and
  8-bit rows are widened to float32, updated there and rounded back; their slots stay float32).
- An 8-bit row keeps one float32 scale beside it (its value is ``float32(row) * scale``), stored
  as a row-wise companion of the optimizer's slots, named ``SCALES`` (``"scales"``): it moves
  with the row wherever a row-wise slot does.
- Bytes a row: ``dim`` values of the row's dtype, plus each slot's width (1 for a row-wise slot,
  else ``dim``) in the slot dtype, plus an 8-bit row's float32 scale.

>>> slot_dtype(torch.float16), slot_dtype(torch.float64)
(torch.float32, torch.float64)
>>> row_bytes(4, torch.float64, [True, False])  # 4 values + a row-wise and a full slot, 8 bytes
72
>>> row_bytes(128, torch.float8_e4m3fn, [True])  # 128 bytes + its scale + a row-wise slot
136
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

# 8-bit rows, each with a float32 scale (``SCALES``, a row-wise companion of the slots)
SCALED = (torch.float8_e4m3fn, torch.float8_e5m2)
ROW_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, *SCALED)
SCALES = "scales"


def slot_dtype(row_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a table's optimizer slots, for rows of ``row_dtype``."""
    return torch.float64 if row_dtype == torch.float64 else torch.float32


def working_dtype(row_dtype: torch.dtype) -> torch.dtype:
    """The dtype an update (and a gradient's conversion) computes in, for rows of ``row_dtype``:
    the slots' dtype."""
    return slot_dtype(row_dtype)


def is_working(t: torch.Tensor) -> bool:
    """Whether ``t`` is already in a working dtype (float32 or float64), needing no widening."""
    return t.dtype == torch.float32 or t.dtype == torch.float64


def row_bytes(dim: int, row_dtype: torch.dtype, rowwise: Iterable[bool] = ()) -> int:
    """Bytes of one row of ``dim`` columns and its slots (one entry of ``rowwise`` per slot:
    True for a row-wise slot of one value, False for a slot as wide as the row)."""
    slot = slot_dtype(row_dtype).itemsize
    scale = 4 if row_dtype in SCALED else 0  # (an 8-bit row's float32 scale)
    return dim * row_dtype.itemsize + scale + sum(slot if r else slot * dim for r in rowwise)
