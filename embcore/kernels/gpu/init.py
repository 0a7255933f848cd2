"""The GPU kernel that writes a dynamic table's new rows, in Triton: hash -> uniform -> normal.

Imported only by ``kernels/gpu/ops.py``, on first use, like ``rows.py`` (without triton it
still imports: kernels/gpu/lang.py). ``init_rows_kernel`` writes, for every ``i < n`` where
``take[i]`` is set, row ``rows[i]`` of ``out`` (columns ``col0 .. col0 + C`` of the logical
table) with the default initial values of raw id ``ids[i]`` (``vocabulary.initial_values``):

- ``key = splitmix64(splitmix64(id) ^ seed)``, ``bits = splitmix64(key + column) >> 11`` (53
  bits), ``u = (bits + 0.5) 2**-53`` (numerics/hashing.py's ``uniform``);
- ``p = lo + u * span``; ``x = inverse_normal(p)`` (Acklam's approximation, the coefficients and
  the order of operations of numerics/normal.py's ``inverse_normal``), all in float64;
- ``out = float32(x / div)``, then the table's dtype, rounded to nearest (even) as
  ``Tensor.to`` rounds (a bfloat16 table, ``BF16``, is written as int16: its rounding done on the
  float32 bits, the same compiled and interpreted).

The float64 constants (the coefficients, ``lo``, ``span``, ``div``) come from a tensor
(``CONSTANTS``' order), not from literals, which Triton may hold as float32. The launch turns
off the fusion of a product and a sum into one fused multiply-add (``enable_fp_fusion``), so
that each operation rounds as torch's do on the CPU. Each program writes ``BLOCK_N`` rows by
``BLOCK_D`` columns.
"""

from __future__ import annotations

from .lang import jit, tl  # (None where triton is missing)

# the constants tensor's layout: A (6), B (5), C (6), D (4), p_low, 1 - p_low, lo, span, div
CONSTANTS = ("a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1", "b2", "b3", "b4",
             "c0", "c1", "c2", "c3", "c4", "c5", "d0", "d1", "d2", "d3",
             "p_low", "p_high", "lo", "span", "div")


@jit
def _mix(z):
    """SplitMix64's output for seed ``z`` (uint64 lanes; products wrap)."""
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@jit
def _poly(x, k_ptr, FIRST: tl.constexpr, COUNT: tl.constexpr):
    """Horner's rule over the coefficients ``k[FIRST : FIRST + COUNT]`` (highest first)."""
    out = tl.zeros_like(x) + tl.load(k_ptr + FIRST)
    for c in tl.static_range(1, COUNT):
        out = out * x + tl.load(k_ptr + FIRST + c)
    return out


@jit
def init_rows_kernel(ids_ptr, rows_ptr, take_ptr, n, out_ptr, stride, C, col0, seed, k_ptr,
                     BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = i < n
    live = live & (tl.load(take_ptr + i, mask=live, other=0) != 0)
    ident = tl.load(ids_ptr + i, mask=live, other=0).to(tl.uint64, bitcast=True)
    row = tl.load(rows_ptr + i, mask=live, other=0)
    s = tl.full((BLOCK_N,), seed, tl.int64).to(tl.uint64, bitcast=True)
    key = _mix(_mix(ident) ^ s)  # (BLOCK_N,)
    col = (col0 + j).to(tl.uint64, bitcast=True)  # (BLOCK_D,)
    bits = _mix(key[:, None] + col[None, :]) >> 11  # (BLOCK_N, BLOCK_D) 53 bits
    u = (bits.to(tl.int64, bitcast=True).to(tl.float64) + 0.5) * 1.1102230246251565e-16
    p = tl.load(k_ptr + 23) + u * tl.load(k_ptr + 24)
    # inverse_normal(p)
    q = p - 0.5
    r = q * q
    central = _poly(r, k_ptr, 0, 6) * q / (_poly(r, k_ptr, 6, 5) * r + 1.0)
    lower = p < tl.load(k_ptr + 21)
    t = tl.sqrt(-2.0 * tl.log(tl.where(lower, p, 1.0 - p)))
    tail = _poly(t, k_ptr, 11, 6) / (_poly(t, k_ptr, 17, 4) * t + 1.0)
    tail = tl.where(lower, tail, -tail)
    x = tl.where(lower | (p > tl.load(k_ptr + 22)), tail, central)
    v = (x / tl.load(k_ptr + 25)).to(tl.float32)
    if BF16:  # rounded to nearest (even) by its bits: out is the bfloat16 table as int16
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        w = b.to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        w = v.to(out_ptr.dtype.element_ty)
    m = live[:, None] & (j < C)[None, :]
    tl.store(out_ptr + row[:, None] * stride + j[None, :], w, mask=m)
