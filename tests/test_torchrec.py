"""embcore.torchrec: TorchRec's module interfaces on embcore's tables, against TorchRec's own
unsharded modules (and FBGEMM's fused kernels) on the CPU.

The equality of training runs: TorchRec's ``EmbeddingBagCollection`` holds its tables as
``nn.Parameter``s, so its model's ``torch.optim.SGD`` updates them in ``opt.step()``; embcore's
module applies its own SGD (from ``fused_params``) to the touched rows during ``loss.backward()``,
and the same ``torch.optim.SGD`` steps the dense part only. Both start from the same weights (the
TorchRec model's ``state_dict`` loaded into the embcore one), so each step's loss, and the tables
after the run, are equal up to float summation order.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_on

torchrec = pytest.importorskip(
    "torchrec", reason="torchrec is not installed: pip install -e '.[torchrec]', and on a "
                       "machine without CUDA pip install -e '.[torchrec]' ./packaging/fbgemm-gpu-cpu "
                       "(README, Quick start)")

from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402
from torchrec import (  # noqa: E402
    EmbeddingBagConfig,
    EmbeddingConfig,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    PoolingType,
)
from torchrec.models.dlrm import DLRM_DCN  # noqa: E402
from torchrec.modules.embedding_configs import DataType  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface  # noqa: E402
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: E402
from torchrec.optim import RowWiseAdagrad  # noqa: E402

import embcore as ec  # noqa: E402
import embcore.torchrec as et  # noqa: E402

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the criteo package
from criteo.data import read_batches  # noqa: E402
from criteo.generate import generate  # noqa: E402

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}
NUM_SPARSE, NUM_DENSE = 26, 13


def _kjt(sparse: torch.Tensor) -> KeyedJaggedTensor:
    """(B, 26) ids of one id per feature as a KJT keyed C1..C26 (feature-major values)."""
    b = sparse.shape[0]
    return KeyedJaggedTensor(keys=[f"C{j + 1}" for j in range(NUM_SPARSE)],
                             values=sparse.t().reshape(-1),
                             lengths=torch.ones(NUM_SPARSE * b, dtype=torch.int64))


def _dlrm(ebc: torch.nn.Module) -> DLRM_DCN:
    return DLRM_DCN(ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=[16, 8],
                    over_arch_layer_sizes=[16, 1], dcn_num_layers=2, dcn_low_rank_dim=4)


def test_dlrm_dcn_on_criteo_trains_as_with_torchrecs_own_tables(tmp_path):
    info = generate(tmp_path, train_lines=6 * 256, test_lines=10, scale=0.0005, seed=3)
    cards = info["cardinalities"]
    batches = list(read_batches(tmp_path / "train.txt", 256, hash_buckets=cards))
    tables = [EmbeddingBagConfig(name=f"t_C{j + 1}", embedding_dim=8, num_embeddings=n,
                                 feature_names=[f"C{j + 1}"]) for j, n in enumerate(cards)]
    torch.manual_seed(0)
    theirs = _dlrm(torchrec.EmbeddingBagCollection(tables=tables))
    ours = _dlrm(et.EmbeddingBagCollection(tables, fused_params=SGD))
    ours.load_state_dict(theirs.state_dict())  # the same initial weights, tables included
    start = {k: v.clone() for k, v in theirs.state_dict().items()}
    # TorchRec's tables are parameters of its model; ours are not (embcore trains them)
    assert sum(p.numel() for p in theirs.parameters()) == (
        sum(p.numel() for p in ours.parameters()) + sum(cards) * 8)
    opts = [torch.optim.SGD(m.parameters(), lr=SGD["learning_rate"]) for m in (theirs, ours)]
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses: dict[str, list[float]] = {"torchrec": [], "embcore": []}
    for batch in batches:
        dense, kjt = torch.from_numpy(batch.dense), _kjt(torch.from_numpy(batch.sparse))
        for name, model, opt in (("torchrec", theirs, opts[0]), ("embcore", ours, opts[1])):
            loss = loss_fn(model(dense, kjt).squeeze(1), torch.from_numpy(batch.label))
            opt.zero_grad()
            loss.backward()  # embcore: the SGD update of the touched rows happens here
            opt.step()       # torchrec: the tables' update (and for both: the dense part)
            losses[name].append(loss.item())
    assert len(losses["embcore"]) == 6
    torch.testing.assert_close(losses["embcore"], losses["torchrec"], rtol=1e-5, atol=1e-6)
    after, moved = ours.state_dict(), 0
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(after[key], value, rtol=1e-5, atol=1e-6, msg=key)
        moved += int(not torch.equal(value, start[key]))
    assert moved == len(start)  # every table and dense tensor was trained


def test_state_dict_has_torchrecs_names_and_a_torchrec_checkpoint_loads(tmp_path):
    tables = [EmbeddingBagConfig(name="users", embedding_dim=4, num_embeddings=10,
                                 feature_names=["user"]),
              EmbeddingBagConfig(name="ads", embedding_dim=8, num_embeddings=20,
                                 feature_names=["item", "seen"])]
    theirs = torchrec.EmbeddingBagCollection(tables=tables)
    ours = et.EmbeddingBagCollection(tables, fused_params=SGD)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == [
        "embedding_bags.users.weight", "embedding_bags.ads.weight"]
    torch.save(theirs.state_dict(), tmp_path / "ckpt.pt")
    assert not torch.equal(ours.state_dict()["embedding_bags.ads.weight"],
                           theirs.state_dict()["embedding_bags.ads.weight"])
    ours.load_state_dict(torch.load(tmp_path / "ckpt.pt"))  # strict
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value)
        assert torch.equal(ours.embedding_bags.embedding_tables[key.split(".")[1]], value)
    theirs.load_state_dict(ours.state_dict())  # and back
    # errors in torch's words, naming TorchRec's keys
    with pytest.raises(RuntimeError, match=r"size mismatch for embedding_bags\.users\.weight"):
        ours.load_state_dict({"embedding_bags.users.weight": torch.zeros(11, 4),
                              "embedding_bags.ads.weight": torch.zeros(20, 8)})
    assert torch.equal(ours.state_dict()["embedding_bags.ads.weight"],
                       theirs.state_dict()["embedding_bags.ads.weight"])  # nothing loaded
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*embedding_bags\.ads\.weight"):
        ours.load_state_dict({"embedding_bags.users.weight": torch.zeros(10, 4)})
    result = ours.load_state_dict({"embedding_bags.users.weight": torch.zeros(10, 4),
                                   "embedding_bags.other.weight": torch.zeros(1)}, strict=False)
    assert result.missing_keys == ["embedding_bags.ads.weight"]
    assert result.unexpected_keys == ["embedding_bags.other.weight"]
    assert torch.equal(ours.embedding_bags.embedding_tables["users"], torch.zeros(10, 4))
    # another module's error does not stop the tables' load (torch loads what fits, then raises)
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(2, 2), "ebc": ours})
    state = model.state_dict()
    state["dense.weight"], state["ebc.embedding_bags.users.weight"] = torch.zeros(3, 3), \
        torch.ones(10, 4)
    with pytest.raises(RuntimeError, match=r"size mismatch for dense\.weight"):
        model.load_state_dict(state)
    assert torch.equal(ours.embedding_bags.embedding_tables["users"], torch.ones(10, 4))


def _step_both(theirs, ours, kjt, lr):
    """One forward, backward and SGD step of both modules on ``kjt`` (loss: a fixed projection
    of the outputs); returns both outputs' values."""
    outs = []
    for module in (theirs, ours):
        out = module(kjt)
        values = out.values() if isinstance(out, KeyedTensor) else torch.cat(
            [out[k].values() for k in sorted(out)])
        torch.manual_seed(1)
        (values * torch.randn_like(values)).sum().backward()
        outs.append(values.detach())
    with torch.no_grad():
        for p in theirs.parameters():
            p -= lr * p.grad
    return outs


