"""The slow tier's files are never a signal ("Trust, third round", point 1): a disk too small is
a clear error when the tier is built (its space reserved, not a SIGBUS at the first write into a
sparse page); the files are private (mode 0600, locked: another process cannot take them, nor
another engine's sweep remove them); a file truncated, removed or replaced by someone else while
the engine runs is a RuntimeError naming it (the truncation, which would fault, in a child
process)."""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import stat
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from distributed import exited_pid

import embcore as ec
from embcore.config.tables import LOG_BYTES_PER_ROW, MAP_BYTES_PER_ROW
from embcore.state.tier import cache as cache_module
from embcore.state.tier import files as files_module

ROWS, DIM = 1000, 8
# the dynamic table's map (MAP_BYTES_PER_ROW a row), both cache indexes and a cache row each (8180
# bytes), the static table's log (LOG_BYTES_PER_ROW a row), 40 cache rows: both tables
# offloaded, their caches a few dozen rows
BUDGET = ROWS * 4 + ROWS * MAP_BYTES_PER_ROW + 8180 + 64 * 40 + ROWS * LOG_BYTES_PER_ROW


def _engine(offload_dir, dynamic=True):
    tables = {"a": ec.TableConfig(vocabulary_size=ROWS, dim=DIM, name="a"),
              "r": ec.TableConfig(vocabulary_size=ROWS, dim=DIM, name="r",
                                  dynamic=ec.DynamicVocabulary() if dynamic else None)}
    fc = {k: ec.FeatureConfig(table=t) for k, t in tables.items()}
    return ec.Embedding(fc, ec.Adagrad(learning_rate=0.1), memory_budget=BUDGET,
                        offload_dir=offload_dir)


def _step(emb, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ROWS, (16,), generator=g)
    emb.enqueue({"a": ids, "r": (ids * 7919) % ROWS})
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})


def _files(base):
    return sorted(Path(base).rglob("*.bin"))


# ------------------------------------------------------------------------------ disk space
def test_a_disk_too_small_is_an_error_when_the_tier_is_built(tmp_path, monkeypatch):
    """posix_fallocate fails with ENOSPC on the tier's second file: an OSError ENOSPC naming the
    directory, the file and the bytes, and nothing is left (the first file is removed too)."""
    calls = []

    def fallocate(fd, offset, length):
        calls.append(length)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    real = os.posix_fallocate
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    emb = _engine(tmp_path)
    with pytest.raises(OSError) as info:
        emb.build(per_replica_batch_size=16)
    e = info.value
    assert e.errno == errno.ENOSPC
    text = str(e)
    assert "no space for the slow tier" in text and str(tmp_path) in text
    assert f"needs {calls[1]} bytes" in text and "bytes are free there" in text
    assert "memory_budget" in text
    assert len(calls) == 2 and not any(tmp_path.iterdir()), "nothing is left behind"


@pytest.mark.parametrize("how", ["unsupported", "missing"])
def test_without_fallocate_free_space_is_checked(tmp_path, monkeypatch, how):
    """Where the file system refuses posix_fallocate (EOPNOTSUPP) or it does not exist, the
    fallback is a check of free space (os.statvfs): too little is ENOSPC naming the bytes free;
    enough builds the tier (its files sparse, reading as zeros)."""
    if how == "missing":
        monkeypatch.delattr(os, "posix_fallocate", raising=False)
    else:
        def fallocate(fd, offset, length):
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        monkeypatch.setattr(os, "posix_fallocate", fallocate)
    real_statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs",
                        lambda p: types.SimpleNamespace(f_bavail=10, f_frsize=4096))
    with pytest.raises(OSError, match=r"needs \d+ bytes.*, 40960 bytes are free there") as info:
        _engine(tmp_path).build(per_replica_batch_size=16)
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    assert not any(tmp_path.iterdir())
    monkeypatch.setattr(os, "statvfs", real_statvfs)
    emb = _engine(tmp_path)
    emb.build(per_replica_batch_size=16)
    for s in range(3):
        _step(emb, s)
    assert _files(tmp_path)


def test_the_tier_is_reserved_and_a_dynamic_tables_rows_read_as_zeros(tmp_path):
    """Every file's disk is reserved at construction (blocks >= size, where the file system has
    fallocate); a dynamic table's rows, never written, read as zeros."""
    emb = _engine(tmp_path)
    emb.build(per_replica_batch_size=16)
    files = _files(tmp_path)
    assert len(files) == 3  # the static table's records; the dynamic table's rows and slot
    for f in files:
        st = f.stat()
        assert st.st_blocks * 512 >= st.st_size, f"{f.name} is reserved"
    dyn = next(c for c in emb._store.caches() if c.name == "r")
    assert not dyn.slow["parameters"].any()


def test_reserve_reports_other_errors_naming_the_file(tmp_path, monkeypatch):
    def fallocate(fd, offset, length):
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(OSError, match=r"cannot reserve 4096 bytes for the slow tier's file .*t\.bin"
                       ) as info:
        files_module.slow_tensor(tmp_path / "t.bin", (64, 16), torch.float32)
    assert info.value.errno == errno.EFBIG and not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ private files
