"""Online training (docs/semantics.md section 12): ``ec.publish``, ``ec.load_published`` and
``refresh``, ``ec.load`` of a publish directory.

What must hold: a snapshot then deltas of exactly the rows written; a follower equal to the
trainer, bit for bit, after every refresh (every store: in memory, stacked, dynamic with
eviction, offloaded); resume from deltas equal to an uninterrupted run; a corrupt or missing
entry an error; concurrent lookups never see a mix; a failed publish loses nothing; W = 2
equal to W = 1.
"""

from __future__ import annotations

import os
import threading
import zipfile

import pytest
import torch
from distributed import run_on

import embcore as ec
from embcore.serving.serve import padded_map
from embcore.formats import publish_writer as writer
from embcore.formats import published as fmt


def make_engine(seed: int = 0, dynamic: bool = True, admit_after: int = 1,
                **kw) -> ec.Embedding:
    torch.manual_seed(seed)
    a = ec.TableConfig(vocabulary_size=100, dim=8, name="a", combiner="sum")
    b = ec.TableConfig(vocabulary_size=60, dim=8, name="b")  # stacks with a
    c = ec.TableConfig(vocabulary_size=40, dim=4, name="c")
    features = {"fa": ec.FeatureConfig(table=a), "fa2": ec.FeatureConfig(table=a),
                "fb": ec.FeatureConfig(table=b), "fc": ec.FeatureConfig(table=c)}
    if dynamic:
        d = ec.TableConfig(vocabulary_size=24, dim=8, name="d",
                           dynamic=ec.DynamicVocabulary(ttl_steps=3, admit_after=admit_after))
        features["fd"] = ec.FeatureConfig(table=d)
        e = ec.TableConfig(vocabulary_size=16, dim=8, name="e",  # stacks with d (W = 1)
                           dynamic=ec.DynamicVocabulary(eviction="lfu"))
        features["fe"] = ec.FeatureConfig(table=e)
    return ec.Embedding(features, ec.Adagrad(learning_rate=0.1), **kw)


