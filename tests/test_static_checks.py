"""The package's static checks: ``ruff check embcore`` (lint) and ``mypy embcore`` (types), both
configured in pyproject.toml, and no ``# type: ignore`` in the package.

Each tool runs as ``python -m <tool>`` from the repository root (this environment's tool, the
repository's configuration); a failure shows the tool's report. A check is skipped only where its
tool is not installed: the ``test`` extra installs both (README's test command, .ci/run).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, *args: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (the test extra installs it: "
                    f"pip install -e '.[test]')")
    done = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, check=False)
    assert done.returncode == 0, (f"{tool} {' '.join(args)} failed (exit {done.returncode}):\n"
                                  f"{done.stdout}{done.stderr}")


def test_ruff_passes_on_the_package():
    _run("ruff", "check", "--output-format", "concise", "embcore")


def test_mypy_passes_on_the_package():
    _run("mypy", "embcore")  # (its cache: .mypy_cache, which git ignores by itself)


def test_the_package_holds_no_type_ignore():
    ignore = re.compile(r"#\s*type:\s*ignore")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in sorted((ROOT / "embcore").rglob("*.py"))
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if ignore.search(line)]
    assert not hits, ("the package types its code instead of silencing mypy (a narrowing, an "
                      "annotation, a cast to Any with its reason):\n" + "\n".join(hits))
