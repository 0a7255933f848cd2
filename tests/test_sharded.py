"""Sharded engines (W = 2 and 4, gloo on CPU) against the single-process engine.

Each process first runs the W = 1 engine on the global batch (all processes' batches
concatenated), then joins the process group and runs the sharded engine on its own slice. Every
step's activations, and at the end every table and optimizer slot, must equal the W = 1 run up to
float summation order (gradients of a row are summed per process, then across processes):
rtol 1e-5, atol 1e-6 on values of order 1.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import run_on

import embcore as ec
from embcore.base.comm import CollectiveError
from embcore.state.dtensors import gather_whole

OPTIMIZERS = {
    "sgd": lambda: ec.SGD(learning_rate=0.5, clipvalue=1.0),
    "adagrad": lambda: ec.Adagrad(learning_rate=0.3),
    "rowwise": lambda: ec.RowwiseAdagrad(learning_rate=0.3),
    "momentum": lambda: ec.AdagradMomentum(learning_rate=0.1, momentum=0.9, use_nesterov=True),
    "adam": lambda: ec.Adam(learning_rate=0.1, weight_decay_factor=0.01),
    "adam_dense": lambda: ec.Adam(learning_rate=0.1, lazy_adam=False),
    "ftrl": lambda: ec.FTRL(learning_rate=0.2, l1_regularization_strength=0.01, beta=0.1),
}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def config(opt_name: str, strategies: dict[str, str]):
    """Six tables (two stackable), features sharing tables, weights, a sequence feature."""
    t = {n: ec.TableConfig(vocabulary_size=v, dim=d, combiner=c, name=n)
         for n, v, d, c in [("a", 37, 4, "sum"), ("b", 23, 4, "mean"), ("c", 41, 6, "sqrtn"),
                            ("d", 19, 4, "mean"), ("e", 11, 4, "sum"), ("f", 29, 4, "sum")]}
    fc = {"a": ec.FeatureConfig(table=t["a"]), "a_seq": ec.FeatureConfig(table=t["a"],
                                                                           max_sequence_length=3),
          "b": ec.FeatureConfig(table=t["b"]), "c": ec.FeatureConfig(table=t["c"]),
          "d": ec.FeatureConfig(table=t["d"]), "d2": ec.FeatureConfig(table=t["d"]),
          "e": ec.FeatureConfig(table=t["e"]), "f": ec.FeatureConfig(table=t["f"])}
    if opt_name == "rowwise":  # a row-wise accumulator cannot be split by columns
        strategies = {k: ("row_div" if v == "column" else v) for k, v in strategies.items()}
    return fc, strategies


def global_batch(step: int, world: int, b: int = 3):
    """Per-rank batches (list of W dicts of ids, weights) for one step."""
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(world):
        lengths = torch.randint(0, 4, (b,), generator=g)  # empty bags included
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        n = int(offs[-1])
        jag = lambda v: torch.nested.nested_tensor_from_jagged(v, offs)  # noqa: E731
        feats = {"a": torch.randint(0, 37, (b,), generator=g),
                 "a_seq": torch.randint(0, 37, (b, 4), generator=g),
                 "b": jag(torch.randint(0, 23, (n,), generator=g)),
                 "c": jag(torch.randint(0, 41, (n,), generator=g)),
                 "d": torch.randint(0, 19, (b, 1), generator=g),
                 "d2": jag(torch.randint(0, 19, (n,), generator=g)),
                 "e": torch.randint(0, 11, (b,), generator=g),
                 "f": jag(torch.randint(0, 29, (n,), generator=g))}
        w = {k: None for k in feats}
        w["b"] = jag(torch.rand(n, generator=g) + 0.5)
        out.append((feats, w))
    return out


def concat(batches):
    """The W = 1 batch: every rank's examples in rank order."""
    feats, weights = {}, {}
    for k, v in batches[0][0].items():
        parts = [b[0][k] for b in batches]
        if v.is_nested:
            vals = torch.cat([p.values() for p in parts])
            lens = torch.cat([p.offsets().diff() for p in parts])
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            feats[k] = torch.nested.nested_tensor_from_jagged(vals, offs)
            ws = [b[1][k] for b in batches]
            weights[k] = (None if ws[0] is None else torch.nested.nested_tensor_from_jagged(
                torch.cat([x.values() for x in ws]), offs))
        else:
            feats[k] = torch.cat(parts)
            weights[k] = None
    return feats, weights


def grads_for(acts, step):
    g = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(a.shape, generator=g) for k, a in sorted(acts.items())}


def slots_whole(emb):
    out = {}
    for name in emb.table_names().values():
        place = emb.plan.table(name)
        for slot in place.slot_names:
            out[f"{name}/{slot}"] = gather_whole(place, emb.plan.physical[place.physical],
                                                 emb._store.local(name, slot), emb.comm)
    return out