def batch(step: int, dynamic: bool = True, rank: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = {"fa": torch.randint(0, 100, (6,), generator=g),
           "fa2": torch.randint(0, 100, (6,), generator=g),
           "fb": torch.randint(0, 10, (6,), generator=g),  # few rows of b: most stay unchanged
           "fc": torch.randint(0, 40, (6,), generator=g)}
    if dynamic:  # raw ids drifting upward: old ones expire (ttl), new ones arrive
        out["fe"] = torch.randint(0, 12, (6,), generator=g) * 104729 - step * 7
        out["fd"] = torch.randint(0, 20, (6,), generator=g) * 7919 + (step // 2) * 40_000 \
            - 10**12
    return out


def train(emb: ec.Embedding, steps: range, dynamic: bool = True, rank: int = 0) -> None:
    for s in steps:
        emb.enqueue(batch(s, dynamic, rank))
        act = emb.dequeue()
        emb.apply_gradients({k: a.detach() * 0.5 + 0.1 for k, a in act.items()})


def state(emb: ec.Embedding) -> dict[str, torch.Tensor]:
    """The engine's state dict, with the rows of a dynamic table that hold no id zeroed: what
    they hold is never read (a row gets its initial values when an id takes it), and a restore
    leaves them zero."""
    out = {k: torch.as_tensor(v).clone() for k, v in emb.state_dict().items()}
    for key in [k for k in out if k.endswith("/vocabulary/last_use")]:
        name = key.split("/")[0]
        free = out[key][:, 0] == 0
        for k in out:
            if k.startswith(name + "/") and "/vocabulary/" not in k:
                out[k][free] = 0
    return out


def tables(emb: ec.Embedding) -> dict[str, torch.Tensor]:
    """Whole tables by name (a collective when sharded), a dynamic table's rows that hold no
    id zeroed (see ``state``)."""
    out = {}
    for t, n in emb.table_names().items():
        out[n] = emb.embedding_tables[t].clone()
        if t.dynamic is not None:
            held = torch.zeros(out[n].shape[0], dtype=torch.bool)
            held[emb.whole_vocabulary(t)[1]] = True
            out[n][~held] = 0
    return out


def assert_state_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def assert_follows(served, emb: ec.Embedding) -> None:
    """The follower's buffers are the trainer's tables and maps, bit for bit."""
    for t, name in emb.table_names().items():
        whole = emb.embedding_tables[t]
        buf = getattr(served, name)
        if t.dynamic is None:
            assert torch.equal(buf, whole), name
        else:
            assert torch.equal(buf[:-1], whole) and not buf[-1].any(), name
            ids, rows = padded_map(*emb.whole_vocabulary(t), t.vocabulary_size)
            assert torch.equal(getattr(served, name + "__ids"), ids), name
            assert torch.equal(getattr(served, name + "__rows"), rows), name


def test_snapshot_then_deltas_of_exactly_the_rows_written(tmp_path):
    emb = make_engine(dynamic=False)
    info = ec.publish(tmp_path, emb)
    assert info["kind"] == "snapshot" and info["seq"] == 0
    assert info["rows"] == {"a": 100, "b": 60, "c": 40}
    before = state(emb)
    train(emb, range(1), dynamic=False)
    info = ec.publish(tmp_path, emb)
    assert info["kind"] == "delta" and info["seq"] == 1 and info["step"] == 1
    after = state(emb)
    for name in ("a", "b", "c"):  # the rows carried are the rows that moved
        moved = (before[f"{name}/parameters"] != after[f"{name}/parameters"]).any(1)
        assert info["rows"][name] == int(moved.sum()), name
    assert info["rows"]["b"] < 10
    nothing = ec.publish(tmp_path, emb)  # nothing written since: an empty delta
    assert nothing["kind"] == "delta" and nothing["rows"] == {"a": 0, "b": 0, "c": 0}
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".writer.lock", "00000000-snapshot", "00000001-delta", "00000002-delta"]
    m = fmt.Entry(1, "delta", tmp_path / "00000001-delta").manifest()
    assert m["previous"]["seq"] == 0 and m["step"] == 1 and m["slots"] is False
    assert all(isinstance(v, int) for f in m["files"].values() for v in f.values())


@pytest.mark.parametrize("store", ["memory", "offloaded"])
def test_follower_equals_trainer_after_every_refresh(tmp_path, store):
    kw = {"memory_budget": 9000, "offload_dir": tmp_path / "slow"} if store == "offloaded" \
        else {}
    emb = make_engine(**kw)
    if store == "offloaded":
        assert any(p.offloaded for p in emb.plan.physical)
    pub = tmp_path / "pub"
    ec.publish(pub, emb)
    served = ec.load_published(pub)
    assert served.version == 0
    assert_follows(served, emb)
    for k in range(1, 7):
        train(emb, range(k * 2, k * 2 + 2))
        ec.publish(pub, emb)
        assert served.refresh() == 1 and served.version == k
        assert_follows(served, emb)
        probe = batch(100 + k)
        want = emb.lookup(probe)
        got = served(probe)
        for f in want:
            assert torch.equal(got[f], want[f]), f
    vocab_ids, _ = emb.vocabulary("d")
    assert vocab_ids.numel() and int(vocab_ids.min()) > 4 * 40_000 - 10**12  # old ids expired
    assert served.refresh() == 0


def test_a_delta_names_the_ids_evicted_since(tmp_path):
    emb = make_engine()
    ec.publish(tmp_path, emb)
    total = 0
    for k in range(1, 6):
        before = set(emb.vocabulary("d")[0].tolist())
        train(emb, range(k * 2, k * 2 + 2))
        info = ec.publish(tmp_path, emb, compact_ratio=100)
        assert info["kind"] == "delta"
        after = set(emb.vocabulary("d")[0].tolist())
        entry = next(e for e in fmt.entries(tmp_path) if e.seq == info["seq"])
        evicted = set()
        for part in fmt.read_entry(entry):
            if "d/vocabulary/evicted" in part:
                evicted |= set(part["d/vocabulary/evicted"].tolist())
        assert evicted == before - after
        total += len(evicted)
    assert total > 20  # (ids leave from the third delta on: ttl 3, capacity 24)


def test_quantized_follower_requantizes_changed_rows(tmp_path):
    emb = make_engine(dynamic=False)
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path, quantize={"a": "int8", "c": "fp16"})
    for k in range(3):
        train(emb, range(k, k + 1), dynamic=False)
        ec.publish(tmp_path, emb)
        served.refresh()
        tables = {n: emb.embedding_tables[t] for t, n in emb.table_names().items()}
        q = ec.quantize_table(tables["a"], "int8")
        assert torch.equal(served.a, q.data) and torch.equal(served.a__scale, q.scale)
        assert torch.equal(served.a__bias, q.bias)
        assert torch.equal(served.c, tables["c"].half()) and torch.equal(served.b, tables["b"])