@pytest.mark.parametrize("torch_optim", [
    functools.partial(torch.optim.SGD, lr=0.5),
    functools.partial(torch.optim.Adagrad, lr=0.1),
], ids=["SGD", "Adagrad"])
def test_without_fused_params_a_torch_optimizer_trains_the_tables_as_torchrecs(torch_optim):
    """No fused_params, no optimizer: as TorchRec's unsharded module, the tables are plain
    parameters (TorchRec's names) that the model's torch optimizer trains. The same model on
    both, the same initial weights: equal losses, tables and dense weights after four steps of
    bags of 0-3 ids, a table two features share, a MEAN table; then weighted bags; and
    EmbeddingCollection likewise."""
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                 feature_names=["f1", "f3"]),
              EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=12,
                                 feature_names=["f2"], pooling=PoolingType.MEAN)]
    torch.manual_seed(0)
    theirs = torch.nn.ModuleDict({"ebc": torchrec.EmbeddingBagCollection(tables=tables),
                                  "dense": torch.nn.Linear(16, 1)})
    ours = torch.nn.ModuleDict({"ebc": et.EmbeddingBagCollection(tables),
                                "dense": torch.nn.Linear(16, 1)})
    assert ours["ebc"].embedding_bags.tables_are_parameters
    assert list(ours.state_dict()) == list(theirs.state_dict()) == [
        "ebc.embedding_bags.t1.weight", "ebc.embedding_bags.t2.weight", "dense.weight",
        "dense.bias"]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    ours.load_state_dict(theirs.state_dict())  # the same initial weights
    start = {k: v.clone() for k, v in theirs.state_dict().items()}
    opts = [torch_optim(m.parameters()) for m in (theirs, ours)]
    losses: dict[int, list[float]] = {0: [], 1: []}
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (12,), generator=g)  # 3 features x 4 bags, some empty
        kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"],
                                values=torch.randint(0, 10, (int(lengths.sum()),), generator=g),
                                lengths=lengths)
        target = torch.randn(4, generator=g)
        for i, (model, opt) in enumerate(zip((theirs, ours), opts)):
            pred = model["dense"](model["ebc"](kjt).values()).squeeze(1)
            loss = torch.nn.functional.mse_loss(pred, target)
            opt.zero_grad()
            loss.backward()
            opt.step()  # the tables' update too (both: plain parameters)
            losses[i].append(loss.item())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(value, start[key]), key  # every tensor was trained
    table = ours["ebc"].embedding_bags.embedding_tables["t1"]
    assert table is ours["ebc"].embedding_bags.t1.weight  # the parameter itself
    # and EmbeddingCollection likewise
    configs = [EmbeddingConfig(name="e1", embedding_dim=4, num_embeddings=10,
                               feature_names=["f1", "f2"])]
    theirs_ec, ours_ec = torchrec.EmbeddingCollection(tables=configs), \
        et.EmbeddingCollection(configs)
    assert [n for n, _ in ours_ec.named_parameters()] == ["embeddings.e1.weight"]
    ours_ec.load_state_dict(theirs_ec.state_dict())
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4, 0, 4, 2]),
                            lengths=torch.tensor([2, 0, 1, 0, 3, 1]))
    for module in (theirs_ec, ours_ec):
        opt = torch.optim.SGD(module.parameters(), lr=0.5)
        out = module(kjt)
        (torch.cat([out[k].values() for k in sorted(out)]) * 2.0).sum().backward()
        opt.step()
    torch.testing.assert_close(ours_ec.state_dict()["embeddings.e1.weight"],
                               theirs_ec.state_dict()["embeddings.e1.weight"])
    # weighted SUM bags: the weights scale the rows and their gradients, as TorchRec's
    for t in tables:
        t.pooling = PoolingType.SUM
    theirs_w = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=True)
    ours_w = et.EmbeddingBagCollection(tables, is_weighted=True)
    ours_w.load_state_dict(theirs_w.state_dict())
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 1]),
                            lengths=torch.tensor([2, 0, 1, 1, 3, 1]),
                            weights=torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 0.25, 1.0, 2.0]))
    for module in (theirs_w, ours_w):
        opt = torch_optim(module.parameters())
        (module(kjt).values() * torch.arange(32.0).view(2, 16)).sum().backward()
        opt.step()
    for key, value in theirs_w.state_dict().items():
        torch.testing.assert_close(ours_w.state_dict()[key], value, msg=key)
    for name in ("engine", "training", "a.b"):  # (TorchRec's ModuleDict refuses 'a.b' too)
        with pytest.raises(ValueError, match=rf"table '{re.escape(name)}'.*cannot name one.*"
                                             rf"fused_params"):
            et.EmbeddingBagCollection([EmbeddingBagConfig(name=name, embedding_dim=4,
                                                           num_embeddings=3)])


