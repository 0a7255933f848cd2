"""The MovieLens example end to end: training, checkpoints and resume, restore, export, serving.

Small on purpose (a few thousand ratings, 8-wide tables, 1-3 epochs): the quality of the default
settings is checked by running the job itself (see examples/movielens/README.md).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import embcore as ec

from ml100k import ML100K, requires_data  # also puts examples/movielens on sys.path

import serve  # noqa: E402  (examples/movielens/serve.py)
import train  # noqa: E402
from data import raw_ids, split, synthetic  # noqa: E402
from model import FEATURES, ModelConfig, RankingModel, as_model_config  # noqa: E402


SMALL = ["--embedding-dim", "8", "--hidden", "16", "8", "--batch-size", "128", "--no-progress"]
METRIC_KEYS = {"epoch", "train_loss", "train_rmse", "test_rmse", "seconds", "data", "dtype"}


def _check_run(out: Path, result: dict, epochs: int, raw: bool = False) -> None:
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == list(range(1, epochs + 1))
    assert all(set(r) == METRIC_KEYS | ({"vocabulary"} if raw else set()) for r in lines)
    assert (out / "checkpoints" / "latest").read_text().strip() == f"epoch-{epochs:04d}"
    assert (out / "serving.pt2").is_file()
    try:
        import matplotlib  # noqa: F401
        assert (out / "curves.png").is_file()
    except ImportError:
        pass
    assert result["test_rmse"] == lines[-1]["test_rmse"] < 1.5
    assert result["partial_restore_equal"] and result["serving_config_equal"]
    assert result["restore_max_diff"] < 1e-6
    assert result["serving_prediction"] == pytest.approx(result["trained_prediction"], abs=1e-6)
    assert 1.0 <= result["serving_prediction"] <= 5.0


@requires_data
def test_whole_flow_on_a_slice_of_the_real_data(tmp_path, capsys):
    out = tmp_path / "run"
    result = train.main(["--data", str(ML100K), "--split", "u1", "--limit", "4000",
                         "--epochs", "2", "--out", str(out), *SMALL])
    _check_run(out, result, epochs=2)
    printed = capsys.readouterr().out
    for step in ("[1/4] restore", "[2/4] partial restore", "[3/4] export", "[4/4] serving_config"):
        assert step in printed
    assert "user 30 rates 'Fargo (1996)'" in printed


def test_whole_flow_on_synthetic_data(tmp_path):
    out = tmp_path / "run"
    result = train.main(["--synthetic", "--split", "u2", "--limit", "4000", "--epochs", "1",
                         "--out", str(out), *SMALL])
    _check_run(out, result, epochs=1)
    again = serve.main(["--out", str(out)])  # serve.py alone, on the finished run
    assert again["serving_prediction"] == pytest.approx(result["serving_prediction"], abs=1e-6)


def _saved_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds: tables, slots, step, MLP, its optimizer, RNG states."""
    dense = torch.load(ckpt / "dense.pt", weights_only=True)
    model = RankingModel(as_model_config(dense["model_config"]), ec.Adagrad(learning_rate=0.1))
    ec.load(ckpt / "embedding", model.embedding)
    state = {f"embedding.{k}": v for k, v in model.embedding.state_dict().items()}
    state |= {f"head.{k}": v for k, v in dense["head"].items()}
    for i, s in dense["optimizer"]["state"].items():
        state |= {f"adam.{i}.{k}": torch.as_tensor(v) for k, v in s.items()}
    state["data_order_rng"], state["torch_rng"] = dense["data_order_rng"], dense["torch_rng"]
    return state