@pytest.mark.parametrize("store,admit_after", [("memory", 1), ("offloaded", 1), ("memory", 2)])
def test_resume_from_deltas_equals_an_uninterrupted_run(tmp_path, store, admit_after):
    kw = (lambda: {"memory_budget": 9000, "offload_dir": tmp_path / "slow"}) \
        if store == "offloaded" else dict
    pub = tmp_path / "pub"
    trainer = make_engine(seed=1, admit_after=admit_after, **kw())
    ec.publish(pub, trainer, slots=True)
    for k in range(4):  # deltas only
        train(trainer, range(k * 3, k * 3 + 3))
        assert ec.publish(pub, trainer, slots=True, compact_ratio=100)["kind"] == "delta"
    resumed = make_engine(seed=2, admit_after=admit_after, **kw())  # all must come from pub
    manifest = ec.load(pub, resumed)
    if admit_after > 1:  # ids counted, not yet admitted, at the last publish: resumed too
        assert trainer.state_dict()["d/vocabulary/pending"].shape[0] > 0
    assert manifest["seq"] == 4 and manifest["step"] == 12 and resumed.step == 12
    assert_state_equal(state(resumed), state(trainer))
    train(trainer, range(12, 16))
    train(resumed, range(12, 16))
    assert_state_equal(state(resumed), state(trainer))


def test_resume_continues_the_chain_and_followers_follow(tmp_path):
    trainer = make_engine(seed=1)
    ec.publish(tmp_path, trainer, slots=True)
    train(trainer, range(3))
    ec.publish(tmp_path, trainer, slots=True)
    served = ec.load_published(tmp_path)
    del trainer  # (the trainer stops; its lock goes with it)
    import gc
    gc.collect()
    resumed = make_engine(seed=3)
    ec.load(tmp_path, resumed)
    train(resumed, range(3, 5))
    info = ec.publish(tmp_path, resumed, slots=True)
    assert info["kind"] == "delta" and info["seq"] == 2
    assert served.refresh() == 1
    assert_follows(served, resumed)


def test_slots_false_cannot_resume_training_but_loads_parameters(tmp_path):
    trainer = make_engine()
    ec.publish(tmp_path, trainer)
    train(trainer, range(2))
    ec.publish(tmp_path, trainer)
    target = make_engine(seed=5)
    with pytest.raises(ValueError, match="slots=False"):
        ec.load(tmp_path, target)
    assert target.step == 0
    ec.load(tmp_path, target, slots=False)
    got, want = state(target), state(trainer)
    for k in want:
        if k.endswith("/parameters") or "/vocabulary/" in k:
            assert torch.equal(got[k], want[k]), k
    assert target.step == 0  # (the step goes with the slots)
    # a change of slots makes the next publish a snapshot
    assert ec.publish(tmp_path, trainer, slots=True)["kind"] == "snapshot"


def _entry_file(directory, seq):
    entry = next(e for e in fmt.entries(directory) if e.seq == seq)
    return entry, entry.path / next(iter(entry.manifest()["files"]))


def test_a_corrupt_delta_is_an_error_never_values(tmp_path):
    trainer = make_engine()
    ec.publish(tmp_path, trainer, slots=True)
    served = ec.load_published(tmp_path)
    train(trainer, range(2))
    ec.publish(tmp_path, trainer, slots=True)
    _, part = _entry_file(tmp_path, 1)
    data = bytearray(part.read_bytes())
    good = bytes(data)
    with zipfile.ZipFile(part) as z:  # the middle of the largest tensor's bytes
        big = max(z.infolist(), key=lambda i: i.compress_size)
        z.fp.seek(big.header_offset + 26)
        head = z.fp.read(4)
    mid = big.header_offset + 30 + int.from_bytes(head[:2], "little") + \
        int.from_bytes(head[2:], "little") + big.compress_size // 2
    for at in (mid, len(data) - 300):  # tensor bytes, then the zip's directory
        data = bytearray(good)
        data[at:at + 8] = bytes(b ^ 0xFF for b in data[at:at + 8])
        part.write_bytes(bytes(data))
        before = {k: v.clone() for k, v in served.state_dict().items()}
        with pytest.raises(fmt.PublishError, match="corrupt|checksum|tensors its manifest"):
            served.refresh()
        assert served.version == 0
        assert all(torch.equal(v, before[k]) for k, v in served.state_dict().items())
        target = make_engine(seed=9)
        with pytest.raises(fmt.PublishError):
            ec.load(tmp_path, target)
        assert target.step == 0
    part.write_bytes(good)
    assert served.refresh() == 1


