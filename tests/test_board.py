"""The jobs' ``--tensorboard DIR``: metrics.jsonl's records as TensorBoard scalars
(examples/board.py), read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import board  # noqa: E402  (examples/board.py)

accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard package is not installed (pip install -e '.[examples]')")


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for ``directory``: {tag: [(step, value)]}, step order."""
    acc = accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_records_become_scalars_under_their_kind_once_each(tmp_path):
    b = board.Board(tmp_path, skip=("epoch",))
    history = [{"kind": "train", "step": 10, "epoch": 1, "loss": 0.5, "synthetic": True,
                "data": "x", "vocabulary": {"a": 1}}]
    b.write(history)
    history += [{"kind": "train", "step": 20, "epoch": 1, "loss": 0.25},
                {"kind": "eval", "step": 20, "epoch": 1, "test_auc": 0.75,
                 "nan": float("nan")}]
    b.write(history)
    b.write(history)  # nothing new: nothing written twice
    b.close()
    assert scalars(tmp_path) == {"train/loss": [(10, 0.5), (20, 0.25)],
                                 "eval/test_auc": [(20, 0.75)]}


def test_a_resumed_run_shows_each_step_once(tmp_path):
    first = board.Board(tmp_path, step="epoch", kind="epoch")
    first.write([{"epoch": e, "rmse": 1.0 / e} for e in (1, 2, 3)])
    first.close()  # the run stops after epoch 3; its checkpoint had epochs 1 and 2
    again = board.Board(tmp_path, step="epoch", kind="epoch")
    again.write([{"epoch": e, "rmse": 2.0 / e} for e in (1, 2)])
    again.write([{"epoch": e, "rmse": 2.0 / e} for e in (1, 2, 3, 4)])
    again.close()
    assert scalars(tmp_path) == {"epoch/rmse": [(e, pytest.approx(2.0 / e)) for e in (1, 2, 3, 4)]}


def test_without_a_directory_nothing_is_written_and_without_the_package_it_says_so(
        tmp_path, monkeypatch):
    b = board.Board(None)
    b.write([{"step": 1, "loss": 1.0}])
    b.close()
    assert b.writer is None
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(SystemExit, match=r"tensorboard package is not installed.*pip install"):
        board.Board(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="cannot be a directory"):  # at the start, not later
        board.Board(tmp_path / "file")


def test_the_stream_job_logs_online_against_frozen(tmp_path, capsys):
    import test_stream
    rows = test_stream._run(tmp_path, "--hours", "3", "--frozen-after", "1",
                            "--tensorboard", str(tmp_path / "tb"))
    got = scalars(tmp_path / "tb")
    steps = [r["step"] for r in rows]
    assert [s for s, _ in got["stream/online_auc"]] == steps
    assert [v for _, v in got["stream/online_auc"]] == pytest.approx(
        [r["online_auc"] for r in rows])
    assert got["stream/frozen_auc"] == [(r["step"], pytest.approx(r["frozen_auc"]))
                                        for r in rows if r["frozen_auc"] is not None]
    assert "stream/seq" not in got and "stream/examples_per_s" in got
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "run" / "auc.png").is_file()
    except ImportError:
        assert "auc.png is not written" in capsys.readouterr().out


def test_the_criteo_job_logs_train_and_eval_by_step(tmp_path, capsys):
    from criteo import train
    out = tmp_path / "run"
    train.main(["--synthetic", "--synthetic-lines", "640", "--out", str(out), "--no-progress",
                "--log-every", "2", "--tensorboard", str(tmp_path / "tb")])
    capsys.readouterr()
    records = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    got = scalars(tmp_path / "tb")
    for kind, field in (("train", "loss"), ("eval", "test_auc")):
        assert got[f"{kind}/{field}"] == [(r["step"], pytest.approx(r[field]))
                                          for r in records if r["kind"] == kind]
    assert not [t for t in got if t.endswith(("/epoch", "/synthetic", "/step"))]


def test_the_movielens_job_logs_by_epoch(tmp_path):
    import test_movielens_train as ml
    out = tmp_path / "run"
    ml.train.main(["--synthetic", "--limit", "2000", "--epochs", "2", "--out", str(out),
                   "--no-serve", "--tensorboard", str(tmp_path / "tb"), *ml.SMALL])
    records = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    got = scalars(tmp_path / "tb")
    assert got["epoch/test_rmse"] == [(r["epoch"], pytest.approx(r["test_rmse"]))
                                      for r in records]
    assert "epoch/epoch" not in got
