"""The compressed exchange's codec: rows and gradients on the wire as bf16, fp16 or fp8.

``ExchangeCompression`` (config/exchange.py) names a format per direction; exchange.py sends a
sharded table's rows (forward) and row gradients (backward) through a ``Wire`` of it when it is
not fp32. Every format works a row at a time, so a matrix's rows can be encoded at once and then
split among the ranks:
- ``bf16``: each value rounded to bfloat16 (to nearest even), 2 bytes; relative error <= 2^-8.
- ``fp16``: each row divided by its scale ``max|x| / 65504`` (a float32 sent with the row) and
  rounded to float16; 2 bytes a value + 4 a row; relative error <= 2^-11 of the value, plus at
  most 2^-25 * scale for the smallest values of the row (float16's subnormals). The scale keeps
  tiny gradients (below float16's 6e-5) from flushing to zero and large rows from overflowing.
- ``fp8``: the same with float8_e4m3fn and ``max|x| / 448``; 1 byte a value + 4 a row; relative
  error <= 2^-4, plus at most 2^-10 * scale.
An all-zero row travels as zeros; a row holding a NaN or an infinity arrives as NaNs under fp16
and fp8 (bf16 keeps each value's own NaN or infinity). Rows whose dtype is the wire's already (a
bfloat16 table under bf16, a float16 one under fp16) travel as they are, exactly.

Error feedback (the backward only): ``ExchangeCodec.gradients`` adds to each row's gradient what
compressing that row lost the last time this process sent it, when that was the previous step
that sent any gradient of the table, and keeps what it loses now: per sharded physical table one
``(U, D)`` float32 residual and its ``(U,)`` ids, U the rows this process sent at its latest
step (docs/semantics.md section 5).
"""

from __future__ import annotations

import torch

from ..config.exchange import ExchangeCompression

_WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
_SCALE_BYTES = 4  # a row's float32 scale, sent after its values