def test_a_missing_delta_or_manifest_is_an_error(tmp_path):
    trainer = make_engine()
    ec.publish(tmp_path, trainer)
    served = ec.load_published(tmp_path)
    for k in range(3):
        train(trainer, range(k, k + 1))
        ec.publish(tmp_path, trainer)
    import shutil
    shutil.rmtree(tmp_path / "00000002-delta")  # a gap: 1, then 3
    with pytest.raises(fmt.PublishError, match="missing"):
        served.refresh()
    assert served.version == 0
    with pytest.raises(fmt.PublishError, match="missing"):
        ec.load_published(tmp_path)
    (tmp_path / "00000001-delta" / fmt.MANIFEST).unlink()
    with pytest.raises(fmt.PublishError, match="incomplete"):
        served.refresh()
    shutil.rmtree(tmp_path / "00000003-delta")  # the trainer's last entry is gone
    with pytest.raises(fmt.PublishError, match="changed under this trainer"):
        ec.publish(tmp_path, trainer)


def test_two_trainers_on_one_directory(tmp_path):
    first, second = make_engine(), make_engine(seed=1)
    ec.publish(tmp_path, first)
    with pytest.raises(RuntimeError, match="another trainer publishes"):
        ec.publish(tmp_path, second)
    assert [e.seq for e in fmt.entries(tmp_path)] == [0]


def test_a_failed_publish_loses_nothing(tmp_path, monkeypatch):
    trainer = make_engine()
    ec.publish(tmp_path, trainer)
    served = ec.load_published(tmp_path)
    train(trainer, range(2))
    real = writer.write_part
    calls = []

    def full_disk(path, tensors):
        calls.append(path)
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(writer, "write_part", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ec.publish(tmp_path, trainer)
    assert calls and [e.seq for e in fmt.entries(tmp_path)] == [0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.setattr(writer, "write_part", real)

    def crash(*a, **k):
        raise KeyboardInterrupt  # interrupted just before the entry's rename

    monkeypatch.setattr(fmt.os, "rename", crash)
    with pytest.raises(KeyboardInterrupt):
        ec.publish(tmp_path, trainer)
    monkeypatch.undo()
    assert [e.seq for e in fmt.entries(tmp_path)] == [0]
    train(trainer, range(2, 3))
    info = ec.publish(tmp_path, trainer)  # every row written since entry 0, none lost
    assert info["seq"] == 1 and info["kind"] == "delta"
    served.refresh()
    assert_follows(served, trainer)


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    from distributed import exited_pid
    trainer = make_engine()
    dead = tmp_path / f".tmp-00000001-{exited_pid()}-00ff"
    live = tmp_path / f".tmp-00000001-{os.getpid()}-00aa"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "r00000-0000.pt").write_bytes(b"partial")
    ec.publish(tmp_path, trainer)
    assert not dead.exists() and live.exists()
    assert ec.load_published(tmp_path).version == 0


def test_compaction_and_retention(tmp_path):
    trainer = make_engine(dynamic=False)
    ec.publish(tmp_path, trainer)
    lagging = ec.load_published(tmp_path)
    kinds = []
    for k in range(8):
        train(trainer, range(k, k + 1), dynamic=False)
        kinds.append(ec.publish(tmp_path, trainer, compact_ratio=0.5)["kind"])
    assert "snapshot" in kinds and kinds[0] == "delta"  # deltas outgrew half the snapshot
    seqs = [e.seq for e in fmt.entries(tmp_path)]
    snapshots = [e.seq for e in fmt.entries(tmp_path) if e.kind == "snapshot"]
    assert len(snapshots) <= 2 and seqs[0] == snapshots[0]  # older entries removed
    assert ec.publish(tmp_path, trainer, snapshot=True, keep_snapshots=1)["kind"] == "snapshot"
    assert [e.kind for e in fmt.entries(tmp_path)] == ["snapshot"]
    assert lagging.refresh() >= 1  # behind the removed entries: starts over from the snapshot
    assert_follows(lagging, trainer)


def test_concurrent_lookups_never_see_a_mix(tmp_path):
    """Every delta sets every row of two tables to one value; a lookup reading both while
    refreshes run sees one value, never a mix of two deltas."""
    a = ec.TableConfig(vocabulary_size=2000, dim=16, name="a", combiner="sum")
    b = ec.TableConfig(vocabulary_size=3000, dim=16, name="b", combiner="sum")
    emb = ec.Embedding({"fa": ec.FeatureConfig(table=a), "fb": ec.FeatureConfig(table=b)},
                       ec.SGD(learning_rate=0.1))

    def set_all(v: float) -> None:
        emb.load_state_dict({"a/parameters": torch.full((2000, 16), v),
                             "b/parameters": torch.full((3000, 16), v)}, strict=False)

    set_all(0.0)
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path)
    ids = {"fa": torch.arange(0, 2000, 7), "fb": torch.arange(0, 3000, 5)}
    seen, stop, errors = set(), threading.Event(), []

    def reader() -> None:
        while not stop.is_set():
            out = served(ids)
            values = torch.cat([out["fa"].flatten(), out["fb"].flatten()]).unique()
            if values.numel() != 1:
                errors.append(values)
            seen.add(float(values[0]))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for k in range(1, 16):
            set_all(float(k))
            ec.publish(tmp_path, emb)
            served.refresh()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert len(seen) > 1 and served.version == 15


