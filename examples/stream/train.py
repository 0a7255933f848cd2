"""Trains the DLRM of examples/criteo online, on a stream of click logs, publishing as it goes.

    python examples/stream/train.py --out runs/stream                 # a generated drifting stream
    python examples/stream/train.py --input /data/landing --follow --out runs/stream
    python examples/stream/serve.py --run runs/stream --port 8080     # another process: serves it

The stream is a directory that Criteo-format files (``label, I1..I13, C1..C26``, tab-separated,
``.gz`` allowed) land in, hourly or daily partitions as a data pipeline writes them: the files
are trained on in name order, each once, a file being complete once it is there under its final
name (pipelines write ``.name.tmp`` and rename; names starting with ``.`` or ending in ``.tmp``
are ignored). With ``--follow`` the job waits for more files (until ``--idle-exit`` seconds pass
without one). Without ``--input`` it trains on a SYNTHETIC drifting stream
(examples/stream/drift.py: new ids arrive every hour, old ones fade, click rates follow a daily
cycle) written hour by hour to ``OUT/stream``, and says so.

The model: examples/criteo's DLRM-DCNv2 (smaller default sizes, flags below) on 26 raw-id tables
(``ec.DynamicVocabulary`` with LRU eviction and ``--ttl-steps``: ids unused that long leave).
Each batch is first **scored** (lookups without admission: ids never seen read zeros), then
trained on: the scores form the **progressive validation** metric of online learning (every
example is predicted before the model has learned from it), reported as the AUC of each file.
From ``--frozen-after`` files on, each batch is also scored by the model as it was then,
frozen: the same model trained on the first part of the stream only.

Every ``--publish-every`` seconds (and at the end) the tables go out with ``ec.publish`` (a
delta of the rows changed since the last one; with their optimizer slots, so that ``--resume``
continues exactly) and the dense part with them:

    OUT/published/          ec.publish's directory: snapshots and deltas (serve.py follows it)
    OUT/dense/00000012.pt   the dense part (and the optimizer, the stream position) of entry 12
    OUT/metrics.jsonl       one line per file: examples, progressive AUC (online, frozen),
                            examples/s, the entry published after it
    OUT/auc.png             the progressive AUC per file, online against frozen (matplotlib)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import embcore as ec  # noqa: E402
from embcore.formats import published as fmt  # noqa: E402
from board import Board  # noqa: E402  (examples/board.py)
from criteo.data import read_batches  # noqa: E402
from criteo.metrics import roc_auc  # noqa: E402
from criteo.model import DLRM, FEATURES, config_from_spec  # noqa: E402
from criteo.serve import ServingDLRM  # noqa: E402
from stream.drift import NOTE, write_hours  # noqa: E402

try:  # optional: a progress bar per file
    from tqdm import tqdm
except ImportError:
    tqdm = None

DENSE_KEPT = 8  # dense files kept beside the published entries
# --dtype: the tables' rows (TableConfig(dtype=...)), as examples/criteo/train.py's
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", type=Path, default=None,
                   help="the directory files land in (none: a generated drifting stream)")
    p.add_argument("--follow", action="store_true", help="wait for more files in --input")
    p.add_argument("--idle-exit", type=float, default=600.0,
                   help="with --follow: stop after this many seconds without a new file")
    p.add_argument("--out", type=Path, default=Path("runs/stream"))
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/published (and OUT/dense): the files done are "
                        "skipped, a file half done continues where it stopped")
    p.add_argument("--hours", type=int, default=24, help="generated stream: hours")
    p.add_argument("--lines-per-hour", type=int, default=20000, help="generated stream")
    p.add_argument("--scale", type=float, default=0.001, help="generated stream: cardinalities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="the tables' rows: float16 / bfloat16 compact 16-bit rows, "
                        "float8_e4m3fn / float8_e5m2 8-bit rows with a float32 scale each "
                        "(published as codes and scales; the follower serves their values)")
    p.add_argument("--capacity", type=int, default=20000, help="ids resident per table")
    p.add_argument("--ttl-steps", type=int, default=2000,
                   help="ids unused for this many steps are evicted")
    p.add_argument("--bottom", type=int, nargs="+", default=[64, 32])
    p.add_argument("--top", type=int, nargs="+", default=[64, 32])
    p.add_argument("--cross-layers", type=int, default=2)
    p.add_argument("--cross-rank", type=int, default=32)
    p.add_argument("--embedding-lr", type=float, default=0.05)
    p.add_argument("--dense-lr", type=float, default=0.002)
    p.add_argument("--publish-every", type=float, default=10.0, help="seconds")
    p.add_argument("--frozen-after", type=int, default=4,
                   help="files after which a frozen copy is also scored (0: none)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch's ops (torch.set_num_threads; 0: torch's default). "
                        "One suits this small model, as the MovieLens job's: beside busy "
                        "processes, on two cores, torch's default made a run 115 s against 30 s")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a tqdm progress bar per file (when tqdm is installed)")
    p.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="also log metrics.jsonl's lines to TensorBoard in DIR, by step, with "
                        "the progressive AUC online against frozen on one chart (needs the "
                        "tensorboard package)")
    args = p.parse_args(argv)
    for name in ("batch_size", "dim", "capacity", "ttl_steps", "hours", "lines_per_hour"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.follow and args.input is None:
        p.error("--follow watches --input: give the directory files land in")
    if args.input is not None and not args.input.is_dir():
        p.error(f"--input {args.input} is not a directory")
    if not args.publish_every > 0:
        p.error("--publish-every must be > 0 seconds")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    return args


def spec_of(args: argparse.Namespace) -> ec.EmbeddingSpec:
    vocab = ec.DynamicVocabulary(eviction="lru", ttl_steps=args.ttl_steps)
    features = {name: ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=args.capacity, dim=args.dim, name=name, dynamic=vocab,
        dtype=DTYPES[args.dtype]), name=name)
        for name in FEATURES}
    return ec.EmbeddingSpec(features, ec.Adagrad(learning_rate=args.embedding_lr,
                                                 initial_accumulator_value=0.0))


def landed(directory: Path) -> list[Path]:
    """The complete files of ``directory``, in name order."""
    return sorted(p for p in directory.iterdir() if p.is_file()
                  and not p.name.startswith(".") and not p.name.endswith(".tmp"))


class Stream:
    """The files to train on, in order: landed ones, or generated hours."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = args.input if args.input is not None else args.out / "stream"
        self.generated = args.input is None

    def files(self, done: set[str]) -> Iterator[Path]:
        args = self.args
        if self.generated:
            for h in range(args.hours):
                path = self.dir / f"part-{h:05d}.txt"
                if path.name in done:
                    continue
                if not path.exists():
                    write_hours(self.dir, range(h, h + 1), args.lines_per_hour,
                                scale=args.scale, seed=args.seed)
                yield path
            return
        idle = time.monotonic()
        while True:
            new = [p for p in landed(self.dir) if p.name not in done]
            for path in new:
                yield path
                done.add(path.name)
                idle = time.monotonic()
            if new:
                continue
            if not self.args.follow or time.monotonic() - idle > self.args.idle_exit:
                return
            time.sleep(0.5)


