"""The standard normal's inverse CDF, in torch ops: what a dynamic table's new rows start from.

``inverse_normal`` is Acklam's rational approximation (relative error below 1.15e-9), the
operations in the order the kernels follow (the fused CPU kernels' csrc/vocab.h, the Triton
kernel of kernels/gpu/init.py), so that each gives the same bits; ``PHI_LO`` / ``PHI_HI`` the
CDF at the default initializer's cut points (two standard deviations: TF's truncated normal).
``state/vocab/vocabulary.py``'s ``initial_values`` maps counter-based uniforms through them.
"""

from __future__ import annotations

import math

import torch

# Truncated normal cut at two standard deviations: the CDF of the cut points.
PHI_LO = 0.5 * math.erfc(2 / math.sqrt(2))
PHI_HI = 1.0 - PHI_LO

# Acklam's rational approximation of the standard normal's inverse CDF (relative error below
# 1.15e-9): csrc/vocab.h's ``inverse_normal`` holds the same coefficients and operation order.
_A = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
      1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
_B = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
      6.680131188771972e+01, -1.328068155288572e+01)
_C = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
      -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
_D = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
      3.754408661907416e+00)
_P_LOW = 0.02425
# the constants of kernels/gpu/init.py (its ``CONSTANTS``' order, less ``div``)
KERNEL = _A + _B + _C + _D + (_P_LOW, 1.0 - _P_LOW, PHI_LO, PHI_HI - PHI_LO)


def _poly(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    out = torch.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        out = out * x + c
    return out


def inverse_normal(p: torch.Tensor) -> torch.Tensor:
    """The standard normal's inverse CDF of float64 ``p`` in (0, 1) (Acklam: relative error
    below 1.15e-9), in torch ops: the twin of the fused kernel's, operation for operation."""
    q = p - 0.5
    r = q * q
    central = _poly(r, _A) * q / (_poly(r, _B) * r + 1.0)
    lower = p < _P_LOW
    t = torch.sqrt(-2.0 * torch.log(torch.where(lower, p, 1.0 - p)))
    tail = _poly(t, _C) / (_poly(t, _D) * t + 1.0)
    tail = torch.where(lower, tail, -tail)
    return torch.where(lower | (p > 1.0 - _P_LOW), tail, central)
