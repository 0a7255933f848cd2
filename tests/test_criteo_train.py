"""The Criteo example's model and job end to end: shapes, training, the last line, resume.

Tiny on purpose (a few hundred synthetic lines, 4-wide tables): the quality of the default
settings is checked by running the job itself (see examples/criteo/README.md).
"""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import embcore as ec

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))  # the criteo package
from criteo import serve, train  # noqa: E402
from criteo.generate import generate  # noqa: E402
from criteo.generate import KAGGLE_CARDINALITIES  # noqa: E402
from criteo.model import (  # noqa: E402
    DLRM,
    FEATURES,
    LowRankCross,
    ModelConfig,
    as_model_config,
    config_from_spec,
    embedding_spec,
)

TINY_DENSE = ["--bottom-mlp", "8", "4", "--top-mlp", "8", "--cross-layers", "2",
              "--cross-rank", "4", "--batch-size", "64", "--no-progress", "--threads", "1",
              "--lr", "0.05"]
TINY = [*TINY_DENSE, "--dim", "4", "--embedding-lr", "0.05"]  # the tables' flags: a spec's
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


def test_the_logistic_regression_baseline_is_one(tmp_path, capsys):
    """--model logreg: logit = w . dense + b + the 26 looked-up weights (tables of dim 1,
    starting at 0); it trains, serves and refuses another dim."""
    config = tiny_config(dim=1, arch="logreg")
    model = DLRM(config, ec.SGD(learning_rate=0.5))
    dense, sparse = torch.rand(5, 13), torch.randint(-1, 2**32, (5, 26))
    assert torch.equal(model(dense, sparse), torch.zeros(5))  # every weight starts at 0
    with torch.no_grad():
        model.dense_arch.dense.weight.normal_()
        model.dense_arch.dense.bias.fill_(0.25)
    model.eval()
    weights = model.embedding.engine.lookup({n: sparse[:, j] for j, n in enumerate(FEATURES)})
    expected = (dense @ model.dense_arch.dense.weight.T).squeeze(-1) + 0.25 + torch.cat(
        [weights[n] for n in FEATURES], dim=1).sum(dim=1)
    torch.testing.assert_close(model(dense, sparse), expected)
    with pytest.raises(ValueError, match="dim 1"):
        tiny_config(dim=4, arch="logreg")
    out = tmp_path / "lr"
    result = train.main(["--synthetic", "--synthetic-lines", "640", "--out", str(out),
                         "--model", "logreg", "--batch-size", "64", "--no-progress",
                         "--threads", "1", "--lr", "0.1", "--embedding-lr", "0.1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert LAST_LINE.fullmatch(lines[-1]) and "logistic regression" in "\n".join(lines)
    assert 0.5 < result["test_auc"] <= 1
    served = serve.main(["--run", str(out)])
    assert served["results"]["fp32"]["test_auc"] == result["test_auc"]
    with pytest.raises(SystemExit):
        train.parse_args(["--synthetic", "--model", "logreg", "--dim", "4"])
    assert "dim 1" in capsys.readouterr().err


def test_dtype_float16_trains_compact_tables_and_serves_them(tmp_path, capsys):
    """--dtype float16: the spec's tables hold float16 rows (so do the checkpoint's manifest and
    rows, and the model serve.py rebuilds), the metrics are finite and the eval record names the
    dtype; a resume with another --dtype is refused; --dtype is a table flag (--write-spec
    writes it, --spec refuses it)."""
    import math
    out = tmp_path / "run"
    result, lines = _run(capsys, "--synthetic", "--synthetic-lines", "640", "--out", str(out),
                         "--dtype", "float16")
    assert LAST_LINE.fullmatch(lines[-1])
    assert any(s.startswith("tables: 26 x D 4, float16 rows (updates rounded stochastically)")
               for s in lines), lines
    assert math.isfinite(result["test_logloss"]) and 0.5 < result["test_auc"] <= 1
    assert (result["dtype"], result["stochastic_rounding"]) == ("float16", True)
    records = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records if r["kind"] == "train")
    manifest = _newest_manifest(out)
    assert {t["dtype"] for t in manifest["tables"].values()} == {"float16"}
    assert {t["dtype"] for t in manifest["spec"]["tables"].values()} == {"float16"}
    layer, _, _, _ = serve.restore(_newest(out))
    assert {v.dtype for v in layer.embedding_tables.values()} == {torch.float16}
    served = serve.main(["--run", str(out), "--precisions", "fp32", "int8"])
    assert served["results"]["fp32"]["test_auc"] == result["test_auc"]
    assert "float16 rows (the fp32 row serves them as trained)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"tables\.C1\.dtype: 'float16' there, 'bfloat16' now"):
        train.main(["--synthetic", "--synthetic-lines", "640", "--out", str(out), "--resume",
                    "--epochs", "2", *TINY, "--dtype", "bfloat16"])
    # a table flag: in the spec --write-spec writes, refused beside --spec
    file = tmp_path / "spec.json"
    train.main(["--write-spec", str(file), "--capacity", "100", "--dtype", "bfloat16",
                "--no-stochastic-rounding"])
    tables = json.loads(file.read_text())["tables"]
    assert {(t["dtype"], t["stochastic_rounding"]) for t in tables.values()} \
        == {("bfloat16", False)}
    assert train.rows_record(train.read_spec(file)) == {"dtype": "bfloat16",
                                                         "stochastic_rounding": False}
    capsys.readouterr()
    for argv, message in ((["--spec", str(file), "--dtype", "float16"], "leave out --dtype"),
                          (["--spec", str(file), "--no-stochastic-rounding"],
                           "leave out --no-stochastic-rounding"),
                          (["--no-stochastic-rounding"], "applies to --dtype float16 / bfloat16")):
        with pytest.raises(SystemExit):
            train.parse_args(["--synthetic", *argv])
        assert message in capsys.readouterr().err


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


def _newest(out: Path) -> Path:
    return out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()


def _newest_manifest(out: Path) -> dict:
    return json.loads((_newest(out) / "embedding" / "manifest.json").read_text())


def _as_written_before_specs(out: Path, spec_recorded: bool) -> None:
    """Rewrites the newest checkpoint under ``out`` as the job wrote it before ``--spec``
    (git history: 038895f added --spec, 10ed945 the spec in embcore's manifests, cc7fa09 the
    checksums, e74b4f2 --model): dense.pt's model config has no "arch"; the manifest has no
    checksums, and either no spec (``spec_recorded`` False) or the one-process engine's spec of
    then, built with no sharding (the job passed ``sharding=None`` on one process)."""
    ckpt = _newest(out)
    dense = torch.load(ckpt / "dense.pt", weights_only=True)
    del dense["model_config"]["arch"]
    torch.save(dense, ckpt / "dense.pt")
    file = ckpt / "embedding" / "manifest.json"
    manifest = json.loads(file.read_text())
    del manifest["checksums"]
    if spec_recorded:
        manifest["spec"]["sharding"] = None
    else:
        del manifest["spec"]
    file.write_text(json.dumps(manifest, indent=1))


def test_resume_accepts_a_one_process_checkpoint_from_before_specs(tmp_path, capsys):
    """A checkpoint without a spec in its manifest (or with the old one-process sharding None)
    resumes when the tables it records are the flags' (a note says the flags' spec is taken),
    exactly as an uninterrupted run; tables that differ are refused, naming the difference."""
    data = tmp_path / "data"
    generate(data, train_lines=400, test_lines=100, scale=1e-4, seed=5)
    base = ["--data", str(data), "--capacity", "200"]
    straight, _ = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "a"))
    _run(capsys, *base, "--epochs", "1", "--out", str(tmp_path / "b"), "--checkpoint-every", "3")
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    _as_written_before_specs(tmp_path / "b", spec_recorded=False)
    _as_written_before_specs(tmp_path / "c", spec_recorded=True)
    assert "spec" not in _newest_manifest(tmp_path / "b")
    with pytest.raises(ValueError, match=r"records no spec of the tables .*are not those the "
                                         r"flags build \(C1\.optimizer: 'Adagrad' there, "
                                         r"'RowwiseAdagrad' now"):
        train.main([*base, "--epochs", "2", "--out", str(tmp_path / "b"), "--resume", *TINY,
                    "--embedding-optimizer", "rowwise_adagrad"])
    resumed, lines = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "b"),
                          "--resume")
    assert any(s.startswith("note: ") and "records no spec of the tables (written before "
               "checkpoints recorded one); resuming with the spec the flags build" in s
               for s in lines), lines
    assert any("resumed from" in s for s in lines) and LAST_LINE.fullmatch(lines[-1])
    for key in ("examples", "test_auc", "test_logloss"):
        assert resumed[key] == pytest.approx(straight[key], abs=1e-6), key
    assert "spec" in _newest_manifest(tmp_path / "b")  # its new checkpoints record one
    resumed, lines = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "c"),
                          "--resume")
    assert "note: the tables' sharding changed (sharding: None there, 'auto' now)" in \
        "\n".join(lines)
    for key in ("examples", "test_auc", "test_logloss"):
        assert resumed[key] == pytest.approx(straight[key], abs=1e-6), key


