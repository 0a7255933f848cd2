"""Independent oracles: what the package computes, written again from the docs' formulas in plain
numpy and Python (no embcore code, no torch math), for the expected side of property tests.

- the random bits of stochastic rounding and the rounding of float32 values into float16 /
  bfloat16, from docs/semantics.md section 14;
- the default initial values of a dynamic table's new ids, from section 9.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

M64 = (1 << 64) - 1
M32 = (1 << 32) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """uint64 -> uint64: Steele, Lea and Flood's splitmix64 finalizer (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def lowbias32(x: np.ndarray) -> np.ndarray:
    """uint32 -> uint32: Wellons' lowbias32."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint32)
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))


def random_bits(identities: list[int], step: int, dim: int, col0: int = 0) -> np.ndarray:
    """(U, dim) uint32: ``u_c`` of rows of identities ``identities`` (Python ints, taken mod
    2**64) at ``step``, columns ``col0 ..``: ``k = splitmix64(splitmix64(identity) ^
    splitmix64(step))``, ``u_c = lowbias32((low32(k) ^ high32(k)) + c * 0x9E3779B9)``."""
    ident = np.array([i & M64 for i in identities], dtype=np.uint64)
    k = splitmix64(splitmix64(ident) ^ splitmix64(np.array([step & M64], dtype=np.uint64)))
    key32 = ((k & np.uint64(M32)) ^ (k >> np.uint64(32))).astype(np.uint64)  # (U,)
    cols = np.arange(col0, col0 + dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return lowbias32((key32[:, None] + cols[None, :] * np.uint64(0x9E3779B9))
                         & np.uint64(M32))


def _bits32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.int64)


def round_nearest(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> int64 16-bit patterns, to nearest even: numpy's float16 conversion; bfloat16
    as the top 16 bits after adding 0x7FFF plus the kept part's lowest bit (NaN: a quiet NaN)."""
    if dtype == "float16":
        with np.errstate(over="ignore", invalid="ignore"):  # (infinite from 65520: as wanted)
            half = np.asarray(x, dtype=np.float32).astype(np.float16)
        return half.view(np.uint16).astype(np.int64)
    b = _bits32(x)
    h = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0 | (b >> 16 & 0x8000), h & 0xFFFF)


def round_stochastic(x: np.ndarray, u: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``x`` and uint32 ``u`` (same shape) -> int64 16-bit patterns by the documented
    rule: ``u >> 16`` (bfloat16) or ``u >> 19`` (a normal float16 result) added below the kept
    bits of |x|, the rest truncated; a float16 subnormal result ``|x| + (u >> 8) * 2**-48`` in
    float32, truncated to a multiple of ``2**-24``; float16 infinite from 65536; NaN a NaN."""
    b = _bits32(x)
    u = u.astype(np.int64)
    sign, a = b & 0x80000000, b & 0x7FFFFFFF
    nan = a > 0x7F800000
    if dtype == "bfloat16":
        h = (sign | (a + (u >> 16))) >> 16
        return np.where(nan, 0x7FC0, h & 0xFFFF)
    normal = np.minimum(((a + (u >> 19)) >> 13) - (112 << 10), 0x7C00)  # exponent 127 -> 15
    mag = np.where(a < 0x38800000, a, 0).astype(np.uint32).view(np.float32)  # (subnormal ones)
    sub = mag + (u >> 8).astype(np.float32) * np.float32(2.0 ** -48)  # float32 arithmetic
    subnormal = np.floor(sub.astype(np.float64) * 2.0 ** 24).astype(np.int64)
    h = np.where(a >= 0x38800000, normal, subnormal)  # |x| >= 2**-14: a normal result
    return (sign >> 16) | np.where(nan, 0x7E00, h)


def same_patterns(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    """16-bit patterns equal, any NaN equal to any NaN."""
    got, want = got.astype(np.int64) & 0xFFFF, want.astype(np.int64) & 0xFFFF
    exp, frac = (0x7C00, 0x3FF) if dtype == "float16" else (0x7F80, 0x7F)

    def is_nan(h):
        return ((h & exp) == exp) & ((h & frac) != 0)
    return bool(((got == want) | (is_nan(got) & is_nan(want))).all())


def truncated_normal_initial_values(seed: int, ids: list[int], dim: int) -> np.ndarray:
    """(n, dim) float32: the default initial values of raw ids ``ids`` of a dynamic table of
    width ``dim`` and seed ``seed`` (TF's truncated normal, stddev ``1/sqrt(dim)``, cut at 2):
    ``u = ((splitmix64(splitmix64(splitmix64(id) ^ seed) + c) >> 11) + 0.5) / 2**53``, then
    ``Phi^-1(Phi(-2) + u (Phi(2) - Phi(-2))) / sqrt(dim)``, with Python's own normal
    distribution (``statistics.NormalDist``: another algorithm than the package's Acklam)."""
    normal = statistics.NormalDist()
    lo, hi = normal.cdf(-2.0), normal.cdf(2.0)
    key = splitmix64(splitmix64(np.array([i & M64 for i in ids], dtype=np.uint64))
                     ^ np.uint64(seed & M64))
    with np.errstate(over="ignore"):
        bits = splitmix64(key[:, None] + np.arange(dim, dtype=np.uint64)[None, :]) \
            >> np.uint64(11)
    u = (bits.astype(np.float64) + 0.5) * 2.0 ** -53
    out = [[normal.inv_cdf(lo + x * (hi - lo)) / math.sqrt(dim) for x in row] for row in u]
    return np.array(out, dtype=np.float32).reshape(len(ids), dim)
