"""The steady device step traced by ``torch.compile(fullgraph=True)`` (tests/step_trace_cases.py),
in a fresh interpreter with ``TRITON_INTERPRET=1`` (chosen before triton is first imported, as
tests/test_triton.py runs its cases). Skipped when triton is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import check_fresh_run

CASES = Path(__file__).with_name("step_trace_cases.py")

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install -e '.[gpu-test]')", allow_module_level=True)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="traced on the CPU's emulation of the device step (CI's machines)")
def test_the_steady_step_traces_without_a_graph_break():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs",
                           "-p", "no:cacheprovider", "-p", "no:warnings", str(CASES)],
                          capture_output=True, text=True, env=env, cwd=CASES.parents[1],
                          timeout=900)
    check_fresh_run(proc)