def test_resume_takes_new_learning_rates(tmp_path, capsys, monkeypatch):
    """--embedding-lr and --lr may change on resume: the engine built on resume trains the
    tables at the new rate, the dense part's optimizer at the new --lr (not the checkpoint's),
    and notes say so."""
    models = []

    class Recorded(train.DLRM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            models.append(self)

    monkeypatch.setattr(train, "DLRM", Recorded)
    out = tmp_path / "run"
    argv = ["--synthetic", "--synthetic-lines", "320", "--out", str(out), *TINY]
    train.main(argv)  # --embedding-lr 0.05, --lr 0.05
    capsys.readouterr()
    resumed = train.main([*argv, "--resume", "--epochs", "2", "--embedding-lr", "0.2",
                          "--lr", "0.1"])  # (the last of a flag given twice counts)
    lines = capsys.readouterr().out.splitlines()
    assert resumed["epoch"] == 2 and LAST_LINE.fullmatch(lines[-1])
    assert "note: the tables' learning rate changed (optimizer.learning_rate: 0.05 there, 0.2 " \
           "now); the resumed run uses the new one" in lines
    assert "note: the dense part's learning rate changed (--lr): 0.05 there, 0.1 now; the " \
           "resumed run uses 0.1" in lines
    engine = models[-1].embedding.engine
    assert models[-1].spec.optimizer.learning_rate == 0.2
    assert engine.manifest()["spec"]["optimizer"]["learning_rate"] == 0.2
    assert {t["optimizer"] for t in engine.manifest()["tables"].values()} \
        == {"Adagrad(learning_rate=0.2, initial_accumulator_value=0.0)"}
    dense = torch.load(_newest(out) / "dense.pt", weights_only=True)
    assert {g["lr"] for g in dense["optimizer"]["param_groups"]} == {0.1}
    manifest = _newest_manifest(out)
    assert manifest["step"] == 10 and manifest["spec"]["optimizer"]["learning_rate"] == 0.2


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
                         "--memory-budget", "200KB", "--offload-dir", str(tmp_path / "slow"))
    assert any("slow tier" in s for s in lines)
    assert budget["test_auc"] == plain["test_auc"]
    assert budget["test_logloss"] == plain["test_logloss"]
    _run(capsys, *base, "--epochs", "1", "--out", str(tmp_path / "c"), "--memory-budget", "220KB")
    resumed, _ = _run(capsys, *base, "--epochs", "2", "--out", str(tmp_path / "c"), "--resume")
    assert resumed["test_auc"] == plain["test_auc"]


