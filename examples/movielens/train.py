"""Trains the MovieLens 100K ranking model with embcore, then restores, exports and serves it.

    python examples/movielens/train.py --data ../ml-100k --split u1      # test RMSE ~0.93
    python examples/movielens/train.py --out runs/ml --resume            # continue a run
    python examples/movielens/train.py --raw-ids --capacity-fraction 0.8 # dynamic tables
    python examples/movielens/train.py --dtype bfloat16                  # 16-bit table rows

The flow of TensorFlow's TPUEmbeddingLayer tutorial, on embcore: user and movie tables trained by
Adagrad inside the engine, an MLP trained by a torch optimizer, a checkpoint per epoch, then (see
serve.py) a restore on CPU without optimizer slots, a partial restore of the tables, an export of
the whole model with ``torch.export`` and predictions from the exported program.

Everything it writes goes under ``--out``:

    checkpoints/epoch-0007/embedding/   ec.save: tables + Adagrad accumulators + step
    checkpoints/epoch-0007/dense.pt     the MLP, its optimizer, the RNG states, the metrics so far
    checkpoints/latest                  the name of the newest complete checkpoint
    metrics.jsonl                       one line per epoch: epoch, train_loss, train_rmse,
                                        test_rmse, seconds, data, dtype (--raw-ids: vocabulary;
                                        --dtype float16 / bfloat16: stochastic_rounding)
    curves.png                          the RMSE curves (when matplotlib is installed)
    serving.pt2                         the exported serving model (torch.export)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import embcore as ec
from embcore.planning.plan import STRATEGIES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # data.py, model.py, serve.py beside us
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # examples/board.py
from board import Board  # noqa: E402
from data import (  # noqa: E402
    DEFAULT_CACHE,
    SPLITS,
    DataError,
    Ratings,
    load_movielens,
    raw_ids,
    split,
    synthetic,
)
import parallel  # noqa: E402
from model import DTYPES, ModelConfig, RankingModel, as_model_config  # noqa: E402

try:  # optional: a progress bar per epoch
    from tqdm import tqdm
except ImportError:
    tqdm = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--data", type=Path, default=None,
                   help="directory holding u.data (u.item, u.user, u1.base ... optional); by "
                        "default the cache, filled by a download, else a synthetic stand-in")
    d.add_argument("--synthetic", action="store_true",
                   help="use the built-in synthetic stand-in (MovieLens 100K's shape, no files)")
    d.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                   help="where the downloaded archive is unpacked")
    d.add_argument("--split", choices=SPLITS, default="random",
                   help="'random': 80/20 shuffled with seed 42 (the tutorial's); u1...u5: the "
                        "canonical folds shipped with the data")
    d.add_argument("--limit", type=int, default=None,
                   help="use only the first N training and N/4 test ratings (quick runs)")
    m = p.add_argument_group("model")
    m.add_argument("--user-vocabulary-size", type=int, default=2048, help="rows of the user table")
    m.add_argument("--movie-vocabulary-size", type=int, default=2048,
                   help="rows of the movie table")
    m.add_argument("--embedding-dim", type=int, default=64, help="D of both tables")
    m.add_argument("--hidden", type=int, nargs="+", default=[256, 64],
                   help="widths of the MLP's hidden layers (its output layer has width 1)")
    m.add_argument("--dropout", type=float, default=0.5,
                   help="dropout on the concatenated embeddings, in training")
    m.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="the tables' rows: float32, or compact 16-bit rows (float16, bfloat16: "
                        "half the bytes; activations stay float32, each update is computed in "
                        "float32 and rounded back into the rows); float8_e4m3fn, float8_e5m2: "
                        "8-bit rows with a float32 scale each")
    m.add_argument("--no-stochastic-rounding", dest="stochastic_rounding", action="store_false",
                   help="--dtype float16 / bfloat16: round updates to nearest instead of "
                        "stochastically (an update below half a unit in the last place is then "
                        "lost)")
    r = p.add_argument_group("raw ids (dynamic tables)")
    r.add_argument("--raw-ids", action="store_true",
                   help="hash every id into all of int64 (data.raw_ids) and look them up in "
                        "dynamic tables (ec.DynamicVocabulary) instead of static ones; the "
                        "vocabulary-size flags are then unused")
    r.add_argument("--capacity-fraction", type=float, default=0.8,
                   help="--raw-ids: each table holds this fraction of the distinct ids of its "
                        "feature in the training ratings (rounded up, at least 1); below 1 "
                        "ids are evicted")
    r.add_argument("--eviction", choices=("lru", "lfu"), default="lru",
                   help="--raw-ids: which resident id a new one evicts (least recently / least "
                        "frequently used)")
    r.add_argument("--admit-after", type=int, default=1,
                   help="--raw-ids: training steps an id must be seen in before it gets a row")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=15, help="total epochs (a resumed run continues to it)")
    t.add_argument("--batch-size", type=int, default=1024, help="examples per step, all processes")
    t.add_argument("--embedding-lr", type=float, default=0.1,
                   help="learning rate of the engine's Adagrad on the tables")
    t.add_argument("--l2", type=float, default=0.05,
                   help="L2 penalty on every looked-up embedding row, per occurrence")
    t.add_argument("--lr", type=float, default=2e-3,
                   help="the MLP's AdamW learning rate, decayed to a tenth by a cosine over the "
                        "epochs")
    t.add_argument("--weight-decay", type=float, default=0.0, help="the MLP's AdamW weight decay")
    t.add_argument("--seed", type=int, default=0, help="seeds the tables, the MLP, data order")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the tables and the MLP train")
    t.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch's ops (torch.set_num_threads; 0: torch's "
                        "default). One suits this small model: with two, on two cores, any "
                        "other busy process made each step about 30x slower")
    t.add_argument("--sharding", default="row_mod", choices=[*STRATEGIES, "auto"],
                   help="how the tables are split when launched with torchrun (several "
                        "processes): row_mod, row_div, table, column, replicated or auto")
    t.add_argument("--exchange-compression", default="fp32", metavar="FORMAT[,BACKWARD]",
                   help="under torchrun, what the tables' rows (forward) and gradients "
                        "(backward) travel as between processes: fp32, bf16, fp16 or fp8, one "
                        "for both or FORWARD,BACKWARD (e.g. bf16,fp8); ec.ExchangeCompression")
    t.add_argument("--no-error-feedback", dest="error_feedback", action="store_false",
                   help="with a compressed backward, drop what compressing a gradient loses "
                        "instead of adding it to the row's next gradient")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("runs/movielens"),
                   help="directory for checkpoints, metrics, curves and the serving model")
    o.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint under --out (up to --epochs)")
    o.add_argument("--keep-checkpoints", type=int, default=3, help="how many epochs to keep")
    o.add_argument("--serve", action=argparse.BooleanOptionalAction, default=True,
                   help="after training: restore on CPU, partial restore, export, serve")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a tqdm progress bar per epoch (when tqdm is installed)")
    o.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="also log metrics.jsonl's records to TensorBoard in DIR, by epoch (needs "
                        "the tensorboard package)")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    for name in ("epochs", "batch_size", "keep_checkpoints"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 4:
        p.error(f"--limit must be >= 4, got {args.limit}")
    if args.synthetic and args.data is not None:
        p.error("--synthetic and --data exclude each other")
    if not args.capacity_fraction > 0:
        p.error(f"--capacity-fraction must be > 0, got {args.capacity_fraction}")
    if args.admit_after < 1:
        p.error(f"--admit-after must be >= 1, got {args.admit_after}")
    if not args.stochastic_rounding and args.dtype == "float32":
        p.error("--no-stochastic-rounding applies to --dtype float16 / bfloat16; float32 rows "
                "are not rounded")
    try:
        args.exchange = ec.ExchangeCompression.parse(args.exchange_compression,
                                                     args.error_feedback)
    except ValueError as e:
        p.error(f"--exchange-compression: {e}")
    return args


SYNTHETIC_WARNING = (
    "*** SYNTHETIC DATA: these ratings are drawn from a built-in latent-factor model, not "
    "MovieLens; their RMSE says nothing about MovieLens (real u1: about 0.93). Point --data or "
    "$EMBCORE_ML100K at the MovieLens 100K files for real results. ***")


def run_identity(args: argparse.Namespace, data: Any) -> dict[str, Any]:
    """What a resumed run must share with the run it continues: the data and the flags that
    decide which ratings are trained and tested on, and in which order."""
    identity = {"data": "synthetic" if data.synthetic else str(data.source),
                "split": args.split, "limit": args.limit, "seed": args.seed,
                "batch_size": args.batch_size, "raw_ids": args.raw_ids}
    if args.raw_ids:
        identity |= {"capacity_fraction": args.capacity_fraction, "eviction": args.eviction,
                     "admit_after": args.admit_after}
    return identity


def capacity(fraction: float, ids: torch.Tensor) -> int:
    """``fraction`` x the number of distinct ``ids``, rounded up, at least 1."""
    return max(1, math.ceil(round(fraction * ids.unique().numel(), 9)))  # (round: 0.6 * 5 = 3)


def model_config(args: argparse.Namespace, train: Ratings) -> ModelConfig:
    rows = {"dtype": args.dtype, "stochastic_rounding": args.stochastic_rounding}
    if args.raw_ids:  # dynamic tables: their sizes are capacities, set from the training ids
        return ModelConfig(user_vocabulary_size=capacity(args.capacity_fraction, train.user_id),
                           movie_vocabulary_size=capacity(args.capacity_fraction,
                                                          train.movie_id),
                           embedding_dim=args.embedding_dim, hidden=tuple(args.hidden),
                           dropout=args.dropout, raw_ids=True, eviction=args.eviction,
                           admit_after=args.admit_after, **rows)
    return ModelConfig(user_vocabulary_size=args.user_vocabulary_size,
                       movie_vocabulary_size=args.movie_vocabulary_size,
                       embedding_dim=args.embedding_dim, hidden=tuple(args.hidden),
                       dropout=args.dropout, **rows)


def rows_record(config: ModelConfig) -> dict[str, Any]:
    """What metrics.jsonl records of the tables' rows: their dtype and, for compact rows, how
    updates are rounded."""
    if config.dtype == "float32":
        return {"dtype": config.dtype}
    return {"dtype": config.dtype, "stochastic_rounding": config.stochastic_rounding}


def features_of(batch: Ratings, device: torch.device | str,
                raw: bool = False) -> dict[str, torch.Tensor]:
    """The model's input: MovieLens ids are used as row ids directly (row 0 stays unused), or
    with ``raw`` hashed into all of int64 (``data.raw_ids``) for dynamic tables."""
    user_id, movie_id = (raw_ids(batch.user_id), raw_ids(batch.movie_id)) if raw else (
        batch.user_id, batch.movie_id)
    return {"user_id": user_id.to(device), "movie_id": movie_id.to(device)}


def vocabulary_stats(model: RankingModel) -> dict[str, dict[str, int]]:
    """Per dynamic table: ids resident over all processes (a collective when sharded) and
    capacity."""
    return {name: {"resident": model.embedding.engine.whole_vocabulary(table)[0].numel(),
                   "capacity": table.vocabulary_size}
            for table, name in model.embedding.engine.table_names().items()
            if table.dynamic is not None}


def check_ids_fit(config: ModelConfig, *parts: Ratings) -> None:
    """A clear message when the tables are too small for the data's ids."""
    for what, flag, size in (("user_id", "--user-vocabulary-size", config.user_vocabulary_size),
                             ("movie_id", "--movie-vocabulary-size",
                              config.movie_vocabulary_size)):
        largest = max(int(getattr(r, what).max()) for r in parts)
        if largest >= size:
            raise ValueError(f"the data has {what} {largest} but the table has {size} rows; "
                             f"pass {flag} {largest + 1} or more")


