"""README's Python examples run as written (```python blocks, in this process); README points a
newcomer to the guide, the reference, the semantics and the figures. The guide's examples, the
multi-process one included, run in tests/test_docs.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def test_readme_has_an_example():
    assert BLOCKS, "README.md has no ```python block"


def test_readme_points_to_the_documentation():
    text = README.read_text()
    for path in ("docs/guide/index.md", "docs/reference.md", "docs/semantics.md",
                 "benchmarks/RESULTS.md", "examples/movielens/README.md"):
        assert f"`{path}`" in text, f"README.md does not name {path}"


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