def _without_timings(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(s).items() if "per_s" not in k and k != "eval_seconds"}
            for s in path.read_text().splitlines()]


@pytest.mark.parametrize("tables", [["--capacity", "0.5", "--embedding-optimizer",
                                     "rowwise_adagrad"], ["--hash-buckets", "50"]])
def test_a_spec_file_trains_as_the_flags_that_wrote_it(tmp_path, capsys, tables):
    data = tmp_path / "data"
    generate(data, train_lines=400, test_lines=100, scale=1e-4, seed=4)
    flags = ["--data", str(data), *tables]
    file = tmp_path / "spec.json"
    wrote, lines = _run(capsys, *flags, "--write-spec", str(file), "--out", str(tmp_path / "w"))
    assert wrote == {"spec": str(file)} and "wrote the tables' spec" in lines[-1]
    assert not (tmp_path / "w").exists()  # nothing trained
    spec = train.read_spec(file)
    assert file.read_text() == train.spec_json(spec)  # a line per table and per feature
    config = config_from_spec(spec, **train.dense_sizes(train.parse_args(["--synthetic",
                                                                          *TINY])))
    assert config.dim == 4 and config.raw_ids == ("--capacity" in tables)
    assert spec.optimizer.learning_rate == 0.05
    by_flags, _ = _run(capsys, *flags, "--out", str(tmp_path / "a"), "--checkpoint-every", "2")
    by_spec = train.main(["--data", str(data), "--spec", str(file), "--out", str(tmp_path / "b"),
                          *TINY_DENSE])
    assert by_spec["test_auc"] == by_flags["test_auc"]
    assert by_spec["test_logloss"] == by_flags["test_logloss"]
    assert _without_timings(tmp_path / "a" / "metrics.jsonl") \
        == _without_timings(tmp_path / "b" / "metrics.jsonl")
    # Resuming checks the spec (the checkpoint's manifest holds it): the flags' run resumes
    # from the spec (the same), an edited spec is refused.
    resumed, _ = _run(capsys, *flags, "--out", str(tmp_path / "b"), "--resume", "--epochs", "2")
    assert resumed["epoch"] == 2
    edited = json.loads(file.read_text())
    edited["optimizer"]["learning_rate"] = 0.1
    edited["tables"]["C7"]["initializer"] = {"torch.nn.init": "zeros_", "kwargs": {}}
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match=r"another spec of the tables \(tables\.C7\.initializer:"
                                         r" None there, [^;]*\); resume with the same spec"):
        train.main(["--data", str(data), "--spec", str(tmp_path / "edited.json"), "--out",
                    str(tmp_path / "b"), "--resume", "--epochs", "3", *TINY_DENSE])
    # ... but for its learning rate: the file's wins
    del edited["tables"]["C7"]["initializer"]
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    again = train.main(["--data", str(data), "--spec", str(tmp_path / "edited.json"), "--out",
                        str(tmp_path / "b"), "--resume", "--epochs", "3", *TINY_DENSE])
    assert again["epoch"] == 3
    assert "note: the tables' learning rate changed (optimizer.learning_rate: 0.05 there, 0.1 " \
           "now)" in capsys.readouterr().out
    assert _newest_manifest(tmp_path / "b")["spec"]["optimizer"]["learning_rate"] == 0.1


