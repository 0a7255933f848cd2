"""The slow tier's bytes (docs/semantics.md, tables beyond memory): every row of an offloaded
table carries a checksum in its file (ops/checksum.py), set when the row is written back and
checked when it is read into the cache, so bytes changed in a file under offload_dir are an error
naming the table, the row and the file, not wrong rows; ec.save checks every row, and still saves
the rows when the offload directory was removed under the run (read through the open files)."""

from __future__ import annotations

import math
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from switches import kernels

import embcore as ec
from embcore.config.tables import LOG_BYTES_PER_ROW, MAP_BYTES_PER_ROW
from embcore.kernels import cpu
from embcore.ops.backend import FUSED_CPU, TORCH_OPS
from embcore.ops.checksum import row_sums
from embcore.state.tier import cache as cache_module
from embcore.state.tier import files as files_module
from embcore.state.tier.files import WRITES_ENV, records, slow_file

ROWS, DIM = 1000, 8
# as tests/test_offload_safety.py: both tables offloaded, their caches a few dozen rows
BUDGET = ROWS * 4 + ROWS * MAP_BYTES_PER_ROW + 8180 + 64 * 40 + ROWS * LOG_BYTES_PER_ROW
NAN = struct.pack("<f", math.nan)


def _engine(offload_dir: Path) -> ec.Embedding:
    tables = {"a": ec.TableConfig(vocabulary_size=ROWS, dim=DIM, name="a"),
              "r": ec.TableConfig(vocabulary_size=ROWS, dim=DIM, name="r",
                                  dynamic=ec.DynamicVocabulary())}
    fc = {k: ec.FeatureConfig(table=t) for k, t in tables.items()}
    torch.manual_seed(0)  # (the engine's seed: twins hold the same rows)
    emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.1), memory_budget=BUDGET,
                       offload_dir=offload_dir)
    emb.build(per_replica_batch_size=16)
    return emb


def _step(emb: ec.Embedding, seed: int, a: torch.Tensor | None = None,
          r: torch.Tensor | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (16,), generator=g)
    emb.enqueue({"a": ids if a is None else a, "r": (ids * 7919) % ROWS if r is None else r})
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})


