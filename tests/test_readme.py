"""README's Python examples run as written: ```python blocks in this process, ```python torchrun
blocks as a script launched on 2 processes (``torch.distributed.run``, as ``torchrun`` does)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import free_port

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
LAUNCHED = re.findall(r"```python torchrun\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("code", LAUNCHED, ids=[f"torchrun{i}" for i in range(len(LAUNCHED))])
@pytest.mark.slow
def test_readme_torchrun_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ShardingPlan(world_size=2") == 2


def test_readme_has_no_link_a_package_index_breaks():
    """README is the package's long description: on a package index, links relative to the
    repository (files, in-page anchors) lead nowhere, so files are named as paths instead; and
    every path it names exists."""
    text = README.read_text()
    relative = re.findall(r"\]\((?!https?://)[^)]*\)", text)
    assert not relative, f"relative links in README.md: {relative}"
    root = README.parent
    for path in re.findall(r"`((?:docs|benchmarks|examples)/[\w./-]+\.(?:md|py))`", text):
        assert (root / path).exists(), f"README.md names {path}, which does not exist"
