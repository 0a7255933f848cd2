"""The docs' Python examples run as written: every ```python block of docs/*.md, each in a fresh
namespace (```text and ```bash blocks are not run), and each asserts something of its results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = sorted((Path(__file__).parents[1] / "docs").glob("*.md"))
BLOCKS = [(doc, i, code) for doc in DOCS
          for i, code in enumerate(re.findall(r"^```python\n(.*?)^```", doc.read_text(),
                                              flags=re.S | re.M))]


def test_docs_have_examples():
    assert BLOCKS, "no ```python block found under docs/"


@pytest.mark.parametrize("doc, index, code", BLOCKS,
                         ids=[f"{doc.stem}-block{i}" for doc, i, _ in BLOCKS])
def test_doc_example_runs(doc, index, code, tmp_path, monkeypatch):
    """Each block runs and checks what it shows with ``assert`` lines a reader sees."""
    assert re.search(r"^\s*assert ", code, flags=re.M), (
        f"{doc.name} block {index} checks nothing: add an assert of its result to it\n{code}")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{doc}:block{index}", "exec"), {"__name__": "docs"})