# --------------------------------------------------------------------------------- one epoch
def dense_lr(base: float, epoch: int, epochs: int, floor: float = 0.1) -> float:
    """The MLP's learning rate in epoch ``epoch`` (1-based): a cosine from ``base`` down to
    ``floor * base``. A pure function of the epoch, so a resumed run needs no scheduler state.
    (The tables' Adagrad needs no schedule: its steps shrink as its accumulators grow.)"""
    progress = (epoch - 1) / max(epochs - 1, 1)  # 0 ... 1
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_epoch(model: RankingModel, train: Ratings, dense_opt: torch.optim.Optimizer, *,
                batch_size: int, l2: float, order: torch.Generator, device: str,
                desc: str, progress: bool) -> tuple[float, float]:
    """One pass over ``train`` in a shuffled order; returns (mean objective, RMSE) per example.

    The engine fixes the batch shape at its first step, so the last partial batch is dropped
    (a different one each epoch, as the order is reshuffled).
    """
    model.train()
    perm = torch.randperm(len(train), generator=order)  # (R,)
    steps = len(train) // batch_size
    bar = tqdm(total=steps, desc=desc, unit="step", leave=False, dynamic_ncols=True,
               disable=not progress) if tqdm is not None else None
    objective_sum, squared_error_sum, seen = 0.0, 0.0, 0
    for step in range(steps):
        # Under torchrun each process takes its share of the global batch.
        batch = train[parallel.my_share(perm[step * batch_size:(step + 1) * batch_size])]
        objective, squared_error = model.compute_loss(
            features_of(batch, device, model.config.raw_ids), batch.rating.to(device), l2)
        dense_opt.zero_grad(set_to_none=True)
        objective.backward()  # the engine updates the touched table rows here
        parallel.sum_grads(model.head)  # the MLP is data parallel (no-op on one process)
        dense_opt.step()  # the MLP
        objective_sum += objective.item()
        squared_error_sum += squared_error.sum().item()
        seen += len(batch)
        if bar is not None:
            bar.update()
            if step % 10 == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{objective_sum / seen:.4f}",
                                rmse=f"{math.sqrt(squared_error_sum / seen):.4f}")
    if bar is not None:
        bar.close()
    totals = torch.tensor([objective_sum, squared_error_sum, float(seen)], dtype=torch.float64)
    parallel.sum_(totals)  # over the processes (no-op on one)
    objective_sum, squared_error_sum, seen = totals.tolist()
    return objective_sum / seen, math.sqrt(squared_error_sum / seen)


