"""Serves a trained DLRM-DCNv2 with float32, fp16 and int8 tables: test AUC, log loss and bytes.

    python examples/criteo/serve.py --run runs/criteo                  # the newest checkpoint
    python examples/criteo/serve.py --checkpoint runs/criteo/checkpoints/step-00000391
    python examples/criteo/serve.py --run runs/criteo --export runs/criteo/serving.pt2
    python examples/criteo/serve.py --run runs/criteo --aoti runs/criteo/dlrm-aoti.pt2

The model is rebuilt from the checkpoint alone: the tables' ``ec.EmbeddingSpec`` from the
embedding checkpoint's manifest (``ec.EmbeddingSpec.from_checkpoint``), their rows and id maps by
``ec.load(..., slots=False)``, the dense part and its sizes from ``dense.pt``. The test set is
the one the run evaluated on, found from what ``dense.pt`` records (the data directory and its
flags, or the synthetic data's seed and size, regenerated); ``--data DIR`` or ``--synthetic``
point elsewhere.

For each precision the tables are served by ``layer.for_serving(quantize=...)`` (None: as
trained, float32 or a ``--dtype float16`` / ``bfloat16`` run's 16-bit rows, the row labelled
"fp32"; ``"fp16"``; ``"int8"``: row-wise codes with a float32 scale and bias per row) under the
same dense part, and the whole test set is scored: the table prints the test AUC, the log loss
and the bytes the tables hold (dynamic tables' id maps counted apart: they are the same at every
precision). ``--export PATH`` exports the whole model (dense part and quantized tables, their
id maps inside) with ``torch.export``, saves it, loads it back and checks that its outputs on
test batches are bitwise the eager model's. ``--aoti PATH`` compiles that exported model with
AOTInductor into one package (``.pt2``: a shared library and the weights) that torch alone serves,
embcore not installed (``torch._inductor.aoti_load_package(PATH)(dense, sparse)``, or C++'s
``AOTIModelPackageLoader``), and checks it the same way. The package takes ``dense`` (B, 13)
float32 and ``sparse`` (B, 26) int64, both contiguous; ``ec.load_package(PATH)`` loads it with
those inputs checked (and the package's checksums verified), torch's loader checks neither.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import embcore as ec  # noqa: E402
from criteo.data import ReadStats  # noqa: E402
from criteo.generate import SYNTHETIC_NOTE, generate  # noqa: E402
from criteo.metrics import log_loss, roc_auc  # noqa: E402
from criteo.model import (FEATURES, ModelConfig, as_model_config,  # noqa: E402
                          make_dense_arch)

PRECISIONS: dict[str, str | None] = {"fp32": None, "fp16": "fp16", "int8": "int8"}


class ServingDLRM(nn.Module):
    """DLRM-DCNv2 for serving: ``forward(dense (B, 13) float, sparse (B, 26) int64) -> logits
    (B,)``, the tables an ``ec`` serving module (plain torch ops, maybe quantized), the dense part
    as trained. ``torch.export``-able."""

    def __init__(self, embedding: nn.Module, dense_arch: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.dense_arch = dense_arch.eval()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        acts = self.embedding({name: sparse[:, j]
                               for j, name in enumerate(FEATURES)})  # {feature: (B, D)}
        return self.dense_arch(dense, [acts[name] for name in FEATURES])  # (B,)


# --------------------------------------------------------------------------------- restore
def find_checkpoint(run: Path | None, checkpoint: Path | None) -> Path:
    """The checkpoint directory (holding ``embedding/`` and ``dense.pt``) to serve."""
    if checkpoint is None:
        assert run is not None
        latest = run / "checkpoints" / "latest"
        if not latest.is_file():
            raise ValueError(f"{run} holds no checkpoints/latest: pass the --out directory of "
                             f"a finished train.py run, or --checkpoint")
        checkpoint = run / "checkpoints" / latest.read_text().strip()
    if not (checkpoint / "dense.pt").is_file() or not (checkpoint / "embedding").is_dir():
        raise ValueError(f"{checkpoint} is not a train.py checkpoint (embedding/ and dense.pt)")
    return checkpoint


def restore(checkpoint: Path) -> tuple[ec.EmbeddingLayer, nn.Module, ModelConfig, dict]:
    """The trained tables (a layer built from the manifest's spec, parameters and id maps
    loaded, no optimizer slots read), the dense part, its config and ``dense.pt``'s content."""
    state = torch.load(checkpoint / "dense.pt", map_location="cpu", weights_only=True)
    config = as_model_config(state["model_config"])
    spec = ec.EmbeddingSpec.from_checkpoint(checkpoint / "embedding")
    layer = ec.EmbeddingLayer.from_spec(spec, device="cpu")
    names = {t.name: t for t in layer.embedding_tables}
    if sorted(names) != sorted(FEATURES) or any(t.dim != config.dim for t in names.values()):
        raise ValueError(f"{checkpoint}: the embedding spec's tables {sorted(names)} do not "
                         f"match the model's 26 tables of dim {config.dim}")
    ec.load(checkpoint / "embedding", layer, slots=False)
    dense_arch = make_dense_arch(config)
    dense_arch.load_state_dict(state["dense_arch"])
    return layer.eval(), dense_arch.eval(), config, state