def test_exported_program_takes_deltas(tmp_path):
    emb = make_engine()
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path)
    probe = batch(50)
    program = torch.export.export(served, (probe,)).module()
    for k in range(3):
        train(emb, range(k * 2, k * 2 + 2))
        ec.publish(tmp_path, emb)
        served.refresh()
        got, want = program(probe), served(probe)
        for f in want:
            assert torch.equal(got[f], want[f]), f


def test_a_new_model_in_the_directory_is_an_error_for_a_follower(tmp_path):
    first = make_engine()
    ec.publish(tmp_path, first)
    served = ec.load_published(tmp_path)
    del first
    import gc
    gc.collect()
    other = ec.Embedding({"x": ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=5, dim=2, name="x"))}, ec.SGD(learning_rate=0.1))
    ec.publish(tmp_path, other)  # a new engine: a new chain, from a snapshot
    with pytest.raises(fmt.PublishError, match="another model"):
        served.refresh()
    assert ec.load_published(tmp_path).version == 1


def test_bad_arguments(tmp_path):
    emb = make_engine()
    with pytest.raises(TypeError, match="ec.Embedding"):
        ec.publish(tmp_path, object())
    layer = ec.EmbeddingLayer(ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=5, dim=2)),
                              None)
    with pytest.raises(TypeError, match="optimizer=None"):
        ec.publish(tmp_path, layer)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="neither empty nor a publish directory"):
        ec.publish(tmp_path / "other", emb)
    with pytest.raises(ValueError, match="keep_snapshots"):
        ec.publish(tmp_path / "p", emb, keep_snapshots=0)
    for bad in ({"slots": "no"}, {"snapshot": 1}, {"keep_snapshots": True},
                {"compact_ratio": "1"}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            ec.publish(tmp_path / "p", emb, **bad)
    for ratio in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="compact_ratio"):
            ec.publish(tmp_path / "p", emb, compact_ratio=ratio)
    assert not (tmp_path / "p").exists()  # (nothing made by a refused call)
    with pytest.raises(FileNotFoundError):
        ec.load_published(tmp_path / "nothing")


def test_layer_publishes_like_its_engine(tmp_path):
    t = ec.TableConfig(vocabulary_size=30, dim=4, name="t")
    layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "adagrad")
    ec.publish(tmp_path, layer)
    served = ec.load_published(tmp_path)
    out = layer({"f": torch.tensor([1, 2, 3])})
    out["f"].sum().backward()
    assert ec.publish(tmp_path, layer)["rows"] == {"t": 3}
    served.refresh()
    assert torch.equal(served.t, layer.engine.embedding_tables[t])


