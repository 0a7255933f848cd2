"""The slow tier written as a log (state/tier/log.py): every row readable at its place after any
appends, the cleaner and compaction; an engine behind a log equal to one writing in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embcore as ec
from embcore.kernels import cpu
from embcore.ops.backend import host
from embcore.state.tier import files as files_module
from embcore.state.tier.files import WRITES_ENV, OffloadDir, records, slow_log, slow_writes
from embcore.state.tier.log import RecordLog, places_for

FIELDS = [(torch.float32, 3), (torch.float32, 1)]


def _log(tmp_path: Path, rows: int) -> tuple[list[torch.Tensor], RecordLog, OffloadDir]:
    d = OffloadDir(tmp_path, 0)
    views, log = slow_log(d.file("t.bin"), rows, FIELDS)
    for v, (_, w) in zip(views, FIELDS):  # row r's record holds r (and -r in the slot)
        v[:rows] = torch.arange(rows, dtype=torch.float32).view(-1, 1).expand(rows, w) * (
            1 if w == 3 else -1)
    return views, log, d


def _check(views: list[torch.Tensor], log: RecordLog, truth: torch.Tensor) -> None:
    """Every row's record at its place holds ``truth[row]``; ``where`` and ``owner`` agree."""
    rows = torch.arange(log.rows)
    at = log.at(rows)
    assert at.unique().numel() == log.rows  # distinct places
    assert torch.equal(log.owner[at].to(torch.int64), rows)
    assert int((log.owner >= 0).sum()) == log.rows  # nothing else live
    per_segment = (log.owner >= 0).view(-1, log.segment).sum(1)
    assert torch.equal(log.live, per_segment)
    assert torch.equal(views[0][at], truth.view(-1, 1).expand(-1, 3))
    assert torch.equal(views[1][at], -truth.view(-1, 1))


def test_places_for() -> None:
    for rows in (1, 2, 15, 16, 17, 1000, 65536, 10**6):
        places, seg = places_for(rows)
        assert places % seg == 0 and places >= rows + seg and places >= rows * 1.5
        assert 1 <= seg <= 4096


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 90), steps=st.lists(
    st.lists(st.integers(0, 89), max_size=60), max_size=12), compact_every=st.integers(1, 6),
    seed=st.integers(0, 2**16))