# --------------------------------------------------------------------------------- data
def load_test_set(run: dict[str, Any], data: Path | None, synthetic: bool, work: Path):
    """``(dataset, synthetic info or None)``: the test examples the run evaluated on (as
    train.py's ``Dataset``), from ``dense.pt``'s ``run`` record unless ``data`` / ``synthetic``
    say otherwise."""
    from criteo.train import Dataset
    flags = SimpleNamespace(skip_bad=run.get("skip_bad", False), limit=run.get("limit"),
                            holdout_every=run.get("holdout_every", 7))
    info = None
    if data is None and (synthetic or run.get("data") == "synthetic"):
        if run.get("data") != "synthetic":
            raise ValueError("--synthetic: the run was not trained on synthetic data, so its "
                             "seed and size are unknown; pass --data DIR")
        lines = int(run["train_lines"])  # test.txt gets a quarter, as train.py --synthetic
        info = generate(work, train_lines=lines, test_lines=max(1, lines // 4),
                        scale=run["scale"], seed=run["seed"])
        data = work
    elif data is None:
        data = Path(run["data"]).parent  # the recorded train.txt's directory
    return Dataset(flags, data, info, run.get("hash_buckets")), info


def scores(model: nn.Module, dataset: Any, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, click probabilities) over the whole test set."""
    labels, probs = [], []
    with torch.no_grad():
        for batch in dataset.test(batch_size, ReadStats(), share=(0, 1)):
            logits = model(torch.from_numpy(batch.dense), torch.from_numpy(batch.sparse))
            probs.append(torch.sigmoid(logits).double().numpy())
            labels.append(batch.label)
    if not labels:
        raise ValueError("the test set is empty")
    return np.concatenate(labels), np.concatenate(probs)


# --------------------------------------------------------------------------------- export
def test_batches(dataset: Any, batch_size: int, batches: int = 3
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``batches`` test batches as ``(dense, sparse)`` tensors, and a batch of one."""
    examples = []
    for batch in dataset.test(batch_size, ReadStats(), share=(0, 1)):
        examples.append((torch.from_numpy(batch.dense), torch.from_numpy(batch.sparse)))
        if len(examples) == batches:
            break
    return [*examples, (examples[0][0][:1], examples[0][1][:1])]


def export_program(model: ServingDLRM, example: tuple[torch.Tensor, torch.Tensor]
                   ) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` for any batch size, traced on 8 rows of ``example``."""
    b = torch.export.Dim("batch", min=1)
    trace = (example[0][:8].clone(), example[1][:8].clone())  # (saved with the program)
    return torch.export.export(model, trace, dynamic_shapes=({0: b}, {0: b}))


def export(model: ServingDLRM, dataset: Any, path: Path, batch_size: int,
           batches: int = 3) -> dict[str, Any]:
    """Exports ``model`` (any batch size), saves it to ``path``, loads it back and compares its
    logits with the eager model's on the first ``batches`` test batches (bitwise)."""
    examples = test_batches(dataset, batch_size, batches)
    torch.export.save(export_program(model, examples[0]), path)
    return compare(torch.export.load(path).module(), model, examples, path)


def package(model: ServingDLRM, dataset: Any, path: Path, batch_size: int,
            batches: int = 3) -> dict[str, Any]:
    """Compiles the exported ``model`` with AOTInductor into the package ``path`` (``.pt2``;
    ``ec.package_program``: the package records its inputs, ``dense`` (B, 13) float32 and
    ``sparse`` (B, 26) int64, and its members' checksums), loads it back with
    ``ec.load_package`` (checksums verified, inputs checked) and compares its logits with the
    eager model's (bitwise)."""
    if path.suffix != ".pt2":
        raise ValueError(f"--aoti {path}: an AOTInductor package's name ends in .pt2")
    examples = test_batches(dataset, batch_size, batches)
    start = time.perf_counter()
    ec.package_program(export_program(model, examples[0]), path)
    seconds = time.perf_counter() - start
    result = compare(ec.load_package(path), model, examples, path)
    return {**result, "compile_seconds": round(seconds, 1)}


def compare(loaded: Any, model: ServingDLRM, examples: list[tuple[torch.Tensor, torch.Tensor]],
            path: Path) -> dict[str, Any]:
    """``loaded``'s logits against ``model``'s on ``examples``: bitwise equal, or how far."""
    worst, equal, n = 0.0, True, 0
    with torch.no_grad():
        for dense, sparse in examples:
            got, want = loaded(dense, sparse), model(dense, sparse)
            equal &= torch.equal(got, want)
            worst = max(worst, float((got - want).abs().max()))
            n += len(want)
    return {"path": str(path), "bytes": path.stat().st_size, "bitwise_equal": bool(equal),
            "max_abs_diff": worst, "examples_checked": n}


# --------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", type=Path, help="a train.py --out directory: its newest "
                       "checkpoint")
    where.add_argument("--checkpoint", type=Path, help="a checkpoint directory "
                       "(checkpoints/step-N, holding embedding/ and dense.pt)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", type=Path, default=None,
                      help="evaluate on DIR's test set (default: the run's recorded data)")
    data.add_argument("--synthetic", action="store_true",
                      help="regenerate the run's synthetic data (the default for a synthetic "
                           "run)")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS),
                   default=list(PRECISIONS), help="table precisions to serve and compare")
    p.add_argument("--export", type=Path, default=None,
                   help="also export the whole model with torch.export to this file")
    p.add_argument("--aoti", type=Path, default=None,
                   help="also compile the exported model with AOTInductor into this package "
                        "(.pt2), served by torch alone")
    p.add_argument("--export-precision", choices=list(PRECISIONS), default="int8",
                   help="the tables' precision in the exported model (and the package)")
    p.add_argument("--batch-size", type=int, default=16384, help="examples per scoring batch")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    if args.aoti is not None and args.aoti.suffix != ".pt2":
        p.error(f"--aoti {args.aoti}: an AOTInductor package's name ends in .pt2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Serves the checkpoint at each precision; returns ``{"results": {precision: {test_auc,
    test_logloss, table_bytes, ...}}, "export": ... or None, ...}``."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="criteo-serve-") as work:
            return _serve(args, Path(work))
    finally:
        torch.set_num_threads(threads)


def _serve(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ckpt = find_checkpoint(args.run, args.checkpoint)
    layer, dense_arch, config, state = restore(ckpt)
    dataset, info = load_test_set(state["run"], args.data, args.synthetic, work)
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in layer.embedding_tables})
    print(f"checkpoint {ckpt} (step {state['position']['global_step']}): 26 tables x D "
          f"{config.dim}, " + ("dynamic (raw ids)" if config.raw_ids else "static (hashed)")
          + f", {'/'.join(dtypes)} rows"
          + ("" if dtypes == ["float32"] else " (the fp32 row serves them as trained)")
          + f"; test set: {dataset.describe()}")
    if info is not None:
        print(f"*** {SYNTHETIC_NOTE} *** best achievable test AUC {info['best_test_auc']:.4f}")
    trained = [r for r in state["history"] if r["kind"] == "eval"
               and r["step"] == state["position"]["global_step"]]
    results: dict[str, dict[str, Any]] = {}
    models: dict[str, ServingDLRM] = {}
    reference = None  # fp32's probabilities, when served first
    for label in args.precisions:
        start = time.perf_counter()
        served = layer.for_serving(quantize=PRECISIONS[label])
        model = ServingDLRM(served, dense_arch).eval()
        y, p = scores(model, dataset, args.batch_size)
        buffers = dict(served.named_buffers())
        maps = sum(v.numel() * v.element_size() for k, v in buffers.items()
                   if k.endswith(("__ids", "__rows")))
        results[label] = {"test_auc": roc_auc(y, p), "test_logloss": log_loss(y, p),
                          "table_bytes": sum(served.table_bytes().values()), "map_bytes": maps,
                          "test_examples": int(y.size),
                          "seconds": round(time.perf_counter() - start, 3)}
        if label == "fp32":
            reference = p
        if reference is not None:  # how far each click probability moved
            results[label]["max_prob_diff"] = float(np.abs(p - reference).max())
        models[label] = model
    base = results.get("fp32")
    print(f"\n{'tables':<7} {'test AUC':>9} {'vs fp32':>10} {'log loss':>9} {'vs fp32':>10} "
          f"{'max |dp|':>9} {'table bytes':>12} {'vs fp32':>7} {'score s':>8}")
    for label, r in results.items():
        d_auc = f"{r['test_auc'] - base['test_auc']:+.6f}" if base else ""
        d_loss = f"{r['test_logloss'] - base['test_logloss']:+.6f}" if base else ""
        ratio = f"{r['table_bytes'] / base['table_bytes']:.3f}" if base else ""
        dp = f"{r['max_prob_diff']:.2e}" if "max_prob_diff" in r else ""
        print(f"{label:<7} {r['test_auc']:>9.6f} {d_auc:>10} {r['test_logloss']:>9.6f} "
              f"{d_loss:>10} {dp:>9} {r['table_bytes']:>12,} {ratio:>7} {r['seconds']:>8.2f}")
    print("(max |dp|: the largest change of a click probability against fp32 tables; score s: "
          "seconds to score the test set, reading included)")
    first = next(iter(results.values()))
    print(f"over {first['test_examples']:,} test examples; id maps of the dynamic tables: "
          f"{first['map_bytes']:,} bytes at every precision"
          + (f"; train.py's own evaluation: AUC {trained[-1]['test_auc']:.5f}, log loss "
             f"{trained[-1]['test_logloss']:.5f}" if trained else ""))
    exported = packaged = None
    label = args.export_precision
    if args.export is not None or args.aoti is not None:
        model = models.get(label) or ServingDLRM(
            layer.for_serving(quantize=PRECISIONS[label]), dense_arch).eval()
    if args.export is not None:
        args.export.parent.mkdir(parents=True, exist_ok=True)
        exported = export(model, dataset, args.export, min(args.batch_size, 4096))
        _say_checked(exported, f"exported the whole model (dense part + {label} tables + id maps) "
                               f"to {args.export} ({exported['bytes']:,} bytes); loaded back",
                     "the exported model")
    if args.aoti is not None:
        args.aoti.parent.mkdir(parents=True, exist_ok=True)
        packaged = package(model, dataset, args.aoti, min(args.batch_size, 4096))
        _say_checked(packaged, f"compiled the whole model ({label} tables) into the AOTInductor "
                               f"package {args.aoti} ({packaged['bytes']:,} bytes, "
                               f"{packaged['compile_seconds']:.0f} s); served by torch alone "
                               f"(torch._inductor.aoti_load_package)", "the AOTInductor package")
    return {"checkpoint": str(ckpt), "results": results, "export": exported, "aoti": packaged,
            "synthetic": info is not None, "trained_eval": trained[-1] if trained else None}


def _say_checked(result: dict[str, Any], what: str, name: str) -> None:
    """Prints ``what`` and how ``result`` (``compare``'s) met the eager model; an error if not
    bitwise."""
    print(f"{what}, its logits on {result['examples_checked']:,} test examples are "
          + ("bitwise the eager model's" if result["bitwise_equal"] else
             f"NOT the eager model's (max |diff| {result['max_abs_diff']:.3g})"))
    if not result["bitwise_equal"]:
        raise RuntimeError(f"{name} disagrees with the eager model")


def cli(argv: list[str] | None = None) -> int:
    try:
        main(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
