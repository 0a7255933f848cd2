"""A publish directory that others can change (docs/semantics.md section 13, "Reading" and
"Chains").

(1) A follower is never killed or hung by its directory: every file is opened without following
a link and without blocking, must be a regular file of the size its manifest states, and is read
into memory, never mapped; a part truncated while it is read, a FIFO, a link (to a FIFO, to
``/dev/zero``) is a ``PublishError`` naming the file, or (truncated after it was read) nothing.
(2) Publishing: the writer lock is never followed through a link; a directory holds one chain,
so a snapshot copied in from elsewhere is refused by readers and by resume; a full disk is an
``OSError``; a failed first publish lets go of its lock at once; retention racing a follower
starts it over from the newest snapshot, never "incomplete"; resume into another optimizer
follows a checkpoint's rules (``strict=False`` skips the slots it lacks).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from checks import unblocking

import embcore as ec
from embcore.formats import published as fmt

ROOT = Path(ec.__file__).resolve().parents[1]


def engine(seed: int = 0, optimizer: Any = None) -> ec.Embedding:
    torch.manual_seed(seed)
    t = ec.TableConfig(vocabulary_size=300, dim=8, name="t")
    u = ec.TableConfig(vocabulary_size=50, dim=4, name="u",
                       dynamic=ec.DynamicVocabulary(eviction="lfu"))
    return ec.Embedding({"f": ec.FeatureConfig(table=t), "g": ec.FeatureConfig(table=u)},
                        optimizer or ec.Adagrad(learning_rate=0.1))


def train(emb: ec.Embedding, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    emb.enqueue({"f": torch.randint(0, 300, (8,), generator=g),
                 "g": torch.randint(0, 30, (8,), generator=g) * 1009 + step})
    act = emb.dequeue()
    emb.apply_gradients({k: a.detach() * 0.5 + 0.1 for k, a in act.items()})


def table(emb: ec.Embedding, name: str = "t") -> torch.Tensor:
    return emb.embedding_tables[next(t for t in emb.table_names() if t.name == name)]


def follows(served, emb: ec.Embedding) -> bool:
    return torch.equal(served.t, table(emb))


def parts(entry_dir: Path) -> list[Path]:
    return sorted(entry_dir.glob("*.pt"))


# ------------------------------------------------------------------ cases run in a subprocess
# (before the fix they kill the process: SIGBUS, memory exhausted; or hold the lock for good)
_CASES = r"""
import errno, json, os, resource, sys
from pathlib import Path
from typing import Any
import torch, embcore as ec
from embcore.formats import published as fmt
sys.path.insert(0, sys.argv[2])
from test_publish_trust import engine, train, table, parts
root = Path(sys.argv[1])

def report(case, **what):
    print(json.dumps({"case": case, **what}), flush=True)

def outcome(fn):
    try:
        return "ok: " + repr(fn())
    except fmt.PublishError as e:
        return f"PublishError: {e}"
    except BaseException as e:
        return f"{type(e).__name__}: {e}"

# (a) a manifest linked to /dev/zero, read with the address space limited (else it eats memory)
d = root / "zero"
ec.publish(d, engine())
(d / "00000000-snapshot" / fmt.MANIFEST).unlink()
(d / "00000000-snapshot" / fmt.MANIFEST).symlink_to("/dev/zero")
size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1])
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (size * 1024 + (2 << 30), hard))
try:
    got = outcome(lambda: ec.load_published(d).version)
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
report("dev-zero", outcome=got)

# (b) a first publish failing (files cannot grow: EFBIG, as a full disk) while its error is kept
d = root / "lock"
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
try:
    ec.publish(d, engine())
    first, kept = "published", None
except BaseException as e:
    first, kept = f"{type(e).__name__} errno {getattr(e, 'errno', None)}", e
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
report("lock", first=first, second=outcome(lambda: ec.publish(d, engine(1))["seq"]))

# (c) a part truncated right after torch.load returned (before: its mapped pages, SIGBUS), and
# right before (a PublishError); the follower's refresh and load_published
real = torch.load
def truncating(before):
    def load(f, *a, **k):
        if before:
            [os.truncate(p, 0) for p in truncated]
        got = real(f, *a, **k)
        [os.truncate(p, 0) for p in truncated]
        return got
    return load
