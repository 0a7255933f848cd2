"""Quantized serving tables: int8 row-wise (a scale and a bias per row) and fp16.

The int8 format is the 8-bit row-wise one FBGEMM serves with, written from its description: each
row x (D,) is stored as D uint8 codes q and two float32 numbers,

    bias  = min(x)
    scale = (max(x) - min(x)) / 255
    q     = round((x - bias) / scale)   in 0..255   (q = 0 where scale = 0: a constant row)
    x^    = q * scale + bias            (float32)

so every entry is off by at most scale / 2 plus float32 rounding: ``|x - x^| <= scale / 2 +
a few ulps of the row's largest magnitude``. A constant row (zeros included) comes back exactly.
A row costs ``D + 8`` bytes instead of ``4 D``. fp16 is a plain cast (``2 D`` bytes a row).

Memory stays quantized: a lookup gathers the codes of the rows it reads (with their scales and
biases) and dequantizes only those, ``rows(index)``; the activations are float32. Functions here
are pure; ``ServingModule`` (serve.py) holds the tensors as buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config.dtypes import SCALED
from ..config.tables import TableConfig

Precision = Literal["fp16", "int8"]
PRECISIONS: tuple[str, ...] = ("fp16", "int8")
LEVELS = 255  # uint8 codes 0..255


@dataclass(frozen=True)
class QuantizedTable:
    """A table stored at reduced precision, read back as float32 one gathered row at a time.

    ``data`` is (N, D) uint8 codes (``"int8"``, with ``scale`` and ``bias`` (N,) float32) or
    (N, D) float16 (``"fp16"``, no scale nor bias). Made by ``quantize_table``.
    """

    precision: Precision
    data: torch.Tensor                  # (N, D) uint8 / float16
    scale: torch.Tensor | None = None   # (N,) float32, int8 only
    bias: torch.Tensor | None = None    # (N,) float32, int8 only

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes (or halves) and, for int8, 8 bytes of scale and bias a row."""
        return sum(t.nbytes for t in (self.data, self.scale, self.bias) if t is not None)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """(n, D) float32: the rows ``index`` (n,) gathered, then dequantized."""
        picked = self.data.index_select(0, index)  # (n, D) uint8 / float16
        if self.scale is None or self.bias is None:
            return picked.float()
        return dequantize_int8_rowwise(picked, self.scale.index_select(0, index),
                                       self.bias.index_select(0, index))

    def dequantize(self) -> torch.Tensor:
        """(N, D) float32: the whole table as its lookups read it."""
        if self.scale is None or self.bias is None:
            return self.data.float()
        return dequantize_int8_rowwise(self.data, self.scale, self.bias)

    def with_zero_row(self) -> QuantizedTable:
        """(N + 1, D): the same rows and a last one that reads as exact zeros (a dynamic table's
        row for ids not resident; the quantization of a zero row)."""
        data = torch.cat([self.data, self.data.new_zeros(1, self.data.shape[1])])
        if self.scale is None or self.bias is None:
            return QuantizedTable(self.precision, data)
        return QuantizedTable(self.precision, data,
                              torch.cat([self.scale, self.scale.new_zeros(1)]),
                              torch.cat([self.bias, self.bias.new_zeros(1)]))


