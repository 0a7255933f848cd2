"""Compact rows: float32 results rounded into float16 / bfloat16 rows, to nearest or stochastically.

A table of ``TableConfig(dtype=torch.float16 | torch.bfloat16)`` keeps its rows in 16 bits; an
update widens them, computes in float32 and rounds the result back (docs/semantics.md section 14).
This module is the readable reference of that rounding, in torch integer ops, bit for bit what
the fused kernels do (csrc/half.h):

- to nearest: IEEE round-to-nearest-even, ``x.to(dtype)``;
- stochastically (the default): ``x`` becomes one of the two 16-bit values around it, the one
  away from zero with probability ``|x - toward_zero(x)| / ulp``, so that ``E[round(x)] = x``:
  32 random bits ``u`` are added below the bits the 16-bit value keeps (bfloat16: ``u >> 16``
  below its 16; float16: ``u >> 19`` below a normal result's 10 mantissa bits) and the rest
  truncated; a float16 subnormal result (``|x| < 2**-14``) is ``|x| + (u >> 8) * 2**-48`` in
  float32, truncated to a multiple of ``2**-24`` (unbiased to within float32's rounding of that
  sum: ``2**-14`` of an ulp). From 65536 (and what carries into it) a float16 result is
  infinite.
- the random bits of a row are a function of its identity (the table's key plus its logical row,
  or plus the raw id of a dynamic table), the step and the logical column alone::

      k   = splitmix64(splitmix64(identity) ^ splitmix64(step))
      u_c = lowbias32((low32(k) ^ high32(k)) + c * 0x9E3779B9 mod 2**32)

  so the same row rounds the same way whatever the threads, the sharding, the stacking, the
  budget or the pipelining.

8-bit rows (``TableConfig(dtype=torch.float8_e4m3fn | torch.float8_e5m2)``) keep a float32 scale
per row (their value is ``float32(code) * scale``). ``quantize`` writes a float32 row as codes
and a scale: ``scale = max|x| / max_finite`` over the row's finite values (448 for e4m3fn, 57344
for e5m2; 1 for a row without a finite non-zero value, or whose scale would underflow to 0), then
``x / scale`` clamped to +-max_finite and rounded into the 8-bit dtype, to nearest (even) or
stochastically with the same bits as a 16-bit row: ``u >> 12`` (e4m3fn, 3 mantissa bits kept)
or ``u >> 11`` (e5m2, 2) added below a normal result's kept bits and the rest truncated; a
subnormal result (``|q| < 2**-6`` for e4m3fn, ``2**-14`` for e5m2) is ``|q| + (u >> 8) * 2**-24
* spacing`` in float32 truncated to a multiple of the spacing (``2**-9``, ``2**-16``); a
result past max_finite (a carry from just below it) is clamped to it. NaN stays NaN; an infinity
is an infinity in e5m2 and NaN in e4m3fn (which has none).

``Segments`` maps a shard's rows to identities (one affine piece per logical table in the shard);
``Rounding`` is what an update of one physical table needs: stochastic or not, the segments, the
first column of the shard and the step's key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config.dtypes import SCALED
from ..config.tables import init_seed
from .hashing import MASK64, _shr, _signed, splitmix64, splitmix64_int

COMPACT = (torch.float16, torch.bfloat16)
# 8-bit rows: (bits dropped below a normal result's mantissa, smallest normal, subnormal spacing)
_FP8 = {torch.float8_e4m3fn: (20, 2.0**-6, 2.0**-9), torch.float8_e5m2: (21, 2.0**-14, 2.0**-16)}
# The tables the kernels read and write (CPU, csrc/half.h's RowType; Triton's ROWS): their codes.
ROW_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9


def step_key(step: int) -> int:
    """``splitmix64(step)`` as the int64 with its bits (a kernel argument)."""
    return _signed(splitmix64_int(int(step) & MASK64))


def table_key(base_seed: int, name: str) -> int:
    """A table's key (the base of its rows' identities): a function of the engine's seed and the
    table's name, as int64 bits."""
    return _signed(splitmix64_int(init_seed(base_seed, name, -2) & MASK64))


