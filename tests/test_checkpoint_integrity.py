"""Checkpoint integrity: every saved chunk's CRC-32 is in the manifest and checked at load
(checkpoint.py, module docstring: Integrity). Flipped bytes in a data file, in the index or in
the manifest's checksums are a ValueError naming the file (and the key), with the target
unchanged; checkpoints without checksums (written before them) still load; an empty or truncated
index and a malformed manifest are ValueErrors saying so; W = 2 -> W = 1 and W = 1 -> W = 2."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from checks import unblocking
from distributed import run_on

import embcore as ec
from embcore.formats import checkpoint as fck
from embcore.formats.published import crc

# ----------------------------------------------------------------------------------- fixtures
A = ec.TableConfig(vocabulary_size=50, dim=4, name="a", combiner="sum")
B = ec.TableConfig(vocabulary_size=30, dim=4, name="b")
C = ec.TableConfig(vocabulary_size=20, dim=8, name="c",
                   optimizer=ec.FTRL(learning_rate=0.5, initial_accumulator_value=0.1))


def engine(seed: int, tables=(A, B, C), **kw) -> ec.Embedding:
    torch.manual_seed(seed)
    return ec.Embedding({f"f{t.name}": ec.FeatureConfig(table=t) for t in tables},
                        ec.Adagrad(learning_rate=0.1), **kw)


def train(emb: ec.Embedding, seed: int, rank: int = 0) -> None:
    g = torch.Generator().manual_seed(100 * seed + rank)
    emb.enqueue({n: torch.randint(0, f.table.vocabulary_size, (6,), generator=g)
                 for n, f in emb.feature_config.items()})
    act = emb.dequeue()
    sum((a * torch.arange(a.numel()).view_as(a)).sin().sum() for a in act.values()).backward()
    emb.apply_gradients({k: a.grad for k, a in act.items()})


def snapshot(obj) -> dict[str, torch.Tensor]:
    """Its state (this process's shards when sharded), copied."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in obj.state_dict().items()}


def assert_state_equal(x: dict, y: dict) -> None:
    assert sorted(x) == sorted(y)
    for k, v in x.items():
        assert torch.equal(v, y[k]), k


def chunks(path: Path) -> dict[tuple[str, tuple[int, ...]], tuple[Path, int, int]]:
    """{(key, offsets): (data file, offset, length)} of every saved chunk, from DCP's index."""
    with open(path / ".metadata", "rb") as f:
        md = fck.RestrictedMetadataUnpickler(f).load()
    return {(i.fqn, tuple(i.offset)): (path / s.relative_path, s.offset, s.length)
            for i, s in md.storage_data.items()}


def values_at(file: Path, tensor: torch.Tensor) -> int:
    """Where ``tensor``'s bytes (its values) lie in ``file``."""
    at = file.read_bytes().find(tensor.detach().contiguous().numpy().tobytes())
    assert at >= 0
    return at


def flip(file: Path, at: int, n: int = 1) -> bytes:
    """XORs ``n`` bytes of ``file`` from ``at`` with 0xFF; returns the original bytes."""
    original = file.read_bytes()
    raw = bytearray(original)
    raw[at:at + n] = bytes(b ^ 0xFF for b in raw[at:at + n])
    file.write_bytes(bytes(raw))
    return original


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest, indent=1))


def drop_checksums(path: Path) -> None:
    """A checkpoint as written before checksums existed: its manifest without them."""
    edit_manifest(path, lambda m: m.pop("checksums"))


@pytest.fixture()
def saved(tmp_path):
    """(checkpoint path, the trained engine saved there)."""
    emb = engine(0)
    train(emb, 1)
    train(emb, 2)
    ec.save(tmp_path / "ck", emb, extra={"epoch": 2})
    return tmp_path / "ck", emb


def corrupt_load(path: Path, target, match: str, **kw) -> ValueError:
    """Loads ``path`` into ``target``: a ValueError matching ``match``; the target unchanged."""
    before, step = snapshot(target), getattr(target, "step", None)
    with pytest.raises(ValueError, match=match) as e:
        ec.load(path, target, **kw)
    assert type(e.value) is ValueError
    assert_state_equal(snapshot(target), before)
    assert getattr(target, "step", None) == step
    return e.value


