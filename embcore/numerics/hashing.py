"""64-bit hashing of raw ids, in torch int64 ops: owners of ids and their initial values.

Raw ids (dynamic tables, docs/semantics.md section 9) are placed and initialized by functions of the
id alone, so the same id lands on the same process and starts from the same values wherever and
whenever it is admitted:

- ``splitmix64(x)``: the output of the SplitMix64 generator seeded with ``x``, i.e. the standard
  64-bit finaliser applied to ``x + 0x9E3779B97F4A7C15`` (shifts are logical, products wrap modulo
  2**64); as int64 holding the unsigned value's bits.
- ``owner(ids, W)``: ``splitmix64(id) % W`` with the hash read as unsigned.
- ``uniform(seed, ids, D)``: ``(n, D)`` float64 values in (0, 1), entry ``(i, j)`` from
  ``splitmix64(splitmix64(seed ^ splitmix64(id_i)) + j)``'s top 53 bits.

int64 tensors wrap on overflow in torch's CPU and CUDA kernels; tests/test_dynamic.py checks every
function against Python integers.
"""

from __future__ import annotations

import torch

GAMMA = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def _signed(u: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """(n,) int64 -> (n,) int64: SplitMix64's output for seed ``x`` (bits of the uint64)."""
    z = x.to(torch.int64) + _signed(GAMMA)
    z = (z ^ _shr(z, 30)) * _signed(M1)
    z = (z ^ _shr(z, 27)) * _signed(M2)
    return z ^ _shr(z, 31)


def splitmix64_int(x: int) -> int:
    """The same on one Python int (a reference for tests, and for seeds)."""
    z = (x + GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * M1) & MASK64
    z = ((z ^ (z >> 27)) * M2) & MASK64
    return z ^ (z >> 31)


def owner(ids: torch.Tensor, world: int) -> torch.Tensor:
    """(n,) int64 process of each raw id: ``splitmix64(id) % world``, the hash unsigned."""
    h = splitmix64(ids)
    if world == 1:
        return torch.zeros_like(h)
    low = (h & ((1 << 63) - 1)) % world  # the low 63 bits; the top bit adds 2**63 % world
    top = (h < 0).to(torch.int64) * ((1 << 63) % world)
    return (low + top) % world


def uniform(seed: int, ids: torch.Tensor, dim: int) -> torch.Tensor:
    """(n, dim) float64 in (0, 1): a function of ``seed``, the id and the column only."""
    key = splitmix64(splitmix64(ids) ^ _signed(seed & MASK64))  # (n,)
    cols = torch.arange(dim, dtype=torch.int64, device=ids.device)  # (dim,)
    bits = _shr(splitmix64(key[:, None] + cols[None, :]), 11)  # (n, dim) 53-bit integers
    return (bits.to(torch.float64) + 0.5) * 2.0**-53