def affine(rows: torch.Tensor) -> tuple[int, int]:
    """``(first, stride)`` of logical rows ``rows`` (a placement's ``held_rows``): every
    placement holds rows ``first + i * stride``."""
    n = rows.numel()
    first = int(rows[0]) if n else 0
    stride = int(rows[1] - rows[0]) if n > 1 else 1
    if n > 1 and not torch.equal(rows, first + stride * torch.arange(n, dtype=rows.dtype)):
        raise ValueError("a placement's rows must be evenly spaced for their rounding keys")
    return first, stride


def shard_segments(members: list[tuple[str, int, torch.Tensor]], base_seed: int,
                   rows: int) -> Segments:
    """The segments of a physical table's shard: per member ``(name, first shard row, its
    logical rows)``, then the shard's row count ``rows``."""
    starts, bases, muls = [], [], []
    for name, start, logical in members:
        first, stride = affine(logical)
        starts.append(start)
        bases.append(_signed((table_key(base_seed, name) + first) & MASK64))
        muls.append(stride)
    i64 = torch.int64
    return Segments(torch.tensor(starts + [rows], dtype=i64), torch.tensor(bases, dtype=i64),
                    torch.tensor(muls, dtype=i64))


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """int64 tensors of uint32 values -> the same: Wellons' lowbias32 (products wrap; the low 32
    bits of an int64 product are the uint32 product's)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_keys(identities: torch.Tensor, key_of_step: int) -> torch.Tensor:
    """(U,) int64 identities -> (U,) int64 uint32 values: each row's ``low32(k) ^ high32(k)``."""
    k = splitmix64(splitmix64(identities) ^ key_of_step)
    return (k & MASK32) ^ _shr(k, 32)


def column_bits(keys32: torch.Tensor, dim: int, col0: int = 0) -> torch.Tensor:
    """(U,) row keys -> (U, dim) int64 uint32 random bits of columns ``col0 .. col0 + dim``."""
    cols = torch.arange(col0, col0 + dim, dtype=torch.int64, device=keys32.device)
    return lowbias32((keys32[:, None] + cols[None, :] * GOLDEN32) & MASK32)