def test_spec_errors(tmp_path, capsys):
    data = tmp_path / "data"
    generate(data, train_lines=100, test_lines=30, scale=1e-4, seed=4)
    good = embedding_spec(ModelConfig(capacities=(50,) * 26, dim=4, raw_ids=False),
                          ec.Adagrad(learning_rate=0.1)).to_dict()

    def error(spec, *extra) -> str:
        file = tmp_path / "s.json"
        file.write_text(spec if isinstance(spec, str) else json.dumps(spec))
        assert train.cli(["--data", str(data), "--spec", str(file), "--out",
                          str(tmp_path / "r"), *TINY_DENSE, *extra]) == 1
        return capsys.readouterr().err

    def edited(edit) -> dict:
        d = json.loads(json.dumps(good))
        edit(d)
        return d

    assert "table 'C26' is used by no feature" in error(  # (the spec's own check)
        edited(lambda d: d["features"].pop("C26")))
    assert "features must be C1 ... C26 (the Criteo columns): missing ['C26']" in error(
        edited(lambda d: (d["features"].pop("C26"), d["tables"].pop("C26"))))
    assert "missing ['C2']; unexpected ['C27', 'c2']" in error(edited(
        lambda d: d["features"].update(c2=d["features"].pop("C2"), C27=d["features"]["C1"])))
    message = error(edited(lambda d: d["tables"]["C3"].update(dim=8)))
    assert "one dim D for all 26 tables; the spec has dim 4: C1, C2, C4," in message
    assert "C26; dim 8: C3" in message
    assert "mixes dynamic tables (raw ids: C5)" in error(edited(
        lambda d: d["tables"]["C5"].update(dynamic={"eviction": "lfu"})))
    assert "feature 'C1': its table has no optimizer" in error(edited(
        lambda d: d.update(optimizer=None)))
    assert "feature 'C4': the job looks up one id per example" in error(edited(
        lambda d: d["features"]["C4"]["__feature__"].update(max_sequence_length=3)))
    assert "not JSON" in error("{")
    assert "not an embcore spec" in error({"tables": {}})
    assert train.cli(["--data", str(data), "--spec", str(tmp_path / "none.json")]) == 1
    assert "cannot read it" in capsys.readouterr().err
    for argv, message in ((["--spec", "s.json", "--dim", "8"], "leave out --dim"),
                          (["--spec", "s.json", "--hash-buckets", "8", "--sharding", "table"],
                           "leave out --hash-buckets, --sharding"),
                          (["--spec", "s.json", "--write-spec", "t.json"], "none to write"),
                          ([], "either --data")):
        with pytest.raises(SystemExit):
            train.parse_args(["--synthetic", *argv] if argv else argv)
        assert message in capsys.readouterr().err
    # --write-spec needs no data unless a fractional --capacity counts ids in it
    with pytest.raises(ValueError, match="counts each feature's distinct ids in the data"):
        train.main(["--write-spec", str(tmp_path / "w.json")])
    assert train.main(["--write-spec", str(tmp_path / "w.json"), "--capacity", "1000"])
    spec = train.read_spec(tmp_path / "w.json")
    assert config_from_spec(spec).capacities == (1000,) * 26 and spec.sharding == "auto"
    train.main(["--write-spec", str(tmp_path / "w.json"), "--hash-buckets", "7", "--dim", "16"])
    assert config_from_spec(train.read_spec(tmp_path / "w.json")) == ModelConfig(
        capacities=(7,) * 26, dim=16, raw_ids=False)


