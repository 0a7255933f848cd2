"""The Criteo example's model and job end to end: shapes, training, the last line, resume.

Tiny on purpose (a few hundred synthetic lines, 4-wide tables): the quality of the default
settings is checked by running the job itself (see examples/criteo/README.md).
"""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import embcore as ec

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # the criteo package
from criteo import train  # noqa: E402
from criteo.generate import generate  # noqa: E402
from criteo.model import DLRM, FEATURES, LowRankCross, ModelConfig, as_model_config  # noqa: E402

TINY = ["--dim", "4", "--bottom-mlp", "8", "4", "--top-mlp", "8", "--cross-layers", "2",
        "--cross-rank", "4", "--batch-size", "64", "--no-progress", "--threads", "1",
        "--lr", "0.05", "--embedding-lr", "0.05"]
LAST_LINE = re.compile(r"test auc=0\.\d{4} logloss=\d\.\d{4}")


def tiny_config(**kw) -> ModelConfig:
    return ModelConfig(**{"capacities": (7,) * 26, "dim": 4, "bottom": (8, 4), "cross_layers": 2,
                          "cross_rank": 3, "top": (8, 6), **kw})


@pytest.mark.parametrize("raw_ids", [True, False])
def test_model_shapes(raw_ids):
    torch.manual_seed(0)
    config = tiny_config(raw_ids=raw_ids)
    model = DLRM(config, ec.Adagrad(learning_rate=0.1, initial_accumulator_value=0.0))
    assert config.interaction_width == 4 + 26 * 4
    assert as_model_config(json.loads(json.dumps(config.__dict__))) == config
    sparse = torch.randint(0, 7, (5, 26)) if not raw_ids else torch.randint(-1, 2**32, (5, 26))
    logits = model(torch.rand(5, 13), sparse)
    assert logits.shape == (5,)
    logits.sum().backward()
    tables = model.embedding.embedding_tables
    assert [t.name for t in tables] == list(FEATURES)
    assert all(v.shape == (7, 4) for v in tables.values())
    assert model.dense_arch.cross.down[0].weight.shape == (3, 108)
    with pytest.raises(ValueError, match="26 sizes"):
        tiny_config(capacities=(7,) * 25)


def test_cross_layer_formula():
    torch.manual_seed(0)
    cross = LowRankCross(width=5, layers=2, rank=2)
    x0 = torch.randn(3, 5)
    x = x0
    for down, up in zip(cross.down, cross.up):
        x = x0 * (x @ down.weight.T @ up.weight.T + up.bias) + x
    torch.testing.assert_close(cross(x0), x)


def _run(capsys, *argv) -> tuple[dict, list[str]]:
    result = train.main([*argv, *TINY])
    return result, capsys.readouterr().out.strip().splitlines()


def test_synthetic_end_to_end_prints_the_auc_last(tmp_path, capsys):
    out = tmp_path / "run"
    result, lines = _run(capsys, "--synthetic", "--synthetic-lines", "640", "--out", str(out))
    assert LAST_LINE.fullmatch(lines[-1]), lines[-1]
    assert lines[-1] == f"test auc={result['test_auc']:.4f} logloss={result['test_logloss']:.4f}"
    assert "SYNTHETIC DATA" in "\n".join(lines) and "best achievable test AUC" in "\n".join(lines)
    assert 0.5 < result["test_auc"] <= 1 and result["test_examples"] == 160
    assert result["train_examples_per_s"] > 0 and "examples/s" in "\n".join(lines)
    records = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["synthetic"] for r in records) and records[-1]["kind"] == "eval"
    assert records[-1]["data"] == "SYNTHETIC" and records[-1]["test_auc"] == result["test_auc"]
    assert any(r["kind"] == "train" and r["loss"] > 0 and r["examples_per_s"] > 0
               for r in records)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000010"