def _equality_worker(rank, world, init, cases, steps):
    batches = [global_batch(s, world) for s in range(steps)]
    reference = {}
    for opt_name, strategies in cases:  # W = 1 runs, before joining the group
        fc, _ = config(opt_name, strategies)
        torch.manual_seed(7)
        emb = ec.Embedding(fc, OPTIMIZERS[opt_name]())
        acts_per_step = []
        for s in range(steps):
            feats, w = concat(batches[s])
            emb.enqueue(feats, w)
            acts = emb.dequeue()
            acts_per_step.append({k: a.detach().clone() for k, a in acts.items()})
            full_grads = grads_for(acts, s)
            emb.apply_gradients(full_grads)
        reference[opt_name, str(strategies)] = (
            acts_per_step, {t.name: v.clone() for t, v in emb.embedding_tables.items()},
            {k: v.clone() for k, v in slots_whole(emb).items()})
    init()
    for opt_name, strategies in cases:
        ref_acts, ref_tables, ref_slots = reference[opt_name, str(strategies)]
        fc, strategies = config(opt_name, strategies)
        torch.manual_seed(7 + rank)  # rank 0's seed is used by every rank
        emb = ec.Embedding(fc, OPTIMIZERS[opt_name](), sharding=strategies, timeout=60)
        for s in range(steps):
            feats, w = batches[s][rank]
            emb.enqueue(feats, w)
            acts = emb.dequeue()
            full_grads = grads_for(ref_acts[s], s)
            mine = {}
            for k, a in acts.items():
                rows = a.shape[0]
                want = ref_acts[s][k][rank * rows:(rank + 1) * rows]
                torch.testing.assert_close(a.detach(), want, **TOL,
                                           msg=lambda m: f"{opt_name} {strategies} step {s} {k}: {m}")
                mine[k] = full_grads[k][rank * rows:(rank + 1) * rows]
            emb.apply_gradients(mine)
        tables = {t.name: v for t, v in emb.embedding_tables.items()}
        for name, v in ref_tables.items():
            torch.testing.assert_close(tables[name], v, **TOL,
                                       msg=lambda m: f"{opt_name} {strategies} table {name}: {m}")
        for key, v in slots_whole(emb).items():
            torch.testing.assert_close(v, ref_slots[key], **TOL,
                                       msg=lambda m: f"{opt_name} {strategies} slot {key}: {m}")


MIXED = {"a": "row_div", "b": "row_mod", "c": "column", "d": "table", "e": "replicated",
         "f": "row_mod"}


def _cases():
    cases = [(opt, MIXED) for opt in OPTIMIZERS]
    cases += [("adagrad", {n: s for n in "abcdef"}) for s in
              ("replicated", "table", "row_div", "row_mod", "column")]
    cases += [("adagrad", {n: "auto" for n in "abcdef"})]
    return cases


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_sharded_equals_single_process(world):
    """Every strategy (mixed in one engine, and each for all tables), every optimizer."""
    run_on(world, _equality_worker, _cases(), 3)


def test_plan_prints_and_rejects_impossible_splits():
    t = ec.TableConfig(vocabulary_size=100, dim=2, name="narrow")
    from embcore.planning.plan import make_plan
    with pytest.raises(ValueError, match="needs dim >= 4"):
        make_plan([("narrow", t, ec.SGD())], 4, "column")
    with pytest.raises(ValueError, match="column split cannot hold"):
        make_plan([("narrow", t, ec.RowwiseAdagrad())], 2, "column")
    plan = make_plan([("narrow", t, ec.Adagrad())], 4, "row_div")
    assert plan.table("narrow").row_counts == (25, 25, 25, 25)
    assert "row_div" in str(plan) and "MiB per rank" in str(plan)
    big = ec.TableConfig(vocabulary_size=100_000, dim=64, name="big")
    small = ec.TableConfig(vocabulary_size=10, dim=64, name="small")
    auto = make_plan([("big", big, ec.Adagrad()), ("small", small, ec.Adagrad())], 2, "auto")
    assert auto.table("small").strategy == "replicated"
    assert auto.table("big").strategy == "row_mod"
    assert make_plan([("big", big, ec.Adagrad())], 3, "row_div").table("big").row_counts == (
        33334, 33333, 33333)


def _dead_rank_worker(rank, world, init, mode, result_dir):
    init()
    t = ec.TableConfig(vocabulary_size=40, dim=4, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                       sharding="row_mod", timeout=3)
    emb.enqueue({"f": torch.tensor([1, 2, 3])})
    if rank == 1:
        if mode == "die":
            os._exit(0)  # dies mid-step without a word
        time.sleep(8)  # stalls past the 3 s timeout
        os._exit(0)
    start = time.time()
    try:
        emb.dequeue()
    except CollectiveError as e:
        with open(os.path.join(result_dir, "error.txt"), "w") as f:
            f.write(f"{time.time() - start:.1f}\n{e}")
    os._exit(0)