class Wire:
    """One format's encoding of (n, d) rows (a row at a time)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype = _WIRE[name]
        self.scaled = name != "bf16"  # a float32 scale per row
        self.largest = float(torch.finfo(self.dtype).max)  # 65504 (fp16), 448 (fp8)

    def carries(self, dtype: torch.dtype) -> bool:
        """Whether rows of ``dtype`` travel as they are (they are in the wire's dtype)."""
        return dtype == self.dtype

    def width(self, d: int) -> int:
        """Bytes of the encoding of a row of ``d`` values."""
        return d * self.dtype.itemsize + (_SCALE_BYTES if self.scaled else 0)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(n, d) rows of any float dtype -> (n, width(d)) uint8 bytes (what every backend
        exchanges)."""
        if not self.scaled:
            q = x.to(self.dtype).contiguous()  # (n, d)
            return q.view(torch.uint8).view(q.shape[0], q.shape[1] * q.itemsize)
        x32 = x.float()  # (n, d)
        amax = (x32.abs().amax(dim=1, keepdim=True) if x32.shape[1]
                else x32.new_zeros(x32.shape[0], 1))  # (n, 1); NaN when the row holds one
        scale = torch.where(amax == 0, 1.0, amax / self.largest)  # (n, 1)
        q = (x32 / scale).to(self.dtype)  # (n, d), within +-largest
        return torch.cat([q.view(torch.uint8).view(q.shape[0], q.shape[1] * q.itemsize),
                          scale.view(torch.uint8)], dim=1)  # (n, d * size + 4)

    def decode(self, y: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
        """``encode``'s (n, width(d)) -> (n, d) rows of ``dtype``."""
        if not (y.shape[0] and d):
            return torch.zeros(y.shape[0], d, dtype=dtype, device=y.device)
        if not self.scaled:
            return _fresh(y).view(self.dtype).to(dtype)  # (n, d)
        k = d * self.dtype.itemsize  # (copies: a view of other bytes needs aligned storage)
        q = _fresh(y[:, :k]).view(self.dtype)  # (n, d)
        scale = _fresh(y[:, k:]).view(torch.float32)  # (n, 1)
        return (q.float() * scale).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What (n, d) ``x`` arrives as (``decode(encode(x))``)."""
        return self.decode(self.encode(x), x.shape[1], x.dtype)


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` at the start of its own storage."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class ExchangeCodec:
    """An engine's compressed exchange: its formats and its error feedback's residuals."""

    def __init__(self, compression: ExchangeCompression) -> None:
        self.compression = compression
        self.forward = None if compression.forward == "fp32" else Wire(compression.forward)
        self.backward = None if compression.backward == "fp32" else Wire(compression.backward)
        # per (physical table, member of a stacked raw-id table): the ids (ascending) and
        # residuals of the rows this process last sent gradients of: ((U,), (U, D) float32)
        self._residuals: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def of(cls, compression: ExchangeCompression) -> ExchangeCodec | None:
        """The codec of ``compression``; None when nothing is compressed (fp32 both ways)."""
        return cls(compression) if compression.lossy else None

    def rows_wire(self, dtype: torch.dtype) -> Wire | None:
        """The forward wire of rows of ``dtype`` (None: they travel as they are)."""
        w = self.forward
        return None if w is None or w.carries(dtype) else w

    def gradients_wire(self, dtype: torch.dtype) -> Wire | None:
        """The backward wire of gradients of ``dtype`` (None: they travel as they are)."""
        w = self.backward
        return None if w is None or w.carries(dtype) else w

    def residual_bytes(self) -> int:
        """Bytes the error feedback's residuals take on this process."""
        return sum(i.numel() * i.element_size() + r.numel() * r.element_size()
                   for i, r in self._residuals.values())

    def gradients(self, wire: Wire, physical: int, unique: torch.Tensor,
                  segments: tuple[tuple[int, int], ...] | None, g: torch.Tensor,
                  columns: list[tuple[int, int]] | None = None) -> list[torch.Tensor]:
        """The encoding of a table's (U, D) row gradients ``g`` (of the rows ``unique``), with
        the error feedback when it is on.

        Args:
            wire: ``gradients_wire``'s. physical: the physical table.
            unique: (U,) the rows' ids; segments: a stacked raw-id table's runs of ``unique``
                by member (``(member, count)``; the same id in two members is two rows).
            columns: the column ranges to encode separately (a column split), or None.

        Returns:
            per column range (one when ``columns`` is None) the (U, width) encoding.
        """
        feedback = self.compression.error_feedback
        runs = [(0, unique.numel())] if segments is None else list(segments)
        if feedback:
            g = g.clone()  # (U, D), float32
            start = 0
            for member, n in runs:
                self._add_residual((physical, member), unique[start:start + n],
                                   g[start:start + n])
                start += n
        ranges = columns if columns is not None else [(0, g.shape[1])]
        out = [wire.encode(g[:, c0:c1]) for c0, c1 in ranges]  # per range (U, width)
        if feedback:
            sent = torch.cat([wire.decode(e, c1 - c0, g.dtype)
                              for e, (c0, c1) in zip(out, ranges)], dim=1)  # (U, D)
            lost = torch.nan_to_num(g - sent, nan=0.0, posinf=0.0, neginf=0.0)  # (U, D)
            start = 0
            for member, n in runs:
                ids, kept = unique[start:start + n], lost[start:start + n]
                if n > 1 and not bool((ids[1:] > ids[:-1]).all()):  # (a static table's are)
                    order = ids.argsort()
                    ids, kept = ids.index_select(0, order), kept.index_select(0, order)
                self._residuals[(physical, member)] = (ids, kept)
                start += n
        return out

    def _add_residual(self, key: tuple[int, int], ids: torch.Tensor, g: torch.Tensor) -> None:
        """Adds the residuals kept under ``key`` to the rows of (n, D) ``g`` (ids ``ids``) that
        have one."""
        kept = self._residuals.get(key)
        if kept is None or not ids.numel():
            return
        kept_ids, residual = kept  # (K,) ascending, (K, D)
        if not kept_ids.numel():
            return
        pos = torch.searchsorted(kept_ids, ids).clamp_(max=kept_ids.numel() - 1)  # (n,)
        rows = (kept_ids.index_select(0, pos) == ids).nonzero().squeeze(1)  # (h,) with one
        g.index_add_(0, rows, residual.index_select(0, pos.index_select(0, rows)).to(g.dtype))
