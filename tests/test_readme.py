"""README's Python examples run as written (```python blocks, in this process); README points a
newcomer to the guide, the reference, the semantics and the figures. The guide's examples, the
multi-process one included, run in tests/test_docs.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import embcore as ec

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _changed_rows(now: torch.Tensor, before: torch.Tensor) -> list[int]:
    return (now != before).any(dim=1).nonzero().squeeze(1).tolist()


def _check_layer(ns: dict, printed: str) -> None:
    """The touched rows trained, the checkpoint written and loadable, and the exported program
    answers as the serving module, which reads the trained tables."""
    emb, ids, movies, users = ns["emb"], ns["ids"], ns["movies"], ns["users"]
    torch.manual_seed(0)
    fresh = ec.EmbeddingLayer(ns["fc"], ec.Adagrad(learning_rate=0.1))
    assert _changed_rows(emb.embedding_tables[movies], fresh.embedding_tables[movies]) == [1, 2]
    assert _changed_rows(emb.embedding_tables[users], fresh.embedding_tables[users]) == [30, 31]
    assert (Path("ckpt") / "manifest.json").is_file()
    ec.load("ckpt", fresh)
    for t in (movies, users):
        assert torch.equal(fresh.embedding_tables[t], emb.embedding_tables[t])
    served = ns["serving"](ids)
    assert torch.equal(served["movie_id"], emb.embedding_tables[movies][ids["movie_id"]])
    program = ns["exported"].module()(ids)
    assert all(torch.equal(program[k], served[k]) for k in served)


# a line of a README block -> the check of what that block computed (its namespace, its printed
# text); a block with neither a check here nor an ``assert`` of its own fails
CHECKS = {
    "exported = serving.export(ids)": _check_layer,
}


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, tmp_path, monkeypatch, capsys):
    """Each block runs, then is checked: by its own ``assert`` lines, or by the check of its
    results here (CHECKS)."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    exec(compile(code, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    checks = [check for line, check in CHECKS.items() if line in code]
    assert checks or re.search(r"^\s*assert ", code, flags=re.M), (
        f"this README block checks nothing: add an assert to it, or a check of its results to "
        f"tests/test_readme.py's CHECKS:\n{code}")
    for check in checks:
        check(namespace, printed)


def test_every_check_has_its_block():
    """A check whose line no block holds any more would check nothing."""
    assert [line for line in CHECKS if not any(line in code for code in BLOCKS)] == []


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