def test_without_fused_params_ec_save_and_load_hold_the_parameters(tmp_path):
    """ec.save / ec.load of a TorchRec module's tables when they are plain parameters: by
    table, into a module of either kind, and back."""
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                 feature_names=["f1"]),
              EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=6,
                                 feature_names=["f2"])]
    plain = et.EmbeddingBagCollection(tables)
    with torch.no_grad():
        plain.embedding_bags.t2.weight.fill_(0.25)  # (what a torch optimizer would write)
    ec.save(tmp_path / "plain", plain.embedding_bags)
    for target in (et.EmbeddingBagCollection(tables),
                   et.EmbeddingBagCollection(tables, fused_params=SGD)):
        ec.load(tmp_path / "plain", target.embedding_bags)
        for key, value in plain.state_dict().items():
            assert torch.equal(target.state_dict()[key], value), key
    fused = et.EmbeddingBagCollection(tables, fused_params=SGD)
    ec.save(tmp_path / "fused", fused.embedding_bags)
    ec.load(tmp_path / "fused", plain.embedding_bags)
    for key, value in fused.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    assert isinstance(plain.embedding_bags.t1.weight, torch.nn.Parameter)


def _sharded_worker(rank, world, init):
    """A TorchRec model's EmbeddingBagCollection on 2 processes (the tables split row_mod,
    whole on one owner, and replicated), each fed its half of the batch: each process's
    outputs, and the whole tables after three SGD steps, are the single-process module's on
    the whole batch."""
    tables = [EmbeddingBagConfig(name="users", embedding_dim=4, num_embeddings=20,
                                 feature_names=["user"]),
              EmbeddingBagConfig(name="items", embedding_dim=8, num_embeddings=30,
                                 feature_names=["item", "seen"]),
              EmbeddingBagConfig(name="genres", embedding_dim=4, num_embeddings=5,
                                 feature_names=["genre"], pooling=PoolingType.MEAN)]
    keys = ["user", "item", "seen", "genre"]
    batches = []
    for step in range(3):  # whole batches of 4 examples, bags of 0-3 ids
        g = torch.Generator().manual_seed(step)
        lengths = torch.randint(0, 4, (len(keys), 4), generator=g)  # (F, B)
        values = [torch.randint(0, 5 if k == "genre" else 20, (int(n),), generator=g)
                  for k, row in zip(keys, lengths) for n in row]  # per (feature, bag)
        batches.append((lengths, values))

    def kjt(lengths, values, bags):  # the bags ``bags`` of every feature
        picked = [values[f * 4 + b] for f in range(len(keys)) for b in bags]
        return KeyedJaggedTensor(keys=keys, values=torch.cat(picked),
                                 lengths=lengths[:, bags].reshape(-1))

    torch.manual_seed(0)
    single = et.EmbeddingBagCollection(tables, fused_params=SGD)
    start = {k: v.clone() for k, v in single.state_dict().items()}
    expected = []
    for lengths, values in batches:
        out = single(kjt(lengths, values, [0, 1, 2, 3])).values()  # (4, 24)
        expected.append(out.detach()[2 * rank:2 * rank + 2])
        (out * torch.arange(24.0)).sum().backward()
    init()
    sharded = et.EmbeddingBagCollection(
        tables, fused_params=SGD, sharding={"users": "row_mod", "items": "table",
                                            "genres": "replicated"}, timeout=60)
    sharded.load_state_dict(start)  # the whole tables, split as planned
    assert "ShardingPlan(world_size=2" in str(sharded.embedding_bags.engine.plan)
    for (lengths, values), want in zip(batches, expected):
        out = sharded(kjt(lengths, values, [2 * rank, 2 * rank + 1])).values()  # (2, 24)
        torch.testing.assert_close(out.detach(), want)
        (out * torch.arange(24.0)).sum().backward()
    whole = sharded.embedding_bags.embedding_tables  # (a collective)
    for name in ("users", "items", "genres"):
        torch.testing.assert_close(whole[name], single.embedding_bags.embedding_tables[name])
        assert not torch.equal(whole[name], start[f"embedding_bags.{name}.weight"]), name
    del sharded, whole  # the engine before its process group