class Job:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        spec = spec_of(args)
        self.config = config_from_spec(spec, bottom=tuple(args.bottom), top=tuple(args.top),
                                       cross_layers=args.cross_layers,
                                       cross_rank=args.cross_rank)
        torch.manual_seed(args.seed)
        self.model = DLRM(self.config, spec=spec)
        self.opt = torch.optim.Adagrad(self.model.dense_arch.parameters(), lr=args.dense_lr)
        self.published, self.dense_dir = args.out / "published", args.out / "dense"
        self.position: dict[str, Any] = {"done": [], "file": None, "lines": 0}
        self.frozen: torch.nn.Module | None = None
        self.last_publish = time.monotonic()
        self.publishes: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------ publish / resume
    def publish(self) -> dict[str, Any]:
        """Publishes the tables and, first, the dense part under the entry's number."""
        self.dense_dir.mkdir(parents=True, exist_ok=True)
        found = fmt.entries(self.published)
        seq = found[-1].seq + 1 if found else 0
        state = {"dense_arch": self.model.dense_arch.state_dict(),
                 "optimizer": self.opt.state_dict(), "position": self.position,
                 "model_config": asdict(self.config), "step": self.model.embedding.engine.step}
        final = self.dense_dir / f"{seq:08d}.pt"
        tmp = final.with_name(f".{final.name}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, final)
        info = ec.publish(self.published, self.model.embedding, slots=True)
        assert info["seq"] == seq, (info["seq"], seq)
        for old in sorted(self.dense_dir.glob("*.pt"))[:-DENSE_KEPT]:
            old.unlink()
        self.last_publish = time.monotonic()
        self.publishes.append({k: info[k] for k in ("seq", "kind", "bytes", "seconds")})
        return info

    def resume(self) -> None:
        manifest = ec.load(self.published, self.model.embedding)  # tables, slots, maps, step
        state = torch.load(self.dense_dir / f"{manifest['seq']:08d}.pt", weights_only=True)
        self.model.dense_arch.load_state_dict(state["dense_arch"])
        self.opt.load_state_dict(state["optimizer"])
        self.position = state["position"]
        print(f"resumed from entry {manifest['seq']} (step {manifest['step']}): "
              f"{len(self.position['done'])} files done"
              + (f", {self.position['file']} from line {self.position['lines']}"
                 if self.position["file"] else ""))

    # ------------------------------------------------------------------------ the stream
    def score(self, model: torch.nn.Module, dense: torch.Tensor,
              sparse: torch.Tensor) -> np.ndarray:
        model.eval()
        with torch.no_grad():
            p = torch.sigmoid(model(dense, sparse)).double().numpy()
        model.train()
        return p

    def train_file(self, path: Path) -> dict[str, Any]:
        args = self.args
        start_after = self.position["lines"] if self.position["file"] == path.name else 0
        self.position.update(file=path.name, lines=start_after)
        labels, online, frozen = [], [], []
        t0, n = time.perf_counter(), 0
        bar = (tqdm(desc=path.name, unit="ex", unit_scale=True, leave=False, dynamic_ncols=True)
               if tqdm is not None and args.progress else None)
        for batch in read_batches(path, args.batch_size, labeled=True, start_after=start_after):
            dense, sparse = torch.from_numpy(batch.dense), torch.from_numpy(batch.sparse)
            label = torch.from_numpy(batch.label)
            online.append(self.score(self.model, dense, sparse))  # before training on it
            if self.frozen is not None:
                frozen.append(self.score(self.frozen, dense, sparse))
            labels.append(batch.label)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                self.model(dense, sparse), label)
            self.opt.zero_grad()
            loss.backward()  # the tables' rows are updated by the engine here
            self.opt.step()
            n += len(label)
            if bar is not None:
                bar.update(len(label))
                bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            self.position["lines"] += len(label)
            if time.monotonic() - self.last_publish >= args.publish_every:
                self.publish()
        seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        self.position["done"].append(path.name)
        self.position.update(file=None, lines=0)
        y = np.concatenate(labels) if labels else np.zeros(0)
        row = {"file": path.name, "examples": n, "examples_per_s": n / max(seconds, 1e-9),
               "step": self.model.embedding.engine.step,
               "online_auc": _auc(y, online), "frozen_auc": _auc(y, frozen) if frozen else None,
               "ctr": float(y.mean()) if y.size else None}
        return row

    def freeze(self) -> None:
        """The model as published now, never refreshed: the frozen baseline."""
        self.publish()
        served = ec.load_published(self.published)
        self.frozen = ServingDLRM(served, copy.deepcopy(self.model.dense_arch))