def test_log_matches_a_table(tmp_path_factory: pytest.TempPathFactory, rows: int,
                             steps: list[list[int]], compact_every: int, seed: int) -> None:
    """Random appends (through the cleaner, wrapping round the file), reads and compactions:
    each row reads as its last value, and a compacted log is the table in row order."""
    views, log, d = _log(tmp_path_factory.mktemp("log"), rows)
    truth = torch.arange(rows, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for i, step in enumerate(steps):
        picked = torch.tensor(sorted({r % rows for r in step}), dtype=torch.int64)
        picked = picked[torch.randperm(picked.numel(), generator=g)]
        values = torch.randn(picked.numel(), generator=g)
        source = torch.stack([values, values, values, -values], 1)  # (k, 4): the two fields
        at = torch.randperm(picked.numel(), generator=g)  # rows of source, in any order
        src = torch.empty_like(source)
        src[at] = source
        log.append(picked, {0: (src[:, :3].contiguous(), at), 12: (src[:, 3:].contiguous(), at)},
                   host())
        truth[picked] = values
        _check(views, log, truth)
        if i % compact_every == 0:
            log.compact(host())
            assert torch.equal(log.at(torch.arange(rows)), torch.arange(rows))
            assert torch.equal(views[0][:rows], truth.view(-1, 1).expand(-1, 3))
            _check(views, log, truth)
    log.compact(host())
    assert torch.equal(views[1][:rows], -truth.view(-1, 1))
    d.remove()


def test_log_writes_whole_segments_and_cleans(tmp_path: Path) -> None:
    """Appends go to the head in order; the head takes the segment with the fewest live
    records, whose live records the cleaner moves to its front first; the file is written by
    pwrite (through the descriptor)."""
    rows = 64
    views, log, d = _log(tmp_path, rows)
    places, seg = places_for(rows)
    assert (log.places, log.segment) == (places, seg) and log.fd is not None
    assert log.head == rows  # the first free segment
    truth = torch.arange(rows, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for rnd in range(40):  # random rows: the segments the head takes are partly live
        for a in range(0, rows, 8):
            picked = torch.randperm(rows, generator=g)[:8]
            v = truth[picked] + 1000
            src = torch.stack([v, v, v, -v], 1)
            log.append(picked, {0: (src[:, :3].contiguous(), torch.arange(picked.numel())),
                                12: (src[:, 3:].contiguous(), torch.arange(picked.numel()))},
                       host())
            truth[picked] = v
    _check(views, log, truth)
    assert log.written == 40 * rows and log.moved > 0  # the cleaner ran
    log.compact(host())
    _check(views, log, truth)
    assert torch.equal(views[0][:rows, 0], truth)
    d.remove()


def test_the_logs_step_never_indexes_with_a_tensor(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Appends (through the cleaner) and reads of places do their index work with
    ``index_select`` / ``index_copy_`` / ``index_fill_``: a tensor used as an index costs
    milliseconds on 2 busy cores (torch's parallel indexing), whatever its length. Rows given
    as int32 are taken too."""
    rows = 64
    views, log, d = _log(tmp_path, rows)
    truth = torch.arange(rows, dtype=torch.float32)
    indexed: list[str] = []
    get, put = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def tensor_in(index: object) -> bool:
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) for p in parts)

    def getitem(self: torch.Tensor, index: object) -> torch.Tensor:
        if tensor_in(index):
            indexed.append("get")
        return get(self, index)

    def setitem(self: torch.Tensor, index: object, value: object) -> None:
        if tensor_in(index):
            indexed.append("set")
        put(self, index, value)

    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)
    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    for rnd in range(20):
        picked = torch.randperm(rows, generator=g)[:16]
        v = truth.index_select(0, picked) + 1000
        src = torch.stack([v, v, v, -v], 1)
        at = torch.arange(picked.numel())
        log.append(picked.to(torch.int32) if rnd % 2 else picked,
                   {0: (src[:, :3].contiguous(), at), 12: (src[:, 3:].contiguous(), at)}, host())
        truth.index_copy_(0, picked, v)
        log.at(picked)
    monkeypatch.undo()
    assert indexed == [] and log.moved > 0  # (the cleaner ran)
    _check(views, log, truth)
    d.remove()


def test_a_write_that_takes_nothing_is_an_error_not_a_hang(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    views, log, d = _log(tmp_path, 64)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)
    src = torch.zeros(2, 4)
    with pytest.raises(OSError, match="took no bytes"):
        log.append(torch.tensor([1, 2]), {0: (src[:, :3].contiguous(), torch.arange(2)),
                                          12: (src[:, 3:].contiguous(), torch.arange(2))},
                       host())
    d.remove()


def test_records_offsets(tmp_path: Path) -> None:
    d = OffloadDir(tmp_path, 0)
    views, log = slow_log(d.file("t.bin"), 10, [(torch.float32, 5), (torch.float64, 1)])
    raw, offsets = records(views)
    assert raw is log.raw and offsets == [0, 24] and raw.shape[1] == 64
    d.remove()


def test_slow_writes_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log where the records exceed what the kernel keeps dirty, else in place; the
    environment variable decides when set."""
    monkeypatch.delenv(WRITES_ENV, raising=False)
    monkeypatch.setattr(files_module, "dirty_limit", lambda: 1000)
    assert slow_writes(1001) == "log" and slow_writes(1000) == "in-place"
    monkeypatch.setattr(files_module, "dirty_limit", lambda: None)  # (not Linux)
    assert slow_writes(10**12) == "in-place"
    monkeypatch.setenv(WRITES_ENV, "in-place")
    assert slow_writes(10**12) == "in-place"
    monkeypatch.setenv(WRITES_ENV, "log")
    assert slow_writes(1) == "log"
    monkeypatch.setenv(WRITES_ENV, "sideways")
    with pytest.raises(ValueError, match="EMBCORE_SLOW_WRITES='sideways'"):
        slow_writes(1)


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux's /proc")
def test_dirty_limit_reads_the_kernels_setting() -> None:
    limit = files_module.dirty_limit()
    assert limit is not None and limit > 0


def _train(tmp_path: Path, writes: str, monkeypatch: pytest.MonkeyPatch,
           budget: int | None) -> tuple[dict, list[torch.Tensor], dict]:
    monkeypatch.setenv(WRITES_ENV, writes)
    torch.manual_seed(0)  # (the tables' initial values)
    tables = [ec.TableConfig(vocabulary_size=3000, dim=8, name=f"t{i}") for i in range(2)]
    features = {f"f{i}": ec.FeatureConfig(table=t, name=f"f{i}") for i, t in enumerate(tables)}
    emb = ec.Embedding(features, ec.Adagrad(learning_rate=0.1),
                       memory_budget=budget, offload_dir=tmp_path)
    g = torch.Generator().manual_seed(0)
    outs = []
    for step in range(40):
        # Zipf-like ids over 3000 rows, 256 a feature: most of a small cache misses every step
        ids = {f: (torch.rand(256, generator=g) ** 3 * 3000).long() for f in features}
        emb.enqueue(ids)
        acts = emb.dequeue()
        outs.append(acts["f0"].detach().clone())
        emb.apply_gradients({f: a.detach() * 0.5 + 0.1 for f, a in sorted(acts.items())})
        if step == 25:  # a checkpoint view mid-run: the log compacted, then appended again
            mid = {k: v.clone() for k, v in emb.state_dict().items()}
    state = {k: v.clone() for k, v in emb.state_dict().items()}
    stats = emb.cache_stats()
    logs = [c.log for c in emb._ready().store.caches()]
    assert all((lg is not None) == (writes in ("log", "auto")) for lg in logs)
    assert budget is None or (logs and all(lg is None or lg.moved > 0 for lg in logs))
    del emb
    return state, outs + [mid["t0/parameters"]], stats


@pytest.mark.skipif(not cpu.usable(torch.zeros(1)) or not hasattr(os, "pwrite"),
                    reason="the log writes by pwrite beside the CPU kernels")
def test_engine_behind_a_log_equals_in_place_and_memory(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Adagrad on two offloaded tables with a small cache: activations, tables, slots and the
    checkpoint taken mid-run are bit-identical behind a log, writing in place, and in memory."""
    ref_state, ref_outs, _ = _train(tmp_path / "m", "log", monkeypatch, None)
    budget = 140_000  # caches of a few hundred rows each: the log laps its file
    monkeypatch.setattr(files_module, "dirty_limit", lambda: 100_000)  # (auto: below the files)
    for writes in ("log", "in-place", "auto"):
        state, outs, stats = _train(tmp_path / writes, writes, monkeypatch, budget)
        assert stats and all(s["misses"] > 1000 for s in stats.values()), stats
        assert state.keys() == ref_state.keys()
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), (writes, k)
        for a, b in zip(outs, ref_outs):
            assert torch.equal(a, b), writes


def test_the_planner_charges_the_logs_index(tmp_path: Path) -> None:
    """``LOG_BYTES_PER_ROW`` covers the log's ``where`` and ``owner`` (int32) per row."""
    from embcore.config.tables import LOG_BYTES_PER_ROW
    from embcore.planning.plan import where_bytes
    for rows in (100, 100_000):
        _, log, d = _log(tmp_path / str(rows), rows)
        held = log.where.element_size() + log.owner.element_size() * log.places / log.rows
        assert held <= LOG_BYTES_PER_ROW < held + 1.5
        d.remove()
    assert where_bytes(False) == where_bytes(True) + LOG_BYTES_PER_ROW