def test_the_shipped_spec_is_kaggles_raw_ids_with_the_jobs_defaults():
    """examples/criteo/spec.json: dynamic tables as large as the distinct values of each column
    of Kaggle's train.txt, D 128, Adagrad at 0.005 from 0 (what --capacity 1.0 counts on
    Kaggle's data, give or take the held-out seventh and the missing value's row)."""
    file = Path(train.__file__).parent / "spec.json"
    spec = train.read_spec(file)
    assert config_from_spec(spec) == ModelConfig(capacities=KAGGLE_CARDINALITIES)
    assert spec.optimizer == ec.Adagrad(learning_rate=0.005, initial_accumulator_value=0.0)
    defaults = train.flags_spec(train.parse_args(["--write-spec", "x", "--capacity", "100"]),
                                None, print)[1]  # the flags' defaults but the capacities
    assert defaults == embedding_spec(ModelConfig(capacities=(100,) * 26), spec.optimizer,
                                      sharding=spec.sharding, memory_budget=spec.memory_budget)
    assert file.read_text() == train.spec_json(spec)


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


@pytest.mark.slow
def test_two_processes_read_their_shares_and_train_as_before(tmp_path, capfd):
    """Each process converts only its examples of each global batch; the run (losses, test
    AUC and log loss, skipped lines) equals the one where every process parses every line and
    keeps every W-th example, with bad lines and a held-out test part; and a run resumed
    mid-epoch ends as the uninterrupted one. Only rank 0 prints."""
    from distributed import free_port, run_on
    data = tmp_path / "data"
    generate(data, train_lines=900, test_lines=10, scale=1e-4, seed=3)
    lines = (data / "train.txt").read_text().splitlines(True)
    for i in (5, 77, 300, 640):  # bad lines 6, 78, 301, 641; line 301 is held out (7 * 43)
        lines[i] = "1\tx\n"
    (data / "train.txt").write_text("".join(lines))
    (data / "test.txt").unlink()  # no test.txt: every 7th line of train.txt is held out

    runs = {}
    for parser in ("reference", "fast"):
        out = tmp_path / parser
        run_on(2, _two_process_worker, str(data), str(out), (free_port(), free_port()), parser)
        runs[parser] = (_without_timings(out / "straight.jsonl"),
                        _without_timings(out / "metrics.jsonl"))
    assert runs["fast"][0] == runs["reference"][0]
    out = capfd.readouterr().out  # (the spawned processes write to the same descriptors)
    assert len(LAST_LINE.findall(out)) == 3, out  # 3 runs (one resumed), rank 0's line each
    assert out.count("model: DLRM-DCNv2") == 3 and out.count("settings: ") == 3, out
    straight, resumed = runs["fast"]
    final = straight[-1]
    assert final["kind"] == "eval" and final["train_skipped"] == 3 and final["test_skipped"] == 1
    assert final["examples"] == 900 - 128 - 3 and final["test_examples"] == 128 - 1
    for key in ("examples", "test_auc", "test_logloss", "test_examples"):
        assert resumed[-1][key] == final[key], key


def _row_mod_raw_ids_worker(rank, world, init, data, out, port):
    """The job under torchrun's variables: raw ids, ``--sharding row_mod`` (``"hash"`` for
    dynamic tables), the default ``--capacity 1.0``."""
    import os
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      LOCAL_RANK=str(rank), MASTER_PORT=str(port))
    train.main(["--data", data, "--out", out, "--sharding", "row_mod", *TINY])