def _cache(emb: ec.Embedding, name: str) -> cache_module.CachedRows:
    return next(c for c in emb._store.caches() if c.name == name)


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    """Writes ``data`` into the file at ``offset`` as another process would (its own descriptor;
    the engine's lock is advisory)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------ the checksum
def _by_hand(arrays: list[torch.Tensor], key: int, version: int = 0) -> int:
    """The checksum of one row (its arrays' rows, 1-D), computed from its definition in
    ops/checksum.py with Python integers, word by word: the independent oracle of row_sums and
    of the kernel."""
    h = (2 * (key + version * 0x9E3779B1) + 1) % 2**32
    for a in arrays:
        data = a.contiguous().view(torch.uint8).numpy().tobytes()
        data += b"\0" * (-len(data) % 4)
        s = sum(int.from_bytes(data[4 * j:4 * j + 4], sys.byteorder) * 0x9E3779B1 * (2 * j + 1)
                for j in range(len(data) // 4))
        h = ((h ^ (s % 2**32)) * 0x01000193) % 2**32
    return h - 2**32 if h >= 2**31 else h


@pytest.mark.parametrize("dtype,width", [(torch.float32, 8), (torch.float16, 3),
                                         (torch.bfloat16, 5), (torch.float64, 2),
                                         (torch.float32, 1), (torch.float32, 67)])
def test_the_kernel_and_the_reference_match_the_definition(dtype: torch.dtype,
                                                          width: int) -> None:
    """move_summed (the fused CPU backend's kernel cpu.copy_rows_summed, and torch ops) and
    row_sums against the definition computed by hand (``_by_hand``), versions anywhere in
    0 .. 2**31 - 1: the checksums set, the rows copied, a row with one bit changed found, a
    row's checksum tied to its row and to its version."""
    if not cpu.available():
        pytest.skip("the fused CPU kernels are not built here")
    g = torch.Generator().manual_seed(width)
    n = 300
    params = (torch.randn(n, width, generator=g) * 100).to(dtype)
    slot = torch.rand(n, 1, generator=g)
    rows = torch.randperm(n, generator=g)[:200]
    versions = torch.randint(0, 2**31 - 1, (200,), generator=g, dtype=torch.int32)  # (200,)
    versions[:3] = torch.tensor([2**31 - 1, 1, 0], dtype=torch.int32)
    expected = torch.tensor([_by_hand([params[r], slot[r]], int(r), int(v))
                             for r, v in zip(rows, versions)], dtype=torch.int32)
    assert torch.equal(row_sums([params[rows], slot[rows]], rows, versions), expected)
    unversioned = torch.tensor([_by_hand([params[r], slot[r]], int(r)) for r in rows[:20]],
                               dtype=torch.int32)
    assert torch.equal(row_sums([params[rows[:20]], slot[rows[:20]]], rows[:20]), unversioned)
    for on in (True, False):
        move_summed = (FUSED_CPU if on else TORCH_OPS).move_summed  # (the backends' verb)
        with kernels(on):
            sums = torch.zeros(n, dtype=torch.int32)
            assert move_summed([params, slot], rows, None, None, rows, sums, False,
                               versions) == -1
            assert torch.equal(sums[rows], expected), f"kernels {on}"
            cache = [torch.zeros(250, width, dtype=dtype), torch.zeros(250, 1)]
            at = torch.randperm(250, generator=g)[:200]
            assert move_summed([params, slot], rows, cache, at, rows, sums, True, versions) == -1
            assert torch.equal(cache[0][at], params[rows]) and torch.equal(cache[1][at],
                                                                           slot[rows])
            hurt = params.clone()
            hurt.view(torch.uint8).view(n, -1)[int(rows[17]), -1] ^= 0x10  # (the last byte)
            assert move_summed([hurt, slot], rows, cache, at, rows, sums, True, versions) == 17
            assert move_summed([params, slot], rows, None, None, rows.flip(0), sums,
                               True, versions.flip(0)) == 0, "a row's checksum depends on its row"
            later = versions.clone()
            later[5] += 1  # (written since: its bytes and checksum are stale)
            assert move_summed([params, slot], rows, None, None, rows, sums, True,
                               later) == 5, "a row's checksum depends on its version"
            plain = torch.zeros(n, dtype=torch.int32)
            assert move_summed([params, slot], rows[:20], None, None, rows[:20], plain,
                               False) == -1
            assert torch.equal(plain[rows[:20]], unversioned), f"kernels {on}, no versions"


def test_every_single_bit_changed_is_found() -> None:
    """One bit flipped anywhere in a row (either array) changes its checksum; a zeroed row
    never matches a zero checksum."""
    g = torch.Generator().manual_seed(0)
    params, slot = torch.randn(1, 5, generator=g), torch.rand(1, 5, generator=g)
    key = torch.tensor([7])
    good = row_sums([params, slot], key)
    for t in (params, slot):
        flat = t.view(torch.uint8).view(-1)
        for byte in range(flat.numel()):
            for bit in range(8):
                flat[byte] ^= 1 << bit
                assert not torch.equal(row_sums([params, slot], key), good)
                flat[byte] ^= 1 << bit
    assert torch.equal(row_sums([params, slot], key), good)
    zero = row_sums([torch.zeros(3, 5), torch.zeros(3, 5)], torch.arange(3))
    assert (zero != 0).all()


# ------------------------------------------------------------------------------ bytes overwritten
@pytest.mark.parametrize("writes", ["log", "in-place"])
@pytest.mark.parametrize("on", [True, False], ids=["native", "torch"])
def test_bytes_overwritten_in_a_static_tables_file_are_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: str, on: bool) -> None:
    """NaNs written over a row's record in p0.bin (a row not in the cache, written back before):
    the step that reads it raises RuntimeError naming the table, the row and the file, and
    what to do; so does every later step (the engine stops)."""
    monkeypatch.setenv(WRITES_ENV, writes)
    with kernels(on):
        emb = _engine(tmp_path)
        for s in range(6):
            _step(emb, s)
        cache = _cache(emb, "a")
        assert (cache.log is not None) == (writes == "log")
        away = torch.nonzero(cache.index.where < 0).flatten()
        row = int(away[0])
        place = int(cache.log.at(torch.tensor([row]))[0]) if cache.log is not None else row
        raw, _ = records([cache.slow["parameters"]])
        path = slow_file(cache.slow["parameters"]).path
        assert path.name == "p0.bin"
        _overwrite(path, place * raw.shape[1], NAN * 2)
        assert math.isnan(float(raw[place, :4].view(torch.float32)))
        for _ in range(2):
            with pytest.raises(RuntimeError) as info:
                _step(emb, 99, a=torch.tensor([row] * 16))
            text = str(info.value)
            assert f"row {row} of table 'a'" in text and str(path) in text, text
            assert "checksum" in text and "last checkpoint" in text


@pytest.mark.parametrize("on", [True, False], ids=["native", "torch"])
def test_bytes_overwritten_in_a_dynamic_tables_file_are_an_error(tmp_path: Path,
                                                                 on: bool) -> None:
    """A raw-id table's rows are a file per array, its checksums after its parameters: bytes
    changed in the slot's file are found when the row of an id is read back."""
    with kernels(on):
        emb = _engine(tmp_path)
        for s in range(6):
            _step(emb, s)
        cache = _cache(emb, "r")
        ids, rows = emb._store.vocabulary("r")
        out = cache.index.where[rows] < 0
        the_id, row = int(ids[out][0]), int(rows[out][0])
        slot = next(v for k, v in cache.slow.items() if k != "parameters")
        path = slow_file(slot).path
        _overwrite(path, row * slot.stride(0) * 4 + 4, NAN)
        with pytest.raises(RuntimeError) as info:
            _step(emb, 99, r=torch.tensor([the_id] * 16))
        text = str(info.value)
        assert "table 'r'" in text and "dynamic" in text and "checksum" in text, text
        assert str(slow_file(cache.slow["parameters"]).path) in text


@pytest.mark.parametrize("writes", ["log", "in-place"])
@pytest.mark.parametrize("on", [True, False], ids=["native", "torch"])
def test_a_lost_write_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: str,
                                  on: bool) -> None:
    """p0.bin overwritten in place, whole, with its own bytes of 15 steps earlier (a lost write:
    every record with the checksum it had then, which matched it): the rows written back since
    no longer match, as their checksums are keyed to the versions the cache holds; the step
    that reads one raises RuntimeError naming the table, the row and the file (it does not
    train on the old values), and so does every later step."""
    monkeypatch.setenv(WRITES_ENV, writes)
    with kernels(on):
        emb = _engine(tmp_path)
        for s in range(3):
            _step(emb, s)
        cache = _cache(emb, "a")
        path = slow_file(cache.slow["parameters"]).path
        old, then = path.read_bytes(), cache.read("parameters", torch.arange(ROWS))
        for s in range(3, 18):
            _step(emb, s)
        changed = (cache.read("parameters", torch.arange(ROWS)) != then).any(1)
        stale = torch.nonzero(changed & (cache.index.where < 0)).flatten()
        assert stale.numel() > 0, "rows written back since, out of the cache now"
        row = int(stale[0])
        _overwrite(path, 0, old)
        for _ in range(2):
            with pytest.raises(RuntimeError) as info:
                _step(emb, 99, a=torch.tensor([row] * 16))
            text = str(info.value)
            assert f"row {row} of table 'a'" in text and str(path) in text, text
            assert "checksum" in text and "last checkpoint" in text


