"""Checkpoints: round trips, partial restores, atomicity under a killed writer, and refusal of
metadata that would run code."""

from __future__ import annotations

import inspect
import io
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import exited_pid

import embcore as ec
from embcore import checkpoint as ck
from embcore.formats import checkpoint as fck

# ----------------------------------------------------------------------------------- fixtures
# Tables a and b stack (same dim and optimizer); c has its own FTRL (accumulators + linears) and
# is shared by two features; d is rowwise (accumulators of shape (N, 1)).
A = ec.TableConfig(vocabulary_size=50, dim=4, name="a", combiner="sum")
B = ec.TableConfig(vocabulary_size=30, dim=4, name="b")
C = ec.TableConfig(vocabulary_size=20, dim=8, name="c",
                   optimizer=ec.FTRL(learning_rate=0.5, initial_accumulator_value=0.1))
D = ec.TableConfig(vocabulary_size=40, dim=2, name="d", optimizer=ec.RowwiseAdagrad(0.3))


def features(tables=(A, B, C, D)):
    return {f"f{t.name}": ec.FeatureConfig(table=t) for t in tables} | (
        {"g": ec.FeatureConfig(table=C)} if C in tables else {})


def engine(seed: int, optimizer=ec.Adagrad(learning_rate=0.1), tables=(A, B, C, D), **kw):
    torch.manual_seed(seed)
    return ec.Embedding(features(tables), optimizer, **kw)