@pytest.mark.slow
def test_a_torchrec_module_sharded_on_two_processes_equals_one_process():
    run_on(2, _sharded_worker)


def test_weighted_mean_and_shared_features_match_torchrec():
    tables = [EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10,
                                 feature_names=["f1", "f3"]),
              EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=10,
                                 feature_names=["f2", "f3"])]
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 1]),
                            lengths=torch.tensor([2, 0, 1, 1, 3, 1]),
                            weights=torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 0.25, 1.0, 2.0]))
    # one id per bag (unweighted: embcore is fed dense ids), the keys in another order
    single = KeyedJaggedTensor(keys=["f3", "f2", "f1"], values=torch.tensor([1, 9, 2, 0, 5, 5]),
                               lengths=torch.ones(6, dtype=torch.int64),
                               weights=torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 0.25]))
    for weighted, pooling, batch in ((True, PoolingType.SUM, kjt), (False, PoolingType.MEAN, kjt),
                                     (True, PoolingType.SUM, single),
                                     (False, PoolingType.MEAN, single)):
        for t in tables:
            t.pooling = pooling
        theirs = torchrec.EmbeddingBagCollection(tables=tables, is_weighted=weighted)
        ours = et.EmbeddingBagCollection(tables, is_weighted=weighted, fused_params=SGD)
        ours.load_state_dict(theirs.state_dict())
        a, b = _step_both(theirs, ours, batch, SGD["learning_rate"])
        assert ours(batch).keys() == theirs(batch).keys() == ["f1", "f3@t1", "f2", "f3@t2"]
        assert ours(batch).length_per_key() == [4, 4, 8, 8]
        torch.testing.assert_close(b, a)
        for key, value in theirs.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[key], value, msg=key)