def test_resume_ends_bit_identical(tmp_path):
    args = ["--synthetic", "--limit", "2000", "--dropout", "0.5", "--no-serve", *SMALL]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    a = train.main([*args, "--epochs", "3", "--keep-checkpoints", "2", "--out", str(straight)])
    train.main([*args, "--epochs", "1", "--out", str(stopped)])  # interrupted after epoch 1
    b = train.main([*args, "--epochs", "3", "--resume", "--out", str(stopped)])

    assert sorted(p.name for p in (straight / "checkpoints").glob("epoch-*")) == [
        "epoch-0002", "epoch-0003"]
    sa = _saved_state(straight / "checkpoints" / "epoch-0003")
    sb = _saved_state(stopped / "checkpoints" / "epoch-0003")
    assert sa.keys() == sb.keys() and "embedding.users/accumulators" in sa
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"resumed run differs in {different}"
    assert int(sa["embedding.step"]) == 3 * (2000 // 128)
    strip = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    assert strip(a) == strip(b)
    lines = [json.loads(s) for s in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [1, 2, 3]

    with pytest.raises(ValueError, match="resume with the same model flags"):
        train.main([*args, "--epochs", "4", "--resume", "--out", str(stopped),
                    "--embedding-dim", "4"])


def test_fresh_run_replaces_old_checkpoints(tmp_path, capsys):
    args = ["--synthetic", "--limit", "600", "--no-serve", "--out", str(tmp_path), *SMALL]
    train.main([*args, "--epochs", "2", "--resume"])  # nothing to resume: starts from scratch
    assert "no checkpoint" in capsys.readouterr().out
    train.main([*args, "--epochs", "1"])
    assert [p.name for p in (tmp_path / "checkpoints").glob("epoch-*")] == ["epoch-0001"]


def test_resume_refuses_other_data_flags_or_nothing_to_do(tmp_path, capsys):
    args = ["--synthetic", "--limit", "600", "--no-serve", "--out", str(tmp_path), *SMALL]
    train.main([*args, "--epochs", "2"])
    printed = capsys.readouterr().out
    assert printed.count("SYNTHETIC DATA") == 2  # at the start and in the summary
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["data"] for r in lines} == {"SYNTHETIC"}
    for other in (["--split", "u1"], ["--limit", "800"], ["--seed", "1"]):
        with pytest.raises(ValueError, match="other data or flags"):
            train.main([*args, "--epochs", "3", "--resume", *other])
    with pytest.raises(ValueError, match="trained 2 epochs already and --epochs is 1"):
        train.main([*args, "--epochs", "1", "--resume"])
    assert train.cli([*args, "--epochs", "3", "--resume", "--split", "u1"]) == 1
    assert "error: " in capsys.readouterr().err  # one line, no traceback
    train.main([*args, "--epochs", "3", "--resume"])  # the same data and flags: it goes on
    train.main([*args, "--epochs", "1"])  # a fresh run says it removes the old checkpoints
    assert "removing the previous run's checkpoints" in capsys.readouterr().out


def test_dtype_float16_trains_resumes_and_serves_compact_tables(tmp_path, capsys):
    """--dtype float16: the tables' rows are float16 in training, in the checkpoints (manifest,
    dense.pt's model config, the rows themselves), in the restored and exported models; the
    metrics are finite and record the dtype; a resumed run ends bit-identical to an
    uninterrupted one and refuses another --dtype."""
    import math
    args = ["--synthetic", "--limit", "2000", *SMALL, "--dtype", "float16"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    a = train.main([*args, "--epochs", "2", "--out", str(straight)])
    assert "compact tables: float16 rows" in capsys.readouterr().out
    lines = [json.loads(s) for s in (straight / "metrics.jsonl").read_text().splitlines()]
    assert all(set(r) == METRIC_KEYS | {"stochastic_rounding"} for r in lines)
    assert all(r["dtype"] == "float16" and r["stochastic_rounding"] is True for r in lines)
    assert all(math.isfinite(r[k]) for r in lines for k in ("train_loss", "train_rmse",
                                                              "test_rmse"))
    assert lines[-1]["test_rmse"] < 1.5
    ckpt = straight / "checkpoints" / "epoch-0002"
    manifest = json.loads((ckpt / "embedding" / "manifest.json").read_text())
    assert {t["dtype"] for t in manifest["tables"].values()} == {"float16"}
    config = as_model_config(torch.load(ckpt / "dense.pt", weights_only=True)["model_config"])
    assert (config.dtype, config.stochastic_rounding) == ("float16", True)
    state = _saved_state(ckpt)
    assert state["embedding.users/parameters"].dtype == torch.float16
    assert state["embedding.movies/parameters"].dtype == torch.float16
    assert state["embedding.users/accumulators"].dtype == torch.float32
    # serving: the restored CPU model and the exported program hold float16 rows
    assert a["table_dtype"] == "float16" and a["restore_max_diff"] < 1e-6
    assert a["serving_prediction"] == pytest.approx(a["trained_prediction"], abs=1e-6)
    exported = torch.export.load(straight / "serving.pt2").state_dict
    assert exported["embedding.users"].dtype == exported["embedding.movies"].dtype \
        == torch.float16
    # resume: the same rows and rounding bits as the run never interrupted
    train.main([*args, "--epochs", "1", "--no-serve", "--out", str(stopped)])
    b = train.main([*args, "--epochs", "2", "--no-serve", "--resume", "--out", str(stopped)])
    sa, sb = _saved_state(ckpt), _saved_state(stopped / "checkpoints" / "epoch-0002")
    assert [k for k in sa if not torch.equal(sa[k], sb[k])] == []
    assert a["test_rmse"] == b["test_rmse"]
    with pytest.raises(ValueError, match="resume with the same model flags"):
        train.main([*args[:-1], "bfloat16", "--epochs", "3", "--no-serve", "--resume",
                    "--out", str(stopped)])
    # the flags
    assert train.parse_args([]).dtype == "float32"
    assert not train.parse_args(["--dtype", "bfloat16",
                                 "--no-stochastic-rounding"]).stochastic_rounding
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.parse_args(["--no-stochastic-rounding"])  # float32 rows are not rounded
    assert "--no-stochastic-rounding applies to --dtype float16 / bfloat16" in \
        capsys.readouterr().err


def test_unknown_sharding_is_a_flag_error(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--sharding", "bogus"])
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


def test_runs_without_tqdm_and_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train, "tqdm", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    train.main(["--synthetic", "--limit", "600", "--epochs", "1", "--no-serve",
                "--out", str(tmp_path), *SMALL, "--progress"])  # asks for a bar: tqdm is missing
    assert "epoch 1/1: train loss" in capsys.readouterr().out
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / "curves.png").exists()


def _trained_tiny_model() -> RankingModel:
    torch.manual_seed(0)
    model = RankingModel(ModelConfig(embedding_dim=8, hidden=(16, 8)), ec.Adagrad(0.1))
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # a few steps, so that tables and MLP differ from their initial values
        ids = {k: torch.randint(1, 1000, (64,), generator=g) for k in FEATURES}
        loss, _ = model.compute_loss(ids, torch.randint(1, 6, (64,), generator=g).float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.slow
def test_export_round_trip(tmp_path):
    model = _trained_tiny_model()
    path = tmp_path / "serving.pt2"
    serve.export_serving_model(model, path)
    served = torch.export.load(path).module()
    g = torch.Generator().manual_seed(1)
    for batch in (1, 5, 300):  # the batch size is dynamic
        ids = {k: torch.randint(0, 2048, (batch,), generator=g) for k in FEATURES}
        with torch.no_grad():
            expected = model(ids)
        assert torch.equal(served(**ids), expected)

    # The saved program runs where embcore cannot even be imported.
    ids = {"user_id": [30, 1], "movie_id": [100, 2]}
    code = ("import sys; sys.modules['embcore'] = None; import torch; "
            f"m = torch.export.load({str(path)!r}).module(); "
            f"print(m(user_id=torch.tensor({ids['user_id']}), "
            f"movie_id=torch.tensor({ids['movie_id']})).tolist())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        expected = model({k: torch.tensor(v) for k, v in ids.items()}).tolist()
    assert json.loads(run.stdout) == expected


@pytest.mark.slow
def test_job_runs_sharded_under_torchrun(tmp_path):
    """Two processes with sharded tables, end to end (data, training, checkpoint, serving)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).parents[1] / "examples" / "movielens" / "train.py"
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
         "--synthetic", "--limit", "4000", "--epochs", "1", "--batch-size", "256",
         "--progress", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # rank 0 alone speaks: each message once, one progress bar (tqdm draws a bar's 0% once)
    assert proc.stdout.count("2 processes; the tables are sharded") == 1, proc.stdout
    if importlib.util.find_spec("tqdm") is not None:
        assert proc.stderr.count("epoch 1/1:   0%") == 1, proc.stderr[-3000:]
    assert "row_mod" in proc.stdout
    assert (out / "serving.pt2").is_file() and (out / "metrics.jsonl").is_file()


# --------------------------------------------------------------------------------- --raw-ids
RAW = ["--synthetic", "--limit", "3000", "--no-serve", "--raw-ids", *SMALL]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]


def _train_ids() -> dict[str, torch.Tensor]:
    """The MovieLens ids of RAW's training ratings."""
    train_part = split(synthetic(), "random")[0][:3000]
    return {"users": train_part.user_id, "movies": train_part.movie_id}


def test_raw_ids_train_and_improve_without_eviction_at_capacity_one(tmp_path):
    out = tmp_path / "run"
    train.main([*RAW, "--epochs", "3", "--capacity-fraction", "1.0", "--out", str(out)])
    lines = _metrics(out)
    assert lines[-1]["train_loss"] < lines[0]["train_loss"]
    assert lines[-1]["test_rmse"] < lines[0]["test_rmse"] < 1.5
    distinct = {t: ids.unique().numel() for t, ids in _train_ids().items()}
    for r in lines:  # room for every training id: none is evicted
        assert {t: v["capacity"] for t, v in r["vocabulary"].items()} == distinct
        assert all(v["resident"] <= v["capacity"] for v in r["vocabulary"].values())
    # (each epoch drops its last partial batch: ids seen only there wait for another epoch)
    assert lines[-1]["vocabulary"] == {t: {"resident": n, "capacity": n}
                                       for t, n in distinct.items()}


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_raw_ids_below_capacity_evict(tmp_path, eviction):
    out = tmp_path / "run"
    train.main([*RAW, "--epochs", "1", "--capacity-fraction", "0.6", "--eviction", eviction,
                "--out", str(out)])
    ids = _train_ids()
    (record,) = _metrics(out)
    dense = torch.load(out / "checkpoints" / "epoch-0001" / "dense.pt", weights_only=True)
    config = as_model_config(dense["model_config"])
    assert config.raw_ids and config.eviction == eviction
    model = RankingModel(config, ec.Adagrad(learning_rate=0.1))
    ec.load(out / "checkpoints" / "epoch-0001" / "embedding", model.embedding)
    for table, n in (("users", ids["users"].unique().numel()),
                     ("movies", ids["movies"].unique().numel())):
        cap = -(-6 * n // 10)  # ceil(0.6 n)
        assert record["vocabulary"][table] == {"resident": cap, "capacity": cap}  # full
        resident = model.embedding.engine.vocabulary(table)[0]
        assert resident.numel() == cap < n  # some training ids were evicted
        assert torch.isin(resident, raw_ids(ids[table])).all()  # the hashed ids are the keys
        assert not torch.isin(resident, ids[table]).any()  # not the MovieLens ids themselves


def test_raw_ids_resume_ends_bit_identical_and_refuses_other_flags(tmp_path):
    args = [*RAW, "--capacity-fraction", "0.7", "--eviction", "lfu", "--admit-after", "2"]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    a = train.main([*args, "--epochs", "3", "--out", str(straight)])
    train.main([*args, "--epochs", "1", "--out", str(stopped)])  # interrupted after epoch 1
    b = train.main([*args, "--epochs", "3", "--resume", "--out", str(stopped)])
    sa = _saved_state(straight / "checkpoints" / "epoch-0003")
    sb = _saved_state(stopped / "checkpoints" / "epoch-0003")
    assert sa.keys() == sb.keys() and "embedding.users/vocabulary/ids" in sa
    different = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not different, f"resumed run differs in {different}"
    strip = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    assert strip(a) == strip(b)
    assert [strip(r) for r in _metrics(straight)] == [strip(r) for r in _metrics(stopped)]

    dense = torch.load(stopped / "checkpoints" / "epoch-0003" / "dense.pt", weights_only=True)
    assert dense["run"] | {"raw_ids": True, "capacity_fraction": 0.7, "eviction": "lfu",
                           "admit_after": 2} == dense["run"]
    for other, said in ((["--eviction", "lru"], "eviction: 'lfu' there, 'lru' now"),
                        (["--capacity-fraction", "0.8"], "capacity_fraction: 0.7 there"),
                        (["--admit-after", "3"], "admit_after: 2 there, 3 now")):
        with pytest.raises(ValueError, match=f"other data or flags.*{said}"):
            train.main([*args, "--epochs", "4", "--resume", "--out", str(stopped), *other])
    static = [a for a in args if a not in ("--raw-ids",)]
    with pytest.raises(ValueError, match="raw_ids: True there, False now"):
        train.main([*static, "--epochs", "4", "--resume", "--out", str(stopped)])
    train.main([*static, "--epochs", "1", "--out", str(stopped)])  # a fresh static run
    with pytest.raises(ValueError, match="raw_ids: False there, True now"):
        train.main([*args, "--epochs", "2", "--resume", "--out", str(stopped)])


def test_raw_id_flags_are_checked(capsys):
    for bad, said in ((["--capacity-fraction", "0"], "--capacity-fraction must be > 0"),
                      (["--admit-after", "0"], "--admit-after must be >= 1"),
                      (["--eviction", "fifo"], "invalid choice: 'fifo'")):
        with pytest.raises(SystemExit):
            train.parse_args(["--raw-ids", *bad])
        assert said in capsys.readouterr().err


def test_raw_id_run_serves_raw_ids(tmp_path, capsys):
    out = tmp_path / "run"
    args = [a for a in RAW if a != "--no-serve"]
    result = train.main([*args, "--epochs", "1", "--capacity-fraction", "0.5",
                         "--admit-after", "2", "--out", str(out)])
    _check_run(out, result, epochs=1, raw=True)
    printed = capsys.readouterr().out
    assert "[3/4] export" in printed and "user resident: " in printed
    again = serve.main(["--out", str(out)])  # serve.py alone, on the finished run
    assert again["serving_prediction"] == pytest.approx(result["serving_prediction"], abs=1e-6)

    # The exported program takes raw ids: resident ones give the trained model's predictions,
    # others (never admitted, or evicted) the prediction of a zero embedding.
    served = torch.export.load(out / "serving.pt2").module()
    model = serve.restore_for_serving(out / "checkpoints" / "epoch-0001")
    users, movies = (model.embedding.engine.vocabulary(t)[0] for t in ("users", "movies"))
    probe = {"user_id": torch.cat([users[:3], torch.tensor([7, -2**63])]),
             "movie_id": torch.cat([movies[:3], torch.tensor([2**62, 0])])}
    with torch.no_grad():
        want = model(probe)
        assert torch.equal(served(**probe), want)
        zeros = model.head(torch.zeros(2, 8), torch.zeros(2, 8))
    assert torch.equal(want[3:], zeros)


@requires_data
def test_raw_ids_on_a_slice_of_the_real_data(tmp_path, capsys):
    out = tmp_path / "run"
    result = train.main(["--data", str(ML100K), "--split", "u1", "--limit", "4000",
                         "--epochs", "2", "--raw-ids", "--out", str(out), *SMALL])
    _check_run(out, result, epochs=2, raw=True)
    assert "user 30 rates 'Fargo (1996)'" in capsys.readouterr().out


def test_the_exchange_compression_flags(capsys):
    assert train.parse_args(["--exchange-compression", "fp16"]).exchange == \
        ec.ExchangeCompression("fp16", "fp16")
    assert train.parse_args(["--exchange-compression", "bf16,fp8", "--no-error-feedback"]
                            ).exchange == ec.ExchangeCompression("bf16", "fp8", False)
    with pytest.raises(SystemExit):
        train.parse_args(["--exchange-compression", "fp8,fp8,fp8"])
    assert "FORWARD,BACKWARD" in capsys.readouterr().err


def test_more_processes_than_gpus_is_a_clear_error_before_any_collective(monkeypatch):
    """Two processes on a machine with one GPU (issue 54: the Criteo job and MovieLens under
    torchrun failed inside NCCL): the second is told at once, naming the fix; the first gets its
    own GPU. No process group is made (none could be, here)."""
    import parallel  # examples/movielens/parallel.py
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parallel.one_gpu_each(0) == 0
    with pytest.raises(SystemExit, match=r"process 1 .* has 1; NCCL needs one per process\): "
                                         r"run --nproc-per-node 1 or fewer, or --device cpu"):
        parallel.one_gpu_each(1)