@pytest.mark.slow
def test_raw_ids_hashed_over_two_processes_train_at_capacity_one(tmp_path, capfd):
    """Hashing splits a feature's ids unevenly over the processes (a feature of 2 ids puts
    both on one process half the time), and each process holds capacity / W rows: capacities
    counted over all processes left the busiest one short ("this step admits 2 new ids but the
    shard holds 1 row"). The job counts each process's own ids; the run trains to the end."""
    from distributed import free_port, run_on
    data = tmp_path / "data"
    generate(data, train_lines=600, test_lines=100, scale=1e-4, seed=5)
    run_on(2, _row_mod_raw_ids_worker, str(data), str(tmp_path / "r"), free_port())
    out = capfd.readouterr().out
    assert "hash " in out and len(LAST_LINE.findall(out)) == 1, out


def test_a_fractional_capacity_counts_the_ids_each_process_owns(tmp_path):
    """``--capacity f`` with W processes: W times the most rows any owner needs (f of the ids
    it owns, at least what one batch brings it), so each process's capacity / W rows hold its
    share; with one process, f of the distinct ids (at least the batch size) as before."""
    from criteo.data import distinct_ids
    data = tmp_path / "data"
    generate(data, train_lines=700, test_lines=10, scale=1e-3, seed=6)
    for capacity, batch in ((1.0, 64), (0.5, 64), (1.0, 8)):
        args = train.parse_args(["--data", str(data), "--capacity", str(capacity),
                                 "--batch-size", str(batch)])
        dataset = train.Dataset(args, data, None, None)
        ids = distinct_ids(data / "train.txt", labeled=True, **dataset.common)
        one = train.capacities(args, dataset, print)
        assert one == tuple(max(1, math.ceil(capacity * len(i)), min(len(i), batch))
                            for i in ids)
        for world in (2, 4):
            caps = train.capacities(args, dataset, print, world)
            assert all(c % world == 0 for c in caps)
            for c, i in zip(caps, ids, strict=True):
                owned = torch.bincount(ec.numerics.hashing.owner(torch.from_numpy(i), world),
                                       minlength=world)
                need = [max(1, math.ceil(capacity * n), min(n, batch)) for n in owned.tolist()]
                assert c // world == max(need), (capacity, batch, world, c, owned)
            assert any(c > o for c, o in zip(caps, one, strict=True))  # uneven somewhere


# ------------------------------------------------------------------ the default settings
MLPERF_SETTINGS = {"batch_size": 4096, "embedding_lr": 0.005, "lr": 0.005, "dim": 128,
                   "bottom_mlp": [512, 256, 128], "cross_layers": 3, "cross_rank": 512,
                   "top_mlp": [1024, 1024, 512, 256]}


def _settings(data: Path, tmp_path: Path, *argv: str) -> tuple[dict, str]:
    """The settings the job chooses for ``argv`` on ``data`` (what _run does before training),
    and what it prints about them."""
    args = train.parse_args(["--data", str(data), "--out", str(tmp_path / "r"), *argv])
    lines: list[str] = []
    chosen = train.choose_settings(args, train.Dataset(args, data, None, None),
                                   args.out / "checkpoints", say=lines.append)
    assert chosen == {k: getattr(args, k) for k in chosen}
    return chosen, "\n".join(lines)