def test_resume_continues_the_run_and_refuses_other_flags(tmp_path, capsys):
    data = tmp_path / "data"
    generate(data, train_lines=500, test_lines=150, scale=1e-4, seed=1)
    base = ["--data", str(data), "--hash-buckets", "50"]
    straight, _ = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "a"))
    first, _ = _run(capsys, *base, "--epochs", "1", "--out", str(tmp_path / "b"),
                    "--checkpoint-every", "3")
    resumed, lines = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "b"),
                          "--resume")
    assert any("resumed from" in s for s in lines) and LAST_LINE.fullmatch(lines[-1])
    assert resumed["epoch"] == 2 and resumed["examples"] == straight["examples"] == 1000
    assert resumed["test_auc"] == pytest.approx(straight["test_auc"], abs=1e-6)
    assert resumed["test_logloss"] == pytest.approx(straight["test_logloss"], abs=1e-6)
    with pytest.raises(ValueError, match="batch_size: 64 there, 32 now"):
        train.main([*base, "--epochs", "3", "--out", str(tmp_path / "b"), "--resume", *TINY,
                    "--batch-size", "32"])
    with pytest.raises(ValueError, match="model with"):
        train.main([*base, "--epochs", "3", "--out", str(tmp_path / "b"), "--resume", *TINY,
                    "--dim", "8"])
    with pytest.raises(ValueError, match="has finished 2 epoch"):
        train.main([*base, "--epochs", "2", "--out", str(tmp_path / "b"), "--resume", *TINY])


def test_resume_mid_epoch_equals_an_uninterrupted_run(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    generate(data, train_lines=400, test_lines=100, scale=1e-4, seed=2)
    base = ["--data", str(data), "--capacity", "0.5", "--out"]
    straight, _ = _run(capsys, *base, str(tmp_path / "a"))
    calls = {"n": 0}
    step = train.DLRM.forward

    def crash_at_step_5(self, *a):  # a run killed mid-epoch, after the checkpoint at step 4
        if self.training:
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
        return step(self, *a)

    monkeypatch.setattr(train.DLRM, "forward", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        _run(capsys, *base, str(tmp_path / "b"), "--checkpoint-every", "2")
    monkeypatch.setattr(train.DLRM, "forward", step)
    resumed, lines = _run(capsys, *base, str(tmp_path / "b"), "--resume")
    assert any("after line" in s for s in lines)
    assert resumed["examples"] == straight["examples"]
    assert resumed["test_auc"] == pytest.approx(straight["test_auc"], abs=1e-6)


def test_held_out_share_when_test_has_no_labels(tmp_path, capsys):
    data = tmp_path / "data"
    generate(data, train_lines=700, test_lines=10, scale=1e-4, seed=0)
    test = data / "test.txt"
    test.write_text("".join(s.split("\t", 1)[1] for s in test.read_text().splitlines(True)))
    result, lines = _run(capsys, "--data", str(data), "--out", str(tmp_path / "r"),
                         "--capacity", "64")
    assert "every 7th line of train.txt held out (test.txt has no labels)" in "\n".join(lines)
    assert result["test_examples"] == 100 and result["examples"] == 600
    with pytest.raises(ValueError, match="raise --capacity"):
        train.main(["--data", str(data), "--out", str(tmp_path / "r"), "--capacity", "20", *TINY])
    assert LAST_LINE.fullmatch(lines[-1])


def test_flag_and_data_errors(tmp_path, capsys):
    for argv, message in ((["--synthetic", "--data", "x"], "either --data"),
                          (["--synthetic", "--capacity", "1.5"], "--capacity must be"),
                          (["--synthetic", "--hash-buckets", "5", "--capacity", "3"],
                           "--capacity applies to --raw-ids"),
                          (["--synthetic", "--hash-buckets", "5", "6"], "one size")):
        with pytest.raises(SystemExit):
            train.parse_args(argv)
        assert message in capsys.readouterr().err
    assert train.cli(["--data", str(tmp_path), "--out", str(tmp_path / "r")]) == 1
    assert "has no train.txt" in capsys.readouterr().err


def test_memory_budget_trains_the_same_model(tmp_path, capsys):
    """--memory-budget offloads the hashed tables to files with small caches: the run's AUC and
    log loss are those of the in-memory run (the cache is exact), and a checkpoint written under
    one budget resumes under another."""
    data = tmp_path / "data"
    generate(data, train_lines=400, test_lines=120, scale=1e-3, seed=2)
    base = ["--data", str(data), "--hash-buckets", "400"]
    plain, _ = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "a"))
    budget, lines = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "b"),
                         "--memory-budget", "20KB", "--offload-dir", str(tmp_path / "slow"))
    assert any("slow tier" in s for s in lines)
    assert budget["test_auc"] == plain["test_auc"]
    assert budget["test_logloss"] == plain["test_logloss"]
    _run(capsys, *base, "--epochs", "1", "--out", str(tmp_path / "c"), "--memory-budget", "30KB")
    resumed, _ = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "c"), "--resume")
    assert resumed["test_auc"] == plain["test_auc"]