d = root / "trunc"
emb = engine()
ec.publish(d, emb)
served = ec.load_published(d)
train(emb, 1)
ec.publish(d, emb)
truncated = parts(d / "00000001-delta")
torch.load = truncating(False)
got = outcome(lambda: (served.refresh(), torch.equal(served.t, table(emb))))
torch.load = real
report("truncated after the read, refresh", outcome=got)
d = root / "trunc2"
ec.publish(d, emb)
truncated = parts(d / "00000000-snapshot")
torch.load = truncating(False)
got = outcome(lambda: torch.equal(ec.load_published(d).t, table(emb)))
torch.load = real
report("truncated after the read, load_published", outcome=got)
d = root / "trunc3"
ec.publish(d, emb)
served = ec.load_published(d)
train(emb, 2)
ec.publish(d, emb)
truncated = parts(d / "00000001-delta")
torch.load = truncating(True)
got = outcome(lambda: served.refresh())
torch.load = real
report("truncated before the read, refresh", outcome=got, version=served.version)
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The subprocess's report per case: ``{case: {...}}``, and its exit status and stderr."""
    root = tmp_path_factory.mktemp("cases")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CASES, str(root), str(Path(__file__).parent)],
                          env=env, capture_output=True, text=True, timeout=300)
    got = {}
    for line in proc.stdout.splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            got[row.pop("case")] = row
    return got, proc.returncode, proc.stderr[-3000:]


def _case(cases, name):
    got, rc, err = cases
    assert name in got, f"the subprocess did not get past this case (exit status {rc}): {err}"
    return got[name]


@pytest.mark.slow
def test_a_part_truncated_while_a_follower_reads_it_never_kills_it(cases):
    """A part truncated while read: before, its mapped pages were read past the file's end
    (SIGBUS, the follower killed). Now it is read into memory: truncated after the read, the
    values read are whole (and checked); truncated before, a PublishError naming the file."""
    assert _case(cases, "truncated after the read, refresh")["outcome"] == "ok: (1, True)"
    assert _case(cases, "truncated after the read, load_published")["outcome"] == "ok: True"
    before = _case(cases, "truncated before the read, refresh")
    assert before["outcome"].startswith("PublishError: ") and "r00000-0000.pt" in \
        before["outcome"] and before["version"] == 0
    assert cases[1] == 0, cases[2]  # the process ended as it should, not by a signal


@pytest.mark.slow
def test_a_manifest_linked_to_dev_zero_is_an_error_not_all_memory(cases):
    got = _case(cases, "dev-zero")["outcome"]
    assert got.startswith("PublishError: ") and fmt.MANIFEST in got and "symbolic link" in got


@pytest.mark.slow
def test_a_failed_first_publish_lets_go_of_the_lock_at_once(cases):
    """A first publish that fails (here: files cannot grow, ``EFBIG``) raises an OSError, and
    another trainer may publish at once, while that error is still referenced (before, the
    lock was held as long as the error lived)."""
    got = _case(cases, "lock")
    assert got["first"] == f"OSError errno {errno.EFBIG}", got
    assert got["second"] == "ok: 0", got


# ------------------------------------------------------------------ FIFOs and links, in process
def test_a_part_or_manifest_that_is_a_fifo_or_a_link_is_an_error_never_a_hang(tmp_path):
    emb = engine()
    d = tmp_path / "pub"
    ec.publish(d, emb)
    served = ec.load_published(d)
    train(emb, 1)
    ec.publish(d, emb)
    fifo = tmp_path / "elsewhere.fifo"
    os.mkfifo(fifo)
    snap, delta = d / "00000000-snapshot", d / "00000001-delta"
    for what, path, replace in (
            ("a FIFO", parts(snap)[0], lambda p: os.mkfifo(p)),
            ("a symbolic link", parts(snap)[0], lambda p: p.symlink_to(fifo)),
            ("a FIFO", snap / fmt.MANIFEST, lambda p: os.mkfifo(p)),
            ("a symbolic link", snap / fmt.MANIFEST, lambda p: p.symlink_to(fifo))):
        kept = tmp_path / "kept"
        os.replace(path, kept)
        replace(path)
        with unblocking([path, fifo]) as had_to, pytest.raises(fmt.PublishError) as got:
            ec.load_published(d)
        assert not had_to, f"load_published blocked on {what} ({path.name})"
        assert str(path) in str(got.value) and what in str(got.value)
        path.unlink()
        os.replace(kept, path)
    part = parts(delta)[0]
    os.replace(part, tmp_path / "kept")
    os.mkfifo(part)
    with unblocking([part]) as had_to, pytest.raises(fmt.PublishError, match="is a FIFO"):
        served.refresh()
    assert not had_to and served.version == 0


