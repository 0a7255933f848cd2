"""Serves the model examples/stream/train.py publishes, over HTTP, following it as it trains.

    python examples/stream/serve.py --run runs/stream --port 8080 [--quantize int8]
    curl -s localhost:8080/version
    curl -s -X POST localhost:8080/score -d '{"lines": ["\\t1\\t5\\t...26 hex ids..."]}'

Started before the trainer's first publish, it waits for it (saying so once; ``--wait``
seconds at most, 0: for ever). A ``Follower`` loads the newest published state
(``ec.load_published(OUT/published)``: the tables, maybe quantized) and the dense part published with it (``OUT/dense/<entry>.pt``), then
refreshes every ``--poll`` seconds: each new entry is applied as one unit, and the dense part of
that entry is switched in the same step (``refresh(on_entry=...)``), so an answer always comes
from one published version, tables and dense part alike. A request is scored while holding the
served module's read lock (``served.reading()``), which a refresh waits for only while it makes
an entry visible.

HTTP (a WSGI app, served by ``waitress`` when installed, ``pip install -e ".[serve]"``; else by
the standard library's ``wsgiref`` in threads, fine for trying it, not for production):

    GET  /version   {"version": entry, "step": training step, "published": unix time of the
                     entry, "refreshed": unix time of the last refresh}
    POST /score     {"lines": [Criteo TSV lines, with or without the label column; their tabs
                    escaped as \t or raw, as the shell pastes a line]}
                    -> {"scores": [click probabilities], "version": ..., "step": ...}
    GET  /health    "ok"
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import embcore as ec  # noqa: E402
from embcore.formats import published as fmt  # noqa: E402
from criteo.data import (  # noqa: E402
    LABELED_FIELDS,
    NUM_DENSE,
    NUM_SPARSE,
    UNLABELED_FIELDS,
    parse_line,
)
from criteo.model import as_model_config, make_dense_arch  # noqa: E402
from criteo.serve import ServingDLRM  # noqa: E402

MAX_LINES = 100_000  # a request scores at most this many lines


class Follower:
    """The newest published model of a run, kept current by ``refresh()``.

    Args:
        run: train.py's ``--out`` (``published/`` and ``dense/``).
        quantize: as ``ec.load_published``'s.
    """

    def __init__(self, run: Path, quantize: Any = None) -> None:
        self.published, self.dense_dir = run / "published", run / "dense"
        self.served = ec.load_published(self.published, quantize=quantize)
        self.model = ServingDLRM(self.served, self._dense(self.served.version))
        self.step = self._manifest(self.served.version)["step"]
        self.published_at = self._manifest(self.served.version)["time"]
        self.refreshed_at = time.time()
        self._lock = threading.Lock()  # one refresh at a time

    def _manifest(self, seq: int) -> dict[str, Any]:
        entry = next(e for e in fmt.entries(self.published) if e.seq == seq)
        return entry.manifest()

    def _dense(self, seq: int) -> torch.nn.Module:
        path = self.dense_dir / f"{seq:08d}.pt"
        state = torch.load(path, map_location="cpu", weights_only=True)
        arch = make_dense_arch(as_model_config(state["model_config"]))
        arch.load_state_dict(state["dense_arch"])
        return arch.eval()

    def refresh(self) -> int:
        """Applies the newer entries (each with its dense part); returns how many."""
        with self._lock:
            pending = {e.seq: e for e in fmt.entries(self.published)
                       if e.seq > self.served.version}
            dense = {}
            for seq in pending:  # read before the switch, which then only swaps references
                try:
                    dense[seq] = self._dense(seq)
                except FileNotFoundError:
                    pass  # (an entry whose dense part is gone: the newest ones have theirs)

            def switch(m: dict[str, Any]) -> None:
                arch = dense.get(m["seq"])
                if arch is None:
                    raise fmt.PublishError(f"no dense part for entry {m['seq']} in "
                                           f"{self.dense_dir}")
                self.model.dense_arch = arch
                self.step, self.published_at = m["step"], m["time"]

            n = self.served.refresh(on_entry=switch)
            self.refreshed_at = time.time()
            return n

    def score(self, lines: list[str]) -> tuple[np.ndarray, int, int]:
        """Click probabilities of Criteo TSV lines, and the version and step that gave them."""
        n = len(lines)
        dense = np.empty((n, NUM_DENSE), dtype=np.float32)
        sparse = np.empty((n, NUM_SPARSE), dtype=np.int64)
        for i, line in enumerate(lines):
            text = line.rstrip("\r\n")
            if not text.strip():
                raise ValueError(f"line {i + 1} is empty: each line to score is a Criteo TSV "
                                 f"line (label optional, 13 counts, 26 categories)")
            fields = text.count("\t") + 1
            if fields not in (LABELED_FIELDS, UNLABELED_FIELDS):
                raise ValueError(f"line {i + 1} has {fields} tab-separated fields; a line to "
                                 f"score has {LABELED_FIELDS} (label, 13 counts, 26 categories) "
                                 f"or {UNLABELED_FIELDS} (the same without the label)")
            try:
                parse_line(line, fields == LABELED_FIELDS, dense[i], sparse[i])
            except ValueError as e:
                raise ValueError(f"line {i + 1}: {e}") from None
        with self.served.reading(), torch.no_grad():  # one version for the whole request
            version, step = self.served.version, self.step
            p = torch.sigmoid(self.model(torch.from_numpy(dense), torch.from_numpy(sparse)))
        return p.double().numpy(), version, step


def app(follower: Follower) -> Any:
    """The WSGI application."""

    def respond(start: Any, status: str, body: Any) -> list[bytes]:
        data = json.dumps(body).encode()
        start(status, [("Content-Type", "application/json"),
                       ("Content-Length", str(len(data)))])
        return [data]

    def application(environ: dict[str, Any], start: Any) -> list[bytes]:
        path, method = environ.get("PATH_INFO", "/"), environ.get("REQUEST_METHOD", "GET")
        if path == "/health" and method == "GET":
            return respond(start, "200 OK", "ok")
        if path == "/version" and method == "GET":
            return respond(start, "200 OK", {"version": follower.served.version,
                                             "step": follower.step,
                                             "published": follower.published_at,
                                             "refreshed": follower.refreshed_at})
        if path == "/score" and method == "POST":
            try:
                size = int(environ.get("CONTENT_LENGTH") or 0)
                # (strict=False: a TSV line pasted into the JSON as it is keeps its raw tabs, as
                # the README's curl command sends it; JSON proper would want them as \t)
                body = json.loads(environ["wsgi.input"].read(size) or b"{}", strict=False)
                lines = body.get("lines") if isinstance(body, dict) else None
                if not isinstance(lines, list) or not all(isinstance(x, str) for x in lines):
                    raise ValueError('the body must be {"lines": [Criteo TSV lines]}')
                if len(lines) > MAX_LINES:
                    raise ValueError(f"at most {MAX_LINES} lines a request, got {len(lines)}")
                scores, version, step = follower.score(lines)
            except (ValueError, json.JSONDecodeError) as e:
                return respond(start, "400 Bad Request", {"error": str(e)})
            return respond(start, "200 OK", {"scores": scores.tolist(), "version": version,
                                             "step": step})
        return respond(start, "404 Not Found", {"error": f"no {method} {path}"})

    return application


def wait_for_publish(published: Path, timeout: float, poll: float = 1.0) -> bool:
    """Waits until ``published`` holds a published entry (the trainer's first publish), saying
    once that it waits; False after ``timeout`` seconds without one (0: waits for ever)."""
    deadline = time.monotonic() + timeout
    said = False
    while not fmt.entries(published):
        if timeout and time.monotonic() >= deadline:
            return False
        if not said:
            limit = f"up to {timeout:g} s" if timeout else "for ever"
            print(f"waiting for the trainer's first publish in {published} ({limit}; --wait)",
                  flush=True)
            said = True
        time.sleep(poll if not timeout else max(0.0, min(poll, deadline - time.monotonic())))
    return True


def follow(follower: Follower, poll: float, stop: threading.Event) -> threading.Thread:
    """Refreshes every ``poll`` seconds in a background thread (errors are printed, and the
    last good version keeps serving)."""

    def loop() -> None:
        while not stop.wait(poll):
            try:
                n = follower.refresh()
                if n:
                    print(f"serving entry {follower.served.version} (step {follower.step}), "
                          f"{time.time() - follower.published_at:.2f} s after it was published",
                          flush=True)
            except (ValueError, OSError) as e:
                print(f"refresh failed, still serving entry {follower.served.version}: {e}",
                      file=sys.stderr, flush=True)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", type=Path, default=Path("runs/stream"), help="train.py's --out")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--poll", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--quantize", choices=["int8", "fp16"], default=None)
    p.add_argument("--threads", type=int, default=4, help="request threads")
    p.add_argument("--wait", type=float, default=600.0,
                   help="seconds to wait for the trainer's first publish (0: for ever)")
    args = p.parse_args(argv)
    if not args.poll > 0:
        p.error(f"--poll must be > 0 seconds, got {args.poll}")
    if not args.wait >= 0:
        p.error(f"--wait must be >= 0 seconds (0: for ever), got {args.wait}")
    published = args.run / "published"
    if not wait_for_publish(published, args.wait, args.poll):
        raise SystemExit(f"nothing was published in {published} within --wait {args.wait:g} s: "
                         f"is the trainer running with --out {args.run}? (--wait 0 waits for "
                         f"ever)")
    follower = Follower(args.run, quantize=args.quantize)
    print(f"serving entry {follower.served.version} (step {follower.step}) of "
          f"{follower.published} on http://{args.host}:{args.port}", flush=True)
    stop = threading.Event()
    follow(follower, args.poll, stop)
    application = app(follower)
    try:
        import waitress
    except ImportError:
        waitress = None
    try:
        if waitress is not None:
            waitress.serve(application, host=args.host, port=args.port, threads=args.threads)
        else:
            from socketserver import ThreadingMixIn
            from wsgiref.simple_server import WSGIServer, make_server

            class Threaded(ThreadingMixIn, WSGIServer):
                daemon_threads = True

            print("(waitress is not installed: the standard library's wsgiref serves; "
                  "pip install waitress for production)", flush=True)
            make_server(args.host, args.port, application, server_class=Threaded).serve_forever()
    finally:
        stop.set()


if __name__ == "__main__":
    main()
