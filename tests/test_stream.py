"""The streaming job (examples/stream): the drifting stream, online training with progressive
validation and publishing, resuming exactly, and the HTTP follower answering from one version."""

from __future__ import annotations

import io
import json
import re
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from stream import drift, serve, train  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.formats import published as fmt  # noqa: E402

TINY = ["--lines-per-hour", "600", "--batch-size", "128", "--dim", "4", "--capacity", "400",
        "--ttl-steps", "20", "--bottom", "8", "--top", "8", "--cross-layers", "1",
        "--cross-rank", "4", "--threads", "1", "--publish-every", "1000"]


def test_the_stream_drifts_new_ids_arrive_and_files_land_whole(tmp_path):
    model = drift.DriftingClicks(seed=3)
    _, early, _, _ = model.hour(0, 4000)
    _, late, _, p = model.hour(12, 4000)
    j = int(np.argmax(model.shift))  # the feature that drifts most
    seen = set(early[:, j][early[:, j] >= 0].tolist())
    new = np.mean([v not in seen for v in late[:, j][late[:, j] >= 0].tolist()])
    assert new > 0.5  # most of hour 12's ids were never seen in hour 0
    assert 0.05 < p.mean() < 0.6
    again = drift.DriftingClicks(seed=3).hour(12, 4000)[1]
    assert np.array_equal(again, late)  # the same seed, the same stream
    paths = drift.write_hours(tmp_path, range(2), 50, seed=3)
    assert [p.name for p in paths] == ["part-00000.txt", "part-00001.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert all(len(line.split("\t")) == 40 for line in paths[1].read_text().splitlines())


def _run(tmp_path, *extra):
    return train.main(["--out", str(tmp_path / "run"), *TINY, *extra])


def test_the_job_trains_online_scores_first_and_publishes(tmp_path, capsys):
    rows = _run(tmp_path, "--hours", "4", "--frozen-after", "2")
    out = capsys.readouterr().out
    assert "SYNTHETIC DRIFTING STREAM" in out and "progressive AUC over the 2 files" in out
    assert [r["file"] for r in rows] == [f"part-{h:05d}.txt" for h in range(4)]
    assert all(r["examples"] == 600 for r in rows)
    assert rows[0]["frozen_auc"] is None and rows[2]["frozen_auc"] is not None
    assert all(0.0 < r["online_auc"] < 1.0 for r in rows)
    run = tmp_path / "run"
    kinds = [e.kind for e in fmt.entries(run / "published")]
    assert kinds[0] == "snapshot" and len(kinds) >= 3  # start, the freeze, the end
    assert sorted(p.name for p in (run / "dense").glob("*.pt"))[-1] == f"{len(kinds) - 1:08d}.pt"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["file"] for x in lines] == [r["file"] for r in rows]
    with pytest.raises(SystemExit, match="--resume"):  # a second run into the same --out
        _run(tmp_path, "--hours", "4")


def test_resume_continues_exactly(tmp_path):
    """Four hours in one run, or two and then two more with --resume: the same tables, maps,
    slots and dense part at the end."""
    _run(tmp_path / "a", "--hours", "4", "--frozen-after", "0")
    _run(tmp_path / "b", "--hours", "2", "--frozen-after", "0")
    rows = _run(tmp_path / "b", "--hours", "4", "--frozen-after", "0", "--resume")
    assert [r["file"] for r in rows] == ["part-00002.txt", "part-00003.txt"]
    args = train.parse_args(["--out", str(tmp_path / "x"), *TINY])
    ends = []
    for run in ("a", "b"):
        job = train.Job(args)
        job.published, job.dense_dir = (tmp_path / run / "run" / "published",
                                        tmp_path / run / "run" / "dense")
        job.resume()
        state = job.model.embedding.engine.state_dict()
        ends.append(({k: v.clone() for k, v in state.items()},
                     {k: v.clone() for k, v in job.model.dense_arch.state_dict().items()}))
    (ta, da), (tb, db) = ends
    for k in ta:
        if k.endswith("/parameters") or "/vocabulary/" in k or k == "step":
            assert torch.equal(ta[k], tb[k]), k
    for k in da:
        assert torch.equal(da[k], db[k]), k