# ----------------------------------------------------------------------------------- the manifest
def test_manifest_holds_a_crc_of_every_saved_chunk(saved):
    path, emb = saved
    manifest = json.loads((path / "manifest.json").read_text())
    sums = manifest["checksums"]
    assert sums["algorithm"] == "crc32" and manifest["format_version"] == 1
    index = chunks(path)
    assert {(c["key"], tuple(c["at"])) for c in sums["chunks"]} == set(index)
    assert {c["key"] for c in sums["chunks"]} == set(emb.state_dict())
    for c in sums["chunks"]:
        file, offset, length = index[(c["key"], tuple(c["at"]))]
        assert (path / c["file"], c["offset"], c["length"]) == (file, offset, length)
        data = file.read_bytes()[offset:offset + length]  # the same CRC as publish entries'
        assert c["crc32"] == crc(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    index_bytes = bytearray((path / ".metadata").read_bytes())
    assert sums["index"] == crc(torch.frombuffer(index_bytes, dtype=torch.uint8))
    # The file's bytes are all in some chunk: no byte of it goes unchecked.
    data = path / "__0_0.distcp"
    assert sum(c["length"] for c in sums["chunks"]) == data.stat().st_size
    fresh = engine(3)
    assert ec.load(path, fresh) == manifest
    assert_state_equal(snapshot(fresh), snapshot(emb))


# ----------------------------------------------------------------------------------- data files
def test_flipped_bytes_in_the_data_raise_naming_file_and_key(saved):
    """The issue's case (64 bytes XORed in the middle of the data file) and single bytes at
    several places of a table's chunk (its header, values, last byte), of a slot's and of the
    step: each a ValueError naming the file and the key; nothing is loaded."""
    path, emb = saved
    index = chunks(path)
    data = path / "__0_0.distcp"
    fresh = engine(3)
    size = data.stat().st_size
    original = flip(data, size // 2 - 32, 64)
    key = next(k for (k, _), (_, o, n) in index.items() if o <= size // 2 < o + n)
    corrupt_load(path, fresh, rf"{re.escape(str(data))}: checkpoint entry '{key}' .*does not "
                              r"match its CRC-32 in .*manifest.json: the checkpoint is corrupt")
    data.write_bytes(original)
    for key in ("a/parameters", "c/linears", "step"):
        file, offset, length = index[(key, (0, 0) if key != "step" else ())]
        values = values_at(file, emb.state_dict()[key])  # the tensor's values in its chunk
        assert offset < values < offset + length
        for at in sorted({offset + 5, offset + length // 3, values, values + 7,
                          offset + length - 1}):
            original = flip(file, at)
            err = corrupt_load(path, fresh, rf"checkpoint entry '{re.escape(key)}'")
            assert str(file) in str(err) and f"bytes {offset}..{offset + length}" in str(err)
            file.write_bytes(original)
    ec.load(path, fresh)  # restored: loads again
    assert_state_equal(snapshot(fresh), snapshot(emb))


def test_only_the_chunks_read_are_checked(saved):
    """A partial load reads (and checks) only its tables' chunks."""
    path, emb = saved
    file, offset, length = chunks(path)[("a/parameters", (0, 0))]
    flip(file, offset + length // 2)
    fresh = engine(3)
    corrupt_load(path, fresh, "'a/parameters'", tables=["a"])
    ec.load(path, fresh, tables=["b", "c"])
    for k, v in snapshot(fresh).items():
        if not k.startswith("a/") and k != "step":
            assert torch.equal(v, emb.state_dict()[k]), k


def test_truncated_or_missing_data_file(saved):
    path, _ = saved
    data = path / "__0_0.distcp"
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) - 100])
    corrupt_load(path, engine(3), rf"{re.escape(str(data))}: checkpoint entry .* ends past the "
                                  r"file's \d+ bytes: the checkpoint is corrupt or truncated")
    data.unlink()
    with pytest.raises(FileNotFoundError, match="__0_0.distcp"):
        ec.load(path, engine(3))


def test_dynamic_table_chunks_are_checked(tmp_path):
    d = ec.TableConfig(vocabulary_size=16, dim=4, name="d", dynamic=ec.DynamicVocabulary())
    torch.manual_seed(0)
    emb = ec.Embedding({"fd": ec.FeatureConfig(table=d)}, ec.Adagrad(learning_rate=0.1))
    emb.enqueue({"fd": torch.tensor([10**12, 7, 7, -3])})
    act = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(a) for k, a in act.items()})
    ec.save(tmp_path / "ck", emb)
    torch.manual_seed(1)
    fresh = ec.Embedding({"fd": ec.FeatureConfig(table=d)}, ec.Adagrad(learning_rate=0.1))
    ec.load(tmp_path / "ck", fresh)
    probe = {"fd": torch.tensor([7, -3, 10**12, 5])}
    assert torch.equal(fresh.lookup(probe)["fd"], emb.lookup(probe)["fd"])
    for key in ("d/vocabulary/ids", "d/vocabulary/seed"):
        (file, offset, length), = [v for (k, _), v in chunks(tmp_path / "ck").items() if k == key]
        original = flip(file, offset + length - 1)
        target = ec.Embedding({"fd": ec.FeatureConfig(table=d)}, ec.Adagrad(learning_rate=0.1))
        corrupt_load(tmp_path / "ck", target, f"checkpoint entry '{key}'")
        file.write_bytes(original)


