"""Triton for the kernel modules (``rows.py``, ``index.py``, ``move.py``),
imported in one place.

Triton is optional: without it this module still imports (pytest's doctest collection imports
every module), ``triton`` and ``tl`` are None, ``MISSING`` says why, and ``jit`` leaves a function
as it is, so the kernels are plain, unused functions. ``kernels/gpu/launch.py`` imports the kernel
modules only on first use and reads ``MISSING``.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:
    triton = tl = None
    MISSING: str | None = f"{type(e).__name__}: {e}"
else:
    MISSING = None

jit = triton.jit if triton is not None else (lambda fn: fn)

__all__ = ["MISSING", "jit", "tl", "triton"]