@pytest.mark.parametrize("mode", ["die", "stall"])
@pytest.mark.slow
def test_failing_rank_makes_the_others_raise(mode, tmp_path):
    try:
        run_on(2, _dead_rank_worker, mode, str(tmp_path))
    except Exception:  # noqa: BLE001 - the processes exit abruptly on purpose
        pass
    text = (tmp_path / "error.txt").read_text()
    seconds, message = text.split("\n", 1)
    assert float(seconds) < 20
    assert "rank 0 of 2" in message and "another process probably died or stalls" in message


def _reshard_worker(rank, world, init, root):
    from pathlib import Path

    import torch.distributed as dist
    root = Path(root)
    batches = [global_batch(s, world) for s in range(3)]
    fc, strategies = config("adagrad", MIXED)
    torch.manual_seed(7)
    ref = ec.Embedding(fc, OPTIMIZERS["adagrad"]())  # W = 1, before joining the group
    for s in range(2):
        feats, w = concat(batches[s])
        ref.enqueue(feats, w)
        acts = ref.dequeue()
        ref.apply_gradients(grads_for(acts, s))
    if rank == 0:
        ec.save(root / "w1", ref)
    want_tables = {t.name: v.clone() for t, v in ref.embedding_tables.items()}
    want_slots = slots_whole(ref)
    init()
    dist.barrier()  # rank 0's checkpoint is complete

    def check(emb, tables, slots, what):
        got = {t.name: v for t, v in emb.embedding_tables.items()}
        for name, v in tables.items():
            torch.testing.assert_close(got[name], v, msg=lambda m: f"{what} {name}: {m}")
        for key, v in slots_whole(emb).items():
            torch.testing.assert_close(v, slots[key], msg=lambda m: f"{what} {key}: {m}")

    # W = 1 -> W = world, every strategy (mixed in one engine)
    emb = ec.Embedding(fc, OPTIMIZERS["adagrad"](), sharding=strategies, timeout=60)
    ec.load(root / "w1", emb)
    assert emb.step == 2
    check(emb, want_tables, want_slots, f"W=1 -> W={world} mixed")
    # row_mod -> row_div at W = world, after one more sharded step
    a = ec.Embedding(fc, OPTIMIZERS["adagrad"](), sharding="row_mod", timeout=60)
    ec.load(root / "w1", a)
    feats, w = batches[2][rank]
    a.enqueue(feats, w)
    acts = a.dequeue()
    a.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
    ec.save(root / "rowmod", a)
    a_tables = {t.name: v.clone() for t, v in a.embedding_tables.items()}
    a_slots = slots_whole(a)
    b = ec.Embedding(fc, OPTIMIZERS["adagrad"](), sharding="row_div", timeout=60)
    ec.load(root / "rowmod", b)
    assert b.step == 3
    check(b, a_tables, a_slots, "row_mod -> row_div")


@pytest.mark.slow
def test_checkpoint_reshards_w1_to_w4_and_row_mod_to_row_div(tmp_path):
    run_on(4, _reshard_worker, str(tmp_path))


def _stalled_save_worker(rank, world, init, mode, root, result_dir):
    init()
    import torch.distributed.checkpoint as dcp_module
    t = ec.TableConfig(vocabulary_size=40, dim=4, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                       sharding="row_mod", timeout=3)
    if rank == 1:  # dies or stalls inside DCP's write phase, after the checkpoint began
        real = dcp_module.FileSystemWriter.write_data

        def write_data(self, *args, **kwargs):
            if mode == "die":
                os._exit(0)
            time.sleep(12)
            return real(self, *args, **kwargs)
        dcp_module.FileSystemWriter.write_data = write_data
    start = time.time()
    try:
        ec.save(os.path.join(root, "ck"), emb)
    except CollectiveError as e:
        with open(os.path.join(result_dir, f"error{rank}.txt"), "w") as f:
            f.write(f"{time.time() - start:.1f}\n{e}")
    os._exit(0)


@pytest.mark.parametrize("mode", ["die", "stall"])
@pytest.mark.slow
def test_failing_rank_inside_a_checkpoint_makes_the_others_raise(mode, tmp_path):
    try:
        run_on(2, _stalled_save_worker, mode, str(tmp_path), str(tmp_path))
    except Exception:  # noqa: BLE001 - the processes exit abruptly on purpose
        pass
    seconds, message = (tmp_path / "error0.txt").read_text().split("\n", 1)
    assert float(seconds) < 10, seconds  # the 3 s timeout, not the group's 30 minutes
    assert "another process probably died or stalls" in message


def test_the_plan_prints_sizes_in_mib():
    """``emb.plan`` prints sizes in MiB (2**20 bytes), labelled so: ``memory_budget`` reads "MB"
    as 10**6 bytes, so a "MB" label on binary sizes would mislead."""
    t = ec.TableConfig(vocabulary_size=4096, dim=64, name="t")  # 4096 x 64 x 4 bytes = 1 MiB
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    emb.build(per_replica_batch_size=4)
    text = str(emb.plan)
    assert "rows per rank / MiB per rank" in text and " 4096/1.00" in text
    assert "MiB per rank (parameters + slots): 1.00" in text
    assert "MB" not in text.replace("MiB", "")