def test_a_lost_write_to_a_dynamic_tables_files_is_an_error(tmp_path: Path) -> None:
    """A raw-id table's files (a file per array, the checksums after the parameters) overwritten
    with their bytes of 15 steps earlier: the row of an id written back since is an error when
    it is read back, naming the table and the file."""
    emb = _engine(tmp_path)
    for s in range(3):
        _step(emb, s)
    cache = _cache(emb, "r")
    paths = [slow_file(v).path for v in cache.slow.values()]
    assert len(set(paths)) == len(cache.slow) > 1
    old = [p.read_bytes() for p in paths]
    rows = torch.arange(cache.rows)
    then = cache.read("parameters", rows)
    for s in range(3, 18):
        _step(emb, s)
    ids, held = emb._store.vocabulary("r")
    changed = (cache.read("parameters", rows) != then).any(1)
    stale = changed[held] & (cache.index.where[held] < 0)
    assert stale.any(), "rows written back since, out of the cache now"
    the_id = int(ids[stale][0])
    for p, data in zip(paths, old):
        _overwrite(p, 0, data)
    with pytest.raises(RuntimeError) as info:
        _step(emb, 99, r=torch.tensor([the_id] * 16))
    text = str(info.value)
    assert "table 'r'" in text and "checksum" in text, text
    assert str(slow_file(cache.slow["parameters"]).path) in text