def test_the_derived_settings_scale_mlperfs_with_the_training_lines():
    """r = sqrt(lines / 3e7) to the nearest power of two (in log scale), 1/32 ... 1: the batch
    times r, the tables' rate over r, the sizes times max(r, 1/4), the dense rate MLPerf's; from
    15M lines on (Kaggle's train.txt less its held-out seventh, the 1TB logs) MLPerf's."""
    derived = train.derived_settings
    assert train.MLPERF == MLPERF_SETTINGS
    for lines in (15_000_000, 45_840_617 * 6 // 7, 45_840_617, 4_000_000_000):
        assert derived(lines) == MLPERF_SETTINGS, lines
    quarter = {"dim": 32, "bottom_mlp": [128, 64, 32], "cross_layers": 3, "cross_rank": 128,
               "top_mlp": [256, 256, 128, 64], "lr": 0.005}
    assert derived(400_000) == {**quarter, "batch_size": 512, "embedding_lr": 0.04}
    assert derived(100_000) == {**quarter, "batch_size": 256, "embedding_lr": 0.08}
    assert derived(1_000_000) == {**quarter, "batch_size": 1024, "embedding_lr": 0.02}
    assert derived(5_000_000) == {"batch_size": 2048, "embedding_lr": 0.01, "lr": 0.005,
                                  "dim": 64, "bottom_mlp": [256, 128, 64], "cross_layers": 3,
                                  "cross_rank": 256, "top_mlp": [512, 512, 256, 128]}
    assert derived(1) == derived(20_000) == {**quarter, "batch_size": 128, "embedding_lr": 0.16}
    # the boundaries: sqrt(lines / 3e7) = 2**(k - 1/2)
    for k, first in enumerate((15_000_000, 3_750_000, 937_500, 234_375, 58_594)):
        assert train.scale_exponent(first) == -k and train.scale_exponent(first - 1) == -k - 1


def test_defaults_are_derived_from_the_data_and_mlperf_is_one_flag_away(tmp_path):
    """Without size flags the job derives its settings from the training lines it counts
    (printed with the rule); --mlperf gives MLPerf's exactly; a flag given wins over both;
    without data (--write-spec alone) the settings are MLPerf's."""
    data = tmp_path / "data"
    generate(data, train_lines=700, test_lines=10, scale=1e-4, seed=0)
    (data / "test.txt").unlink()  # every 7th line held out: 600 training lines
    derived, said = _settings(data, tmp_path)
    assert derived == train.derived_settings(600) != MLPERF_SETTINGS
    assert (derived["batch_size"], derived["embedding_lr"], derived["dim"]) == (128, 0.16, 32)
    assert said.startswith("settings: batch 128, tables' rate 0.16, dense rate 0.005, D 32, "
                           "bottom 128-64-32, cross layers 3, cross rank 128, top "
                           "256-256-128-64\n  all: derived from the 600 training lines: r = "
                           "1/32"), said
    assert "--mlperf gives MLPerf's" in said
    mlperf, said = _settings(data, tmp_path, "--mlperf")
    assert mlperf == MLPERF_SETTINGS and "--mlperf: MLPerf DLRM-DCNv2's" in said
    argv = ["--batch-size", "64", "--lr", "0.02", "--dim", "8", "--cross-rank", "16"]
    for base in (["--mlperf"], []):
        given, said = _settings(data, tmp_path, *base, *argv)
        expected = MLPERF_SETTINGS if base else derived
        assert given == {**expected, "batch_size": 64, "lr": 0.02, "dim": 8, "cross_rank": 16}
        assert "given: --batch-size, --lr, --dim, --cross-rank (a flag given wins)" in said
    # the logistic regression: D 1 and no MLP, its batch and rates derived the same way
    logreg, _ = _settings(data, tmp_path, "--model", "logreg")
    assert logreg == {"batch_size": 128, "embedding_lr": 0.16, "lr": 0.005}
    # no data: MLPerf's (and parse_args alone leaves MLPerf's)
    args = train.parse_args(["--write-spec", str(tmp_path / "s.json"), "--capacity", "9"])
    assert {k: getattr(args, k) for k in MLPERF_SETTINGS} == MLPERF_SETTINGS
    assert train.choose_settings(args, None, tmp_path, say=lambda *a: None) == MLPERF_SETTINGS
    with pytest.raises(SystemExit):
        train.parse_args(["--synthetic", "--mlperf", "--batch-size", "0"])


def test_a_run_trains_with_its_derived_settings_and_resumes_with_them(tmp_path, capsys,
                                                                      monkeypatch):
    """A run without size flags builds the derived model and rates and records them in its
    checkpoints; a resumed run takes the checkpoint's settings for the flags not given again
    (even where the rule would now derive others), a flag given again wins; a checkpoint from
    before the settings were recorded resumes with MLPerf's (the defaults then)."""
    data = tmp_path / "data"
    generate(data, train_lines=500, test_lines=150, scale=1e-4, seed=1)
    out = tmp_path / "run"
    argv = ["--data", str(data), "--out", str(out), "--no-progress", "--threads", "1",
            "--capacity", "300"]
    first = train.main([*argv, "--checkpoint-every", "2", "--lr", "0.05"])
    lines = capsys.readouterr().out.splitlines()
    assert "settings: batch 128, tables' rate 0.16, dense rate 0.05, D 32, bottom 128-64-32, " \
           "cross layers 3, cross rank 128, top 256-256-128-64" in lines
    assert first["examples"] == 500
    dense = torch.load(_newest(out) / "dense.pt", weights_only=True)
    recorded = {**train.derived_settings(500), "lr": 0.05}
    assert dense["settings"] == recorded
    assert as_model_config(dense["model_config"]) == ModelConfig(
        capacities=(300,) * 26, dim=32, bottom=(128, 64, 32), cross_rank=128,
        top=(256, 256, 128, 64))
    assert dense["run"]["batch_size"] == 128
    assert {g["lr"] for g in dense["optimizer"]["param_groups"]} == {0.05}
    assert _newest_manifest(out)["spec"]["optimizer"]["learning_rate"] == 0.16
    # The rule changes (as in a later version of the job): the resumed run keeps its own.
    monkeypatch.setattr(train, "SCALE_LINES", 500)
    assert train.derived_settings(500) == MLPERF_SETTINGS
    resumed = train.main([*argv, "--resume", "--epochs", "2", "--embedding-lr", "0.3"])
    lines = capsys.readouterr().out.splitlines()
    assert resumed["epoch"] == 2 and resumed["examples"] == 1000
    assert "  given: --embedding-lr (a flag given wins)" in lines
    assert any(s.startswith(f"  the others: the checkpoint's under {out / 'checkpoints'}")
               for s in lines), lines
    assert "note: the tables' learning rate changed (optimizer.learning_rate: 0.16 there, " \
           "0.3 now); the resumed run uses the new one" in lines
    assert not any("dense part's learning rate changed" in s for s in lines)  # 0.05 kept
    dense = torch.load(_newest(out) / "dense.pt", weights_only=True)
    assert dense["settings"] == {**recorded, "embedding_lr": 0.3}
    # --mlperf on resume: MLPerf's batch, not the checkpoint's (refused, naming it)
    with pytest.raises(ValueError, match="batch_size: 128 there, 4096 now"):
        train.main([*argv, "--resume", "--epochs", "3", "--mlperf"])
    # A checkpoint from before the settings were recorded: MLPerf's were the defaults then.
    del dense["settings"]
    torch.save(dense, _newest(out) / "dense.pt")
    assert train.checkpoint_settings(out / "checkpoints") == MLPERF_SETTINGS
    with pytest.raises(ValueError, match="batch_size: 128 there, 4096 now"):
        train.main([*argv, "--resume", "--epochs", "3"])
    again = train.main([*argv, "--resume", "--epochs", "3", "--batch-size", "128", "--dim",
                        "32", "--bottom-mlp", "128", "64", "32", "--cross-rank", "128",
                        "--top-mlp", "256", "256", "128", "64"])
    assert again["epoch"] == 3


@pytest.mark.slow
def test_the_defaults_train_small_data_as_well_as_a_tuned_logistic_regression(tmp_path):
    """The job's defaults on --synthetic's 20,000 lines (MLPerf's settings left the model at
    chance there, AUC 0.46-0.52): within 0.005 of the logistic-regression baseline at its best
    rate on this data (0.1) and at most 0.05 below the best achievable AUC."""
    common = ["--synthetic", "--no-progress", "--threads", "1"]
    dcn = train.main([*common, "--out", str(tmp_path / "dcn")])
    logreg = train.main([*common, "--out", str(tmp_path / "lr"), "--model", "logreg", "--lr",
                         "0.1", "--embedding-lr", "0.1"])
    assert dcn["test_auc"] > logreg["test_auc"] - 0.005, (dcn["test_auc"], logreg["test_auc"])
    assert dcn["test_auc"] > dcn["best_test_auc"] - 0.05


def test_the_exchange_compression_flags_go_into_the_spec(capsys):
    args = train.parse_args(["--write-spec", "x", "--capacity", "100",
                             "--exchange-compression", "bf16,fp8", "--no-error-feedback"])
    spec = train.flags_spec(args, None, print)[1]
    assert spec.to_dict()["exchange_compression"] == {"forward": "bf16", "backward": "fp8",
                                                      "error_feedback": False}
    assert train.parse_args(["--synthetic"]).exchange == ec.ExchangeCompression()
    with pytest.raises(SystemExit):
        train.parse_args(["--synthetic", "--exchange-compression", "fp4"])
    assert "--exchange-compression: exchange compression 'fp4'" in capsys.readouterr().err


def test_more_processes_than_gpus_is_a_clear_error_before_any_collective(monkeypatch):
    """torchrun with 2 processes on a machine with one GPU (issue 54): the process without a GPU
    of its own stops at once, naming the fix, before any process group is made."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    made = []
    monkeypatch.setattr(train.dist, "init_process_group", lambda *a, **k: made.append(a))
    with pytest.raises(SystemExit, match=r"process 1 .* run --nproc-per-node 1 or fewer"):
        train.init_processes("cuda")
    assert not made
