"""The raw-id map on the device, from the CPU side.

- ``ops/selection.py``'s ``smallest_ordered`` (torch ops only) against sorting, with hypothesis;
- the raw-id suites (tests/test_dynamic.py, tests/test_dynamic_stack.py) passing with every map a
  ``DeviceVocabMap`` (tests/device_map_everywhere.py), its kernels in Triton's interpreter.

The map's own cases (against the oracle, the hash index, the steps that read nothing back) are
tests/triton_map_cases.py, which tests/test_triton.py runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checks import check_fresh_run
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

from embcore.ops.selection import smallest_ordered

BIG = 2**63 - 1


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
       st.data())
def test_smallest_ordered_is_the_head_of_the_sorted_valid_entries(entries, data):
    """Scores with many ties, keys anywhere in int64 (2**63 - 1, the masking value, among
    them): the first k are the k smallest valid (score, key), in order."""
    n = len(entries)
    keys = data.draw(st.lists(st.one_of(st.integers(-2**63, BIG), st.just(BIG), st.just(-2**63)),
                              min_size=n, max_size=n, unique=True))
    score = torch.tensor([s for s, _ in entries])
    valid = torch.tensor([v for _, v in entries])
    key = torch.tensor(keys, dtype=torch.int64)
    want = sorted((i for i in range(n) if valid[i]), key=lambda i: (int(score[i]), keys[i]))
    kmax = data.draw(st.sampled_from(sorted({n, max(len(want), 1), max(len(want) - 1, 1),
                                             max(len(want) // 2, 1)})))
    k = max(min(kmax, len(want)) - data.draw(st.integers(0, 2)), 0)
    got = smallest_ordered(score, key, valid, torch.tensor(k), kmax)
    assert got.shape == (kmax,)
    assert got[:k].tolist() == want[:k]
    # k known on the host (the device map's steps that read their counts): the same
    assert smallest_ordered(score, key, valid, k, kmax)[:k].tolist() == want[:k]


def test_smallest_ordered_of_nothing():
    empty = torch.empty(0, dtype=torch.int64)
    assert smallest_ordered(empty, empty, empty.bool(), torch.tensor(0), 0).numel() == 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install -e '.[gpu-test]')")
def test_the_raw_id_suites_pass_with_the_device_map(pytestconfig):
    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    profile = pytestconfig.getoption("--hypothesis-profile")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs", "-p", "no:cacheprovider",
         "-p", "no:warnings", "-p", "device_map_everywhere",
         *(["--hypothesis-profile", profile] if profile else []),
         "tests/test_dynamic.py", "tests/test_dynamic_stack.py"],
        capture_output=True, text=True, env=env, cwd=here.parent, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-4000:]
    check_fresh_run(proc)  # passed, none failed, none skipped
    made = re.search(r"device maps made: (\d+)", proc.stdout)
    assert made is not None and int(made.group(1)) > 100, tail


def test_a_wrapper_whose_cases_all_skip_is_skipped_not_passed(tmp_path):
    """The check of the wrappers that run cases in a fresh interpreter (this file's, and
    tests/test_triton.py's): cases that all skip skip the wrapper, with their reason (never a
    pass); a skip beside passes fails it (unless allowed); a failure fails it."""
    (tmp_path / "test_cases.py").write_text(
        "import pytest\n\n"
        "def test_skipped():\n    pytest.skip('no compiler for this GPU here')\n\n"
        "@pytest.mark.parametrize('ok', [True, False])\n"
        "def test_mixed(ok):\n    if not ok:\n        pytest.skip('half of them')\n\n"
        "def test_fails():\n    assert False\n")

    def run(pattern: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs", "-p",
             "no:cacheprovider", "test_cases.py", "-k", pattern],
            capture_output=True, text=True, cwd=tmp_path, timeout=300)

    with pytest.raises(pytest.skip.Exception, match="no compiler for this GPU here"):
        check_fresh_run(run("skipped"))
    with pytest.raises(AssertionError, match="half of them"):
        check_fresh_run(run("mixed"))
    check_fresh_run(run("mixed"), partial_skips=True)
    for pattern in ("fails", "nothing_matches"):
        with pytest.raises(AssertionError):
            check_fresh_run(run(pattern))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (pip install -e '.[gpu-test]')")
def test_the_gpu_maps_study_runs():
    """benchmarks/studies/gpu_maps.py (what a lent GPU measures) runs: tiny sizes on the CPU,
    the kernels in Triton's interpreter."""
    root = Path(__file__).parents[1]
    proc = subprocess.run([sys.executable, "benchmarks/studies/gpu_maps.py", "--smoke"],
                          capture_output=True, text=True, cwd=root, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for line in ("find, load 0.5", "training step of", "raw ids (LRU", "budget"):
        assert line in proc.stdout, proc.stdout


@pytest.mark.parametrize("capacity", [1, 6, 100, 3000])
def test_the_hash_index_is_rebuilt_before_three_quarters_of_its_slots_fill(capacity):
    """``DeviceHash.due(n)``: a rebuild is due exactly when ``n`` more keys could take the
    slots not empty past three quarters of them (state/device_hash.py; the bound on slots not
    empty is ``filled``). Nothing here runs a kernel."""
    from embcore.state.vocab.device_hash import DeviceHash

    index = DeviceHash(capacity, torch.zeros(capacity, dtype=torch.int64))
    slots = index.slots
    assert slots >= 2 * capacity and slots & (slots - 1) == 0
    quarter3 = slots * 3 // 4  # (slots is a power of two, at least 16: exact)
    assert quarter3 * 4 == slots * 3
    assert not index.due(0) and not index.due(quarter3) and index.due(quarter3 + 1)
    index.filled = 5
    assert not index.due(quarter3 - 5) and index.due(quarter3 - 4)
    index.filled = quarter3
    assert not index.due(0) and index.due(1)
