"""The Triton kernels' tests (tests/triton_cases.py).

With a CUDA GPU they run here, compiled. Without one they run in Triton's interpreter, which must
be chosen before triton is first imported and never switched; other tests of the suite import
triton indirectly (torch.compile, torch.export), so the cases run in a fresh interpreter with
``TRITON_INTERPRET=1`` (``python -m pytest tests/triton_cases.py``), and this test reports its
result; likewise tests/triton_map_cases.py (the raw-id map on the device) and
tests/triton_cache_cases.py (the cache of tables beyond device memory) and
tests/step_budget_cases.py (the syncs and ops of a steady device step, within a ceiling) and
tests/triton_checks_cases.py (its input checks on the device, its dedup of fixed capacity); and
tests/triton_compile_cases.py compiles kernels for sm_90 without the interpreter. Skipped when
triton is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import check_fresh_run

CASES = Path(__file__).with_name("triton_cases.py")
MAP_CASES = Path(__file__).with_name("triton_map_cases.py")  # the raw-id map on the device
CACHE_CASES = Path(__file__).with_name("triton_cache_cases.py")  # the cache on the device
COMPILE_CASES = Path(__file__).with_name("triton_compile_cases.py")  # compiled for sm_90
BUDGET_CASES = Path(__file__).with_name("step_budget_cases.py")  # the device step's budget
CHECKS_CASES = Path(__file__).with_name("triton_checks_cases.py")  # its checks, its dedup

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install -e '.[gpu-test]')", allow_module_level=True)

if torch.cuda.is_available():
    from triton_cases import *  # noqa: F401,F403  (compiled, on the GPU)
    from triton_cache_cases import *  # noqa: F401,F403
    from triton_map_cases import *  # noqa: F401,F403
else:
    @pytest.mark.slow
    def test_kernels_under_the_interpreter(pytestconfig):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        profile = pytestconfig.getoption("--hypothesis-profile")  # the cases' profile: this run's
        proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs",
                               "-p", "no:cacheprovider", "-p", "no:warnings",
                               *(["--hypothesis-profile", profile] if profile else []),
                               str(CASES), str(MAP_CASES),
                               str(CACHE_CASES), str(BUDGET_CASES), str(CHECKS_CASES)],
                              capture_output=True, text=True,
                              env=env, cwd=CASES.parents[1], timeout=900)
        check_fresh_run(proc)


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one():
    """tests/triton_compile_cases.py, in a fresh interpreter without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs", "-p",
                           "no:cacheprovider", "-p", "no:warnings", str(COMPILE_CASES)],
                          capture_output=True, text=True, env=env, cwd=CASES.parents[1],
                          timeout=900)
    check_fresh_run(proc)  # every case skipped (no compiler for CUDA): skipped here, saying why