def test_embedding_collection_matches_torchrec():
    tables = [EmbeddingConfig(name="e1", embedding_dim=4, num_embeddings=10,
                              feature_names=["f1", "f2"]),
              EmbeddingConfig(name="e2", embedding_dim=4, num_embeddings=5, feature_names=["f2"])]
    kjt = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([1, 2, 3, 4, 0, 4, 2]),
                            lengths=torch.tensor([2, 0, 1, 0, 3, 1]))
    theirs = torchrec.EmbeddingCollection(tables=tables, need_indices=True)
    ours = et.EmbeddingCollection(tables, need_indices=True, fused_params=SGD)
    assert list(ours.state_dict()) == ["embeddings.e1.weight", "embeddings.e2.weight"]
    ours.load_state_dict(theirs.state_dict())
    out = ours(kjt)
    assert sorted(out) == ["f1", "f2@e1", "f2@e2"] and isinstance(out["f1"], JaggedTensor)
    assert out["f2@e2"].values().shape == (4, 4)
    assert out["f2@e2"].lengths().tolist() == [0, 3, 1]
    assert out["f2@e2"].weights().tolist() == [4, 0, 4, 2]  # need_indices: the ids
    assert torch.equal(out["f2@e2"].weights(), theirs(kjt)["f2@e2"].weights())
    assert ours.embedding_names_by_table() == theirs.embedding_names_by_table()
    assert ours.embedding_dim() == 4
    a, b = _step_both(theirs, ours, kjt, SGD["learning_rate"])
    torch.testing.assert_close(b, a)
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, msg=key)
    empty = KeyedJaggedTensor(keys=["f1", "f2"], values=torch.tensor([], dtype=torch.int64),
                              lengths=torch.zeros(4, dtype=torch.int64))
    assert ours(empty)["f1"].values().shape == (0, 4)