def test_the_follower_answers_from_one_version_and_follows(tmp_path):
    _run(tmp_path, "--hours", "2", "--frozen-after", "0")
    run = tmp_path / "run"
    follower = serve.Follower(run)
    first = follower.served.version
    lines = (run / "stream" / "part-00001.txt").read_text().splitlines()[:50]
    scores, version, step = follower.score(lines)
    assert version == first and scores.shape == (50,) and ((0 < scores) & (scores < 1)).all()
    # the same as the trainer's model restored from that entry
    job = train.Job(train.parse_args(["--out", str(run), *TINY]))
    job.resume()
    batch = next(train.read_batches(run / "stream" / "part-00001.txt", 50, labeled=True))
    want = job.score(job.model, torch.from_numpy(batch.dense), torch.from_numpy(batch.sparse))
    np.testing.assert_allclose(scores, want, rtol=1e-6, atol=1e-7)
    assert step == job.model.embedding.engine.step
    # training goes on (resumed); the follower takes the new entries and their dense parts
    _run(tmp_path, "--hours", "3", "--frozen-after", "0", "--resume")
    assert follower.refresh() >= 1 and follower.served.version > first
    _, version, step = follower.score(lines[:3])
    assert version == fmt.entries(run / "published")[-1].seq
    state = torch.load(run / "dense" / f"{version:08d}.pt", weights_only=True)
    assert step == state["step"]
    got = follower.model.dense_arch.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state["dense_arch"].items())


def test_8_bit_rows_train_publish_and_serve(tmp_path):
    """``--dtype float8_e4m3fn``: the tables hold 8-bit rows, published as codes and scales; the
    follower scores as the trainer's model restored from the entry does."""
    _run(tmp_path, "--hours", "2", "--frozen-after", "0", "--dtype", "float8_e4m3fn")
    run = tmp_path / "run"
    follower = serve.Follower(run)
    lines = (run / "stream" / "part-00001.txt").read_text().splitlines()[:50]
    scores, _, _ = follower.score(lines)
    job = train.Job(train.parse_args(["--out", str(run), *TINY, "--dtype", "float8_e4m3fn"]))
    job.resume()
    state = job.model.embedding.engine.state_dict()
    assert state["C1/parameters"].dtype == torch.float8_e4m3fn and "C1/scales" in state
    batch = next(train.read_batches(run / "stream" / "part-00001.txt", 50, labeled=True))
    want = job.score(job.model, torch.from_numpy(batch.dense), torch.from_numpy(batch.sparse))
    np.testing.assert_allclose(scores, want, rtol=1e-6, atol=1e-7)


def _call(application, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else b""
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "CONTENT_LENGTH": str(len(data)),
               "wsgi.input": io.BytesIO(data)}
    status = []
    out = b"".join(application(environ, lambda s, headers: status.append(s)))
    return status[0], json.loads(out)


def test_the_http_app(tmp_path):
    _run(tmp_path, "--hours", "1", "--frozen-after", "0")
    run = tmp_path / "run"
    follower = serve.Follower(run, quantize="int8")
    application = serve.app(follower)
    status, body = _call(application, "GET", "/version")
    assert status == "200 OK" and body["version"] == follower.served.version
    line = (run / "stream" / "part-00000.txt").read_text().splitlines()[0]
    unlabeled = line.split("\t", 1)[1]
    status, body = _call(application, "POST", "/score", {"lines": [line, unlabeled]})
    assert status == "200 OK" and len(body["scores"]) == 2
    assert body["scores"][0] == body["scores"][1]  # the label column is optional
    for bad in ({"lines": ["1\t2"]}, {"rows": []}, [1, 2]):
        status, body = _call(application, "POST", "/score", bad)
        assert status == "400 Bad Request" and body["error"]
    for lines, said in (([line, ""], "line 2 is empty"),
                        (["1\t2"], "line 1 has 2 tab-separated fields; a line to score has 40")):
        status, body = _call(application, "POST", "/score", {"lines": lines})
        assert status == "400 Bad Request" and said in body["error"], body
        assert "file" not in body["error"]  # (the request's terms, not a data file's)
    assert _call(application, "GET", "/nothing")[0] == "404 Not Found"
    assert _call(application, "GET", "/health") == ("200 OK", "ok")