@torch.no_grad()
def evaluate(model: RankingModel, ratings: Ratings, device: str,
             batch_size: int = 8192) -> float:
    """RMSE over all of ``ratings`` (eval mode: no dropout, predictions clamped to 1...5)."""
    model.eval()
    squared_error_sum = torch.zeros((), dtype=torch.float64)
    for start in range(0, len(ratings), batch_size):
        index = torch.arange(start, min(start + batch_size, len(ratings)))
        batch = ratings[parallel.my_share(index)]  # every process looks up together
        prediction = model(features_of(batch, device, model.config.raw_ids))  # (B,)
        squared_error_sum += (prediction - batch.rating.to(device)).square().sum().cpu()
    parallel.sum_(squared_error_sum)
    return math.sqrt(float(squared_error_sum) / len(ratings))


# --------------------------------------------------------------------------------- checkpoints
def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(root: Path, epoch: int, model: RankingModel,
                    dense_opt: torch.optim.Optimizer, order: torch.Generator,
                    history: list[dict[str, float]], keep: int,
                    identity: dict[str, Any] | None = None) -> Path:
    """Writes epoch ``epoch``'s checkpoint, then points ``latest`` at it, then prunes old ones.

    ``latest`` moves only once both parts are on disk, so an interrupted save leaves the previous
    checkpoint the one ``--resume`` reads.
    """
    ckpt = root / f"epoch-{epoch:04d}"
    ec.save(ckpt / "embedding", model.embedding, extra={"epoch": epoch})  # every process
    if not parallel.is_main():  # the dense part is the same on every process
        parallel.barrier()
        return ckpt
    dense = {
        "epoch": epoch,
        "model_config": asdict(model.config),
        "head": model.head.state_dict(),
        "optimizer": dense_opt.state_dict(),
        "data_order_rng": order.get_state(),  # the shuffles of the epochs still to come
        "torch_rng": torch.get_rng_state(),  # dropout
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "history": history,
        "run": identity,
    }
    _write_atomic(ckpt / "dense.pt", lambda p: torch.save(dense, p))
    _write_atomic(root / "latest", lambda p: p.write_text(ckpt.name + "\n"))
    for old in sorted(root.glob("epoch-*"))[:-keep]:
        shutil.rmtree(old)
    parallel.barrier()
    return ckpt


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    return root / name