@pytest.mark.parametrize("fbgemm, torch_optim", [
    (EmbOptimType.EXACT_ADAGRAD, torch.optim.Adagrad),
    (EmbOptimType.EXACT_ROWWISE_ADAGRAD, RowWiseAdagrad),
])
def test_fused_params_give_fbgemms_updates(fbgemm, torch_optim):
    """TorchRec's fused module (FBGEMM's kernels) and embcore given the same optimizer as
    fused_params: equal tables after three steps with duplicate ids."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50,
                                 feature_names=[f"f{i}"]) for i in range(2)]
    torch.manual_seed(0)
    theirs = FusedEmbeddingBagCollection(tables=tables, optimizer_type=torch_optim,
                                         optimizer_kwargs={"lr": 0.1, "eps": 1e-10},
                                         device=torch.device("cpu"))
    ours = et.EmbeddingBagCollection(
        tables, fused_params={"optimizer": fbgemm, "learning_rate": 0.1, "eps": 1e-10})
    ours.load_state_dict(theirs.state_dict())
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.randint(0, 50, (40,), generator=g),
                                lengths=torch.tensor([2] * 8 + [3] * 8) if step else
                                torch.tensor([5, 0] + [2] * 13 + [9]))
        for module in (theirs, ours):
            out = module(kjt).values()
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(9))).sum() \
                .backward()
    moved = 0
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value, msg=key)
        moved += 1
    assert moved == 2


def test_refusals_name_the_table_feature_or_key():
    t = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    with pytest.raises(ValueError, match="not both"):
        et.EmbeddingBagCollection([t], fused_params=SGD, optimizer="sgd")
    with pytest.raises(ValueError, match=r"optimizer 'adam' is not supported.*ec.Adam"):
        et.EmbeddingBagCollection([t], fused_params={"optimizer": EmbOptimType.ADAM})
    with pytest.raises(ValueError, match="optimizer 'lamb' is not supported"):
        et.EmbeddingBagCollection([t], fused_params={"optimizer": EmbOptimType.LAMB})
    with pytest.raises(ValueError, match=r"unknown or unsupported keys \['lr'\]"):
        et.EmbeddingBagCollection([t], fused_params={"optimizer": "exact_sgd", "lr": 0.1})
    for bad, message in (
            ({"pooling": PoolingType.NONE}, "table 't': pooling .* use SUM or MEAN"),
            ({"data_type": DataType.INT8}, "table 't': data_type .* FP32, FP16 or BF16")):
        config = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, **bad)
        with pytest.raises(ValueError, match=message):
            et.EmbeddingBagCollection([config], fused_params=SGD)
    mean = EmbeddingBagConfig(name="m", embedding_dim=4, num_embeddings=10,
                              pooling=PoolingType.MEAN)
    with pytest.raises(ValueError, match=r"table 'm': weighted .* mode='sum'"):
        et.EmbeddingBagCollection([mean], is_weighted=True, fused_params=SGD)
    with pytest.raises(ValueError, match="duplicate table name 't'"):
        et.EmbeddingBagCollection([t, t], fused_params=SGD)
    with pytest.raises(ValueError, match="meta device"):
        et.EmbeddingBagCollection([t], device="meta", fused_params=SGD)
    with pytest.raises(ValueError, match="one embedding_dim"):
        et.EmbeddingCollection([EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=3),
                                EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=3)],
                               fused_params=SGD)
    ebc = et.EmbeddingBagCollection([t], is_weighted=True, fused_params=SGD)
    assert isinstance(ebc, EmbeddingBagCollectionInterface) and ebc.is_weighted()
    plain = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="has no weights"):
        ebc(plain)
    other = KeyedJaggedTensor(keys=["g"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"lacks features \['f'\]"):
        ebc(other)
    with pytest.raises(TypeError, match="expected a torchrec KeyedJaggedTensor"):
        ebc({"f": torch.tensor([1])})
    outside = KeyedJaggedTensor(keys=["f"], values=torch.tensor([10]), lengths=torch.tensor([1]),
                                weights=torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"feature 'f'.*10"):
        ebc(outside)


def test_fp16_tables_and_an_embcore_optimizer():
    t = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"],
                           data_type=DataType.FP16)
    ebc = et.EmbeddingBagCollection([t], optimizer=ec.Adagrad(learning_rate=0.1))
    assert ebc.state_dict()["embedding_bags.t.weight"].dtype == torch.float16
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([2]))
    before = ebc.state_dict()["embedding_bags.t.weight"].clone()
    out = ebc(kjt).values()
    assert out.dtype == torch.float32 and out.shape == (1, 4)
    out.sum().backward()
    after = ebc.state_dict()["embedding_bags.t.weight"]
    assert not torch.equal(after[1:3], before[1:3]) and torch.equal(after[3:], before[3:])

# (The guide's TorchRec example, docs/guide/train.md, runs in tests/test_docs.py.)


def _kjts_torchrec_refuses():
    """KJTs TorchRec's modules refuse (TorchRec's validator: ValueError), each with what
    embcore's error says: 2 keys of 2 bags."""
    kjt, i = KeyedJaggedTensor, torch.tensor
    return {
        "lengths summing to fewer than the values": (
            kjt(keys=["f", "g"], values=i([1, 2, 3, 4]), lengths=i([1, 1, 0, 1]),
                weights=torch.ones(4)), r"offsets run from 0 to 3 but there are 4 values"),
        "4 weights for 3 ids": (
            kjt(keys=["f", "g"], values=i([1, 2, 3]), lengths=i([1, 1, 1, 0]),
                weights=torch.ones(4)), r"4 weights of shape \[4\] for 3 values"),
        "3 lengths for 2 keys": (
            kjt(keys=["f", "g"], values=i([1, 2, 3]), lengths=i([1, 1, 1]),
                weights=torch.ones(3)), r"3 lengths for 2 keys"),
        "lengths and offsets that disagree": (
            kjt(keys=["f", "g"], values=i([1, 2, 3]), lengths=i([1, 1, 1, 0]),
                offsets=i([0, 2, 2, 3, 3]), weights=torch.ones(3)),
            r"lengths are not the differences of its 5 offsets"),
        "offsets not starting at 0": (
            kjt(keys=["f", "g"], values=i([1, 2, 3]), offsets=i([1, 1, 2, 3, 3]),
                weights=torch.ones(3)), r"offsets run from 1 to 3"),
        "a repeated key": (
            kjt(keys=["f", "f"], values=i([1, 2, 3]), lengths=i([1, 1, 1, 0]),
                weights=torch.ones(3)), r"repeat \['f'\]; keys must be unique"),
    }


