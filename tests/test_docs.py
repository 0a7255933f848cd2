"""The docs' Python examples run as written: every ```python block of docs/**/*.md (the guide under
docs/guide/ included), each in a fresh namespace; ```text and ```bash blocks are not run.

A word after ``python`` says how a block runs:
- ```python torchrun: a script launched on 2 processes (``torch.distributed.run``, as ``torchrun``
  does); it must print its plan on each (``ShardingPlan(world_size=2``). One that imports
  torchrec is skipped, saying so, where torchrec is not installed.
- ```python torchrec: needs the torchrec extra; skipped, saying so, where torchrec is not installed.
- ```python gpu: needs a CUDA device; skipped, saying so, where there is none.
- ```python slow: runs here, marked ``slow`` (a minute or so: ``-m "not slow"`` leaves it out).
Any other word is an error: a block is never left out silently. Every block asserts
something of its results (an ``assert`` a reader sees).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import free_port

DOCS = Path(__file__).parents[1] / "docs"
KINDS = ("", "torchrun", "torchrec", "gpu", "slow")
FENCE = re.compile(r"^```python(?:[ \t]+(\w+))?[ \t]*\n(.*?)^```", flags=re.S | re.M)


def python_blocks(text: str) -> list[tuple[str, str]]:
    """``(kind, code)`` of every ```python block, kind "" for a plain one."""
    return [(kind or "", code) for kind, code in FENCE.findall(text)]


BLOCKS = [(doc, i, kind, code) for doc in sorted(DOCS.rglob("*.md"))
          for i, (kind, code) in enumerate(python_blocks(doc.read_text()))]
IDS = [f"{doc.relative_to(DOCS).with_suffix('')}-block{i}" for doc, i, _, _ in BLOCKS]


def test_docs_have_examples():
    assert BLOCKS, "no ```python block found under docs/"
    assert any(doc.parent.name == "guide" for doc, *_ in BLOCKS), "no ```python block in the guide"


def test_the_fence_reader():
    text = ("```python\na = 1\n```\n```python torchrun\nb = 2\n```\n```bash\nls\n```\n"
            "```python gpu\nc = 3\n```\n```py\nd = 4\n```\n")
    assert python_blocks(text) == [("", "a = 1\n"), ("torchrun", "b = 2\n"), ("gpu", "c = 3\n")]


def test_every_block_has_a_known_kind():
    unknown = [f"{doc.relative_to(DOCS)} block {i}: ```python {kind}"
               for doc, i, kind, _ in BLOCKS if kind not in KINDS]
    assert not unknown, f"blocks of a kind tests/test_docs.py does not run: {unknown}"


def test_every_code_block_is_run_or_is_a_command():
    """A block the runner does not read (```py, ```pycon, no language) would go untested: the docs'
    fences are ```python (with a kind), or ```bash / ```text for commands and output."""
    odd = []
    for doc in sorted(DOCS.rglob("*.md")):
        inside = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if not line.startswith("```"):
                continue
            if not inside and not re.fullmatch(r"```(?:python(?:[ \t]+\w+)?|bash|text)[ \t]*",
                                               line):
                odd.append(f"{doc.relative_to(DOCS)}:{n}: {line!r}")
            inside = not inside
    assert not odd, f"code blocks tests/test_docs.py would not run: {odd}"


def run_torchrun(code: str, tmp_path: Path, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    """``code`` as a script launched on ``nproc`` processes, as ``torchrun`` does."""
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(nproc), "--master-port", str(free_port()), str(script)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("doc, index, kind, code", [
    pytest.param(*b, id=i, marks=[pytest.mark.slow] if b[2] == "slow" else [])
    for i, b in zip(IDS, BLOCKS) if b[2] != "torchrun"])
def test_doc_example_runs(doc, index, kind, code, tmp_path, monkeypatch):
    if kind == "torchrec":
        pytest.importorskip("torchrec", reason="torchrec is not installed: pip install -e "
                                               "'.[torchrec]' (without CUDA: pip install -e "
                                               "'.[torchrec]' ./packaging/fbgemm-gpu-cpu)")
    if kind == "gpu" and not torch.cuda.is_available():
        pytest.skip("a GPU block: no CUDA device here")
    assert re.search(r"^\s*assert ", code, flags=re.M), (
        f"{doc.name} block {index} checks nothing: add an assert of its result to it\n{code}")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{doc}:block{index}", "exec"), {"__name__": "docs"})


@pytest.mark.slow
@pytest.mark.parametrize("doc, index, kind, code", [
    pytest.param(*b, id=i) for i, b in zip(IDS, BLOCKS) if b[2] == "torchrun"])
def test_doc_torchrun_example_runs(doc, index, kind, code, tmp_path):
    if re.search(r"^(import|from) torchrec\b", code, flags=re.M):  # a TorchRec model's block
        pytest.importorskip("torchrec", reason="torchrec is not installed: pip install -e "
                                               "'.[torchrec]' (docs/guide/train.md)")
    proc = run_torchrun(code, tmp_path)
    assert proc.stdout.count("ShardingPlan(world_size=2") == 2, proc.stdout[-2000:]