def _auc(y: np.ndarray, scores: list[np.ndarray]) -> float | None:
    if not scores or y.size == 0 or y.min() == y.max():
        return None
    return roc_auc(y, np.concatenate(scores))


def plot_auc(out: Path) -> bool:
    """auc.png: each file's progressive AUC, online against frozen, in stream order (over every
    run of OUT/metrics.jsonl: a resumed job's files follow its predecessor's). False: no
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(line) for line in
            (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("online_auc", "online (trained as it goes)"),
                       ("frozen_auc", "frozen (trained on the first files only)")):
        points = [(i, r[key]) for i, r in enumerate(rows) if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), "o-", markersize=3, label=label)
    ax.set_xlabel("file of the stream (in order)")
    ax.set_ylabel("progressive AUC")
    ax.set_title("Online learning on a stream (embcore)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "auc.png", dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)  # main() may be called from a larger program


def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    job = Job(args)
    stream = Stream(args)
    if stream.generated:
        print(f"*** {NOTE} ***")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        if not fmt.is_publish_dir(job.published):
            raise SystemExit(f"--resume: {job.published} holds nothing published")
        job.resume()
    elif fmt.is_publish_dir(job.published):
        raise SystemExit(f"{job.published} holds a run already: --resume continues it, or "
                         f"choose another --out")
    else:
        job.publish()  # the snapshot a server can start from
    rows: list[dict[str, Any]] = []
    board = Board(args.tensorboard, kind="stream", skip=("seq",))
    board.together("progressive AUC: online against frozen",
                   ["stream/online_auc", "stream/frozen_auc"])
    done = set(job.position["done"])
    with open(args.out / "metrics.jsonl", "a", encoding="utf-8") as metrics:
        for i, path in enumerate(stream.files(done), start=len(done)):
            if args.frozen_after and i == args.frozen_after and job.frozen is None:
                job.freeze()
            row = job.train_file(path)
            row["seq"] = job.publishes[-1]["seq"] if job.publishes else None
            rows.append(row)
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            board.write(rows)
            frozen = (f", frozen {row['frozen_auc']:.4f}" if row["frozen_auc"] is not None
                      else "")
            online = f"{row['online_auc']:.4f}" if row["online_auc"] is not None else "n/a"
            print(f"{path.name}: {row['examples']:,} examples, progressive AUC online {online}"
                  f"{frozen}; {row['examples_per_s']:,.0f} examples/s; step {row['step']}; "
                  f"published up to entry {row['seq']}", flush=True)
    board.close()
    if not plot_auc(args.out):
        print("auc.png is not written: matplotlib is not installed")
    info = job.publish()
    sizes = [p["bytes"] for p in job.publishes if p["kind"] == "delta"]
    print(f"published {len(job.publishes)} entries to {job.published} (the last: {info['kind']} "
          f"{info['seq']} at step {info['step']}); deltas {np.mean(sizes) / 2**20:.1f} MiB on "
          f"average" if sizes else f"published {len(job.publishes)} entries")
    both = [r for r in rows if r["frozen_auc"] is not None and r["online_auc"] is not None]
    if both:
        on = float(np.mean([r["online_auc"] for r in both]))
        fr = float(np.mean([r["frozen_auc"] for r in both]))
        print(f"progressive AUC over the {len(both)} files after the freeze: online {on:.4f}, "
              f"frozen {fr:.4f} (online - frozen = {on - fr:+.4f})")
    return rows


if __name__ == "__main__":
    main()