def test_a_part_of_another_size_than_its_manifest_states_is_named(tmp_path):
    emb = engine()
    ec.publish(tmp_path, emb)
    part = parts(tmp_path / "00000000-snapshot")[0]
    size = part.stat().st_size
    with open(part, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(fmt.PublishError, match=rf"{part} is {size + 10} bytes but its manifest "
                                               rf"says {size}"):
        ec.load_published(tmp_path)
    os.truncate(part, size - 100)
    with pytest.raises(fmt.PublishError, match=rf"is {size - 100} bytes but its manifest says"):
        ec.load_published(tmp_path)


# ------------------------------------------------------------------ (2) the writer's lock
def test_the_writer_lock_is_never_followed_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = tmp_path / "pub"
    d.mkdir()
    (d / fmt.LOCK).symlink_to(victim)
    with pytest.raises(fmt.PublishError, match=rf"{d / fmt.LOCK} is a symbolic link"):
        ec.publish(d, engine())
    assert victim.read_text() == "precious" and not fmt.entries(d)
    (d / fmt.LOCK).unlink()
    os.mkfifo(d / fmt.LOCK)
    with pytest.raises(fmt.PublishError, match="is a FIFO"):
        ec.publish(d, engine())
    (d / fmt.LOCK).unlink()
    assert ec.publish(d, engine())["seq"] == 0  # a regular file: as before


# ------------------------------------------------------------------ (2) one chain a directory
def _reseal(entry: fmt.Entry, change) -> None:
    m = entry.manifest()
    change(m)
    (entry.path / fmt.MANIFEST).write_text(json.dumps({**m, "seal": fmt._seal(m)}))


def test_a_snapshot_copied_in_from_another_directory_is_refused(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    a, b = engine(0), engine(1)  # the same model, other values
    for k in range(3):
        train(a, k)
        ec.publish(ours, a)
    for k in range(4):
        train(b, k)
        ec.publish(theirs, b, snapshot=k == 3)  # entry 3 of theirs: a snapshot
    served = ec.load_published(ours)
    assert served.version == 2
    shutil.copytree(theirs / "00000003-snapshot", ours / "00000003-snapshot")
    refused = r"00000003-snapshot belongs to chain [0-9a-f]+, not to this directory's chain"
    with pytest.raises(fmt.PublishError, match=refused):
        ec.load_published(ours)
    with pytest.raises(fmt.PublishError, match=refused):
        served.refresh()
    assert served.version == 2 and follows(served, a)
    target = engine(5)
    with pytest.raises(fmt.PublishError, match=refused):
        ec.load(ours, target)
    assert target.step == 0
    # one without a chain identity (an older embcore's, or stripped) after ours: refused too
    _reseal(fmt.entries(ours)[-1], lambda m: m.pop("chain"))
    with pytest.raises(fmt.PublishError, match="carries no chain identity"):
        ec.load_published(ours)
    shutil.rmtree(ours / "00000003-snapshot")
    assert ec.load_published(ours).version == 2


def test_a_snapshot_of_a_copy_of_the_directory_is_refused(tmp_path):
    """A copy of the directory, continued by another trainer: same chain, other entries. Its
    snapshot names a predecessor that is here under another id."""
    ours, copy = tmp_path / "ours", tmp_path / "copy"
    a = engine(0)
    for k in range(3):
        train(a, k)
        ec.publish(ours, a, slots=True)
    shutil.copytree(ours, copy)
    c = engine(7)
    ec.load(copy, c)
    train(c, 10)
    ec.publish(copy, c, slots=True)  # entry 3 of the copy
    train(a, 3)
    ec.publish(ours, a, slots=True)  # entry 3 of ours
    train(c, 11)
    ec.publish(copy, c, slots=True, snapshot=True)  # entry 4 of the copy, after its own 3
    shutil.copytree(copy / "00000004-snapshot", ours / "00000004-snapshot")
    with pytest.raises(fmt.PublishError, match=r"names entry 3 with id .* as its predecessor, "
                                               r"but 00000003-delta has id"):
        ec.load_published(ours)


def test_a_new_trainer_continues_the_directorys_chain(tmp_path):
    first = engine(0)
    ec.publish(tmp_path, first)
    served = ec.load_published(tmp_path)
    m0 = fmt.entries(tmp_path)[0].manifest()
    assert m0["chain"] == m0["id"] and m0["previous"] is None  # the first entry: the identity
    del first
    gc.collect()  # (the trainer stops; its lock goes with it)
    second = engine(2)
    train(second, 1)
    assert ec.publish(tmp_path, second)["kind"] == "snapshot"
    m1 = fmt.entries(tmp_path)[1].manifest()
    assert m1["chain"] == m0["chain"] and m1["previous"] == {"seq": 0, "id": m0["id"]}
    assert served.refresh() == 1 and follows(served, second)


def test_directories_written_before_chains_are_read_as_before(tmp_path):
    """Entries without ``chain`` or ``sizes`` (written by an older embcore) are read, followed
    and resumed; a trainer's first entry after them starts the directory's identity."""
    emb = engine(0)
    for k in range(2):
        train(emb, k)
        ec.publish(tmp_path, emb, slots=True)
    for e in fmt.entries(tmp_path):
        _reseal(e, lambda m: (m.pop("chain"), m.pop("sizes")))
    served = ec.load_published(tmp_path)
    assert served.version == 1 and follows(served, emb)
    del emb
    gc.collect()  # (the trainer stops; its lock goes with it)
    resumed = engine(4)
    ec.load(tmp_path, resumed)
    assert resumed.step == 2
    train(resumed, 2)
    assert ec.publish(tmp_path, resumed, slots=True)["kind"] == "delta"
    m = fmt.entries(tmp_path)[-1].manifest()
    assert m["chain"] == m["id"] and m["previous"]["seq"] == 1
    assert served.refresh() == 1 and follows(served, resumed)
    assert follows(ec.load_published(tmp_path), resumed)


# ------------------------------------------------------------------ (2) a full disk
def test_a_full_disk_while_a_part_is_written_is_an_oserror(tmp_path, monkeypatch):
    """torch.save reports a failed write as ``RuntimeError [enforce fail at
    inline_container.cc...]``; publish raises the OSError (``ENOSPC``) it stands for, chained,
    and loses nothing."""
    emb = engine()
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path)
    train(emb, 1)
    real = torch.save

    class Full(io.RawIOBase):  # a disk that fills up after a few writes
        def __init__(self) -> None:
            self.left = 2

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            self.left -= 1
            if self.left < 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return len(b)

    def full_disk(obj, f, *a, **k):
        real(obj, Full(), *a, **k)  # torch's own error, as a full disk gives it

    with pytest.raises(RuntimeError, match=r"enforce fail at inline_container\.cc"):
        full_disk({"x": torch.zeros(100)}, None)  # (what torch.save raises)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as got:
        ec.publish(tmp_path, emb)
    monkeypatch.undo()
    assert got.value.errno == errno.ENOSPC and "r00000-0000.pt" in str(got.value)
    assert isinstance(got.value.__cause__, RuntimeError)
    assert "inline_container" in str(got.value.__cause__)
    assert [e.seq for e in fmt.entries(tmp_path)] == [0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    info = ec.publish(tmp_path, emb)  # the rows of the failed publish go out now
    assert info["seq"] == 1 and info["rows"]["t"] > 0
    assert served.refresh() == 1 and follows(served, emb)


# ------------------------------------------------------------------ (2) retention vs followers
def test_retention_removing_what_a_follower_reads_starts_it_over(tmp_path, monkeypatch):
    """Entries listed, then removed by the trainer's retention (``keep_snapshots=1``) before the
    follower reads them, three times running: ``refresh`` and ``load_published`` read the newest
    chain again (no error, no warning: this is retention, not damage)."""
    emb = engine()
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path)
    train(emb, 1)
    ec.publish(tmp_path, emb)
    real = fmt.entries
    state = {"left": 3, "busy": False, "step": 2}

    def racing(directory):
        found = real(directory)
        if state["left"] and not state["busy"]:
            state["left"] -= 1
            state["busy"] = True
            try:  # the trainer publishes a snapshot and removes every entry just listed
                train(emb, state["step"])
                state["step"] += 1
                ec.publish(tmp_path, emb, snapshot=True, keep_snapshots=1)
            finally:
                state["busy"] = False
        return found

    monkeypatch.setattr(fmt, "entries", racing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert served.refresh() == 1
        assert follows(served, emb)
        state["left"] = 3
        assert follows(ec.load_published(tmp_path), emb)


def test_retention_racing_a_follower_in_another_thread(tmp_path):
    """A trainer thread publishing with ``keep_snapshots=1`` while the follower refreshes and
    loads as fast as it can, for a bounded time: never an error."""
    emb = engine()
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path)
    stop, failed = threading.Event(), []

    def trainer() -> None:
        k = 0
        try:
            while not stop.is_set():
                k += 1
                train(emb, k)
                ec.publish(tmp_path, emb, snapshot=k % 2 == 0, keep_snapshots=1)
        except BaseException as e:  # (reported below)
            failed.append(e)

    t = threading.Thread(target=trainer)
    t.start()
    calls, end = 0, time.monotonic() + 3.0
    try:
        while time.monotonic() < end and not failed:
            calls += 1
            try:
                served.refresh()
                if calls % 4 == 0:
                    ec.load_published(tmp_path)
            except Exception as e:
                failed.append(e)
    finally:
        stop.set()
        t.join()
    assert not failed, f"{len(failed)} failures in {calls} calls: {failed[0]!r}"
    served.refresh()
    assert follows(served, emb)


# ------------------------------------------------------------------ (2) resume, other optimizer
def test_resume_into_another_optimizer_follows_the_checkpoint_rules(tmp_path):
    """As ``ec.load`` of a checkpoint: a slot the directory lacks is a KeyError, skipped with
    ``strict=False`` (the step then stays: it needs every slot); a directory published without
    slots loads its parameters with ``strict=False``."""
    sgd = engine(0, ec.SGD(learning_rate=0.1))
    ec.publish(tmp_path / "sgd", sgd, slots=True)
    train(sgd, 1)
    ec.publish(tmp_path / "sgd", sgd, slots=True)
    target = engine(3)  # Adagrad: accumulators
    with pytest.raises(KeyError, match=r"slot 'accumulators' of table 't' is not in .*SGD"):
        ec.load(tmp_path / "sgd", target)
    before = target.state_dict()["t/accumulators"].clone()
    ec.load(tmp_path / "sgd", target, strict=False)
    assert torch.equal(table(target), table(sgd)) and torch.equal(table(target, "u"),
                                                                  table(sgd, "u"))
    assert torch.equal(target.state_dict()["t/accumulators"], before) and target.step == 0
    ada = engine(1)
    train(ada, 1)
    ec.publish(tmp_path / "plain", ada)  # without slots
    with pytest.raises(ValueError, match="slots=False"):
        ec.load(tmp_path / "plain", engine(5))
    other = engine(5)
    ec.load(tmp_path / "plain", other, strict=False)
    assert torch.equal(table(other), table(ada)) and other.step == 0
    into_sgd = engine(6, ec.SGD(learning_rate=0.1))  # no slots wanted: all of it, with the step
    ec.publish(tmp_path / "ada", ada, slots=True)
    ec.load(tmp_path / "ada", into_sgd)
    assert torch.equal(table(into_sgd), table(ada)) and into_sgd.step == 1


def test_an_int8_followers_refusal_names_the_table_row_not_the_deltas_position(tmp_path):
    """A delta row that int8 codes cannot hold (NaN): the follower's error names the table and
    the table's row (the delta carries a few rows, so a position in it is another number)."""
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=50, dim=4, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path, quantize="int8")
    with torch.no_grad():
        emb.embedding_tables[t][37] = float("nan")  # (as a diverged run would leave it)
    emb.enqueue({"f": torch.tensor([3, 37])})
    act = emb.dequeue()
    emb.apply_gradients({"f": torch.ones_like(act["f"])})
    assert ec.publish(tmp_path, emb, snapshot=False)["rows"] == {"t": 2}
    with pytest.raises(ValueError, match=r"table 't': row 37 holds NaN or inf"):
        served.refresh()