def _two_process_worker(rank, world, init, data, out, ports, parser):
    """The job in a torchrun-like environment. ``parser="reference"`` reads as the job did
    before input sharing: every process parses the whole of every batch and keeps
    ``batch[rank::world]`` (the reference loop of ``read_batches``). Then a resume from the
    checkpoint at step 4."""
    import os
    import shutil

    from criteo import data as reader
    shares = []

    def read_batches(*args, **kwargs):
        shares.append(kwargs.get("share"))
        return reader.read_batches(*args, parser=parser, **kwargs)

    train.read_batches = read_batches
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      LOCAL_RANK=str(rank), MASTER_PORT=str(ports[0]))
    argv = ["--data", data, "--out", out, "--skip-bad", "--capacity", "300",
            "--checkpoint-every", "4", "--keep-checkpoints", "100", *TINY]
    train.main(argv)
    assert shares and set(shares) == {(rank, world)}, shares
    if rank == 0:
        shutil.copy(Path(out) / "metrics.jsonl", Path(out) / "straight.jsonl")
        (Path(out) / "checkpoints" / "latest").write_text("step-00000004\n")
    if parser == "fast":
        os.environ["MASTER_PORT"] = str(ports[1])
        train.main([*argv, "--resume"])


def test_two_processes_read_their_shares_and_train_as_before(tmp_path):
    """Each process converts only its examples of each global batch; the run (losses, test
    AUC and log loss, skipped lines) equals the one where every process parses every line and
    keeps every W-th example, with bad lines and a held-out test part; and a run resumed
    mid-epoch ends as the uninterrupted one."""
    from distributed import free_port, run_on
    data = tmp_path / "data"
    generate(data, train_lines=900, test_lines=10, scale=1e-4, seed=3)
    lines = (data / "train.txt").read_text().splitlines(True)
    for i in (5, 77, 300, 640):  # bad lines 6, 78, 301, 641; line 301 is held out (7 * 43)
        lines[i] = "1\tx\n"
    (data / "train.txt").write_text("".join(lines))
    (data / "test.txt").unlink()  # no test.txt: every 7th line of train.txt is held out

    def records(path):
        return [{k: v for k, v in json.loads(s).items()
                 if "per_s" not in k and k != "eval_seconds"}
                for s in path.read_text().splitlines()]

    runs = {}
    for parser in ("reference", "fast"):
        out = tmp_path / parser
        run_on(2, _two_process_worker, str(data), str(out), (free_port(), free_port()), parser)
        runs[parser] = records(out / "straight.jsonl"), records(out / "metrics.jsonl")
    assert runs["fast"][0] == runs["reference"][0]
    straight, resumed = runs["fast"]
    final = straight[-1]
    assert final["kind"] == "eval" and final["train_skipped"] == 3 and final["test_skipped"] == 1
    assert final["examples"] == 900 - 128 - 3 and final["test_examples"] == 128 - 1
    for key in ("examples", "test_auc", "test_logloss", "test_examples"):
        assert resumed[-1][key] == final[key], key