def test_the_readmes_score_command(tmp_path):
    """examples/stream/README.md's curl command, as the shell builds its body: a generated line
    pasted into the JSON with its raw tabs (the server once answered "Invalid control
    character")."""
    readme = (ROOT / "examples" / "stream" / "README.md").read_text()
    found = re.search(r'^ +curl -s -X POST localhost:8080/score -d "(.*)"$', readme, re.M)
    assert found, "the README's /score command"
    template = found.group(1).replace('\\"', '"')  # what the shell passes to curl
    sed = re.search(r"\$\(sed -n 1p ([^)]*)\)", template)
    assert sed and sed.group(1).startswith("runs/stream/stream/part-")
    _run(tmp_path, "--hours", "1", "--frozen-after", "0")
    run = tmp_path / "run"
    line = (run / "stream" / "part-00000.txt").read_text().splitlines()[0]
    assert "\t" in line
    data = template.replace(sed.group(0), line).encode()
    application = serve.app(serve.Follower(run))
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": "/score",
               "CONTENT_LENGTH": str(len(data)), "wsgi.input": io.BytesIO(data)}
    status = []
    body = json.loads(b"".join(application(environ, lambda s, headers: status.append(s))))
    assert status == ["200 OK"], body
    assert len(body["scores"]) == 1 and 0 < body["scores"][0] < 1
    escaped = _call(application, "POST", "/score", {"lines": [line]})[1]  # tabs as \t
    assert escaped["scores"] == body["scores"]


def test_a_server_started_before_the_trainer_waits_for_its_first_publish(tmp_path, capsys):
    """No traceback when nothing is published yet: the server says once that it waits, and
    goes on when the trainer's first publish lands; past --wait it exits saying why."""
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"nothing was published in .*published within --wait "
                                         r"0\.2 s: is the trainer running with --out"):
        serve.main(["--run", str(run), "--wait", "0.2", "--poll", "0.05"])
    assert capsys.readouterr().out.count("waiting for the trainer's first publish") == 1
    for bad in (["--wait", "-1"], ["--poll", "0"]):
        with pytest.raises(SystemExit):
            serve.main(["--run", str(run), *bad])
    result: dict[str, bool] = {}
    waiter = threading.Thread(target=lambda: result.update(
        found=serve.wait_for_publish(run / "published", 300, 0.05)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # waiting, before the trainer starts
    _run(tmp_path, "--hours", "1", "--frozen-after", "0")
    waiter.join(30)
    assert result == {"found": True}
    assert capsys.readouterr().out.count("waiting for the trainer's first publish") == 1
    assert serve.Follower(run).served.version == fmt.entries(run / "published")[-1].seq


def test_the_job_draws_a_bar_per_file_unless_no_progress(tmp_path, capsys):
    _run(tmp_path / "b", "--hours", "2", "--frozen-after", "0", "--no-progress")
    captured = capsys.readouterr()
    assert "part-00000.txt" not in captured.err and "ex/s" not in captured.err
    assert "part-00001.txt: 600 examples" in captured.out  # the results still print
    pytest.importorskip("tqdm", reason="the bar needs tqdm: pip install -e '.[examples]'")
    _run(tmp_path / "a", "--hours", "2", "--frozen-after", "0")
    err = capsys.readouterr().err
    assert "part-00000.txt" in err and "part-00001.txt" in err and "ex/s" in err


def test_bad_flags(tmp_path):
    with pytest.raises(SystemExit):
        train.parse_args(["--follow"])  # --follow needs --input
    with pytest.raises(SystemExit):
        train.parse_args(["--input", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="holds nothing published"):
        _run(tmp_path, "--resume")
    assert ec.__version__


def test_the_job_runs_on_one_thread_by_default_and_restores_torchs(tmp_path, monkeypatch):
    """``--threads`` defaults to 1 (as the MovieLens job), 0 keeps torch's count, and main()
    gives torch its count back when it returns."""
    assert train.parse_args([]).threads == 1
    assert train.parse_args(["--threads", "0"]).threads == 0
    with pytest.raises(SystemExit):
        train.parse_args(["--threads", "-1"])
    seen = []
    real = train._main
    monkeypatch.setattr(train, "_main", lambda args: seen.append(torch.get_num_threads())
                        or real(args))
    before = torch.get_num_threads()
    _run(tmp_path, "--hours", "1", "--frozen-after", "0")
    assert seen == [1] and torch.get_num_threads() == before