# ---------------------------------------------------------------------------------- W = 2
def _sharded(rank: int, world: int, init, root: str) -> None:
    init()
    emb = make_engine(seed=4, sharding={"a": "row_mod", "b": "row_div", "c": "column"})
    pub = os.path.join(root, "w2")
    ec.publish(pub, emb, slots=True)
    for k in range(3):
        train(emb, range(k * 2, k * 2 + 2), rank=rank)
        ec.publish(pub, emb, slots=True)
    whole = {n: emb.embedding_tables[t] for t, n in emb.table_names().items()}  # collective
    vocab = {n: emb.whole_vocabulary(t) for t, n in emb.table_names().items()
             if t.dynamic is not None}
    if rank == 0:
        served = ec.load_published(pub)
        for n, w in whole.items():
            buf = getattr(served, n)
            assert torch.equal(buf[:w.shape[0]], w), n
        for n, (ids, rows) in vocab.items():
            want = padded_map(ids, rows, whole[n].shape[0])
            assert torch.equal(getattr(served, n + "__ids"), want[0]), n
    resumed = make_engine(seed=6, sharding={"a": "replicated", "b": "row_mod", "c": "row_div",
                                            "d": "table"})
    ec.load(pub, resumed)  # W = 2, other strategies
    assert_state_equal(tables(resumed), tables(emb))


@pytest.mark.slow
def test_two_processes_publish_what_one_would(tmp_path):
    """W = 2 publishes; the follower equals the sharded trainer bitwise; resuming into W = 2
    with other strategies and into W = 1 gives the trainer's tables; W = 1 trained on both
    processes' batches gives the same tables (to float rounding of the summed gradients)."""
    run_on(2, _sharded, str(tmp_path))
    one = make_engine(seed=7)
    ec.load(tmp_path / "w2", one)
    ref = make_engine(seed=4)
    for s in range(6):
        b0, b1 = batch(s, rank=0), batch(s, rank=1)
        ref.enqueue({k: torch.cat([b0[k], b1[k]]) for k in b0})
        act = ref.dequeue()
        ref.apply_gradients({k: a.detach() * 0.5 + 0.1 for k, a in act.items()})
    got, want = state(one), state(ref)
    assert sorted(got) == sorted(want) and one.step == 6
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=k)


_KILLED_WRITER = r"""
import sys, time, torch, embcore as ec
from embcore.formats import publish_writer as writer
sys.path.insert(0, sys.argv[2])
from test_publish import make_engine, train
real = writer.write_part
def slow(path, tensors):
    out = real(path, tensors)
    time.sleep(0.2)  # the parent kills us among the part files
    return out
writer.write_part = slow
writer.PART_BYTES = 1000  # many part files per entry
emb = make_engine(seed=1)
ec.publish(sys.argv[1], emb, slots=True)
print("published", flush=True)
for k in range(100):
    train(emb, range(k, k + 1))
    ec.publish(sys.argv[1], emb, slots=True, compact_ratio=1000)
"""