# ------------------------------------------------------------------ (1) a manifest's numbers
_NOT_NUMBERS = {"NaN": "NaN", "Infinity": "Infinity", "1e999": "1e999",
                "5000 digits": "9" * 5000, "-2**63 - 1": str(-2**63 - 1)}


def _spoil(entry: Path, number: str) -> None:
    """Writes ``number`` as the manifest's time (its last field but the seal, on one line)."""
    path = entry / fmt.MANIFEST
    text = path.read_text()
    spoiled = re.sub(r'^ "time": [0-9.e+-]+,$', f' "time": {number},', text, flags=re.M)
    assert spoiled != text
    path.write_text(spoiled)


@pytest.mark.parametrize("number", list(_NOT_NUMBERS.values()), ids=list(_NOT_NUMBERS))
def test_a_manifest_of_nan_infinity_or_a_huge_integer_is_a_publish_error(tmp_path, number):
    emb = engine()
    ec.publish(tmp_path, emb)
    _spoil(tmp_path / "00000000-snapshot", number)
    named = re.escape(str(tmp_path / "00000000-snapshot" / fmt.MANIFEST))
    with pytest.raises(fmt.PublishError, match=rf"{named} is unreadable or not JSON"):
        fmt.entries(tmp_path)[0].manifest()
    with pytest.raises(fmt.PublishError, match=rf"{named} is unreadable or not JSON"):
        ec.load_published(tmp_path)


