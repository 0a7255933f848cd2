"""README's Python examples run as written: ```python blocks in this process, ```python torchrun
blocks as a script launched on 2 processes (``torch.distributed.run``, as ``torchrun`` does)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import free_port

import embcore as ec

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
LAUNCHED = re.findall(r"```python torchrun\n(.*?)```", README.read_text(), flags=re.S)


def _changed_rows(now: torch.Tensor, before: torch.Tensor) -> list[int]:
    return (now != before).any(dim=1).nonzero().squeeze(1).tolist()


def _check_quick_start(ns: dict, printed: str) -> None:
    """The activations are the rows (the mean of the history's), Adagrad moved exactly the 5
    touched rows by its rule, and the plan printed stacks both tables."""
    emb, users, items, acts = ns["emb"], ns["users"], ns["items"], ns["acts"]
    torch.manual_seed(0)  # the block's tables, as drawn before the update
    fresh = ec.Embedding(ns["features"], ec.Adagrad(learning_rate=0.1))
    u0, i0 = fresh.embedding_tables[users], fresh.embedding_tables[items]
    assert torch.equal(acts["user"].detach(), u0[[3, 7]])
    torch.testing.assert_close(acts["history"].detach(),
                               torch.stack([(i0[1] + i0[2]) / 2, i0[9]]))
    u1, i1 = emb.embedding_tables[users], emb.embedding_tables[items]
    assert _changed_rows(u1, u0) == [3, 7] and _changed_rows(i1, i0) == [1, 2, 9]
    g = acts["user"].grad[0].double()  # user 3's gradient: its only occurrence
    want = u0[3].double() - 0.1 * g / torch.sqrt(0.1 + g * g)  # Adagrad, accumulator 0.1
    torch.testing.assert_close(u1[3].double(), want, rtol=1e-5, atol=1e-6)
    assert "2 tables in 1 physical tables" in printed and "users" in printed


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


def _check_dynamic(ns: dict, printed: str) -> None:
    """Both raw ids got rows (the layer's vocabulary)."""
    ids, rows = ns["layer"].vocabulary(ns["users"])
    assert sorted(ids.tolist()) == [-31337, 2**62 + 7] and len(set(rows.tolist())) == 2


def _check_budget(ns: dict, printed: str) -> None:
    """The table is offloaded behind a cache, and the first step's lookups all missed it."""
    emb = ns["emb"]
    assert emb.plan.physical[0].offloaded and "slow tier, cached" in printed
    stats = emb.cache_stats()["items"]
    assert stats["hits"] == 0 and stats["misses"] > 0 and str(stats["misses"]) in printed


def _check_publish(ns: dict, printed: str) -> None:
    """The follower applied the delta: version 1, and it serves the trainer's rows, the 2
    updated ones included."""
    served, emb, items = ns["served"], ns["emb"], ns["items"]
    assert served.version == 1
    every = torch.arange(items.vocabulary_size)
    assert torch.equal(served({"item": every})["item"], emb.embedding_tables[items])


# a line of a README block -> the check of what that block computed (its namespace, its printed
# text); a block with neither a check here nor an ``assert`` of its own fails
CHECKS = {
    "emb.apply_gradients({k: a.grad for k, a in acts.items()})": _check_quick_start,
    "exported = serving.export(ids)": _check_layer,
    "[2**62 + 7, -31337]": _check_dynamic,
    'memory_budget="1MB"': _check_budget,
    "served = ec.load_published(d)": _check_publish,
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