@pytest.mark.parametrize("case", list(_kjts_torchrec_refuses()))
@pytest.mark.parametrize("kind", ["EmbeddingBagCollection", "EmbeddingCollection"])
def test_a_kjt_torchrec_refuses_is_refused_before_anything_changes(kind, case):
    from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor
    kjt, message = _kjts_torchrec_refuses()[case]
    with pytest.raises(ValueError):  # TorchRec's own check refuses it
        validate_keyed_jagged_tensor(kjt)
    if kind == "EmbeddingBagCollection":
        module = et.EmbeddingBagCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                feature_names=["f", "g"])], is_weighted=True, fused_params=SGD)
    else:
        module = et.EmbeddingCollection(
            [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10,
                             feature_names=["f", "g"])], fused_params=SGD)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        module(kjt)
    for key, value in before.items():
        assert torch.equal(module.state_dict()[key], value), key
    good = KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1, 2, 3]),
                             lengths=torch.tensor([2, 0, 1, 0]), weights=torch.ones(3))
    out = module(good)  # and the module goes on with the next batch
    values = out.values() if kind == "EmbeddingBagCollection" else out["f"].values()
    assert values.shape == ((2, 8) if kind == "EmbeddingBagCollection" else (2, 4))


def test_fused_params_stochastic_rounding_is_a_bool_and_fbgemms_default():
    """FP16 tables round stochastically unless fused_params says False (FBGEMM's default,
    True, when it says nothing): updates of 1/16 of a unit in the last place move some entries
    with it and none without it; a string is refused, not read as True."""
    import functools
    import inspect

    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen,
    )
    signature = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__)
    assert signature.parameters["stochastic_rounding"].default is True
    config = EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=64,
                                feature_names=["f"], data_type=DataType.FP16,
                                init_fn=functools.partial(torch.nn.init.constant_, val=1.0))
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.arange(64),
                            lengths=torch.ones(64, dtype=torch.int64))
    ulp = 2.0 ** -10  # float16's spacing at 1.0
    moved = {}
    for given in ({}, {"stochastic_rounding": True}, {"stochastic_rounding": False}):
        torch.manual_seed(0)  # (the engine's seed: the same random bits)
        ebc = et.EmbeddingBagCollection([config], fused_params={**SGD, "learning_rate": 1.0,
                                                                **given})
        (ebc(kjt).values() * (-ulp / 16)).sum().backward()  # each entry: + ulp / 16
        moved[str(given)] = int((ebc.state_dict()["embedding_bags.t.weight"] != 1.0).sum())
    assert moved["{}"] == moved["{'stochastic_rounding': True}"] > 100  # about 4096 / 16
    assert moved["{'stochastic_rounding': False}"] == 0
    with pytest.raises(TypeError, match=r"\['stochastic_rounding'\] must be a bool, got str "
                                        r"'False'"):
        et.EmbeddingBagCollection([config], fused_params={**SGD, "stochastic_rounding": "False"})
    for cls, table in ((et.EmbeddingBagCollection, config),
                       (et.EmbeddingCollection, EmbeddingConfig(name="e", embedding_dim=4,
                                                                num_embeddings=10))):
        with pytest.raises(TypeError, match="fused_params must be a dict, got str"):
            cls([table], fused_params="exact_sgd")