def restore_checkpoint(ckpt: Path, model: RankingModel, dense_opt: torch.optim.Optimizer,
                       order: torch.Generator, identity: dict[str, Any] | None = None
                       ) -> tuple[int, list[dict[str, float]]]:
    """Restores everything ``save_checkpoint`` wrote; returns (epoch, metrics history).

    Raises:
        ValueError: ``identity`` (``run_identity``: data source, split, ...) differs from the
            run that wrote the checkpoint, or the model flags differ. Nothing is restored.
    """
    dense = torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=True)
    saved = dense.get("run") or {}  # (checkpoints of older versions recorded nothing)
    if saved and "raw_ids" not in saved:  # (nor raw_ids: they were static)
        saved = {**saved, "raw_ids": False}
    if identity is not None and saved != identity:
        differ = ", ".join(f"{k}: {saved.get(k, 'unrecorded')!r} there, {v!r} now"
                           for k, v in identity.items() if saved.get(k, "unrecorded") != v)
        raise ValueError(f"{ckpt} was written by a run with other data or flags ({differ}); "
                         f"resuming would not continue that run. Resume with the same "
                         f"data and flags, or leave out --resume for a fresh run")
    saved = as_model_config(dense["model_config"])
    if saved != model.config:
        raise ValueError(f"{ckpt} holds a model with {saved}, but the flags give "
                         f"{model.config}; resume with the same model flags")
    ec.load(ckpt / "embedding", model.embedding)  # tables, accumulators and step
    model.head.load_state_dict(dense["head"])
    dense_opt.load_state_dict(dense["optimizer"])
    order.set_state(dense["data_order_rng"])
    torch.set_rng_state(dense["torch_rng"])
    if dense["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(dense["cuda_rng"])
    return dense["epoch"], dense["history"]


# --------------------------------------------------------------------------------- outputs
def write_metrics(out: Path, history: Iterable[dict[str, float]]) -> None:
    """metrics.jsonl, rewritten whole each epoch (after a resume it matches the checkpoint)."""
    lines = "".join(json.dumps(record) + "\n" for record in history)
    _write_atomic(out / "metrics.jsonl", lambda p: p.write_text(lines))


def plot_curves(out: Path, history: list[dict[str, float]]) -> bool:
    """curves.png: train and test RMSE per epoch. Returns False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    epochs = [r["epoch"] for r in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(epochs, [r["train_rmse"] for r in history], "o-", label="train RMSE (running)")
    ax.plot(epochs, [r["test_rmse"] for r in history], "o-", label="test RMSE")
    ax.set_xlabel("epoch")
    ax.set_ylabel("RMSE")
    ax.set_title("MovieLens 100K ranking model (embcore)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the job; returns the last epoch's metrics (plus the serving check's results)."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # main() may be called from a larger program


def run(args: argparse.Namespace) -> dict[str, Any]:
    rank, world, args.device = parallel.init(args.device)
    try:
        return _run(args, rank, world)
    finally:
        parallel.shutdown()


def _run(args: argparse.Namespace, rank: int, world: int) -> dict[str, Any]:
    out: Path = args.out
    root = out / "checkpoints"
    out.mkdir(parents=True, exist_ok=True)

    data = synthetic() if args.synthetic else load_movielens(args.data, args.cache_dir)
    train, test = split(data, args.split)
    if args.limit is not None:
        train, test = train[:args.limit], test[:args.limit // 4]
    if len(train) < args.batch_size:
        raise ValueError(f"--batch-size {args.batch_size} is larger than the training set "
                         f"({len(train)} ratings); lower it")
    config = model_config(args, train)
    if not config.raw_ids:  # (raw ids need no room: a dynamic table takes any id)
        check_ids_fit(config, train, test)
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of "
                         f"processes ({world})")
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"data: {data.source}, split {args.split}: {len(train):,} train / {len(test):,} test "
          f"ratings of {data.num_users} users and {data.num_movies} movies")
    if data.synthetic:
        say(SYNTHETIC_WARNING)
    if config.raw_ids:
        say(f"raw ids: dynamic tables of capacity {config.user_vocabulary_size} users and "
            f"{config.movie_vocabulary_size} movies ({args.capacity_fraction} x the distinct "
            f"training ids), {args.eviction} eviction, ids admitted when seen in "
            f"{args.admit_after} step(s)")
    if config.dtype != "float32":
        say(f"compact tables: {config.dtype} rows (activations float32), updates rounded "
            + ("stochastically" if config.stochastic_rounding else "to nearest"))

    torch.manual_seed(args.seed)  # fixes the tables (drawn at construction), the MLP, dropout
    model = RankingModel(config, ec.Adagrad(learning_rate=args.embedding_lr),
                         device=args.device, sharding=args.sharding if world > 1 else None,
                         exchange_compression=args.exchange)
    if world > 1:
        say(f"{world} processes; the tables are sharded:\n{model.embedding.engine.plan}")
        if args.exchange.lossy:
            say(f"exchange: {args.exchange}")
    model.head.init_output_bias(float(train.rating.mean()))
    dense_opt = torch.optim.AdamW(model.head.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay)
    order = torch.Generator().manual_seed(args.seed)  # the data order of every epoch

    done, history = 0, []  # epochs completed, their metrics
    board = Board(args.tensorboard if rank == 0 else None, step="epoch", kind="epoch")
    identity = run_identity(args, data)
    ckpt = latest_checkpoint(root) if args.resume else None
    if ckpt is not None:
        done, history = restore_checkpoint(ckpt, model, dense_opt, order, identity)
        if done >= args.epochs:
            raise ValueError(f"{ckpt} has trained {done} epochs already and --epochs is "
                             f"{args.epochs}: nothing to do; pass --epochs above {done} to "
                             f"train on, or leave out --resume for a fresh run")
        say(f"resumed from {ckpt} (epoch {done})")
    else:
        if args.resume:
            say(f"--resume: no checkpoint under {root}; starting from scratch")
        if root.exists() and rank == 0:  # a fresh run must not resume an older run's checkpoints
            say(f"a fresh run: removing the previous run's checkpoints in {root} (--resume "
                f"continues a run instead)")
            shutil.rmtree(root)
        parallel.barrier()

    for epoch in range(done + 1, args.epochs + 1):
        start = time.perf_counter()
        for group in dense_opt.param_groups:
            group["lr"] = dense_lr(args.lr, epoch, args.epochs)
        train_loss, train_rmse = train_epoch(
            model, train, dense_opt, batch_size=args.batch_size, l2=args.l2, order=order,
            device=args.device, desc=f"epoch {epoch}/{args.epochs}",
            progress=args.progress and rank == 0)  # one bar under torchrun: rank 0's
        test_rmse = evaluate(model, test, args.device)
        record = {"epoch": epoch, "train_loss": train_loss, "train_rmse": train_rmse,
                  "test_rmse": test_rmse, "seconds": round(time.perf_counter() - start, 3),
                  "data": "SYNTHETIC" if data.synthetic else data.source,
                  **rows_record(config)}
        if config.raw_ids:
            record["vocabulary"] = vocabulary_stats(model)  # {table: {resident, capacity}}
        history.append(record)
        ckpt = save_checkpoint(root, epoch, model, dense_opt, order, history,
                               args.keep_checkpoints, identity)
        if rank == 0:
            write_metrics(out, history)
            board.write(history)
            if not plot_curves(out, history) and epoch == 1:
                say("curves.png is not written: matplotlib is not installed (pip install "
                    "matplotlib, or the examples extra)", flush=True)
        say(f"epoch {epoch}/{args.epochs}: train loss {train_loss:.4f}, train RMSE "
              f"{train_rmse:.4f}, test RMSE {test_rmse:.4f} ({record['seconds']:.1f} s)"
              + "".join(f", {n} resident {v['resident']}/{v['capacity']}"
                        for n, v in record.get("vocabulary", {}).items()), flush=True)

    board.close()
    result: dict[str, Any] = dict(history[-1]) if history else {}
    if data.synthetic:
        say(SYNTHETIC_WARNING)
    if args.serve and ckpt is not None:
        from serve import restore_for_serving, serving_flow
        trained = model
        if world > 1:  # serve from one process: the W-process checkpoint restored on one
            parallel.shutdown()
            if rank != 0:
                return result
            say(f"serving from rank 0 with the {world}-process checkpoint restored on one process")
            trained = restore_for_serving(ckpt)
        result.update(serving_flow(trained, ckpt, out, data))
    return result


def cli(argv: list[str] | None = None) -> int:
    """The command line: ``main`` with data errors reported in one line instead of a traceback."""
    try:
        main(argv)
    except (DataError, ValueError) as e:  # a bad file (name and line) or flag: one line
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