def quantize_int8_rowwise(table: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q (N, D) uint8, scale (N,) float32, bias (N,) float32)`` of a finite (N, D) table.

    The codes are computed in float64 against the stored (float32) scale and bias, so rounding
    picks the nearest code of what dequantization will compute.
    """
    x = table.detach().double()  # (N, D)
    lo = x.amin(dim=1)  # (N,)
    bias = lo.float()  # the row minima, stored (exact: float32 values)
    scale = ((x.amax(dim=1) - lo) / LEVELS).float()  # (N,)
    step = torch.where(scale > 0, scale.double(), 1.0)  # (N,) no division by zero
    q = ((x - bias.double()[:, None]) / step[:, None]).round().clamp(0, LEVELS)  # (N, D)
    q = torch.where(scale[:, None] > 0, q, 0.0)  # a constant row: bias alone
    return q.to(torch.uint8), scale, bias


def dequantize_int8_rowwise(q: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor) -> torch.Tensor:
    """(n, D) float32 ``q * scale + bias`` of (n, D) uint8 codes and their (n,) scales, biases."""
    return q.float() * scale[:, None] + bias[:, None]  # (n, D)


def quantize_table(table: torch.Tensor, precision: str, *, name: str = "table",
                   rows: torch.Tensor | None = None) -> QuantizedTable:
    """A table's rows at ``precision``: ``"int8"`` (row-wise, a scale and bias per row) or
    ``"fp16"``.

    Args:
        table: (N, D) floating-point rows.
        precision: ``"int8"`` or ``"fp16"``.
        name: the table's name, for error messages.
        rows: (N,) the table's row numbers of ``table``'s rows, when they are some rows of a
            table (a follower's delta): error messages name those; None: ``0 .. N-1``.

    Returns:
        A ``QuantizedTable``; ``rows(index)`` gathers and dequantizes, ``nbytes`` is its size.

    Raises:
        ValueError: an unknown precision; for int8 a row with NaN / inf, or whose range
            ``max - min`` float32 cannot hold; for fp16 a finite value beyond fp16's range.

    Example:
        >>> import torch, embcore as ec
        >>> q = ec.quantize_table(torch.tensor([[0.0, 1.0, 0.5], [2.0, 2.0, 2.0]]), "int8")
        >>> q.data.dtype, q.nbytes   # 3 codes + 8 bytes a row
        (torch.uint8, 22)
        >>> q.rows(torch.tensor([1]))
        tensor([[2., 2., 2.]])
    """
    check_precision(precision, name)
    if table.dim() != 2 or not table.is_floating_point():
        raise ValueError(f"table {name!r}: expected (N, D) floating-point rows, got "
                         f"{tuple(table.shape)} {table.dtype}")
    check_not_scaled(table, name)
    table = table.detach()

    def row_of(i: int) -> int:  # (the table's row, for messages)
        return i if rows is None else int(rows[i])

    if precision == "fp16":
        half = table.to(torch.float16)
        over = torch.isinf(half) & torch.isfinite(table)
        if bool(over.any()):
            row = int(over.any(dim=1).nonzero()[0])
            largest = float(table[row][over[row]].abs().max())  # (the row's, not the table's)
            raise ValueError(f"table {name!r}: row {row_of(row)} holds values beyond fp16's range "
                             f"(+-65504; the largest |x| of that row beyond it "
                             f"{largest:.6g}); serve it as 'int8' or unquantized (None)")
        return QuantizedTable("fp16", half)
    bad = ~torch.isfinite(table).all(dim=1)  # (N,)
    if bool(bad.any()):
        raise ValueError(f"table {name!r}: row {row_of(int(bad.nonzero()[0]))} holds NaN or inf, "
                         f"which int8 codes cannot hold; serve it unquantized (None) or fix the "
                         f"row")
    q, scale, bias = quantize_int8_rowwise(table)
    wide = ~torch.isfinite(scale * LEVELS)  # (N,) the dequantized maximum would overflow
    if bool(wide.any()):
        row = int(wide.nonzero()[0])
        raise ValueError(f"table {name!r}: row {row_of(row)} spans [{float(table[row].min()):.4g}, "
                         f"{float(table[row].max()):.4g}], a range float32 cannot hold; "
                         f"serve it unquantized (None)")
    return QuantizedTable("int8", q, scale, bias)


def check_precision(precision: Any, name: str) -> None:
    """ValueError unless ``precision`` is ``"int8"`` or ``"fp16"``."""
    if not (isinstance(precision, str) and precision in PRECISIONS):
        raise ValueError(f"table {name!r}: quantize={precision!r} is not one of "
                         f"{[None, *PRECISIONS]} (None: float32 as trained)")


def resolve_quantize(quantize: Any, names: Mapping[TableConfig, str]
                     ) -> dict[TableConfig, str | None]:
    """Each served table's precision (None: as it is) from ``for_serving``'s ``quantize``.

    Args:
        quantize: None, ``"fp16"`` / ``"int8"`` for every table, or a mapping from table names
            (or TableConfigs) to None / ``"fp16"`` / ``"int8"``; tables it leaves out stay as
            they are.
        names: the served tables and their names.

    Raises:
        ValueError: an unknown precision (naming the table), or a table not served.
        TypeError: ``quantize`` of another type.
    """
    if quantize is None or isinstance(quantize, str):
        for name in names.values():
            if quantize is not None:
                check_precision(quantize, name)
        return dict.fromkeys(names, quantize)
    if not isinstance(quantize, Mapping):
        raise TypeError(f"quantize must be None, 'fp16', 'int8' or a mapping of table names to "
                        f"those, got {type(quantize).__name__}")
    by_name = {n: t for t, n in names.items()}
    out: dict[TableConfig, str | None] = dict.fromkeys(names)
    for key, precision in quantize.items():
        table = key if isinstance(key, TableConfig) and key in names else by_name.get(key)
        if table is None:
            label = key.name if isinstance(key, TableConfig) else key
            raise ValueError(f"quantize names table {label!r}, which is not served here; the "
                             f"served tables are {sorted(by_name)}")
        if precision is not None:
            check_precision(precision, names[table])
        out[table] = precision
    return out


def check_not_scaled(table: torch.Tensor, name: str) -> None:
    """Refuses 8-bit codes given without their scales (an 8-bit table's parameters alone)."""
    if table.dtype in SCALED:
        raise ValueError(f"table {name!r}: {str(table.dtype).removeprefix('torch.')} rows are "
                         f"codes whose values are code * scale; pass the values (codes.float() "
                         f"* scales, the state_dict's '{name}/scales'), or serve the layer with "
                         f"for_serving(), which widens them")