@pytest.mark.parametrize("number", ["NaN", "9" * 5000])
def test_a_spoilt_older_entry_blocks_nothing_that_reaches_the_newest_snapshot(tmp_path,
                                                                              number):
    """Entries 0 (snapshot), 1 (delta), 2 (snapshot), 3 (delta): reaching the newest state
    needs 2 and 3 only, so a manifest of entry 0 or 1 that cannot be read blocks neither
    load_published, refresh, ec.load nor a new trainer's publish; one of entry 2 or 3 does,
    named (docs/semantics.md section 13, Reading)."""
    emb = engine()
    for k in range(4):
        train(emb, k)
        ec.publish(tmp_path, emb, slots=True, snapshot=k == 2)
    served = ec.load_published(tmp_path)
    assert served.version == 3
    train(emb, 4)
    ec.publish(tmp_path, emb, slots=True)  # entry 4, a delta: what refresh reads
    older = fmt.entries(tmp_path)[:2]
    for e in older:
        _spoil(e.path, number)
    assert served.refresh() == 1 and follows(served, emb)
    assert ec.load_published(tmp_path).version == 4
    resumed = engine(3)
    assert ec.load(tmp_path, resumed)["seq"] == 4 and resumed.step == emb.step
    assert torch.equal(table(resumed), table(emb))
    del emb
    gc.collect()  # (the trainer stops; its lock goes with it)
    train(resumed, 5)
    assert ec.publish(tmp_path, resumed, slots=True)["seq"] == 5  # continues the chain
    assert served.refresh() == 1 and follows(served, resumed)
    # an entry the newest state needs: named, every way
    _spoil(tmp_path / "00000004-delta", number)
    named = re.escape(str(tmp_path / "00000004-delta" / fmt.MANIFEST))
    with pytest.raises(fmt.PublishError, match=rf"{named} is unreadable or not JSON"):
        ec.load_published(tmp_path)
    with pytest.raises(fmt.PublishError, match=rf"{named} is unreadable or not JSON"):
        ec.load(tmp_path, engine(4))