def test_load_state_dict_into_fp16_tables_refuses_values_beyond_their_range():
    """As ec.load (docs/semantics.md section 14): float32 rows of 1e5 are not narrowed to
    infinity in an FP16 table; the error (in torch's words) names the key, table, row and
    value, and no table is loaded."""
    tables = [EmbeddingBagConfig(name="t", embedding_dim=2, num_embeddings=4, feature_names=["f"],
                                 data_type=DataType.FP16),
              EmbeddingBagConfig(name="u", embedding_dim=2, num_embeddings=4, feature_names=["g"],
                                 data_type=DataType.FP16)]
    for module, prefix in ((et.EmbeddingBagCollection(tables, fused_params=SGD), "embedding_bags"),
                           (et.EmbeddingCollection([EmbeddingConfig(
                               name=c.name, embedding_dim=2, num_embeddings=4,
                               feature_names=c.feature_names, data_type=DataType.FP16)
                               for c in tables], fused_params=SGD), "embeddings")):
        before = {k: v.clone() for k, v in module.state_dict().items()}
        state = {k: v.float() for k, v in before.items()}
        state[f"{prefix}.u.weight"] = torch.ones(4, 2)
        state[f"{prefix}.t.weight"][3, 1] = 1e5
        with pytest.raises(RuntimeError, match=rf"load_state_dict \({prefix}\.t\.weight\): table "
                                               rf"'t' is float16 .* row\(s\) \(3\) hold values "
                                               rf"beyond float16's range \(largest \|x\| 100000"):
            module.load_state_dict(state)
        for key, value in before.items():
            assert torch.equal(module.state_dict()[key], value), key  # neither table loaded
        state[f"{prefix}.t.weight"][3, 1] = 6e4  # within the range: loads, rounded to nearest
        module.load_state_dict(state)
        assert module.state_dict()[f"{prefix}.t.weight"][3, 1] == 6e4