@pytest.mark.slow
def test_a_trainer_killed_mid_publish_leaves_the_last_entry(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    env = dict(os.environ, PYTHONPATH=str(Path(ec.__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path),
                             str(Path(__file__).parent)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "published"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # an entry after the snapshot is being written
            tmps = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
            if fmt.entries(tmp_path)[-1].seq >= 1 and any(
                    len(list(t.glob("*.pt"))) >= 2 for t in tmps):
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the writer never got to a second entry")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # its leftover
    served = ec.load_published(tmp_path)  # the last complete entry
    last = fmt.entries(tmp_path)[-1]
    assert served.version == last.seq >= 1
    resumed = make_engine(seed=2)  # the kernel dropped the dead writer's lock
    ec.load(tmp_path, resumed)
    assert resumed.step == served.version
    train(resumed, range(resumed.step, resumed.step + 1))
    info = ec.publish(tmp_path, resumed, slots=True)
    assert info["seq"] == last.seq + 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert served.refresh() == 1
    assert torch.equal(served.a, resumed.embedding_tables[
        next(t for t in resumed.table_names() if t.name == "a")])


def test_a_table_named_like_an_attribute_is_followed(tmp_path):
    tables = {n: ec.TableConfig(vocabulary_size=20, dim=4, name=n)
              for n in ("version", "refresh", "items")}
    emb = ec.Embedding({n: ec.FeatureConfig(table=t) for n, t in tables.items()},
                       ec.SGD(learning_rate=0.1))
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path, quantize={"refresh": "int8"})
    ids = {n: torch.tensor([1, 2]) for n in tables}
    emb.enqueue(ids)
    emb.apply_gradients({k: torch.ones_like(a) for k, a in emb.dequeue().items()})
    ec.publish(tmp_path, emb)
    assert served.refresh() == 1 and served.version == 1  # (the attribute, not the table)
    got, want = served(ids), emb.lookup(ids)
    assert torch.equal(got["version"], want["version"]) and torch.equal(got["items"],
                                                                         want["items"])
    torch.testing.assert_close(got["refresh"], want["refresh"], atol=0.02, rtol=0)


def test_one_engine_publishes_to_two_directories(tmp_path):
    """Each directory's deltas hold the rows written since its own last publish, whatever the
    other one took (a row taken by one stays pending for the other)."""
    emb = make_engine(seed=2)
    a, b = tmp_path / "a", tmp_path / "b"
    ec.publish(a, emb)
    served_a = ec.load_published(a)
    for k in range(4):
        train(emb, range(k, k + 1))
        ec.publish(a, emb, compact_ratio=100)
        if k == 0:
            ec.publish(b, emb)
            served_b = ec.load_published(b)
        elif k % 2 == 0:  # b publishes every other step: its deltas span two of a's
            assert ec.publish(b, emb, compact_ratio=100)["kind"] == "delta"
            served_b.refresh()
            assert_follows(served_b, emb)
        served_a.refresh()
        assert_follows(served_a, emb)


# ------------------------------------------------------------------------------- corruption fuzz
@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    """A published directory (a snapshot and a delta) and the trainer's tables after each."""
    root = tmp_path_factory.mktemp("fuzz")
    emb = make_engine(seed=3)
    ec.publish(root, emb, slots=True)
    first = {n: emb.embedding_tables[t].clone() for t, n in emb.table_names().items()}
    train(emb, range(3))
    ec.publish(root, emb, slots=True, compact_ratio=100)
    last = {n: emb.embedding_tables[t].clone() for t, n in emb.table_names().items()}
    files = sorted(p.relative_to(root) for p in root.rglob("*")
                   if p.is_file() and p.name != fmt.LOCK)
    return {"root": root, "first": first, "last": last, "files": files}


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from profiles import examples  # noqa: E402


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_byte_anywhere_is_an_error_or_harmless(tmp_path, fuzz_dir, data):
    """Bytes flipped anywhere in any file of a publish directory (tensor data, zip headers,
    manifests): reading it is a PublishError, or what is read is exactly what was published;
    never other values."""
    import shutil
    fz = fuzz_dir
    work = tmp_path / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(fz["root"], work)
    rel = data.draw(st.sampled_from(fz["files"]))
    path = work / rel
    raw = bytearray(path.read_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    width = data.draw(st.integers(1, 8))
    mask = data.draw(st.integers(1, 255))
    for i in range(at, min(at + width, len(raw))):
        raw[i] ^= mask
    path.write_bytes(bytes(raw))
    try:
        served = ec.load_published(work)
    except (fmt.PublishError, FileNotFoundError):
        return
    want = fz["last"] if served.version == 1 else fz["first"]
    for n, w in want.items():
        got = getattr(served, served.buffer_name(n))
        assert torch.equal(got[:w.shape[0]], w), (rel, at, n)
    target = make_engine(seed=9)
    try:
        ec.load(work, target)
    except fmt.PublishError:
        return
    assert target.step == 3, (rel, at)  # (the manifest's seal covers the step)
    for t, n in target.table_names().items():
        if t.dynamic is None:
            assert torch.equal(target.embedding_tables[t], fz["last"][n]), (rel, at, n)


def test_a_failing_on_entry_still_applies_its_entry_whole(tmp_path):
    emb = make_engine(dynamic=False)
    ec.publish(tmp_path, emb)
    served = ec.load_published(tmp_path)
    with pytest.raises(TypeError, match="on_entry"):
        served.refresh(on_entry="switch")
    for k in range(2):
        train(emb, range(k, k + 1), dynamic=False)
        ec.publish(tmp_path, emb, compact_ratio=100)

    def fails(manifest):
        raise RuntimeError(f"cannot switch to {manifest['seq']}")

    with pytest.raises(RuntimeError, match="cannot switch to 1"):
        served.refresh(on_entry=fails)
    assert served.version == 1 and not served._overlays  # entry 1 whole, not entry 2
    assert served.refresh() == 1
    assert_follows(served, emb)


def test_a_follower_skips_a_corrupt_delta_once_a_newer_snapshot_follows(tmp_path):
    """``refresh()`` past a corrupt entry: an error while nothing newer starts over, then, once
    the trainer publishes a snapshot, the newest state, with a warning naming what it skipped."""
    trainer = make_engine()
    ec.publish(tmp_path, trainer)
    served = ec.load_published(tmp_path)
    train(trainer, range(2))
    ec.publish(tmp_path, trainer)  # entry 1, a delta: damaged below
    _, part = _entry_file(tmp_path, 1)
    data = bytearray(part.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = bytes(8)
    part.write_bytes(bytes(data))
    with pytest.raises(fmt.PublishError):
        served.refresh()
    assert served.version == 0
    train(trainer, range(2, 4))
    ec.publish(tmp_path, trainer)  # entry 2, a delta after the damaged one: still no way on
    with pytest.raises(fmt.PublishError):
        served.refresh()
    assert served.version == 0
    ec.publish(tmp_path, trainer, snapshot=True)  # entry 3: starts over
    train(trainer, range(4, 5))
    ec.publish(tmp_path, trainer)  # entry 4, a delta on it
    with pytest.warns(RuntimeWarning, match=r"entry 1 cannot be read .*skipped entries 1\.\.2 "
                                            r"and started over from snapshot 3"):
        assert served.refresh() == 2  # the snapshot and its delta
    assert served.version == 4
    fresh = ec.load_published(tmp_path)
    for k, v in fresh.state_dict().items():
        assert torch.equal(served.state_dict()[k], v), k


def test_an_unreadable_part_is_named_in_the_users_terms(tmp_path):
    """A part file torch.load cannot read: the error names the file, says what is wrong and what
    to do, and quotes torch's reason in whole words (it was cut mid-sentence)."""
    part = tmp_path / "r00000-0000.pt"
    part.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)  # a zip header, then garbage
    with pytest.raises(fmt.PublishError) as got:
        fmt.read_part(part, {"t/rows": 0})
    said = str(got.value)
    assert said.startswith(f"{part} is corrupt or truncated: torch.load cannot read it (")
    assert said.endswith("lets followers start over past it") and "snapshot=True" in said
    cause = said.split("(", 1)[1].split("). Its entry", 1)[0]
    assert len(cause) < 200 and (cause.endswith(" ...") or "\n" not in cause)


def test_save_load_and_publish_refuse_another_object_alike(tmp_path):
    """ec.save, ec.load (of a checkpoint and of a publish directory) and ec.publish find the
    engine in one place (layer.py ``engine_of``): anything but an engine or a layer is one
    TypeError naming the call, the type and the fix (for embcore's TorchRec modules, the layer
    to pass), and nothing is written."""

    class Wrapper(torch.nn.Module):  # as embcore.torchrec's modules hold their layer
        def __init__(self) -> None:
            super().__init__()
            t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
            self.embedding_bags = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "sgd")

    emb = make_engine(dynamic=False)
    ec.save(tmp_path / "ckpt", emb)
    ec.publish(tmp_path / "pub", emb)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    calls = {"ec.save": lambda o: ec.save(tmp_path / "new", o),
             "ec.load": lambda o: ec.load(tmp_path / "ckpt", o),
             "ec.publish": lambda o: ec.publish(tmp_path / "pub2", o)}
    for call, run in [*calls.items(), ("ec.load", lambda o: ec.load(tmp_path / "pub", o))]:
        with pytest.raises(TypeError, match=rf"^{call}: obj must be an ec.Embedding or "
                                            rf"ec.EmbeddingLayer, got dict; pass the "):
            run({"t": emb})
        with pytest.raises(TypeError, match=rf"^{call}: .* got Wrapper; pass its layer, "
                                            rf"Wrapper.embedding_bags \(an ec.EmbeddingLayer\)"):
            run(Wrapper())
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    ec.save(tmp_path / "new", Wrapper().embedding_bags)  # the fix it names works