@pytest.mark.parametrize("on", [True, False], ids=["native", "torch"])
def test_the_tiers_sums_are_the_references(tmp_path: Path, on: bool) -> None:
    """After steps that wrote rows back (appended to a log, or in place) and a check of every
    row (as ec.save does), each row's checksum in the file is row_sums of its bytes there, bit
    for bit, with the kernels on and off."""
    with kernels(on):
        emb = _engine(tmp_path)
        for s in range(6):
            _step(emb, s)
        assert sum(c.written_rows for c in emb._store.caches()) > 0
        with files_module.saving():
            emb.state_dict()
        for c in emb._store.caches():
            assert c.sealed and c.sums is not None
            keys = torch.arange(c.rows)
            places = c.log.at(keys) if c.log is not None else keys
            assert torch.equal(c.sums, row_sums([v[places] for v in c.slow.values()], keys,
                                                c.index.versions(keys)))


def test_writes_through_the_tiers_view_are_the_callers(tmp_path: Path) -> None:
    """The tier handed out whole (state_dict's views) may be written: the checksums are set
    again at the next move, so the rows written are read back as written, not as an error."""
    emb = _engine(tmp_path)
    for s in range(3):
        _step(emb, s)
    state = emb.state_dict()
    state["a/parameters"][5] = 7.0
    state["a/accumulators"][5] = 3.0
    emb.enqueue({"a": torch.tensor([5] * 16), "r": torch.tensor([1] * 16)})
    assert torch.equal(emb.dequeue()["a"][0], torch.full((DIM,), 7.0))


# ------------------------------------------------------------------------------ ec.save
def test_save_checks_every_row(tmp_path: Path) -> None:
    """A row changed in the file fails ec.save (naming it), which writes no checkpoint."""
    emb = _engine(tmp_path / "tier")
    for s in range(4):
        _step(emb, s)
    cache = _cache(emb, "a")
    row = int(torch.nonzero(cache.index.where < 0).flatten()[-1])
    raw, _ = records([cache.slow["parameters"]])
    place = int(cache.log.at(torch.tensor([row]))[0]) if cache.log is not None else row
    _overwrite(slow_file(raw).path, place * raw.shape[1] + DIM * 4, b"\x01")  # (its accumulator)
    with pytest.raises(RuntimeError, match=rf"row {row} of table 'a'.*checksum"):
        ec.save(tmp_path / "ckpt", emb)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("on", [True, False], ids=["native", "torch"])
def test_publish_of_a_corrupt_tier_is_an_error(tmp_path: Path, on: bool) -> None:
    """NaNs written over a row's record in p0.bin (out of the cache): ec.publish, which reads
    the rows through ``CachedRows.read``, raises RuntimeError naming the row, the table and the
    file, and publishes nothing (no entry a follower could load); it never ships the NaN."""
    from embcore.formats.published import entries

    with kernels(on):
        emb = _engine(tmp_path / "tier")
        for s in range(6):
            _step(emb, s)
        cache = _cache(emb, "a")
        row = int(torch.nonzero(cache.index.where < 0).flatten()[0])
        raw, _ = records([cache.slow["parameters"]])
        place = int(cache.log.at(torch.tensor([row]))[0]) if cache.log is not None else row
        _overwrite(slow_file(raw).path, place * raw.shape[1], NAN * 2)
        with pytest.raises(RuntimeError) as info:
            ec.publish(tmp_path / "pub", emb)
        text = str(info.value)
        assert f"row {row} of table 'a'" in text and str(slow_file(raw).path) in text, text
        assert "checksum" in text
        assert not (tmp_path / "pub").exists() or not entries(tmp_path / "pub")


def test_save_rescues_the_rows_after_the_offload_directory_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rm -rf of the offload directory under a run: ec.save warns and reads the rows through
    the files still open; the checkpoint, loaded into a new engine, holds the rows of a twin
    that was not harmed; the harmed engine's next step is an error naming a file."""
    monkeypatch.setattr(cache_module, "PATH_CHECK_SECONDS", 0.0)
    hurt, twin = _engine(tmp_path / "hurt"), _engine(tmp_path / "twin")
    for s in range(5):
        _step(hurt, s)
        _step(twin, s)
    shutil.rmtree(tmp_path / "hurt")
    with pytest.warns(RuntimeWarning, match="was removed while the engine ran"):
        ec.save(tmp_path / "ckpt", hurt)
    fresh = _engine(tmp_path / "fresh")
    ec.load(tmp_path / "ckpt", fresh)
    got, want = fresh.state_dict(), twin.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with pytest.raises(RuntimeError, match="was removed"):
        _step(hurt, 9)
