"""Tests that need the fused CPU kernels: the ``requires_native`` marker (tests/conftest.py
applies it) and ``require_native()`` (in a test's body).

Where no C++ compiler is found (``library._compiler``: c++, g++ or clang++ on PATH) such a test
is skipped, saying so. Where one is found the kernels must build: a build that fails (a syntax
error in ``embcore/kernels/cpu/csrc/``, a stale library) fails the test with the build's error, so
that a broken build never turns the kernels' tests into skips (CI has a compiler).
"""

from __future__ import annotations

import pytest

from embcore.kernels import cpu
from embcore.kernels.cpu import library

requires_native = pytest.mark.requires_native


def native_problem() -> tuple[str, str] | None:
    """None when the kernels are built; else ``("skip", why)`` (switched off, or no compiler
    here) or ``("fail", why)`` (a compiler is here and the build failed)."""
    if cpu.available():
        return None
    if not cpu.enabled():
        return "skip", "the fused CPU kernels are switched off (cpu.set_enabled(False))"
    try:
        cxx = library._compiler()
    except OSError as e:
        return "skip", f"the fused CPU kernels cannot be built here: {e}"
    return "fail", (f"the fused CPU kernels failed to build with {cxx} (a compiler is here, so "
                    f"this is a failure, not a skip): {cpu.error()}")


def require_native() -> None:
    """Returns when the kernels are built; else skips the test (no compiler) or fails it (a
    failed build), as ``native_problem`` says."""
    problem = native_problem()
    if problem is None:
        return
    kind, why = problem
    if kind == "skip":
        pytest.skip(why)
    pytest.fail(why, pytrace=False)