def test_a_sealed_manifest_of_a_step_beyond_64_bits_is_a_publish_error(tmp_path):
    """Resealed (the seal is a CRC: anyone can write one), a step of 2**64 was read, then
    failed as torch's bare ValueError (an overflow) when resumed."""
    emb = engine()
    ec.publish(tmp_path, emb, slots=True)
    _reseal(fmt.entries(tmp_path)[0], lambda m: m.update(step=2**64))
    target = engine(1)
    with pytest.raises(fmt.PublishError, match="an integer of 20 digits, beyond 64 bits"):
        ec.load(tmp_path, target)
    assert target.step == 0


def test_a_later_snapshot_that_names_no_predecessor_is_refused(tmp_path):
    """Only the chain's first entry (its id the chain's identity) may name no predecessor."""
    emb = engine()
    for k in range(3):
        train(emb, k)
        ec.publish(tmp_path, emb, snapshot=k == 2)
    _reseal(fmt.entries(tmp_path)[2], lambda m: m.update(previous=None))
    refused = (r"00000002-snapshot names no predecessor, yet it is not the first entry of its "
               r"chain [0-9a-f]+; an entry after the first must name one")
    with pytest.raises(fmt.PublishError, match=refused):
        ec.load_published(tmp_path)
    with pytest.raises(fmt.PublishError, match=refused):
        ec.load(tmp_path, engine(1))
    # the chain's own first entry names none, and is read
    shutil.rmtree(tmp_path / "00000002-snapshot")
    assert ec.load_published(tmp_path).version == 1