def test_files_are_private_and_locked(tmp_path):
    """Files 0600 and the directory 0700; the files and the directory are locked (flock
    LOCK_EX) while the engine lives: another process cannot take them; gone with the engine."""
    emb = _engine(tmp_path)
    emb.build(per_replica_batch_size=16)
    files = _files(tmp_path)
    (tier,) = [d for d in tmp_path.iterdir()]
    assert stat.S_IMODE(tier.stat().st_mode) == 0o700
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f.name
    for target in files + [tier]:  # another open file description: as another process sees it
        fd = os.open(target, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    take = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)")
    child = subprocess.run([sys.executable, "-c", take, str(files[0])], check=False,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode != 0 and "BlockingIOError" in child.stderr
    del emb
    gc.collect()
    assert not any(tmp_path.iterdir())


def test_a_sweep_leaves_a_locked_directory_of_a_dead_pid(tmp_path):
    """A directory whose name gives a dead pid of this host, but whose lock is held (its
    process lives in another pid namespace): the next engine's sweep leaves it; unlocked, the
    one after removes it."""
    import socket

    host = "".join(c if c.isalnum() or c in "_." else "_" for c in socket.gethostname())
    held = tmp_path / f"embcore-offload-{host}-p{exited_pid()}-r0-held"
    held.mkdir()
    (held / "p0.bin").write_bytes(b"x" * 10)
    fd = os.open(held, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _engine(tmp_path).build(per_replica_batch_size=16)
        assert (held / "p0.bin").exists()
    finally:
        os.close(fd)
    _engine(tmp_path).build(per_replica_batch_size=16)
    assert not held.exists()


# ------------------------------------------------------------------------------ files changed
TRUNCATE = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import test_offload_safety as t
    for dynamic in (False, True):
        base = Path(sys.argv[1]) / ("dynamic" if dynamic else "static")
        emb = t._engine(base, dynamic)
        emb.build(per_replica_batch_size=16)
        t._step(emb, 0)
        for f in t._files(base):  # (dynamic: the raw-id table's files alone, one per array)
            if not dynamic or "-" in f.stem:
                os.truncate(f, 0)
        try:
            for s in range(1, 20):  # (misses and write-backs: the files are touched)
                t._step(emb, s)
        except RuntimeError as e:
            print("step:", e, file=sys.stderr)
        try:
            emb.state_dict()
        except RuntimeError as e:
            print("state_dict:", e, file=sys.stderr)
        print("survived", dynamic)
""")


def test_a_truncated_file_is_an_error_not_a_signal(tmp_path):
    """The file of two static tables (stacked: one file), or those of a dynamic table, truncated
    to 0 bytes after a step: the next steps, and state_dict (which hands out the tier whole),
    raise RuntimeError naming the file and its tables; the process is not killed by SIGBUS (-7,
    or 135 from a shell)."""
    child = subprocess.run([sys.executable, "-c", TRUNCATE, str(tmp_path),
                            str(Path(__file__).parent)],
                           check=False, capture_output=True, text=True, timeout=120)
    assert child.returncode not in (-7, 135), "killed by SIGBUS"
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["survived", "False", "survived", "True"]
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 4, child.stderr
    for line, kind in zip(lines, ["static", "static", "dynamic", "dynamic"]):
        assert "was truncated to 0 bytes" in line and str(tmp_path / kind) in line, line
        assert ".bin" in line and "SIGBUS" in line
        assert ("(tables ['a', 'r'])" if kind == "static" else "(table 'r')") in line, line


def test_a_removed_or_replaced_file_is_an_error(tmp_path, monkeypatch):
    """The file's path removed, or given another file: the next step's moves (the path checked
    every time here: PATH_CHECK_SECONDS 0) or state_dict raise RuntimeError naming it."""
    monkeypatch.setattr(cache_module, "PATH_CHECK_SECONDS", 0.0)
    emb = _engine(tmp_path, dynamic=False)
    emb.build(per_replica_batch_size=16)
    _step(emb, 0)
    first = _files(tmp_path)[0]
    other = tmp_path / "other.bin"
    other.write_bytes(first.read_bytes())
    os.replace(other, first)  # a file of the same size and bytes, but not the engine's
    with pytest.raises(RuntimeError, match=rf"{first}.*was replaced by another file"):
        for s in range(1, 20):
            _step(emb, s)
    os.unlink(first)
    with pytest.raises(RuntimeError, match=rf"{first}.*was removed"):
        emb.state_dict()


def test_a_check_costs_little(tmp_path):
    """The per-step check of a step's moves (one fstat a file) stays cheap: well under 50 us."""
    import time

    emb = _engine(tmp_path)
    emb.build(per_replica_batch_size=16)
    cache = next(iter(emb._store.caches()))
    cache.check_files(moving=True)
    start = time.perf_counter()
    for _ in range(1000):
        cache.check_files(moving=True)
    assert (time.perf_counter() - start) / 1000 < 50e-6
