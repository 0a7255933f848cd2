"""Trains DLRM-DCNv2 on Criteo click logs with embcore, then reports the test AUC.

    python examples/criteo/train.py --data DIR             # DIR/train.txt (+ DIR/test.txt)
    python examples/criteo/train.py --synthetic            # a small SYNTHETIC dataset
    python examples/criteo/train.py --data DIR --out runs/criteo --resume   # continue a run
    torchrun --nproc-per-node 2 examples/criteo/train.py --data DIR          # several processes
    python examples/criteo/train.py --data DIR --spec examples/criteo/spec.json   # tables as data
    python examples/criteo/train.py --data DIR --write-spec my.json  # the flags' spec, then exit
    python examples/criteo/train.py --data DIR --dtype bfloat16      # 16-bit table rows
    python examples/criteo/train.py --data DIR --mlperf        # MLPerf's settings at any size

One epoch (by default) over DIR/train.txt in file order, streamed in batches (files larger than
memory are fine); then an evaluation over DIR/test.txt when it has labels, else over the lines
of train.txt held out by ``--holdout-every`` (every k-th line; they are then not trained on).
The last line printed is exactly ``test auc=0.XXXX logloss=0.XXXX``.

The settings (batch, learning rates, model sizes) are MLPerf DLRM-DCNv2's from 15M training lines
on (Kaggle's train.txt, the 1TB logs); for fewer lines they are derived from the number of
training lines of an epoch (``derived_settings``: MLPerf's batch times r, the tables' rate over
r, the sizes times max(r, 1/4), r = sqrt(lines / 3e7) as a power of two between 1/32 and 1) and
printed at the start. ``--mlperf`` gives MLPerf's at any size; a flag given wins over both, and
a resumed run takes the settings its checkpoint records for the flags not given again.

The 26 tables, their features, optimizer, sharding and memory budget are an ``ec.EmbeddingSpec``:
the one the flags build (``--dim``, ``--dtype``, ``--no-stochastic-rounding``, ``--raw-ids`` /
``--hash-buckets``, ``--capacity``, ``--embedding-lr``, ``--embedding-optimizer``, ``--sharding``,
``--memory-budget``, ``--exchange-compression``, ``--no-error-feedback``), which
``--write-spec FILE`` writes as JSON, or the one ``--spec FILE`` reads (those flags are then
refused: the file says it). The dense part takes D from it.

Everything it writes goes under ``--out``:

    checkpoints/step-00001234/embedding/   ec.save: tables, Adagrad accumulators, id maps, step
    checkpoints/step-00001234/dense.pt     the dense part, its optimizer, the position in the
                                           data, the run's settings
    checkpoints/latest                     the name of the newest complete checkpoint
    metrics.jsonl                          "train" lines (loss, examples/s) every --log-every
                                           steps, an "eval" line (test AUC, log loss, the
                                           tables' dtype) per epoch
    curves.png                             loss and AUC (when matplotlib is installed)
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import embcore as ec  # noqa: E402
from embcore.planning.plan import STRATEGIES  # noqa: E402
from criteo.data import (  # noqa: E402
    NUM_SPARSE,
    DataError,
    ReadStats,
    count_lines,
    distinct_ids,
    has_labels,
    read_batches,
)
from board import Board  # noqa: E402  (examples/board.py)
from criteo.generate import SYNTHETIC_NOTE, generate  # noqa: E402
from criteo.metrics import log_loss, roc_auc  # noqa: E402
from criteo.model import (  # noqa: E402
    DLRM,
    ModelConfig,
    as_model_config,
    config_from_spec,
    embedding_spec,
    spec_tables,
)

try:  # optional: a progress bar
    from tqdm import tqdm
except ImportError:
    tqdm = None

SYNTHETIC_WARNING = (f"*** {SYNTHETIC_NOTE}. Point --data at Criteo's files (Kaggle's "
                     f"train.txt or the 1TB day files) for real results. ***")


# MLPerf DLRM-DCNv2's settings (TorchRec's dlrm_main with --adagrad; the batch the job's 4096, the
# reference's 65,536 being 8 GPUs'): what --mlperf sets, and the defaults from SCALE_LINES / 2
# training lines on (Kaggle's train.txt, the 1TB logs). Below that the defaults are derived from
# the number of training lines (derived_settings); a flag given explicitly always wins.
MLPERF: dict[str, Any] = {"batch_size": 4096, "embedding_lr": 0.005, "lr": 0.005, "dim": 128,
                          "bottom_mlp": [512, 256, 128], "cross_layers": 3, "cross_rank": 512,
                          "top_mlp": [1024, 1024, 512, 256]}
SIZES = ("dim", "bottom_mlp", "cross_layers", "cross_rank", "top_mlp")  # (not logreg's)
SCALE_LINES = 30_000_000  # r = sqrt(lines / SCALE_LINES) as a power of two, 1/32 ... 1
SMALLEST_R, SMALLEST_MODEL_R = -5, -2  # log2: r >= 1/32; the sizes >= a quarter of MLPerf's

# The flags that build the tables' spec, with their defaults; --spec FILE replaces them.
TABLE_FLAGS = {"dim": MLPERF["dim"], "dtype": "float32", "stochastic_rounding": True,
               "raw_ids": True, "hash_buckets": None, "capacity": None,
               "embedding_lr": MLPERF["embedding_lr"], "embedding_optimizer": "adagrad",
               "sharding": "auto", "memory_budget": None, "exchange_compression": "fp32",
               "error_feedback": True}
FLAG_NAMES = {"stochastic_rounding": "--no-stochastic-rounding",
              "error_feedback": "--no-error-feedback"}  # (else --name-with-dashes)
# --dtype: the tables' rows, float32 or compact 16-bit ones (TableConfig(dtype=...)).
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    table = {"default": argparse.SUPPRESS}  # to tell the flags given from the defaults
    d = p.add_argument_group("data")
    d.add_argument("--data", type=Path, default=None,
                   help="directory holding train.txt (or train.txt.gz) and optionally "
                        "test.txt: Criteo's TSV (label, I1..I13, C1..C26)")
    d.add_argument("--synthetic", action="store_true",
                   help="generate a small SYNTHETIC dataset (generate.py) into a temporary "
                        "directory and train on it")
    d.add_argument("--synthetic-lines", type=int, default=20000,
                   help="--synthetic: lines of train.txt (test.txt gets a quarter)")
    d.add_argument("--limit", type=int, default=None,
                   help="read only the first N lines of train.txt and of test.txt")
    d.add_argument("--holdout-every", type=int, default=7,
                   help="when test.txt is missing or unlabeled: every k-th line of train.txt "
                        "is held out as the test set (k = 7: a seventh, Kaggle's one day in "
                        "seven)")
    d.add_argument("--skip-bad", action="store_true",
                   help="skip malformed lines (and count them) instead of stopping at the first")
    derived = {"default": argparse.SUPPRESS}  # MLPerf's, or derived from the data's size
    m = p.add_argument_group("model (by default derived from the number of training lines: "
                             "MLPerf DLRM-DCNv2's sizes from 15M lines on, smaller below; "
                             "--mlperf: MLPerf's)")
    m.add_argument("--mlperf", action="store_true",
                   help="MLPerf DLRM-DCNv2's settings instead of the ones derived from the "
                        "data's size: batch 4096, Adagrad rates 0.005 (tables and dense part), "
                        "D 128, bottom MLP 512-256-128, 3 cross layers of rank 512, top MLP "
                        "1024-1024-512-256. Flags given explicitly still win")
    m.add_argument("--spec", type=Path, default=None,
                   help="the tables as data: an ec.EmbeddingSpec JSON file (features C1 ... C26, "
                        "their tables, optimizer, sharding, memory budget; all tables of one "
                        "dim, which the dense part takes), e.g. examples/criteo/spec.json. "
                        "Replaces the flags that build the tables (--dim, --dtype, "
                        "--no-stochastic-rounding, --raw-ids, --hash-buckets, --capacity, "
                        "--embedding-lr, --embedding-optimizer, --sharding, --memory-budget)")
    m.add_argument("--write-spec", type=Path, default=None,
                   help="write the spec the flags build to this JSON file and exit (a "
                        "fractional --capacity counts the ids in --data first)")
    m.add_argument("--model", choices=("dcnv2", "logreg"), default="dcnv2",
                   help="dcnv2: DLRM-DCNv2; logreg: the logistic-regression baseline (a weight "
                        "per category value in tables of dim 1, a linear term of the 13 counts; "
                        "the MLP and cross flags do not apply)")
    m.add_argument("--dim", type=int, **table, help="D of the 26 tables (default: derived, "
                   "128 with --mlperf; 1 with --model logreg)")
    m.add_argument("--dtype", choices=tuple(DTYPES), **table,
                   help="the tables' rows (default float32): float16 or bfloat16 are compact "
                        "16-bit rows (half the bytes; activations stay float32, each update is "
                        "computed in float32 and rounded back into the rows); float8_e4m3fn or "
                        "float8_e5m2 are 8-bit rows with a float32 scale each (static tables: "
                        "with --hash-buckets)")
    m.add_argument("--no-stochastic-rounding", dest="stochastic_rounding", action="store_false",
                   **table, help="--dtype float16 / bfloat16: round updates to nearest instead "
                                 "of stochastically (an update below half a unit in the last "
                                 "place is then lost)")
    m.add_argument("--bottom-mlp", type=int, nargs="+", **derived,
                   help="bottom MLP widths over the 13 counts (default: derived, 512 256 128 "
                        "with --mlperf)")
    m.add_argument("--top-mlp", type=int, nargs="+", **derived,
                   help="top MLP hidden widths, then one logit (default: derived, 1024 1024 512 "
                        "256 with --mlperf)")
    m.add_argument("--cross-layers", type=int, **derived, help="DCN v2 cross layers (default 3)")
    m.add_argument("--cross-rank", type=int, **derived,
                   help="rank of each cross layer (default: derived, 512 with --mlperf)")
    i = p.add_argument_group("ids and tables")
    ids = i.add_mutually_exclusive_group()
    ids.add_argument("--raw-ids", action="store_true", **table,
                     help="(default) the 32-bit hashes as raw ids in dynamic tables "
                          "(ec.DynamicVocabulary), missing: -1")
    ids.add_argument("--hash-buckets", type=int, nargs="+", **table,
                     help="MLPerf-style: id %% N into static tables of N rows (one N for all "
                          "features, or 26)")
    i.add_argument("--capacity", type=float, **table,
                   help="--raw-ids: rows per dynamic table: an integer > 1, or a fraction in "
                        "(0, 1] of each feature's distinct training ids (counted by one extra "
                        "pass over the data; never below the batch size, or the feature's "
                        "distinct ids if fewer); beyond it the least recently used ids are "
                        "evicted; with several processes, of the ids each owns, times the "
                        "processes. A step needs a row per distinct id: an integer below "
                        "--batch-size (times the processes) may stop the run. Default 1.0")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=1, help="passes over train.txt")
    t.add_argument("--batch-size", type=int, **derived,
                   help="examples per step, all processes (default: derived, 4096 with --mlperf)")
    t.add_argument("--lr", type=float, **derived, help="the dense part's Adagrad rate "
                   "(default 0.005)")
    t.add_argument("--embedding-lr", type=float, **table,
                   help="the tables' Adagrad rate (default: derived, 0.005 with --mlperf)")
    t.add_argument("--embedding-optimizer", choices=("adagrad", "rowwise_adagrad"), **table,
                   help="ec.Adagrad (an accumulator per entry; the default) or "
                        "ec.RowwiseAdagrad (per row, as MLPerf's reference)")
    t.add_argument("--seed", type=int, default=0, help="seeds the model (and --synthetic data)")
    t.add_argument("--memory-budget", **table,
                   help="bytes of fast memory per process for tables, slots and caches (e.g. "
                        "8GiB): tables beyond it train from files under --offload-dir with "
                        "their hot rows cached, exactly (static tables: use --hash-buckets; "
                        "dynamic tables stay in memory)")
    t.add_argument("--offload-dir", default=None,
                   help="where --memory-budget's slow tier goes (default: a temporary "
                        "directory; scratch, removed at exit)")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the tables and the dense part train")
    t.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default)")
    t.add_argument("--sharding", choices=[*STRATEGIES, "auto"], **table,
                   help="how the tables are split under torchrun (several processes; default "
                        "auto)")
    t.add_argument("--exchange-compression", metavar="FORMAT[,BACKWARD]", **table,
                   help="under torchrun, what the tables' rows (forward) and gradients "
                        "(backward) travel as between processes: fp32 (default), bf16, fp16 or "
                        "fp8, one for both or FORWARD,BACKWARD (e.g. bf16,fp8)")
    t.add_argument("--no-error-feedback", dest="error_feedback", action="store_false", **table,
                   help="with a compressed backward, drop what compressing a gradient loses "
                        "instead of adding it to the row's next gradient")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=Path("runs/criteo"),
                   help="directory for checkpoints, metrics.jsonl and curves.png")
    o.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint under --out (same data and flags; "
                        "the settings not given again are the checkpoint's; the learning "
                        "rates --lr and --embedding-lr may change)")
    o.add_argument("--checkpoint-every", type=int, default=0,
                   help="also checkpoint every N steps within an epoch (0: at epoch ends only)")
    o.add_argument("--keep-checkpoints", type=int, default=2, help="how many to keep")
    o.add_argument("--log-every", type=int, default=50, help="steps between metrics.jsonl lines")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a tqdm progress bar (when tqdm is installed)")
    o.add_argument("--tensorboard", type=Path, default=None, metavar="DIR",
                   help="also log metrics.jsonl's records to TensorBoard in DIR (needs the "
                        "tensorboard package)")
    args = p.parse_args(argv)
    # The settings given on the command line; the others are MLPerf's until _run chooses them
    # (choose_settings: from the data, a checkpoint or --mlperf), so parse_args alone gives
    # MLPerf's.
    args.given = {k for k in MLPERF if hasattr(args, k)}
    for k, v in MLPERF.items():
        if not hasattr(args, k) and k not in TABLE_FLAGS:
            setattr(args, k, list(v) if isinstance(v, list) else v)
    given = [FLAG_NAMES.get(k, f"--{k.replace('_', '-')}") for k in TABLE_FLAGS
             if hasattr(args, k)]
    if args.spec is not None and given:
        p.error(f"--spec {args.spec} declares the tables: leave out {', '.join(given)} (edit "
                f"the spec instead)")
    if args.spec is not None and args.write_spec is not None:
        p.error("--write-spec writes the spec the flags build; with --spec there is none to "
                "write (copy the file)")
    if args.model == "logreg" and not hasattr(args, "dim"):
        args.dim = 1
    for k, v in TABLE_FLAGS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    if not args.stochastic_rounding and args.dtype == "float32":
        p.error("--no-stochastic-rounding applies to --dtype float16 / bfloat16; float32 rows "
                "are not rounded")
    if args.model == "logreg" and args.dim != 1:
        p.error(f"--model logreg: the tables hold one weight per value (dim 1), got --dim "
                f"{args.dim}")
    for name in ("epochs", "batch_size", "keep_checkpoints", "log_every", "dim", "cross_rank",
                 "synthetic_lines"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("threads", "checkpoint_every", "cross_layers"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if min(args.bottom_mlp + args.top_mlp) < 1:
        p.error("--bottom-mlp and --top-mlp widths must be >= 1")
    sources = args.synthetic + (args.data is not None)
    if sources > 1 or (sources == 0 and args.write_spec is None):  # --write-spec may need none
        p.error("pass either --data DIR (Criteo's files) or --synthetic")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    if args.holdout_every < 2:
        p.error(f"--holdout-every must be >= 2, got {args.holdout_every}")
    if args.hash_buckets is not None:
        args.raw_ids = False
        if len(args.hash_buckets) not in (1, NUM_SPARSE) or min(args.hash_buckets) < 1:
            p.error(f"--hash-buckets takes one size >= 1 or 26 of them, got {args.hash_buckets}")
        if args.capacity is not None:
            p.error("--capacity applies to --raw-ids; with --hash-buckets the tables have the "
                    "bucket counts as rows")
    cap = 1.0 if args.capacity is None else args.capacity
    if not (0 < cap <= 1 or (cap > 1 and cap == int(cap))):
        p.error(f"--capacity must be a fraction in (0, 1] or an integer > 1, got {cap}")
    args.capacity = cap
    try:
        args.exchange = ec.ExchangeCompression.parse(args.exchange_compression,
                                                     args.error_feedback)
    except ValueError as e:
        p.error(f"--exchange-compression: {e}")
    return args


# --------------------------------------------------------------------------------- processes
def init_processes(device: str) -> tuple[int, int, str]:
    """Joins the process group when launched by torchrun; returns (rank, world, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():  # (NCCL needs a GPU per process: fail now)
            raise SystemExit(f"process {local} of this machine has no GPU of its own (the "
                             f"machine has {torch.cuda.device_count()}; NCCL needs one per "
                             f"process): run --nproc-per-node {max(torch.cuda.device_count(), 1)}"
                             f" or fewer, or --device cpu (gloo)")
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            timeout=timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size(), device


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    if distributed():
        dist.all_reduce(t)
    return t


def barrier() -> None:
    if distributed():
        dist.barrier()


# --------------------------------------------------------------------------------- data
class Dataset:
    """Where the training and test examples come from, and how to read them."""

    def __init__(self, args: argparse.Namespace, directory: Path, synthetic: dict | None,
                 hash_buckets: list[int] | None):
        self.directory, self.synthetic = directory, synthetic
        self.train_path = self._find(directory, "train.txt", required=True)
        test = self._find(directory, "test.txt", required=False)
        self.test_path = test if test is not None and has_labels(test) else None
        self.common = {"hash_buckets": hash_buckets, "skip_bad": args.skip_bad,
                       "limit": args.limit}
        self.holdout = {} if self.test_path else {"holdout_every": args.holdout_every}
        self.unlabeled_test = test is not None and self.test_path is None

    @staticmethod
    def _find(directory: Path, name: str, required: bool) -> Path | None:
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                return candidate
        if required:
            raise ValueError(f"{directory} has no {name} (nor {name}.gz): --data must name a "
                             f"directory holding Criteo's train.txt")
        return None

    def describe(self) -> str:
        test = (f"{self.test_path}" if self.test_path else
                f"every {self.holdout['holdout_every']}th line of {self.train_path.name} held out"
                + (" (test.txt has no labels)" if self.unlabeled_test else ""))
        return f"train {self.train_path}, test {test}"

    def train(self, batch_size: int, stats: ReadStats, share: tuple[int, int],
              start_after: int = 0) -> Iterator[Any]:
        """This process's share (``batch[rank::world]``) of each global batch of train.txt's
        training part; ``stats`` counts the global batches."""
        part = {"part": "train", **self.holdout} if self.holdout else {}
        return read_batches(self.train_path, batch_size, stats=stats, start_after=start_after,
                            labeled=True, share=share, **self.common, **part)

    def test(self, batch_size: int, stats: ReadStats, share: tuple[int, int]
             ) -> Iterator[Any]:
        if self.test_path is not None:
            return read_batches(self.test_path, batch_size, stats=stats, labeled=True,
                                share=share, **self.common)
        return read_batches(self.train_path, batch_size, stats=stats, labeled=True,
                            part="test", share=share, **self.holdout, **self.common)

    def train_lines(self) -> tuple[int, bool] | None:
        """The lines of an epoch's training part (bad ones included) and whether counted
        exactly: counted, or estimated from the first 16 MB for a file over 1 GB or a .gz (the
        compressed bytes they took); None when unknown (no newline in the first 16 MB, a
        corrupt .gz). Counted once."""
        if not hasattr(self, "_train_lines"):
            part = {"part": "train", **self.holdout} if self.holdout else {}
            count = count_gz_lines if self.train_path.suffix == ".gz" else count_lines
            self._train_lines = count(self.train_path, limit=self.common["limit"], **part)
        return self._train_lines

    def train_steps(self, batch_size: int) -> int | None:
        """The steps of an epoch for the progress bar (skipped bad lines make fewer)."""
        counted = self.train_lines()
        return None if counted is None else math.ceil(counted[0] / batch_size)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the run it continues."""
        if self.synthetic is not None:
            source = {k: self.synthetic[k] for k in ("seed", "scale", "train_lines")}
            return {"data": "synthetic", **source, **self.common}
        return {"data": str(self.train_path.resolve()),
                "train_bytes": self.train_path.stat().st_size, **self.common, **self.holdout}


def count_gz_lines(path: Path, *, limit: int | None = None, part: str = "all",
                   holdout_every: int = 0, block: int = 1 << 24) -> tuple[int, bool] | None:
    """``count_lines`` for a .gz file: the lines of its first ``block`` bytes (decompressed)
    times its size over the compressed bytes they took, or the exact count when the whole
    file (or ``limit`` lines) fits in that block; None for a corrupt file (the reader names
    the damage) or no newline in the block."""
    cap = math.inf if limit is None else limit
    try:
        with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw) as f:
            first = f.read(block)
            lines = first.count(b"\n")
            exact = len(first) < block or lines >= cap
            if exact:
                lines += bool(first) and first[-1:] != b"\n"  # an unterminated last line
            elif not lines:
                return None
            else:
                lines = round(lines * path.stat().st_size / max(1, raw.tell()))
    except (OSError, EOFError, zlib.error):
        return None
    lines = int(min(lines, cap))
    if holdout_every > 0 and part != "all":  # line numbers k, 2k, ... are the test part
        lines = lines // holdout_every if part == "test" else lines - lines // holdout_every
    return lines, exact


# ------------------------------------------------------------------------------ the settings
def scale_exponent(lines: int) -> int:
    """k of the scale r = 2**k of ``derived_settings``: sqrt(lines / SCALE_LINES) rounded to a
    power of two (the nearest in log scale), between 1/32 and 1. In integers: the largest k <= 0
    with lines >= SCALE_LINES / 2**(1 - 2 k), i.e. 15M lines for r = 1, 3.75M for 1/2, 937,500
    for 1/4, 234,375 for 1/8, 58,594 for 1/16; 1/32 below."""
    for k in range(0, SMALLEST_R, -1):
        if lines * 2 ** (1 - 2 * k) >= SCALE_LINES:
            return k
    return SMALLEST_R


def derived_settings(lines: int) -> dict[str, Any]:
    """The default settings for an epoch of ``lines`` training lines: MLPerf's (``MLPERF``)
    scaled by r = 2**scale_exponent(lines): the batch times r; the tables' rate divided by r
    (a table row gets r**2 times MLPerf's updates, and Adagrad moves a row about in proportion
    to the square root of its updates); the dense part's rate MLPerf's (its steps, lines /
    batch, shrink only as r); D, the MLP widths and the cross rank times r, but not below a
    quarter of MLPerf's (D 32); the cross layers 3. From 15M lines on: MLPerf's exactly."""
    k = scale_exponent(lines)
    m = -max(k, SMALLEST_MODEL_R)  # the sizes: w >> m = w * 2**-m (MLPerf's are powers of two)
    return {"batch_size": MLPERF["batch_size"] >> -k,
            "embedding_lr": MLPERF["embedding_lr"] * 2 ** -k, "lr": MLPERF["lr"],
            "dim": MLPERF["dim"] >> m, "bottom_mlp": [w >> m for w in MLPERF["bottom_mlp"]],
            "cross_layers": MLPERF["cross_layers"], "cross_rank": MLPERF["cross_rank"] >> m,
            "top_mlp": [w >> m for w in MLPERF["top_mlp"]]}


def checkpoint_settings(root: Path) -> dict[str, Any] | None:
    """The settings the newest checkpoint under ``root`` records (``save_checkpoint``); MLPerf's
    for one written before checkpoints recorded them (MLPerf's were the defaults then); None
    when there is no checkpoint or it cannot be read (``restore_checkpoint`` says why)."""
    try:
        ckpt = root / (root / "latest").read_text().strip()
        dense = torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - restore_checkpoint reads it again and names the problem
        return None
    recorded = dense.get("settings") if isinstance(dense, dict) else None
    return dict(MLPERF) if recorded is None else dict(recorded)


SETTING_NAMES = {"batch_size": "batch", "lr": "dense rate", "embedding_lr": "tables' rate",
                 "dim": "D", "bottom_mlp": "bottom", "cross_layers": "cross layers",
                 "cross_rank": "cross rank", "top_mlp": "top"}


def _setting(key: str, value: Any) -> str:
    shown = "-".join(map(str, value)) if isinstance(value, list) else f"{value:g}"
    return f"{SETTING_NAMES[key]} {shown}"


def choose_settings(args: argparse.Namespace, data: Dataset | None, root: Path,
                    say: Callable[..., None] = print) -> dict[str, Any]:
    """Sets the settings of ``MLPERF``'s keys that the command line leaves open, and prints
    them with their source. Who wins: a flag given explicitly; then ``--mlperf`` (MLPerf's);
    then, on ``--resume`` with a checkpoint, the checkpoint's (so a resumed run trains on with
    the settings it started with); then the ones derived from the training lines of ``data``
    (``derived_settings``; MLPerf's when there is no data or its size is unknown). The tables'
    D and rate come from the ``--spec`` file when there is one, D is 1 with ``--model logreg``
    and the model sizes do not apply to it. Returns the settings the run uses (for its
    checkpoints)."""
    keys = [k for k in MLPERF
            if not (args.spec is not None and k in ("dim", "embedding_lr"))
            and not (args.model == "logreg" and k in SIZES)]
    open_keys = [k for k in keys if k not in args.given]
    why, values = "", dict(MLPERF)
    recorded = checkpoint_settings(root) if args.resume and not args.mlperf else None
    if args.mlperf:
        why = "--mlperf: MLPerf DLRM-DCNv2's"
    elif recorded is not None:
        values.update(recorded)
        why = f"the checkpoint's under {root} (the run's own)"
    elif data is None:
        why = "MLPerf DLRM-DCNv2's (no data to derive them from)"
    elif (counted := data.train_lines()) is None:
        why = (f"MLPerf DLRM-DCNv2's (the lines of {data.train_path.name} are unknown: nothing "
               f"to derive them from)")
    else:
        lines, exact = counted
        k = scale_exponent(lines)
        values = derived_settings(lines)
        scale = "1" if k == 0 else f"1/{2 ** -k}"
        why = (f"derived from the {'' if exact else 'estimated '}{lines:,} training lines: "
               f"r = {scale} (sqrt(lines / {SCALE_LINES:,}) to a power of two, 1/32 ... 1), "
               f"MLPerf's batch x r, tables' rate / r"
               + (", sizes x max(r, 1/4)" if args.model == "dcnv2" else "")
               + ("; MLPerf's exactly from 15M lines on" if k else " (MLPerf's)"))
    for k in open_keys:
        v = values.get(k, MLPERF[k])
        setattr(args, k, list(v) if isinstance(v, list) else v)
    chosen = {k: getattr(args, k) for k in keys}
    say("settings: " + ", ".join(_setting(k, v) for k, v in chosen.items())
        + (f" (the tables' D and rate: {args.spec}'s)" if args.spec is not None else ""))
    given = [f"--{k.replace('_', '-')}" for k in keys if k in args.given]
    if given:
        say(f"  given: {', '.join(given)} (a flag given wins)")
    if open_keys:
        say(f"  {'the others' if given else 'all'}: {why}"
            + ("" if args.mlperf else "; --mlperf gives MLPerf's"))
    return chosen


def capacities(args: argparse.Namespace, data: Dataset | None, say: Callable[..., None],
               world: int = 1) -> tuple[int, ...]:
    """The tables' rows: ``--hash-buckets``, an integer ``--capacity``, or a fraction of each
    feature's distinct training ids. With ``world`` processes a fraction is taken of the ids each
    process owns (``splitmix64(id) % world``, the engine's ``"hash"`` sharding, where each holds
    ``capacity / world`` rows): the most any process needs, times ``world``. Hashing splits ids
    unevenly, so the distinct ids counted over all processes would leave the busiest one short."""
    if not args.raw_ids:
        sizes = args.hash_buckets * (NUM_SPARSE if len(args.hash_buckets) == 1 else 1)
        return tuple(int(s) for s in sizes)
    if args.capacity > 1:
        return (int(args.capacity),) * NUM_SPARSE
    if data is None:
        raise ValueError(f"--capacity {args.capacity} (a fraction) counts each feature's "
                         f"distinct ids in the data: pass --data DIR (or --synthetic), or an "
                         f"integer --capacity")
    say(f"counting the distinct ids of each feature for --capacity {args.capacity} (one pass; "
        f"pass an integer --capacity to skip it)", flush=True)
    part = {"part": "train", **data.holdout} if data.holdout else {}
    caps = []
    for ids in distinct_ids(data.train_path, labeled=True, **data.common, **part):
        owners = ec.numerics.hashing.owner(torch.from_numpy(ids), world)
        # A step must find a row for each of its distinct ids on their owner: never fewer rows
        # there than one batch can bring (the batch size), unless it owns fewer ids than that.
        caps.append(world * max(max(1, math.ceil(round(args.capacity * int(n), 9)),
                                    min(int(n), args.batch_size))
                                for n in torch.bincount(owners, minlength=world).tolist()))
    return tuple(caps)


# --------------------------------------------------------------------------------- the tables
def dense_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The ModelConfig fields of the dense part (the flags')."""
    return {"bottom": tuple(args.bottom_mlp), "cross_layers": args.cross_layers,
            "cross_rank": args.cross_rank, "top": tuple(args.top_mlp), "arch": args.model}


def flags_spec(args: argparse.Namespace, data: Dataset | None, say: Callable[..., None],
               world: int = 1) -> tuple[ModelConfig, ec.EmbeddingSpec]:
    """The model config and the tables' spec that the flags describe (for ``world``
    processes: a fractional ``--capacity``'s rows, ``capacities``)."""
    config = ModelConfig(capacities=capacities(args, data, say, world), dim=args.dim,
                         raw_ids=args.raw_ids, **dense_sizes(args))
    # Accumulators start at 0 as torch's Adagrad (MLPerf's reference), not at TF's 0.1.
    opt_class = ec.Adagrad if args.embedding_optimizer == "adagrad" else ec.RowwiseAdagrad
    optimizer = opt_class(learning_rate=args.embedding_lr, initial_accumulator_value=0.0)
    return config, embedding_spec(config, optimizer, sharding=args.sharding,
                                  memory_budget=args.memory_budget, dtype=DTYPES[args.dtype],
                                  stochastic_rounding=args.stochastic_rounding,
                                  exchange_compression=args.exchange)


def rows_record(spec: ec.EmbeddingSpec) -> dict[str, Any]:
    """What the eval records hold of the tables' rows: ``{"dtype": "float32"}`` when every table
    has one dtype, else ``{"dtype": {table: dtype}}``; with compact (16-bit) rows also
    ``"stochastic_rounding"``, one bool or a bool per compact table."""
    tables = spec_tables(spec)
    dtypes = {n: str(t.dtype).replace("torch.", "") for n, t in tables.items()}
    rounding = {n: t.stochastic_rounding for n, t in tables.items()
                if t.dtype in (torch.float16, torch.bfloat16)}
    record: dict[str, Any] = {"dtype": _one_or_all(dtypes)}
    if rounding:
        record["stochastic_rounding"] = _one_or_all(rounding)
    return record


def _one_or_all(values: dict[str, Any]) -> Any:
    return next(iter(values.values())) if len(set(values.values())) == 1 else values


def describe_rows(record: dict[str, Any]) -> str:
    """``rows_record``'s record in words, for the tables' line."""
    dtype = record["dtype"]
    if isinstance(dtype, dict):
        words = "rows " + ", ".join(f"{n} {d}" for n, d in dtype.items())
    else:
        words = f"{dtype} rows"
    rounding = record.get("stochastic_rounding")
    if rounding is None:
        return words
    if isinstance(rounding, dict):
        return words + " (compact rows rounded " + ", ".join(
            f"{n} {'stochastically' if r else 'to nearest'}" for n, r in rounding.items()) + ")"
    return words + f" (updates rounded {'stochastically' if rounding else 'to nearest'})"


def read_spec(path: Path) -> ec.EmbeddingSpec:
    """The EmbeddingSpec in the JSON file ``path``.

    Raises:
        ValueError: no such file, not JSON, or not a spec (naming the file and the part).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--spec {path}: cannot read it ({e.strerror or e})") from None
    try:
        return ec.EmbeddingSpec.from_dict(json.loads(text))
    except json.JSONDecodeError as e:
        raise ValueError(f"--spec {path}: not JSON ({e})") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"--spec {path}: {e}") from None


def spec_json(spec: ec.EmbeddingSpec) -> str:
    """``spec.to_dict()`` as JSON for people to edit: a line per table and per feature."""
    d = spec.to_dict()
    lines = []
    for key, value in d.items():
        if key in ("tables", "features") and isinstance(value, dict) and value:
            inner = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items())
            lines.append(f"  {json.dumps(key)}: {{\n{inner}\n  }}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def spec_differences(saved: Any, given: Any, path: str = "") -> list[str]:
    """Where two specs' dicts differ, as ``"tables.C3.dim: 16 there, 8 now"``."""
    if isinstance(saved, dict) and isinstance(given, dict):
        return [d for k in dict.fromkeys([*saved, *given])
                for d in spec_differences(saved.get(k, "absent"), given.get(k, "absent"),
                                          f"{path}.{k}" if path else str(k))]
    return [] if saved == given else [f"{path}: {saved!r} there, {given!r} now"]


# --------------------------------------------------------------------------------- steps
def to_torch(batch: Any, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A process's share of a batch (``read_batches(share=...)``), as tensors on ``device``."""
    return (torch.from_numpy(batch.dense).to(device),  # (b, 13)
            torch.from_numpy(batch.sparse).to(device),  # (b, 26)
            torch.from_numpy(batch.label).to(device))  # (b,)


@torch.no_grad()
def evaluate(model: DLRM, data: Dataset, device: str, rank: int, world: int,
             batch_size: int = 16384) -> dict[str, Any]:
    """Exact AUC and log loss over the whole test set (every process scores its share)."""
    model.eval()
    stats = ReadStats()
    labels, probs = [], []
    for batch in data.test(batch_size, stats, share=(rank, world)):
        dense, sparse, label = to_torch(batch, device)
        probs.append(torch.sigmoid(model(dense, sparse)).double().cpu().numpy())
        labels.append(label.cpu().numpy())
    y = np.concatenate(labels) if labels else np.zeros(0)
    p = np.concatenate(probs) if probs else np.zeros(0)
    if distributed():
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (y, p))
        y = np.concatenate([g[0] for g in gathered])
        p = np.concatenate([g[1] for g in gathered])
    model.train()
    if y.size == 0:
        raise ValueError("the test set is empty: more lines (--limit) or a smaller "
                         "--holdout-every are needed")
    return {"test_auc": roc_auc(y, p), "test_logloss": log_loss(y, p),
            "test_examples": int(y.size), "test_ctr": float(y.mean()),
            "test_skipped": stats.skipped}


# --------------------------------------------------------------------------------- checkpoints
def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(root: Path, model: DLRM, dense_opt: torch.optim.Optimizer,
                    position: dict[str, int], history: list[dict[str, Any]],
                    identity: dict[str, Any], keep: int, rank: int,
                    settings: dict[str, Any] | None = None) -> Path:
    """Writes a checkpoint, then points ``latest`` at it, then prunes old ones: an interrupted
    save leaves the previous checkpoint the one ``--resume`` reads. ``settings``: the run's
    (``choose_settings``), which a resumed run takes for the flags not given again."""
    ckpt = root / f"step-{position['global_step']:08d}"
    ec.save(ckpt / "embedding", model.embedding, extra=dict(position))  # every process
    if rank == 0:
        dense = {"position": position, "model_config": asdict(model.config),
                 "dense_arch": model.dense_arch.state_dict(),
                 "optimizer": dense_opt.state_dict(), "history": history, "run": identity,
                 "settings": settings}
        _write_atomic(ckpt / "dense.pt", lambda p: torch.save(dense, p))
        _write_atomic(root / "latest", lambda p: p.write_text(ckpt.name + "\n"))
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old)
    barrier()
    return ckpt


# A rate path of a spec's dict: the default optimizer's or a table's own (a schedule's parts too).
LEARNING_RATE = re.compile(r"(optimizer|tables\.[^.]+\.optimizer)\.learning_rate(\..+)?")


def restore_checkpoint(root: Path, model: DLRM, dense_opt: torch.optim.Optimizer,
                       identity: dict[str, Any], say: Callable[..., None] = print,
                       spec_source: str = "the flags build"
                       ) -> tuple[dict[str, int], list[dict]] | None:
    """Restores the newest checkpoint under ``root``; None when there is none.

    The learning rates may change: the tables' (the spec's, ``--embedding-lr``) and the dense
    part's (``--lr``) are the ones ``model`` and ``dense_opt`` were built with, not the
    checkpoint's (a note says so). On one process the spec's sharding may change too (every
    table is whole there). A checkpoint whose manifest records no spec (written before
    checkpoints recorded one) is taken to have ``model``'s (``spec_source``: whence it comes,
    for the note), once what the manifest does record of each table matches.

    Raises:
        ValueError: the checkpoint was written with other data or flags (nothing restored).
    """
    try:
        ckpt = root / (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    dense = torch.load(ckpt / "dense.pt", map_location="cpu", weights_only=True)
    saved = dense["run"]
    if saved != identity:
        differ = ", ".join(f"{k}: {saved.get(k, 'unrecorded')!r} there, {v!r} now"
                           for k, v in identity.items() if saved.get(k, "unrecorded") != v)
        raise ValueError(f"{ckpt} was written by a run with other data or flags ({differ}); "
                         f"resume with the same data and flags, or leave out --resume")
    config = as_model_config(dense["model_config"])  # ("arch" unrecorded before --model: dcnv2)
    if config != model.config:
        raise ValueError(f"{ckpt} holds a model with {config}, but the flags give "
                         f"{model.config}; resume with the same model flags")
    notes = _check_tables(ckpt, model, one_process=identity.get("world") == 1,
                          spec_source=spec_source)
    ec.load(ckpt / "embedding", model.embedding)
    model.dense_arch.load_state_dict(dense["dense_arch"])
    rates = [group["lr"] for group in dense_opt.param_groups]  # the flags' (--lr)
    dense_opt.load_state_dict(dense["optimizer"])  # its accumulators, and its rate ...
    saved_rates = [group["lr"] for group in dense_opt.param_groups]
    for group, lr in zip(dense_opt.param_groups, rates, strict=True):
        group["lr"] = lr  # ... which the flags' replaces
    if saved_rates != rates:
        notes.append(f"the dense part's learning rate changed (--lr): "
                     f"{_one(saved_rates)!r} there, {_one(rates)!r} now; the resumed run uses "
                     f"{_one(rates)!r}")
    for note in notes:
        say(f"note: {note}")
    return dense["position"], dense["history"]


def _one(values: list[Any]) -> Any:
    return values[0] if len(set(values)) == 1 else values


def _check_tables(ckpt: Path, model: DLRM, one_process: bool, spec_source: str) -> list[str]:
    """Checks the tables' spec the checkpoint's manifest records against ``model.spec``: the
    same but for the memory budget, the exchange's compression, the learning rates and (on
    one process) the sharding.
    Returns the notes to print (what changed and is allowed, or that no spec was recorded).

    Raises:
        ValueError: another spec (naming the differences), or with no spec recorded, tables
            whose manifest entries differ from ``model``'s.
    """
    embedding = ckpt / "embedding"
    try:
        manifest = json.loads((embedding / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        manifest = None  # EmbeddingSpec.from_checkpoint (then ec.load) names what is wrong
    if isinstance(manifest, dict) and manifest.get("spec") is None:
        return _check_unrecorded_spec(ckpt, manifest, model, spec_source)
    saved_spec = ec.EmbeddingSpec.from_checkpoint(embedding).to_dict()
    differ = spec_differences(saved_spec, model.spec.to_dict())
    rates = [d for d in differ if LEARNING_RATE.fullmatch(d.partition(": ")[0])]
    sharding = [d for d in differ if d.partition(": ")[0].split(".")[0] == "sharding"]
    refused = [d for d in differ if d not in rates and not d.startswith("memory_budget:")
               and not d.startswith("exchange_compression.")
               and not (one_process and d in sharding)]
    if refused:
        raise ValueError(f"{ckpt} was written with another spec of the tables ("
                         f"{'; '.join(refused[:6])}{'; ...' if len(refused) > 6 else ''}); "
                         f"resume with the same spec (--spec, or the flags that build it), or "
                         f"leave out --resume")
    notes = []
    if rates:
        notes.append(f"the tables' learning rate changed ({'; '.join(rates)}); the resumed "
                     f"run uses the new one")
    if one_process and sharding:
        notes.append(f"the tables' sharding changed ({'; '.join(sharding)}); one process holds "
                     f"every table whole whatever the sharding, so nothing else changes")
    return notes


def _check_unrecorded_spec(ckpt: Path, manifest: dict[str, Any], model: DLRM,
                           spec_source: str) -> list[str]:
    """A checkpoint written before manifests recorded the spec: what they did record of each
    table (rows, dim, dtype, combiner, dynamic or static, the optimizer's class) must be
    ``model``'s; its spec is then taken to be ``model.spec``."""
    def record(tables: Any) -> dict[str, Any]:
        if not isinstance(tables, dict):
            return {"tables": tables}
        return {name: {"vocabulary_size": t.get("vocabulary_size"), "dim": t.get("dim"),
                       "dtype": t.get("dtype"), "combiner": t.get("combiner"),
                       "kind": "static" if t.get("dynamic") is None else "dynamic",
                       "optimizer": (None if t.get("optimizer") is None
                                     else str(t["optimizer"]).split("(")[0])}
                if isinstance(t, dict) else t for name, t in tables.items()}

    why = manifest.get("spec_error", "written before checkpoints recorded one")
    now = model.embedding.engine.manifest()["tables"]
    differ = spec_differences(record(manifest.get("tables")), record(now))
    if differ:
        raise ValueError(f"{ckpt} records no spec of the tables ({why}), and its tables are "
                         f"not those {spec_source} ("
                         f"{'; '.join(differ[:6])}{'; ...' if len(differ) > 6 else ''}); "
                         f"resume with the same tables, or leave out --resume")
    notes = [(f"{ckpt} records no spec of the tables ({why}); resuming with the spec "
              f"{spec_source}: its tables' rows, dims, kinds and optimizers match the "
              f"checkpoint's")]
    saved_rates = {_rate(t.get("optimizer")) for t in manifest["tables"].values()
                   if isinstance(t, dict)}
    rates = {_rate(t.get("optimizer")) for t in now.values()}
    if None not in saved_rates | rates and saved_rates != rates:
        notes.append(f"the tables' learning rate changed ({_one(sorted(saved_rates))} there, "
                     f"{_one(sorted(rates))} now); the resumed run uses the new one")
    return notes


def _rate(optimizer: Any) -> str | None:
    """The learning rate an optimizer's repr (a manifest's table entry) shows, as written."""
    found = re.search(r"learning_rate=([^,)]+)", str(optimizer)) if optimizer else None
    return found.group(1) if found else None


# --------------------------------------------------------------------------------- outputs
def write_metrics(out: Path, history: list[dict[str, Any]]) -> None:
    """metrics.jsonl, rewritten whole (after a resume it matches the checkpoint)."""
    lines = "".join(json.dumps(r) + "\n" for r in history)
    _write_atomic(out / "metrics.jsonl", lambda p: p.write_text(lines))


def plot_curves(out: Path, history: list[dict[str, Any]], title: str) -> bool:
    """curves.png: training loss over examples and test AUC per epoch. False: no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [r for r in history if r["kind"] == "train"]
    evals = [r for r in history if r["kind"] == "eval"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["examples"] for r in train], [r["loss"] for r in train], label="train log loss")
    a.set_xlabel("training examples")
    a.set_ylabel("log loss (mean over the last steps)")
    b.plot([r["epoch"] for r in evals], [r["test_auc"] for r in evals], "o-", label="test AUC")
    b.set_xlabel("epoch")
    b.set_ylabel("test AUC")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the job; returns the final metrics (test_auc, test_logloss, examples_per_s, ...)."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rank, world, args.device = init_processes(args.device)
    try:
        if not args.synthetic:  # no --data: --write-spec only
            return _run(args, args.data, None, rank, world)
        with tempfile.TemporaryDirectory(prefix="criteo-synthetic-") as tmp:
            info = generate(tmp, train_lines=args.synthetic_lines,
                            test_lines=max(1, args.synthetic_lines // 4), seed=args.seed)
            return _run(args, Path(tmp), info, rank, world)
    finally:
        torch.set_num_threads(threads)  # main() may be called from a larger program
        if distributed():
            dist.destroy_process_group()


def _run(args: argparse.Namespace, directory: Path | None, synthetic: dict | None, rank: int,
         world: int) -> dict[str, Any]:
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of "
                         f"processes ({world})")
    spec = config = buckets = None
    if args.spec is not None:  # the tables as data: the dense part takes D from them
        spec = read_spec(args.spec)
        try:
            config = config_from_spec(spec, **dense_sizes(args))  # (checked; sizes below)
        except ValueError as e:
            raise ValueError(f"--spec {args.spec}: {e}") from None
        if not config.raw_ids:  # static tables: the reader hashes the ids into their rows
            rows = sorted(set(config.capacities))
            buckets = rows if len(rows) == 1 else list(config.capacities)
    elif args.hash_buckets is not None:
        buckets = list(args.hash_buckets)
    data = Dataset(args, directory, synthetic, buckets) if directory is not None else None
    if synthetic is not None:
        say(SYNTHETIC_WARNING)
        say(f"synthetic data: {synthetic['train_lines']:,} train / {synthetic['test_lines']:,} "
            f"test lines; best achievable test AUC {synthetic['best_test_auc']:.4f} (the true "
            f"click probabilities'), their log loss {synthetic['best_test_logloss']:.4f}")
    if data is not None:
        say(f"data: {data.describe()}")
    out: Path = args.out
    root = out / "checkpoints"
    settings = choose_settings(args, data, root, say)
    if spec is None:
        config, spec = flags_spec(args, data, say, world)
    else:
        config = config_from_spec(spec, **dense_sizes(args))
    if args.write_spec is not None:
        if rank == 0:
            args.write_spec.parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(args.write_spec, lambda p: p.write_text(spec_json(spec)))
        say(f"wrote the tables' spec to {args.write_spec}: edit it, then train with --spec "
            f"{args.write_spec}")
        return {"spec": str(args.write_spec)}
    assert config is not None and data is not None
    rows = rows_record(spec)
    say(f"tables: 26 x D {config.dim}, {describe_rows(rows)}, "
        + (f"dynamic (raw ids, LRU eviction), capacities {list(config.capacities)}"
           if config.raw_ids else f"static, hashed rows {list(config.capacities)}")
        + (f", from {args.spec}" if args.spec is not None else ""))

    torch.manual_seed(args.seed)  # the tables' seeds and the dense part's initial weights
    model = DLRM(config, spec=spec, device=args.device, offload_dir=args.offload_dir)
    if spec.memory_budget is not None:
        say(f"memory budget {spec.memory_budget}:\n{model.embedding.engine.plan}")
    if world > 1:
        say(f"{world} processes; the tables are sharded:\n{model.embedding.engine.plan}")
    dense_opt = torch.optim.Adagrad(model.dense_arch.parameters(), lr=args.lr, eps=1e-8)
    n_dense = sum(p.numel() for p in model.dense_arch.parameters())
    say((f"model: DLRM-DCNv2, bottom {config.bottom}, {config.cross_layers} cross layers of "
         f"rank {config.cross_rank} over width {config.interaction_width}, top {config.top}; "
         if config.arch == "dcnv2" else "model: logistic regression (the baseline); ")
        + f"{n_dense:,} dense parameters, {sum(config.capacities) * config.dim:,} table entries")

    out.mkdir(parents=True, exist_ok=True)
    identity = {**data.identity(), "batch_size": args.batch_size, "seed": args.seed,
                "world": world}
    position = {"epoch": 0, "line": 0, "epoch_step": 0, "global_step": 0, "examples": 0}
    history: list[dict[str, Any]] = []
    board = Board(args.tensorboard if rank == 0 else None, skip=("epoch", "synthetic"))
    source = f"--spec {args.spec} gives" if args.spec is not None else "the flags build"
    restored = (restore_checkpoint(root, model, dense_opt, identity, say, source)
                if args.resume else None)
    if restored is not None:
        position, history = restored
        if position["epoch"] >= args.epochs:
            raise ValueError(f"the checkpoint under {root} has finished {position['epoch']} "
                             f"epoch(s) and --epochs is {args.epochs}: pass a larger --epochs "
                             f"to train on, or leave out --resume for a fresh run")
        say(f"resumed from {root}: epoch {position['epoch'] + 1}, after line "
            f"{position['line']:,} ({position['global_step']} steps)")
    else:
        if args.resume:
            say(f"--resume: no checkpoint under {root}; starting from scratch")
        if root.exists() and rank == 0:
            say(f"a fresh run: removing the previous run's checkpoints in {root}")
            shutil.rmtree(root)
        barrier()

    model.train()
    final: dict[str, Any] = {}
    train_seconds, train_examples = 0.0, 0
    show_bar = tqdm is not None and args.progress and rank == 0
    steps = data.train_steps(args.batch_size) if show_bar else None  # the bar's total
    while position["epoch"] < args.epochs:
        epoch = position["epoch"] + 1
        stats = ReadStats()
        bar = (tqdm(desc=f"epoch {epoch}/{args.epochs}", unit="step", leave=False,
                    dynamic_ncols=True, disable=not show_bar, total=steps,
                    initial=position["epoch_step"])
               if tqdm is not None else None)
        window_loss, window_n, window_start = 0.0, 0, time.perf_counter()
        examples_read = 0
        for batch in data.train(args.batch_size, stats, share=(rank, world),
                                start_after=position["line"]):
            start = time.perf_counter()
            n = stats.examples - examples_read  # the global batch's size (all processes)
            examples_read = stats.examples
            dense, sparse, label = to_torch(batch, args.device)
            try:
                logits = model(dense, sparse)  # (b,)
            except ValueError as e:
                if "new ids but the shard holds" not in str(e):
                    raise
                raise ValueError(f"{e}: a dynamic table needs a row for every distinct id of "
                                 f"a step on the process owning it; raise --capacity "
                                 f"({args.batch_size * world} rows, --batch-size on each of "
                                 f"{world} process(es), are always enough) or lower "
                                 f"--batch-size") from e
            # sum / global batch: the engine sums row gradients over processes and the dense
            # gradients are summed below, so a step equals the one-process step on the batch
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, label, reduction="sum") / n
            dense_opt.zero_grad(set_to_none=True)
            loss.backward()  # the engine updates the touched table rows here
            if world > 1:
                for p in model.dense_arch.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
            dense_opt.step()
            batch_loss = float(all_sum(loss.detach().double().cpu()))
            train_seconds += time.perf_counter() - start
            train_examples += n
            position["epoch_step"] += 1
            position["global_step"] += 1
            position["examples"] += n
            position["line"] = stats.lines
            window_loss += batch_loss * n
            window_n += n
            if bar is not None:
                bar.update()
                bar.set_postfix(loss=f"{batch_loss:.4f}", refresh=False)
            if position["global_step"] % args.log_every == 0:
                now = time.perf_counter()
                history.append({"kind": "train", "synthetic": synthetic is not None,
                                "epoch": epoch,
                                "step": position["global_step"],
                                "examples": position["examples"],
                                "loss": window_loss / window_n,
                                "examples_per_s": window_n / (now - window_start)})
                window_loss, window_n, window_start = 0.0, 0, now
            if args.checkpoint_every and position["global_step"] % args.checkpoint_every == 0:
                save_checkpoint(root, model, dense_opt, position, history, identity,
                                args.keep_checkpoints, rank, settings)
                if rank == 0:
                    write_metrics(out, history)
                    board.write(history)
        if bar is not None:
            bar.close()
        if stats.skipped:
            say(f"skipped {stats.skipped} bad line(s) of {data.train_path}, e.g. "
                f"{stats.examples_of_bad[0]}")
        if window_n:
            history.append({"kind": "train", "synthetic": synthetic is not None,
                            "epoch": epoch, "step": position["global_step"],
                            "examples": position["examples"], "loss": window_loss / window_n,
                            "examples_per_s": window_n / (time.perf_counter() - window_start)})
        eval_start = time.perf_counter()
        metrics = evaluate(model, data, args.device, rank, world)
        throughput = train_examples / train_seconds if train_seconds else float("nan")
        record = {"kind": "eval", "synthetic": synthetic is not None, "epoch": epoch,
                  "step": position["global_step"],
                  "examples": position["examples"], **metrics,
                  "train_examples_per_s": throughput, "train_skipped": stats.skipped,
                  "eval_seconds": round(time.perf_counter() - eval_start, 3),
                  "data": "SYNTHETIC" if synthetic else str(data.train_path), **rows}
        if synthetic is not None:
            record["best_test_auc"] = synthetic["best_test_auc"]
        history.append(record)
        position.update(epoch=epoch, line=0, epoch_step=0)
        save_checkpoint(root, model, dense_opt, position, history, identity,
                        args.keep_checkpoints, rank, settings)
        if rank == 0:
            write_metrics(out, history)
            board.write(history)
            title = "DLRM-DCNv2" if config.arch == "dcnv2" else "Logistic regression"
            if not plot_curves(out, history, title + " on "
                               + ("SYNTHETIC data" if synthetic else "Criteo")) and epoch == 1:
                say("curves.png is not written: matplotlib is not installed")
        say(f"epoch {epoch}/{args.epochs}: {position['examples']:,} examples trained, "
            f"{throughput:,.0f} examples/s; test AUC {metrics['test_auc']:.4f}, log loss "
            f"{metrics['test_logloss']:.4f} over {metrics['test_examples']:,} examples",
            flush=True)
        final = record
    board.close()
    if synthetic is not None:
        say(f"{SYNTHETIC_WARNING}\nbest achievable test AUC on it: "
            f"{synthetic['best_test_auc']:.4f}")
    say(f"test auc={final['test_auc']:.4f} logloss={final['test_logloss']:.4f}", flush=True)
    return final


def cli(argv: list[str] | None = None) -> int:
    """The command line: data and flag errors in one line instead of a traceback."""
    try:
        main(argv)
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