# ----------------------------------------------------------------------------------- the index
@pytest.mark.parametrize("checksums", [True, False])
def test_empty_or_truncated_index_is_a_corrupt_checkpoint(saved, checksums):
    """An empty or truncated .metadata (not EOFError), with checksums or without, and a damaged
    one (a flipped byte) with them."""
    path, _ = saved
    if not checksums:
        drop_checksums(path)
    index = path / ".metadata"
    whole = index.read_bytes()
    fresh = engine(3)
    index.write_bytes(b"")
    corrupt_load(path, fresh, rf"{re.escape(str(index))} is empty: the checkpoint is corrupt")
    for cut in (1, 10, len(whole) // 2, len(whole) - 1):
        index.write_bytes(whole[:cut])
        err = corrupt_load(path, fresh, re.escape(str(index)))
        assert "corrupt" in str(err)
        if checksums:
            assert "does not match its CRC-32" in str(err)
    if checksums:
        index.write_bytes(whole)
        flip(index, len(whole) // 2)
        corrupt_load(path, fresh, rf"{re.escape(str(index))} does not match its CRC-32 in "
                                  r".*manifest.json: the checkpoint is corrupt")


def test_manifest_of_another_checkpoint_is_refused(tmp_path, saved):
    """The same tables saved again (other values): its manifest's checksums do not fit."""
    path, emb = saved
    train(emb, 3)
    ec.save(tmp_path / "other", emb)
    shutil.copy(tmp_path / "other" / "manifest.json", path / "manifest.json")
    corrupt_load(path, engine(3), r"\.metadata does not match its CRC-32")


# ----------------------------------------------------------------------------------- checksums
def test_a_damaged_manifest_field_is_an_error(saved):
    """The manifest's own fields are sealed too: a changed step, table config or ``extra``
    value (a flipped byte, or an edit) is a corrupt manifest, nothing loaded; a checkpoint
    written before they were sealed (no ``manifest`` CRC) still loads."""
    path, emb = saved
    text = (path / "manifest.json").read_text()
    for change in (lambda m: m.update(step=m["step"] + 7),
                   lambda m: m["extra"].update(epoch=3),
                   lambda m: m["tables"]["a"].update(combiner="mean")):
        edit_manifest(path, change)
        corrupt_load(path, engine(3), r"its fields .* do not match their CRC-32 "
                                      r"\(checksums\['manifest'\]\): manifest.json is corrupt")
        (path / "manifest.json").write_text(text)

    def unsealed(m):  # as written before the fields were sealed
        m["checksums"].pop("manifest")
        m["checksums"]["seal"] = fck.seal_of(m["checksums"])

    edit_manifest(path, unsealed)
    fresh = engine(3)
    assert ec.load(path, fresh)["extra"] == {"epoch": 2}
    assert_state_equal(snapshot(fresh), snapshot(emb))


def test_damaged_checksums_are_an_error(saved):
    """A flipped digit of a chunk's CRC, of the index's or of the seal: the manifest is
    corrupt. A forged manifest (a CRC changed and its seal recomputed) names the data file."""
    path, _ = saved
    text = (path / "manifest.json").read_text()
    fresh = engine(3)
    sums = json.loads(text)["checksums"]
    for value in (sums["chunks"][1]["crc32"], sums["index"], sums["seal"]):
        digits = str(value)
        at = re.search(rf": {digits}\b", text).start() + 2 + len(digits) // 2  # a digit in it
        raw = text[:at] + ("0" if text[at] != "0" else "1") + text[at + 1:]
        (path / "manifest.json").write_text(raw)
        corrupt_load(path, fresh, r"manifest.json: its 'checksums' do not match their own "
                                  r"CRC-32 \('seal'\): manifest.json is corrupt")
    (path / "manifest.json").write_text(text)

    def forge(m):
        m["checksums"]["chunks"][1]["crc32"] ^= 1
        m["checksums"]["seal"] = fck.seal_of(m["checksums"])

    edit_manifest(path, forge)
    key = sums["chunks"][1]["key"]
    corrupt_load(path, fresh, rf"__0_0.distcp: checkpoint entry '{key}' .*does not match its "
                              r"CRC-32")


@pytest.mark.parametrize("change,match", [
    (lambda s: s.update(chunks={}), r"checksums\['chunks'\] is dict"),
    (lambda s: s["chunks"][0].update(crc32="12"), (r"checksums\['chunks'\]\[0\]\['crc32'\] "
                                                   r"is str '12', not an integer")),
    (lambda s: s["chunks"][0].update(crc32=2**32), r"\['crc32'\] is int"),
    (lambda s: s["chunks"][0].update(at=[True, 0]), r"\['at'\] is bool"),
    (lambda s: s["chunks"][0].pop("key"), r"checksums\['chunks'\]\[0\] is dict"),
    (lambda s: s["chunks"].append(dict(s["chunks"][0])), r"repeats the chunk at __0_0.distcp"),
    (lambda s: s.pop("index"), r"checksums\['index'\] is NoneType"),
    (lambda s: s.update(algorithm="crc32c"), (r"checksums computed with 'crc32c'; this "
                                              r"embcore knows 'crc32'")),
], ids=["chunks", "crc-str", "crc-big", "at-bool", "no-key", "repeated", "no-index",
        "algorithm"])
def test_malformed_checksums_are_named(saved, change, match):
    path, _ = saved

    def edit(m):
        change(m["checksums"])
        m["checksums"]["seal"] = fck.seal_of(m["checksums"])  # past the seal: the shape is checked

    edit_manifest(path, edit)
    corrupt_load(path, engine(3), match)
    edit_manifest(path, lambda m: m.update(checksums=[1]))
    corrupt_load(path, engine(3), r"manifest.json is malformed: 'checksums' is list")


def test_a_chunk_missing_from_the_checksums_is_an_error(saved):
    path, _ = saved

    def drop_one(m):
        m["checksums"]["chunks"].pop(2)
        m["checksums"]["seal"] = fck.seal_of(m["checksums"])

    edit_manifest(path, drop_one)
    corrupt_load(path, engine(3), r"has no checksum in .*manifest.json: the index and the "
                                  r"manifest disagree; the checkpoint is corrupt")


def test_checkpoint_without_checksums_loads_unverified(saved):
    """A checkpoint written before checksums existed loads as before: unverified, so flipped
    tensor bytes load as other values (what checksums now catch)."""
    path, emb = saved
    drop_checksums(path)
    fresh = engine(3)
    manifest = ec.load(path, fresh)
    assert "checksums" not in manifest and manifest["extra"] == {"epoch": 2}
    assert_state_equal(snapshot(fresh), snapshot(emb))
    file, _, _ = chunks(path)[("a/parameters", (0, 0))]
    flip(file, values_at(file, emb.state_dict()["a/parameters"]) + 100)  # inside a value
    ec.load(path, fresh)
    assert not torch.equal(fresh.state_dict()["a/parameters"], emb.state_dict()["a/parameters"])


# ----------------------------------------------------------------------------------- the manifest
@pytest.mark.parametrize("change,match", [
    (lambda m: m["tables"]["a"].update(dim="4"),
     r"manifest.json is malformed: tables\['a'\]\['dim'\] is str '4', not an int"),
    (lambda m: m["tables"]["b"].update(vocabulary_size=30.0),
     (r"manifest.json is malformed: tables\['b'\]\['vocabulary_size'\] is float '30.0', "
      r"not an int")),
    (lambda m: m["tables"]["b"].update(dim=True), r"tables\['b'\]\['dim'\] is bool"),
    (lambda m: m["tables"].update(c=[20, 8]), r"tables\['c'\] is list"),
    (lambda m: m.update(tables=[]), r"malformed: tables is list '\[\]', not an object"),
    (lambda m: m["tables"]["a"].update(dynamic=1), r"tables\['a'\]\['dynamic'\] is int"),
    (lambda m: m.update(format_version="1"), r"malformed: format_version is str '1', not an int"),
], ids=["dim-str", "size-float", "dim-bool", "table-list", "tables-list", "dynamic-int",
        "version-str"])
def test_malformed_manifest_is_named(saved, change, match):
    path, _ = saved
    edit_manifest(path, change)
    corrupt_load(path, engine(3), match)


# ----------------------------------------------------------------------------------- W = 2
SHARDING = {"a": "row_mod", "b": "row_div", "c": "column", "d": "replicated"}
D = ec.TableConfig(vocabulary_size=10, dim=4, name="d")


def sharded(seed: int, sharding: bool = True) -> ec.Embedding:
    return engine(seed, tables=(A, B, C, D), sharding=SHARDING if sharding else None)


def _two_processes(rank: int, world: int, init, root: str) -> None:
    root_path = Path(root)
    init()
    emb = sharded(0)
    train(emb, 1, rank)
    ec.save(root_path / "w2", emb)  # W = 2: each process writes its shards, CRCs gathered
    whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
             for k, v in emb.state_dict().items()}
    if rank == 0:
        torch.save(whole, root_path / "want.pt")
        shutil.copytree(root_path / "w2", root_path / "w2-good")
        # A chunk rank 1 wrote (and checked), which only rank 1 reads back at W = 2.
        file, offset, length = chunks(root_path / "w2")[("a/parameters", (25, 0))]
        assert file.name == "__1_0.distcp"
        flip(file, offset + length // 2)
    torch.distributed.barrier()
    for name in ("w2", "w1"):  # W = 2 -> 2 (rank 1 finds it; rank 0 hears of it), W = 1 -> 2
        target = sharded(5)
        err = corrupt_load(root_path / name, target, r"checkpoint entry 'a/parameters'.*does "
                                                     r"not match its CRC-32")
        assert ("__1_0.distcp" if name == "w2" else "__0_0.distcp") in str(err)
    target = sharded(6)
    ec.load(root_path / "w2-good", target)
    assert_state_equal(snapshot(target), snapshot(emb))


@pytest.mark.slow
def test_two_processes_write_and_check_their_chunks(tmp_path):
    """W = 2 saves (each process the CRCs of its own shards; the replicated table and the step
    by one of them), then W = 2 and W = 1 loads of a copy with a flipped byte in a shard rank 1
    wrote fail naming its file; a corrupt W = 1 checkpoint fails at W = 2 too (each process
    checks the whole-table chunk it reads part of); the intact copy loads at W = 2 and W = 1."""
    one = sharded(0, sharding=False)
    train(one, 1)
    ec.save(tmp_path / "w1", one)
    file, offset, length = chunks(tmp_path / "w1")[("a/parameters", (0, 0))]
    flip(file, offset + length // 2)
    run_on(2, _two_processes, str(tmp_path))
    manifest = json.loads((tmp_path / "w2-good" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {c["file"] for c in manifest["checksums"]["chunks"]} == {"__0_0.distcp",
                                                                     "__1_0.distcp"}
    assert {(c["key"], tuple(c["at"])) for c in manifest["checksums"]["chunks"]} == set(
        chunks(tmp_path / "w2-good"))
    err = corrupt_load(tmp_path / "w2", sharded(7, sharding=False),
                       r"checkpoint entry 'a/parameters' \(its chunk at offsets \[25, 0\]")
    assert str(tmp_path / "w2" / "__1_0.distcp") in str(err)
    target = sharded(7, sharding=False)
    ec.load(tmp_path / "w2-good", target)
    want = torch.load(tmp_path / "want.pt")
    assert_state_equal(snapshot(target), want)


# ----------------------------------------------------------------------------------- files
@pytest.mark.parametrize("checksums", [True, False], ids=["checksums", "old-format"])
def test_a_data_file_that_is_a_fifo_or_a_link_out_is_an_error_never_a_hang(saved, checksums):
    """DCP opens the data files itself (following links, blocking on a FIFO): load checks them
    first. An old-format checkpoint (no checksums) whose .distcp was a FIFO hung ``ec.load``; a
    link to a copy of the file outside the directory loaded."""
    path, emb = saved
    if not checksums:
        drop_checksums(path)
    data, outside, fifo = path / "__0_0.distcp", path.parent / "kept.distcp", path.parent / "f"
    os.replace(data, outside)
    os.mkfifo(fifo)
    fresh = engine(3)
    named = re.escape(str(data))
    fifo_error = rf"{named} is a FIFO, not a regular file; a checkpoint's files are regular files"
    out = rf"{named} is a symbolic link to .*kept\.distcp, outside the checkpoint directory"
    for make, match in (
            (lambda: os.mkfifo(data), fifo_error),
            (lambda: data.symlink_to(outside), out),
            (lambda: data.symlink_to(fifo), rf"{named} is a symbolic link to .*, outside"),
            (lambda: data.symlink_to("/dev/zero"), rf"{named} is a symbolic link to /dev/zero")):
        make()
        with unblocking([data, fifo]) as had_to:
            try:
                corrupt_load(path, fresh, match)
            finally:  # (a hang is what fails first)
                assert not had_to, f"ec.load blocked reading {data} ({match})"
        data.unlink()
    # the index, linked to a copy outside: refused too
    os.replace(outside, data)
    index = path / ".metadata"
    shutil.copy(index, path.parent / "index-copy")
    index.unlink()
    index.symlink_to(path.parent / "index-copy")
    corrupt_load(path, fresh, rf"{re.escape(str(index))} is a symbolic link to .*index-copy, "
                              r"outside the checkpoint directory")
    # a link that stays in the directory is read
    index.unlink()
    os.replace(path.parent / "index-copy", path / "index.real")
    index.symlink_to("index.real")
    os.replace(data, path / "data.real")
    data.symlink_to(path / "data.real")
    ec.load(path, fresh)
    assert_state_equal(snapshot(fresh), snapshot(emb))


def test_a_huge_manifest_or_index_is_named_unread(saved):
    """Sparse files of 1 TiB: read whole before, a MemoryError."""
    path, emb = saved
    fresh = engine(3)
    for name in ("manifest.json", ".metadata"):
        file = path / name
        os.replace(file, path.parent / "kept")
        with open(file, "wb") as f:
            f.truncate(2**40)
        corrupt_load(path, fresh, rf"{re.escape(str(file))} is 1099511627776 bytes, more than "
                                  rf"the 1073741824 a checkpoint's {re.escape(name)} may take")
        os.replace(path.parent / "kept", file)
    ec.load(path, fresh)
    assert_state_equal(snapshot(fresh), snapshot(emb))


@pytest.mark.parametrize("spoilt", ["[" * 100_000 + "]" * 100_000, "NaN", "-Infinity", "1e999",
                                    "9" * 5000],
                         ids=["nested", "NaN", "-Infinity", "1e999", "5000 digits"])
def test_a_manifest_nested_too_deep_or_of_numbers_json_lacks_is_named(saved, spoilt):
    """Before: a RecursionError, a bare ValueError of json (an integer's digits) or of the
    manifest's CRC (NaN cannot be written again), none naming the file."""
    path, _ = saved
    manifest = path / "manifest.json"
    text = manifest.read_text()
    assert '"epoch": 2' in text
    manifest.write_text(text.replace('"epoch": 2', f'"epoch": {spoilt}'))
    corrupt_load(path, engine(3), rf"{re.escape(str(manifest))} is not valid JSON \(.*\): the "
                                  r"checkpoint is corrupt")


def test_an_index_nested_too_deep_is_named(saved):
    """A chunk's file name that is a list nested 100,000 deep (a crafted .metadata of an
    old-format checkpoint, whose index has no CRC): before, a RecursionError."""
    path, _ = saved
    drop_checksums(path)
    index = path / ".metadata"
    with open(index, "rb") as f:
        md = fck.RestrictedMetadataUnpickler(f).load()
    info = next(iter(md.storage_data.values()))
    info.relative_path = "@@DEEP@@"
    raw = pickle.dumps(md, protocol=2)  # (no frames: the file name is replaced in place)
    name = b"X" + len(b"@@DEEP@@").to_bytes(4, "little") + b"@@DEEP@@"
    assert raw.count(name) == 1
    index.write_bytes(raw.replace(name, b"]" * 100_000 + b"a" * 99_999))
    corrupt_load(path, engine(3), rf"{re.escape(str(index))} holds an entry of another kind "
                                  r"than DCP writes \(a _StorageInfo\): the checkpoint is corrupt")