def round_stochastic(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` rounded to ``dtype`` stochastically with the uint32 random ``bits`` (int64,
    ``x``'s shape): csrc/half.h's rule."""
    b = x.contiguous().view(torch.int32).to(torch.int64) & MASK32
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    if dtype == torch.bfloat16:
        h = torch.where(nan, 0x7FC0, (b + (bits >> 16)) >> 16)
    elif dtype == torch.float16:
        sign = (b >> 16) & 0x8000
        a = b & 0x7FFFFFFF
        hn = (((a + (bits >> 19)) >> 13) - 0x1C000).clamp(max=0x7C00)
        # a subnormal result: |x| + (u >> 8) * 2**-48 in float32, truncated to 2**-24's multiples
        mag = a.to(torch.int32).view(torch.float32)
        sub = mag + (bits >> 8).to(torch.float32) * 2.0**-48
        sub = torch.where(sub < 2.0**-13, sub, 0.0)
        hs = (sub * 2.0**24).to(torch.int32).to(torch.int64)
        h = sign | torch.where(nan, 0x7E00, torch.where(a >= 0x38800000, hn, hs))
    elif dtype in _FP8:
        return _round_fp8(x, b, bits, dtype)
    else:
        raise TypeError(f"stochastic rounding rounds into {COMPACT + SCALED}, not {dtype}")
    return h.to(torch.int32).to(torch.int16).view(dtype)


def _round_fp8(x: torch.Tensor, b: torch.Tensor, bits: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """float32 ``x`` (its bits ``b``, int64) rounded stochastically into an 8-bit ``dtype``, the
    quotient already within +-max_finite but for a carry (clamped): the module's rule."""
    drop, normal, spacing = _FP8[dtype]
    top = torch.finfo(dtype).max
    a = b & 0x7FFFFFFF
    hn = ((a + (bits >> (32 - drop))) >> drop) << drop  # (a normal result's kept bits)
    mag_n = hn.to(torch.int32).view(torch.float32)
    mag = a.to(torch.int32).view(torch.float32)
    sub = mag + (bits >> 8).to(torch.float32) * (2.0**-24 * spacing)
    mag_s = torch.floor(sub / spacing) * spacing
    out = torch.where(mag >= normal, mag_n, mag_s).clamp(max=top)
    out = torch.where(x < 0, -out, out)
    return _to8(torch.where(torch.isfinite(x), out, x), dtype)


def _to8(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``q`` (finite ones within range) to an 8-bit ``dtype`` to nearest (even): an
    infinity is NaN in e4m3fn, which has none (torch's conversion would saturate it)."""
    if dtype == torch.float8_e4m3fn:
        q = torch.where(torch.isinf(q), torch.nan, q)
    return q.to(dtype)


def row_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(U, D) float32 rows -> (U, 1) float32 scales for an 8-bit ``dtype``: ``max|x| /
    max_finite`` over each row's finite values; 1 where that is 0 (a row of zeros, or of no
    finite value, or a scale below float32's range)."""
    a = torch.where(torch.isfinite(x), x.abs(), 0.0)
    s = a.amax(dim=1, keepdim=True) / torch.finfo(dtype).max  # (U, 1)
    return torch.where(s > 0, s, 1.0)


def quantize(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, D) float32 rows -> ``(codes (U, D) of dtype, scales (U, 1) float32)``: to nearest,
    or stochastically with the uint32 random ``bits`` (int64, ``x``'s shape)."""
    x = x.to(torch.float32)
    scales = row_scales(x, dtype)  # (U, 1)
    top = torch.finfo(dtype).max
    q = x / scales  # (U, D)
    q = torch.where(torch.isfinite(q), q.clamp(-top, top), q)
    if bits is None:
        return _to8(q, dtype), scales
    return round_stochastic(q, bits.to(q.device), dtype), scales


def widen(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(U, D) 8-bit codes and their (U, 1) scales -> (U, D) float32 values."""
    return codes.to(torch.float32) * scales


@dataclass(frozen=True)
class Segments:
    """A shard's rows as identities: segment ``t`` covers shard rows ``[starts[t], starts[t+1])``,
    row ``k`` of it has identity ``bases[t] + (k - starts[t]) * muls[t]`` (uint64 arithmetic).

    One segment per logical table of a physical table (``bases`` its key plus the logical row of
    its first shard row, ``muls`` the stride of its placement's rows). A dynamic table has one
    segment from 0 with base the table's key and stride 1, and its raw ids as the rows."""

    starts: torch.Tensor  # (T + 1,) int64
    bases: torch.Tensor   # (T,) int64 (uint64 bits)
    muls: torch.Tensor    # (T,) int64

    def packed(self, device: torch.device) -> torch.Tensor:
        """(3, T) int64 starts, bases and strides on ``device`` (the Triton kernel's), copied
        there once and kept."""
        cache = self.__dict__.setdefault("_packed", {})
        out = cache.get(device)
        if out is None:
            n = self.bases.numel()
            out = cache[device] = torch.stack([self.starts[:n], self.bases, self.muls]).to(device)
        return out

    def identities(self, rows: torch.Tensor) -> torch.Tensor:
        """(U,) int64 identities of shard rows ``rows`` (U,)."""
        n = self.bases.numel()
        dev = rows.device
        starts, bases, muls = self.starts.to(dev), self.bases.to(dev), self.muls.to(dev)
        if n == 1:
            t = torch.zeros_like(rows)
        else:
            t = (torch.searchsorted(starts[:n], rows, right=True) - 1).clamp(min=0)
        return bases[t] + (rows - starts[t]) * muls[t]


@dataclass(frozen=True)
class Rounding:
    """How one update of a 16-bit table rounds its float32 results.

    ``stochastic`` False: to nearest (the rest is unused). Else the bits of each updated row
    ``r`` come from the identity of ``key_rows[r]`` (None: ``r`` itself) through ``segments``,
    columns from ``col0``, and ``key_of_step`` (``step_key(step)``). ``key_rows`` is indexed by
    the table's rows (a dynamic table's raw ids; the shard rows of an offloaded table's cache
    rows); rows past its end are their own."""

    stochastic: bool
    segments: Segments
    col0: int = 0
    key_of_step: int = 0
    key_rows: torch.Tensor | None = None

    def at(self, step: int, key_rows: torch.Tensor | None = None) -> Rounding:
        """This rounding at ``step``, the identities from ``key_rows`` (N,) (None: the rows)."""
        return replace(self, key_of_step=step_key(step), key_rows=key_rows)

    def keys32(self, rows: torch.Tensor) -> torch.Tensor:
        """(U,) int64 uint32 values: the row keys of updated rows ``rows`` (U,)."""
        keys = rows
        if self.key_rows is not None:  # (rows past its end are their own)
            n = self.key_rows.numel()
            kr = self.key_rows.to(rows.device)
            keys = torch.where(rows < n, kr[rows.clamp(max=max(n - 1, 0))], rows) if n else rows
        return row_keys(self.segments.identities(keys.to(torch.int64)), self.key_of_step)

    def round(self, values: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(U, D) float32 ``values`` of updated rows ``rows`` (U,) rounded to ``dtype``."""
        if not self.stochastic:
            return values.to(dtype)
        bits = column_bits(self.keys32(rows), values.shape[1], self.col0)
        return round_stochastic(values.to(torch.float32), bits.to(values.device), dtype)

    def quantize(self, values: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(U, D) float32 ``values`` of updated rows ``rows`` (U,) -> 8-bit ``dtype`` codes and
        (U, 1) float32 scales (``quantize``), with this rounding's bits."""
        if not self.stochastic:
            return quantize(values, dtype)
        bits = column_bits(self.keys32(rows), values.shape[1], self.col0)
        return quantize(values, dtype, bits)


def nearest() -> Rounding:
    """Rounding to nearest (for tables without stochastic rounding, and tests)."""
    z = torch.zeros(1, dtype=torch.int64)
    return Rounding(False, Segments(torch.zeros(2, dtype=torch.int64), z, z + 1))


def wider(stored: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether values of ``stored`` can lie beyond ``dtype``'s finite range."""
    if not stored.is_floating_point:
        return False
    return torch.finfo(stored).max > torch.finfo(dtype).max


def narrowed(wide: torch.Tensor, dtype: torch.dtype, key: str, source: str, stored_in: str,
             saturate: bool, fix: str | None = None) -> torch.Tensor:
    """``wide`` (a saved entry ``key``, ``"<table>/..."``, read at its stored dtype) rounded to
    nearest into ``dtype``, for a load from ``source`` (a path, or the method loading;
    ``stored_in``: "the checkpoint", "the published entries", "the state_dict"): a finite value
    that would become infinite is refused (ValueError naming the table, its rows and the
    largest such value, and ``fix``: by default, loading with ``saturate=True``), or with
    ``saturate`` stored as ``dtype``'s largest finite value of its sign (docs/semantics.md
    section 14)."""
    out = wide.to(dtype)
    over = torch.isfinite(wide) & ~torch.isfinite(out)  # (N, D)
    if not bool(over.any()):
        return out
    top = torch.finfo(dtype).max
    if saturate:
        return torch.where(over, torch.sign(wide).to(dtype) * top, out)
    rows = over.any(dim=1).nonzero().flatten().tolist() if over.dim() == 2 else []
    named = rows[:10] + (["..."] if len(rows) > 10 else [])
    largest = float(wide[over].abs().max())
    kind = str(dtype).removeprefix("torch.")
    raise ValueError(
        f"{source}: table {key.split('/')[0]!r} is {kind} here but its rows are stored "
        f"{str(wide.dtype).removeprefix('torch.')} in {stored_in}, and {len(rows)} row(s) "
        f"({', '.join(map(str, named))}) hold values beyond {kind}'s range (largest |x| "
        f"{largest:.6g}; {kind} holds +-{top:.6g}), which would load as infinite; nothing was "
        f"loaded. " + (fix or f"Load with saturate=True to store +-{top:.6g} instead, or into a "
                              f"wider table"))


def narrowed_for_load(value: Any, dtype: torch.dtype, key: str, source: str, stored_in: str,
                      saturate: bool, fix: str | None = None) -> Any:
    """``value``, to be copied into an entry of ``dtype``: a tensor of a wider floating dtype
    than a 16-bit ``dtype`` is ``narrowed`` (refused or saturated where it would become
    infinite); anything else is returned as it is. Every load path applies it: ``ec.load``,
    ``Embedding.load_state_dict``, the modules' ``load_state_dict``."""
    if (type(value) is torch.Tensor and dtype in COMPACT and value.is_floating_point()
            and wider(value.dtype, dtype)):
        return narrowed(value, dtype, key, source, stored_in, saturate, fix)
    return value


def clamp_fix(dtype: torch.dtype) -> str:
    """How to load values beyond ``dtype``'s range where no ``saturate=`` is taken (a module's
    ``load_state_dict``): the ending of ``narrowed``'s message."""
    top = torch.finfo(dtype).max
    return (f"Clamp them to +-{top:.6g} first (tensor.clamp(-{top:.6g}, {top:.6g})), or load into "
            f"a wider table")