def batch(emb: ec.Embedding, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, f in emb.feature_config.items():
        out[name] = torch.randint(0, f.table.vocabulary_size, (6,), generator=g)
    return out


def train(emb: ec.Embedding, seed: int) -> dict[str, torch.Tensor]:
    emb.enqueue(batch(emb, seed))
    act = emb.dequeue()
    loss = sum((a * torch.arange(a.numel()).view_as(a)).sin().sum() for a in act.values())
    loss.backward()
    emb.apply_gradients({k: a.grad for k, a in act.items()})
    return {k: a.detach() for k, a in act.items()}


def snapshot(obj) -> dict[str, torch.Tensor]:
    sd = obj.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def assert_state_equal(x: dict, y: dict) -> None:
    assert sorted(x) == sorted(y)
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.fixture()
def trained():
    emb = engine(0)
    train(emb, 1)
    train(emb, 2)
    return emb


# ----------------------------------------------------------------------------------- round trips
def test_round_trip_engine_and_next_step_identical(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    fresh = engine(12345)
    assert not torch.equal(fresh.state_dict()["a/parameters"], trained.state_dict()["a/parameters"])
    manifest = ec.load(tmp_path / "ck", fresh)
    assert manifest["step"] == 2 and fresh.step == 2
    assert_state_equal(snapshot(fresh), snapshot(trained))
    assert torch.equal(fresh.state_dict()["c/linears"], trained.state_dict()["c/linears"])
    assert fresh.state_dict()["d/accumulators"].shape == (40, 1)
    a1, a2 = train(trained, 3), train(fresh, 3)
    for k in a1:
        assert torch.equal(a1[k], a2[k])
    assert_state_equal(snapshot(fresh), snapshot(trained))


def test_round_trip_into_other_stacking(tmp_path, trained):
    """Entries are whole logical tables: a target that stacks differently loads the same."""
    ec.save(tmp_path / "ck", trained)
    torch.manual_seed(7)  # another feature order: b is stacked before a (other row offsets)
    other = ec.Embedding({"fb": ec.FeatureConfig(table=B), "fd": ec.FeatureConfig(table=D),
                          "fa": ec.FeatureConfig(table=A), "fc": ec.FeatureConfig(table=C)},
                         ec.Adagrad(learning_rate=0.1))
    assert other.plan.table("a").row_offset == 30
    ec.load(tmp_path / "ck", other)
    assert_state_equal(snapshot(other), snapshot(trained))


def test_layer_round_trip(tmp_path):
    def layer(seed):
        torch.manual_seed(seed)
        return ec.EmbeddingLayer(features((A, C)), ec.Adagrad(learning_rate=0.2))

    def step(lay, seed):
        out = lay(batch(lay.engine, seed))
        sum(o.square().sum() for o in out.values()).backward()
        return out

    src = layer(0)
    step(src, 1)
    ec.save(tmp_path / "ck", src, extra={"epoch": 4})
    dst = layer(99)
    assert ec.load(tmp_path / "ck", dst)["extra"] == {"epoch": 4}
    assert_state_equal(snapshot(dst), snapshot(src))
    assert dst.engine.step == 1
    o1, o2 = step(src, 2), step(dst, 2)
    for k in o1:
        assert torch.equal(o1[k], o2[k])
    assert_state_equal(snapshot(dst), snapshot(src))


def test_v0_layer_round_trip(tmp_path):
    def layer(seed):
        torch.manual_seed(seed)
        return ec.EmbeddingLayer(features((A, B)), None)

    src = layer(0)
    opt = torch.optim.SGD(src.parameters(), lr=0.5)
    sum(o.sum() for o in src(batch(src.engine, 1)).values()).backward()
    opt.step()
    ec.save(tmp_path / "ck", src)
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["keys"] == ["a/parameters", "b/parameters"]
    assert manifest["object"] == "EmbeddingLayer (optimizer=None)"
    dst = layer(1)
    ec.load(tmp_path / "ck", dst)
    assert_state_equal(snapshot(dst), snapshot(src))
    assert isinstance(dst.get_parameter("a/parameters"), torch.nn.Parameter)
    # A V0 checkpoint has no slots: an engine with an optimizer takes it with slots=False.
    emb = engine(3, tables=(A, B))
    with pytest.raises(KeyError, match="slot 'accumulators' of table 'a'.*slots=False"):
        ec.load(tmp_path / "ck", emb)
    ec.load(tmp_path / "ck", emb, slots=False)
    assert torch.equal(emb.state_dict()["b/parameters"], src.state_dict()["b/parameters"])
    # ... and an engine checkpoint with slots loads into a V0 layer (slots skipped).
    trained = engine(4, tables=(A, B))
    train(trained, 1)
    ec.save(tmp_path / "ck2", trained)
    ec.load(tmp_path / "ck2", dst)
    assert torch.equal(dst.state_dict()["a/parameters"], trained.state_dict()["a/parameters"])


def test_partial_load(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    fresh = engine(5)
    before = snapshot(fresh)
    ec.load(tmp_path / "ck", fresh, tables=["a", "c"])
    now, src = snapshot(fresh), snapshot(trained)
    for k in now:
        table = k.split("/")[0]
        expect = src[k] if table in ("a", "c") else before[k]
        assert torch.equal(now[k], expect), k
    assert fresh.step == 0  # the step comes only with every table and slot


def test_slots_false(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    serving = engine(6, optimizer=None, tables=(A, B))  # no optimizer: no slots at all
    ec.load(tmp_path / "ck", serving, tables=["a", "b"])  # slots skipped automatically
    assert torch.equal(serving.state_dict()["a/parameters"], trained.state_dict()["a/parameters"])
    serving2 = engine(6, optimizer=None, tables=(A, B))
    ec.load(tmp_path / "ck", serving2, slots=False, strict=False)  # c, d absent: skipped
    assert torch.equal(serving2.state_dict()["b/parameters"], serving.state_dict()["b/parameters"])
    assert serving.step == 2  # every table of the target with all its (zero) slots
    assert serving2.step == 0  # slots=False: parameters only

    fresh = engine(7)
    ec.load(tmp_path / "ck", fresh, slots=False)
    sd = fresh.state_dict()
    assert torch.equal(sd["c/parameters"], trained.state_dict()["c/parameters"])
    assert torch.all(sd["a/accumulators"] == 0.1)  # slots keep their initial values
    assert torch.all(sd["c/linears"] == 0) and fresh.step == 0



@pytest.mark.parametrize("saved, target", [(ec.Adagrad, ec.RowwiseAdagrad),
                                           (ec.RowwiseAdagrad, ec.Adagrad)])
def test_a_slot_of_another_optimizers_shape_names_both_and_slots_false(tmp_path, saved,
                                                                        target):
    """Adagrad's accumulators (N, D) into RowwiseAdagrad's (N, 1), or back: the error names the
    table, both optimizers and slots=False, and nothing is loaded; slots=False then loads the
    parameters, the target's slots at their initial values."""
    t = ec.TableConfig(vocabulary_size=20, dim=4, name="users")
    features = {"user": ec.FeatureConfig(table=t)}
    trained = ec.Embedding(features, saved(learning_rate=0.1))
    trained.enqueue({"user": torch.tensor([1, 2, 3])})
    trained.apply_gradients({"user": torch.ones_like(trained.dequeue()["user"])})
    ec.save(tmp_path / "ck", trained)
    other = ec.Embedding(features, target(learning_rate=0.1))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=rf"'users/accumulators' has shape .*table 'users' was "
                                         rf"saved with optimizer {saved.__name__}\(.*the target "
                                         rf"has {target.__name__}\(.*slots=False"):
        ec.load(tmp_path / "ck", other)
    for key, value in before.items():
        assert torch.equal(other.state_dict()[key], value), key
    ec.load(tmp_path / "ck", other, slots=False)
    assert torch.equal(other.state_dict()["users/parameters"],
                       trained.state_dict()["users/parameters"])
    assert torch.equal(other.state_dict()["users/accumulators"], before["users/accumulators"])


def test_manifest(tmp_path, trained):
    ec.save(tmp_path / "ck", trained, extra={"epoch": 2, "metrics": {"auc": 0.75}})
    on_disk = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    returned = ec.load(tmp_path / "ck", engine(1))
    assert returned == on_disk
    assert on_disk["format"] == "embcore.checkpoint" and on_disk["format_version"] == 1
    assert on_disk["embcore_version"] == ec.__version__ and on_disk["step"] == 2
    assert on_disk["extra"] == {"epoch": 2, "metrics": {"auc": 0.75}}
    assert on_disk["object"] == "Embedding" and on_disk["world_size"] == 1
    assert on_disk["tables"]["c"]["slots"] == ["accumulators", "linears"]
    assert on_disk["tables"]["a"] == trained.manifest()["tables"]["a"]
    assert {p["table"]: p["physical"] for p in on_disk["plan"]}["b"] == 0  # stacked with a
    assert "step" in on_disk["keys"] and "d/accumulators" in on_disk["keys"]


def test_overwrite_keeps_no_leftovers(tmp_path, trained):
    path = tmp_path / "ck"
    ec.save(path, engine(1))
    ec.save(path, trained)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    fresh = engine(2)
    ec.load(str(path), fresh)
    assert_state_equal(snapshot(fresh), snapshot(trained))


def test_load_falls_back_to_old(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    os.replace(tmp_path / "ck", tmp_path / "ck.old")  # a save killed between its two renames
    (tmp_path / "ck.tmp-1-abcd").mkdir()  # a leftover temporary directory never counts
    fresh = engine(2)
    ec.load(tmp_path / "ck", fresh)
    assert_state_equal(snapshot(fresh), snapshot(trained))
    ec.save(tmp_path / "ck", engine(3))  # the next save completes the swap
    assert not (tmp_path / "ck.old").exists() and (tmp_path / "ck").is_dir()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_onto_other_device(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    gpu = engine(9, device="cuda")
    ec.load(tmp_path / "ck", gpu)
    for k, v in gpu.state_dict().items():
        assert torch.equal(v.cpu(), trained.state_dict()[k]), k
    ec.save(tmp_path / "ck2", gpu)
    cpu = engine(10)
    ec.load(tmp_path / "ck2", cpu)
    assert_state_equal(snapshot(cpu), snapshot(trained))


# ----------------------------------------------------------------------------------- errors
def test_errors(tmp_path, trained):
    path = tmp_path / "ck"
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*ck"):
        ec.load(path, trained)
    (tmp_path / "plain").mkdir()
    with pytest.raises(FileNotFoundError, match="not an embcore checkpoint"):
        ec.load(tmp_path / "plain", trained)
    ec.save(path, trained)
    fresh = engine(3)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"tables \['zzz'\] are not in the checkpoint; it has "
                                         r"\['a', 'b', 'c', 'd'\]"):
        ec.load(path, fresh, tables=["a", "zzz"])
    wide = ec.TableConfig(vocabulary_size=50, dim=6, name="a")
    with pytest.raises(ValueError, match=r"table 'a' has shape \[50, 4\] in the checkpoint but "
                                         r"\[50, 6\] in the target"):
        ec.load(path, engine(3, tables=(wide, B)), strict=False)
    extra = ec.TableConfig(vocabulary_size=5, dim=4, name="e")
    with pytest.raises(KeyError, match=r"tables \['e'\] of the target are not in the checkpoint"):
        ec.load(path, engine(3, tables=(A, extra)))
    partial = engine(3, tables=(A, extra))
    ec.load(path, partial, strict=False)
    assert torch.equal(partial.state_dict()["a/parameters"], trained.state_dict()["a/parameters"])
    assert partial.step == 0
    with pytest.raises(TypeError, match="JSON"):
        ec.save(tmp_path / "ck2", trained, extra={"t": torch.ones(1)})
    with pytest.raises(TypeError, match="JSON"):
        ec.save(tmp_path / "ck2", trained, extra={"x": float("nan")})
    assert not (tmp_path / "ck2").exists()
    with pytest.raises(TypeError, match="Embedding or ec.EmbeddingLayer"):
        ec.save(tmp_path / "ck2", torch.nn.Linear(2, 2))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an embcore checkpoint"):
        ec.save(tmp_path / "notes", trained)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert_state_equal(snapshot(fresh), before)
    # An SGD checkpoint lacks the Adagrad target's accumulators.
    sgd = engine(3, optimizer=ec.SGD(learning_rate=0.1), tables=(A, B))
    ec.save(tmp_path / "sgd", sgd)
    with pytest.raises(KeyError, match="slot 'accumulators' of table 'a'"):
        ec.load(tmp_path / "sgd", engine(3, tables=(A, B)))


def test_failed_read_leaves_target_untouched(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    data = tmp_path / "ck" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated tensor bytes
    fresh = engine(3)
    before = snapshot(fresh)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        ec.load(tmp_path / "ck", fresh)
    assert_state_equal(snapshot(fresh), before)
    assert fresh.step == 0


def drop_checksums(path: Path) -> None:
    """Makes ``path`` a checkpoint as written before checksums existed (or by whoever rewrote
    its manifest too): its manifest without ``checksums``."""
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["checksums"]
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("checksums", [True, False])
def test_flipped_bytes_are_a_corrupt_checkpoint_error(tmp_path, trained, checksums):
    """64 bytes flipped at 40 places of a data file: with checksums every load fails with a
    ValueError naming the file and saying the checkpoint is corrupt; without (a checkpoint
    written before them), each load succeeds (flips inside tensor values) or raises a clear
    error (ValueError saying the checkpoint is corrupt, or the restricted unpickler's
    UnpicklingError), never a raw UnicodeDecodeError. A failed load leaves the target
    untouched."""
    import pickle
    ec.save(tmp_path / "ck", trained)
    if not checksums:
        drop_checksums(tmp_path / "ck")
    data = tmp_path / "ck" / "__0_0.distcp"
    original = data.read_bytes()
    fresh = engine(3)
    before = snapshot(fresh)
    corrupt = 0
    for at in range(0, len(original) - 64, max(1, (len(original) - 64) // 40)):
        raw = bytearray(original)
        raw[at:at + 64] = bytes(b ^ 0xFF for b in raw[at:at + 64])
        data.write_bytes(bytes(raw))
        try:
            ec.load(tmp_path / "ck", fresh)
            assert not checksums, f"flip at {at} loaded"
            fresh.load_state_dict({k: v.clone() for k, v in before.items()})
        except (ValueError, pickle.UnpicklingError) as e:
            assert not isinstance(e, UnicodeError), f"flip at {at}: {e!r}"
            if checksums:
                assert type(e) is ValueError and str(data) in str(e) and "corrupt" in str(e), e
            corrupt += "corrupt" in str(e)
            assert_state_equal(snapshot(fresh), before)
    assert corrupt > 0


# ----------------------------------------------------------------------------------- safety
class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_metadata_is_refused(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    marker = tmp_path / "pwned"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    fresh = engine(3)
    before = snapshot(fresh)
    # The index no longer matches its checksum: refused before it is unpickled...
    with pytest.raises(ValueError, match=r"\.metadata does not match its CRC-32"):
        ec.load(tmp_path / "ck", fresh)
    # ... and, with the manifest rewritten too, by the restricted unpickler.
    drop_checksums(tmp_path / "ck")
    with pytest.raises(pickle.UnpicklingError, match=r"(posix|nt|os)\.system"):
        ec.load(tmp_path / "ck", fresh)
    assert not marker.exists()
    assert_state_equal(snapshot(fresh), before)
    # The same through a class DCP has but we refuse: a "bytes" entry would be unpickled by
    # torch.load(weights_only=False).
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    with pytest.raises(pickle.UnpicklingError, match="BytesStorageMetadata"):
        fck.RestrictedMetadataUnpickler(
            io.BytesIO(pickle.dumps(BytesStorageMetadata()))).load()
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        fck.RestrictedMetadataUnpickler(io.BytesIO(
            b"cbuiltins\neval\n(S'1+1'\ntR.")).load()


def test_index_pointing_outside_is_refused(tmp_path, trained):
    ec.save(tmp_path / "ck", trained)
    with open(tmp_path / "ck" / ".metadata", "rb") as f:
        md = fck.RestrictedMetadataUnpickler(f).load()
    for info in md.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ValueError, match="does not match its CRC-32"):
        ec.load(tmp_path / "ck", engine(3))
    drop_checksums(tmp_path / "ck")  # (as the manifest of a checkpoint from before checksums)
    with pytest.raises(ValueError, match="outside its directory"):
        ec.load(tmp_path / "ck", engine(3))


def test_metadata_needs_only_the_allowed_classes(tmp_path, trained):
    """Records every global a real index resolves: all are in the allow-list (or dtypes)."""
    ec.save(tmp_path / "ck", trained)
    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(tmp_path / "ck" / ".metadata", "rb") as f:
        Recorder(f).load()
    extra = {(m, n) for m, n in seen if (m, n) not in fck.ALLOWED_METADATA_GLOBALS
             and not (m == "torch" and isinstance(getattr(torch, n), torch.dtype))}
    assert not extra


# ----------------------------------------------------------------------------------- helper process
# One helper process imports torch and DCP once (seconds), then forks the writers of the
# killed-writer tests: each installs its hook and saves, and the hook SIGKILLs it at that point
# ("mid_data" is killed from outside, by the helper, once tensor bytes land in the temporary
# directory). Then it forks two processes (gloo, W = 2) that load a W = 1 checkpoint into a
# sharded engine, train a step and save, for the resharding test.
_HELPER = r"""
import json, os, signal, sys, time, traceback
import torch
import torch.distributed as dist
import embcore as ec
from embcore import checkpoint as ck
from embcore.formats import checkpoint as fck
fck.dcp_io()  # import torch.distributed.checkpoint before forking
root, points = sys.stdin.readline().strip(), sys.argv[1:]  # "go": previous checkpoints exist

def write(path, point):
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    replaced = []
    real_replace, real_remove = fck.replace_dir, fck.remove_tree
    def replace(src, dst):
        if (point, len(replaced)) in (("before_swap", 0), ("between_renames", 1)):
            die()
        replaced.append(dst)
        real_replace(src, dst)
    def remove(p, missing_ok=False):
        if point == "after_swap" and len(replaced) == 2:
            die()
        real_remove(p, missing_ok)
    fck.replace_dir, fck.remove_tree = replace, remove
    if point == "before_metadata":  # first fsync: tensor bytes written, the index not yet
        os.fsync = lambda fd: die()
    if point == "mid_data":  # slow the writes down so that the helper kills us among them
        import torch.distributed.checkpoint.filesystem as fs
        real_write = fs._write_item
        def slow_write(*a, **k):
            out = real_write(*a, **k)
            time.sleep(0.3)
            return out
        fs._write_item = slow_write
    ec.save(path, writer_engine(777))

def reshard(rank):
    dist.init_process_group("gloo", init_method=f"file://{root}/pg", rank=rank, world_size=2)
    emb = sharded_engine(3)
    ec.load(f"{root}/w1", emb)  # W = 1 -> W = 2
    emb.enqueue(reshard_batch(rank))
    act = emb.dequeue()
    sum(a.sum() for a in act.values()).backward()
    emb.apply_gradients({k: a.grad for k, a in act.items()})
    ec.save(f"{root}/w2", emb)  # W = 2 -> checkpoint
    dist.destroy_process_group()

def fork(fn, *args):
    pid = os.fork()
    if pid == 0:
        code = 3  # a writer that returns missed its kill point
        try:
            fn(*args)
            code = 0 if fn is reshard else 3
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid

pids = {point: fork(write, os.path.join(root, point, "ck"), point) for point in points}
killed_mid_data, deadline = False, time.monotonic() + 60
while not killed_mid_data and time.monotonic() < deadline:
    d = os.path.join(root, "mid_data")
    for t in os.listdir(d):
        files = os.listdir(os.path.join(d, t)) if ".tmp-" in t else []
        if any(f.endswith(".distcp") and os.path.getsize(os.path.join(d, t, f)) for f in files):
            os.kill(pids["mid_data"], signal.SIGKILL)
            killed_mid_data = True
    time.sleep(0.002)
codes = {p: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for p, pid in pids.items()}
ranks = [fork(reshard, r) for r in range(2)]
codes["reshard"] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in ranks]
print(json.dumps({"codes": codes, "killed_mid_data": killed_mid_data}))
"""
# Engines both sides build: the helper runs these functions' source.
def writer_engine(seed):
    torch.manual_seed(seed)
    a = ec.TableConfig(vocabulary_size=50, dim=4, name="a", combiner="sum")
    b = ec.TableConfig(vocabulary_size=30, dim=4, name="b")
    return ec.Embedding({"fa": ec.FeatureConfig(table=a), "fb": ec.FeatureConfig(table=b)},
                        ec.Adagrad(learning_rate=0.1))


def sharded_tables():
    """{table: (strategy with W = 2, vocabulary_size, dim)}"""
    return {"a": ("row_mod", 50, 4), "b": ("row_div", 30, 4), "c": ("column", 21, 6),
            "d": ("replicated", 10, 4)}


def sharded_engine(seed, sharding=True):
    torch.manual_seed(seed)
    spec = sharded_tables()
    tables = {n: ec.TableConfig(vocabulary_size=v, dim=d, name=n) for n, (_, v, d) in spec.items()}
    return ec.Embedding({f"f{n}": ec.FeatureConfig(table=t) for n, t in tables.items()},
                        ec.Adagrad(learning_rate=0.1),
                        sharding={n: s for n, (s, _, _) in spec.items()} if sharding else None)


def reshard_batch(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return {f"f{n}": torch.randint(0, v, (6,), generator=g)
            for n, (_, v, _) in sharded_tables().items()}


_HELPER = _HELPER.replace("def write(path, point):", "\n".join(
    inspect.getsource(f) for f in (writer_engine, sharded_tables, sharded_engine, reshard_batch)
) + "\ndef write(path, point):")

# kill point -> which checkpoint a load then finds
POINTS = {"mid_data": "old", "before_metadata": "old", "before_swap": "old",
          "between_renames": "old", "after_swap": "new"}


@pytest.fixture(scope="module", autouse=True)
def helper(request):
    """Starts the helper with the module's first test: it imports torch while the others run.
    Not started where no test that needs it is selected (``-m "not slow"``)."""
    needed = any("helper_results" in getattr(item, "fixturenames", ()) for item in
                 request.session.items if getattr(item, "module", None) is request.module)
    if not hasattr(os, "fork") or not needed:
        yield None
        return
    env = dict(os.environ, PYTHONPATH=str(Path(ec.__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", _HELPER, *POINTS], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield proc
    if proc.poll() is None:  # its tests were not selected
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def helper_results(tmp_path_factory, helper):
    """Prepares the checkpoints the helper starts from, lets it run, returns its report."""
    if helper is None:
        pytest.skip("needs fork and SIGKILL")
    root = tmp_path_factory.mktemp("helper")
    previous = writer_engine(1)
    train(previous, 1)
    for point in POINTS:
        ec.save(root / point / "ck", previous)
    w1 = sharded_engine(0, sharding=False)
    train(w1, 1)
    ec.save(root / "w1", w1)
    out, err = helper.communicate(f"{root}\n", timeout=180)
    assert helper.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    return root, previous, w1, report, err


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.slow
def test_killed_writer_leaves_a_loadable_checkpoint(helper_results, point):
    root, previous, _, report, err = helper_results
    assert report["killed_mid_data"]
    assert report["codes"][point] == -signal.SIGKILL, err  # the writer did die at that point
    path = root / point / "ck"
    if point == "between_renames":
        assert not path.exists() and (root / point / "ck.old").is_dir()
    if point in ("mid_data", "before_metadata"):
        assert list((root / point).glob("ck.tmp-*"))  # its leftover is never read
    expect = snapshot(previous) if POINTS[point] == "old" else snapshot(writer_engine(777))
    target = writer_engine(42)
    ec.load(path, target)
    assert_state_equal(snapshot(target), expect)
    # The next save completes normally.
    newer = writer_engine(5)
    ec.save(path, newer)
    assert not (root / point / "ck.old").exists()
    ec.load(path, target)
    assert_state_equal(snapshot(target), snapshot(newer))


@pytest.mark.slow
def test_reshard_w1_to_w2_to_w1(helper_results):
    """A W = 1 checkpoint restored into two processes (row_mod, row_div, column, replicated),
    trained a step there and saved from both, restores into one process: the same state as
    the step taken by one process on both processes' batches."""
    root, _, _, report, err = helper_results
    assert report["codes"]["reshard"] == [0, 0], err
    ref = sharded_engine(12, sharding=False)  # the W = 1 checkpoint, one step on both batches
    ec.load(root / "w1", ref)
    b0, b1 = reshard_batch(0), reshard_batch(1)
    ref.enqueue({k: torch.cat([b0[k], b1[k]]) for k in b0})
    act = ref.dequeue()
    sum(a.sum() for a in act.values()).backward()
    ref.apply_gradients({k: a.grad for k, a in act.items()})
    back = sharded_engine(11, sharding=False)
    manifest = ec.load(root / "w2", back)
    assert manifest["world_size"] == 2 and back.step == 2
    got, want = snapshot(back), snapshot(ref)
    assert sorted(got) == sorted(want)
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-6, msg=k)


def test_save_removes_temporaries_of_dead_writers_only(tmp_path, trained):
    dead = exited_pid()
    stale = tmp_path / f"ck.tmp-{dead}-00ff"
    live = tmp_path / f"ck.tmp-{os.getpid()}-00aa"  # a writer still running (this process)
    other = tmp_path / "ck-other.tmp-1-00bb"  # another checkpoint's: not ours to touch
    for d in (stale, live, other):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"partial")
    ec.save(tmp_path / "ck", trained)
    assert not stale.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", live.name, other.name])
