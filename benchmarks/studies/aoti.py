"""Serving latency of the Criteo model: eager, torch.export and an AOTInductor package.

    .venv/bin/python benchmarks/studies/aoti.py                  # fp32, fp16, int8; batches 1, 256
    .venv/bin/python benchmarks/studies/aoti.py --precisions int8 --batches 1 --json

The model is examples/criteo's DLRM-DCNv2 served as examples/criteo/serve.py serves it
(``ServingDLRM``: the tables by ``layer.for_serving(quantize=...)``, the dense part as trained),
after a short training run on synthetic data (``--lines``; D 16, the example's small MLPs, 26
raw-id tables). For each table precision three forms answer the same test batches:

- eager: the ``nn.Module`` (Python, embcore's serving lookups: plain torch ops);
- exported: ``torch.export.load(...).module()`` (the exported graph, run by torch's interpreter);
- AOTInductor: the package ``ec.package_program`` wrote, loaded with torch's
  ``aoti_load_package`` (compiled C++; what a process without embcore serves);
- checked: the same package loaded with ``ec.load_package`` (each call's inputs checked against
  what was traced before the package runs; "check us" is its time less the unchecked one's).

Each is checked bitwise against eager first. A latency is the median over ``--repeats`` calls of
one batch (torch.no_grad, ``--threads`` threads), after 10 warm-up calls; the three forms are
timed in turn, round after round, so drift hits them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import embcore as ec  # noqa: E402
from criteo import serve, train  # noqa: E402

SMALL = ["--dim", "16", "--bottom-mlp", "64", "16", "--top-mlp", "64", "32", "--cross-layers",
         "2", "--cross-rank", "16", "--batch-size", "256", "--no-progress", "--threads", "1"]


def median_latencies(forms: dict[str, Any], args: tuple, repeats: int) -> dict[str, float]:
    """Median seconds per call of each form on ``args``, the forms interleaved."""
    times: dict[str, list[float]] = {name: [] for name in forms}
    with torch.no_grad():
        for f in forms.values():
            for _ in range(10):
                f(*args)
        for _ in range(repeats):
            for name, f in forms.items():
                start = time.perf_counter()
                f(*args)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "int8"],
                   choices=list(serve.PRECISIONS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    p.add_argument("--lines", type=int, default=4000, help="synthetic training lines")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON line per result")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="aoti-study-") as tmp:
        work = Path(tmp)
        train.main(["--synthetic", "--synthetic-lines", str(args.lines), "--out",
                    str(work / "run"), *SMALL])
        layer, dense_arch, _, state = serve.restore(serve.find_checkpoint(work / "run", None))
        dataset, _ = serve.load_test_set(state["run"], None, False, work / "data")
        for label in args.precisions:
            model = serve.ServingDLRM(layer.for_serving(quantize=serve.PRECISIONS[label]),
                                      dense_arch).eval()
            exported = serve.export(model, dataset, work / f"{label}-export.pt2", 256)
            packaged = serve.package(model, dataset, work / f"{label}-aoti.pt2", 256)
            assert exported["bitwise_equal"] and packaged["bitwise_equal"], (exported, packaged)
            forms = {"eager": model,
                     "exported": torch.export.load(work / f"{label}-export.pt2").module(),
                     "aoti": torch._inductor.aoti_load_package(str(work / f"{label}-aoti.pt2")),
                     "checked": ec.load_package(work / f"{label}-aoti.pt2")}
            batch = serve.test_batches(dataset, max(args.batches), batches=1)[0]
            for b in args.batches:
                inputs = (batch[0][:b].contiguous(), batch[1][:b].contiguous())
                lat = median_latencies(forms, inputs, args.repeats)
                row = {"precision": label, "batch": b, "threads": args.threads,
                       **{f"{k}_us": round(v * 1e6, 1) for k, v in lat.items()},
                       "aoti_vs_eager": round(lat["eager"] / lat["aoti"], 2),
                       "aoti_vs_exported": round(lat["exported"] / lat["aoti"], 2),
                       "check_us": round((lat["checked"] - lat["aoti"]) * 1e6, 1),
                       "compile_seconds": packaged["compile_seconds"],
                       "package_bytes": packaged["bytes"]}
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
    if not args.json:
        print(f"{'tables':<7} {'batch':>5} {'eager us':>9} {'exported us':>12} {'AOTI us':>8} "
              f"{'checked us':>10} {'check us':>8} {'eager/AOTI':>10} {'exported/AOTI':>13} "
              f"{'compile s':>9}")
        for r in rows:
            print(f"{r['precision']:<7} {r['batch']:>5} {r['eager_us']:>9.1f} "
                  f"{r['exported_us']:>12.1f} {r['aoti_us']:>8.1f} {r['checked_us']:>10.1f} "
                  f"{r['check_us']:>8.1f} {r['aoti_vs_eager']:>10.2f} "
                  f"{r['aoti_vs_exported']:>13.2f} {r['compile_seconds']:>9.1f}")
    return rows


if __name__ == "__main__":
    main()
