"""End-to-end DLRM-DCNv2 training steps: embcore against TorchRec, same dense model and batches.

    .venv/bin/python benchmarks/studies/dlrm.py                         # both systems, both sizes
    .venv/bin/python benchmarks/studies/dlrm.py --size small --repeats 3  # medians of 3 interleaved
    .venv/bin/python benchmarks/studies/dlrm.py --system embcore --size mlperf --json  # one run

The model is examples/criteo/model.py's DLRM-DCNv2 (bottom MLP, 26 tables, low-rank cross
layers, top MLP, one logit) in both systems: the dense part is the same ``DenseArch`` module,
built from the same seed; only the tables differ:

- embcore: ``ec.EmbeddingLayer`` (the example's ``DLRM``), the update fused into backward;
- TorchRec: ``FusedEmbeddingBagCollection`` (FBGEMM's CPU TBE underneath, the update fused
  into backward) fed a ``KeyedJaggedTensor``; runs with ``--peers-python``.

The "TorchRec model on embcore" rows run TorchRec's own ``torchrec.models.dlrm.DLRM_DCN`` (its
dense arch, low-rank cross net and over arch at the same sizes) twice, both with
``--peers-python``: ``trec-embcore`` with ``embcore.torchrec.EmbeddingBagCollection`` (the one
line a TorchRec user changes; ``fused_params`` EXACT_ADAGRAD or EXACT_ROWWISE_ADAGRAD, lr 0.005,
eps 1e-10), ``trec-torchrec`` with TorchRec's ``FusedEmbeddingBagCollection`` as above; the same
configs, batches (as ``KeyedJaggedTensor``s) and dense optimizer. Their "vs TorchRec" compares
the two; the dense-part columns do not apply (another dense model).

A step: forward, mean binary cross-entropy, backward (the tables update themselves), then
``torch.optim.Adagrad`` (lr 0.005, MLPerf's) on the dense part. Tables: exact Adagrad (lr 0.005,
accumulators from 0) by default, ``--optimizer rowwise`` for row-wise Adagrad (MLPerf's choice).
Rows per table: Criteo Kaggle's 26 cardinalities capped at ``--max-rows`` (memory: 2 systems x
26 tables on a 24 GiB machine); ids follow Zipf(1.05) over each table
(benchmarks/core/workloads.py).

Sizes: ``mlperf`` is MLPerf's model (D 128, bottom 512-256-128, 3 cross layers of rank 512, top
1024-1024-512-256, batch 4096: about 90 MFLOP an example, so the dense part dominates on a CPU);
``small`` is the example's quick setting (D 16, bottom 64-16, cross rank 64, top 256-128, batch
4096), where the tables weigh more. The embedding share is measured by timing the same steps
with the dense part replaced by a linear read-out of the embeddings (the tables' forward,
backward and update only): share = that time / the full step's.

The ceiling: ``--system none`` times the dense part alone (the same model fed fixed embeddings,
their gradient still computed), so ``step - dense part`` is what the tables add to a full step,
and TorchRec's step / the dense part is the most any engine could gain over TorchRec with the
same dense model (its tables taking no time at all).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent  # benchmarks/studies
ROOT = HERE.parents[1]                  # the repository
sys.path[:0] = [str(HERE), str(ROOT / "benchmarks" / "core"), str(ROOT), str(ROOT / "examples")]
from workloads import _permutation, zipf_ids  # noqa: E402

KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
          27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
SIZES = {
    "mlperf": dict(dim=128, bottom=(512, 256, 128), cross_layers=3, cross_rank=512,
                   top=(1024, 1024, 512, 256)),
    "small": dict(dim=16, bottom=(64, 16), cross_layers=3, cross_rank=64, top=(256, 128)),
}
LR = 0.005
SYSTEMS = ["none", "embcore", "torchrec", "trec-embcore", "trec-torchrec"]
# for each system, the one its "vs TorchRec" column compares with
PEER = {"embcore": "torchrec", "torchrec": "torchrec", "trec-embcore": "trec-torchrec",
        "trec-torchrec": "trec-torchrec"}
BATCH = 4096
NUM_BATCHES = 4


def make_batches(rows: list[int], count: int) -> list[tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor]]:
    """``count`` batches of (dense (B, 13) float, sparse (B, 26) int64, labels (B,) float)."""
    out = []
    for i in range(count):
        rng = np.random.default_rng([7, i])
        dense = torch.from_numpy(np.log1p(rng.exponential(3.0, (BATCH, 13))).astype(np.float32))
        sparse = torch.from_numpy(np.stack(
            [zipf_ids(np.random.default_rng([7, i, t]), n, BATCH, _permutation(n, t))
             for t, n in enumerate(rows)], axis=1).astype(np.int64))  # (B, 26)
        labels = torch.from_numpy((rng.random(BATCH) < 0.25).astype(np.float32))
        out.append((dense, sparse, labels))
    return out


class Readout(torch.nn.Module):
    """The dense part replaced by a linear read-out: the tables' share of a step."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = torch.nn.Linear(width, 1)

    def forward(self, dense: torch.Tensor, embeddings: list[torch.Tensor]) -> torch.Tensor:
        return self.w(torch.cat(embeddings, dim=1)).squeeze(-1)


def build_torchrec_model(system: str, size: str, optimizer: str, rows: list[int],
                         tables_only: bool):
    """TorchRec's DLRM_DCN on embcore's EmbeddingBagCollection (``trec-embcore``) or TorchRec's
    fused one (``trec-torchrec``): (forward(dense, sparse) -> logits, dense parameters)."""
    from criteo.model import NUM_DENSE, NUM_SPARSE
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.models.dlrm import DLRM_DCN
    sz = SIZES[size]
    keys = [f"C{j + 1}" for j in range(NUM_SPARSE)]
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=sz["dim"], num_embeddings=n,
                                 feature_names=[k]) for k, n in zip(keys, rows)]
    torch.manual_seed(0)
    if system == "trec-embcore":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        import embcore.torchrec
        kind = (EmbOptimType.EXACT_ADAGRAD if optimizer == "adagrad"
                else EmbOptimType.EXACT_ROWWISE_ADAGRAD)
        ebc = embcore.torchrec.EmbeddingBagCollection(
            tables, fused_params={"optimizer": kind, "learning_rate": LR, "eps": 1e-10})
    else:
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim import RowWiseAdagrad
        ebc = FusedEmbeddingBagCollection(
            tables=tables, device=torch.device("cpu"), optimizer_kwargs={"lr": LR, "eps": 1e-10},
            optimizer_type=torch.optim.Adagrad if optimizer == "adagrad" else RowWiseAdagrad)
    lengths = torch.ones(NUM_SPARSE * BATCH, dtype=torch.int64)

    def kjt(sparse: torch.Tensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=keys, values=sparse.t().reshape(-1), lengths=lengths)

    if tables_only:
        readout = Readout(NUM_SPARSE * sz["dim"])

        def forward_tables(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return readout(dense, [ebc(kjt(sparse)).values()])

        return forward_tables, list(readout.parameters())
    model = DLRM_DCN(ebc, dense_in_features=NUM_DENSE, dense_arch_layer_sizes=list(sz["bottom"]),
                     over_arch_layer_sizes=list(sz["top"]) + [1],
                     dcn_num_layers=sz["cross_layers"], dcn_low_rank_dim=sz["cross_rank"])

    def forward(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return model(dense, kjt(sparse)).squeeze(-1)

    # the dense part only: the tables update themselves in backward (TorchRec's fused module
    # has its weights as parameters too)
    return forward, [p for n, p in model.named_parameters()
                     if ".embedding_bag_collection." not in n]


def build(system: str, size: str, optimizer: str, rows: list[int], tables_only: bool):
    """(forward(dense, sparse) -> logits, dense parameters) for one system."""
    if system.startswith("trec-"):
        return build_torchrec_model(system, size, optimizer, rows, tables_only)
    from criteo.model import NUM_SPARSE, DenseArch, ModelConfig
    cfg = ModelConfig(capacities=tuple(rows), raw_ids=False, **SIZES[size])
    torch.manual_seed(0)
    dense_arch = Readout(NUM_SPARSE * cfg.dim) if tables_only else DenseArch(cfg)
    if system == "none":  # the dense part alone: fixed embeddings (their gradient computed)
        fixed = [torch.randn(BATCH, cfg.dim, requires_grad=True) for _ in range(NUM_SPARSE)]

        def forward_dense(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
            return dense_arch(dense, fixed)

        return forward_dense, list(dense_arch.parameters())
    if system == "embcore":
        import embcore as ec
        from criteo.model import DLRM
        opt_cls = ec.Adagrad if optimizer == "adagrad" else ec.RowwiseAdagrad
        model = DLRM(cfg, opt_cls(learning_rate=LR, initial_accumulator_value=0.0))
        model.dense_arch = dense_arch
        return model, list(dense_arch.parameters())
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
    keys = [f"C{j + 1}" for j in range(NUM_SPARSE)]
    ebc = FusedEmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=k, embedding_dim=cfg.dim, num_embeddings=n,
                                   feature_names=[k], pooling=PoolingType.SUM)
                for k, n in zip(keys, rows)],
        optimizer_type=torch.optim.Adagrad if optimizer == "adagrad" else RowWiseAdagrad,
        optimizer_kwargs={"lr": LR, "eps": 1e-10}, device=torch.device("cpu"))
    lengths = torch.ones(NUM_SPARSE * BATCH, dtype=torch.int64)

    def forward(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        kjt = KeyedJaggedTensor(keys=keys, values=sparse.t().reshape(-1), lengths=lengths)
        acts = ebc(kjt).values()  # (B, 26 D), features in key order
        return dense_arch(dense, list(acts.split(cfg.dim, dim=1)))

    return forward, list(dense_arch.parameters())


def measure(system: str, size: str, optimizer: str, max_rows: int, steps: int,
            tables_only: bool) -> float:
    """Median seconds per training step."""
    rows = [min(n, max_rows) for n in KAGGLE]
    batches = make_batches(rows, NUM_BATCHES)
    forward, params = build(system, size, optimizer, rows, tables_only)
    opt = torch.optim.Adagrad(params, lr=LR)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step(i: int) -> None:
        dense, sparse, labels = batches[i % NUM_BATCHES]
        loss = loss_fn(forward(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(2):  # warm-up
        step(i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    full = measure(args.system, args.size, args.optimizer, args.max_rows, args.steps, False)
    tables = measure(args.system, args.size, args.optimizer, args.max_rows, args.steps, True)
    if args.system == "none":
        print(json.dumps({"system": "none", "size": args.size, "dense_ms_per_step": 1e3 * full,
                          "readout_ms_per_step": 1e3 * tables}))
        return
    versions = {"torch": torch.__version__}
    if args.system in ("torchrec", "trec-embcore", "trec-torchrec"):
        import fbgemm_gpu
        import torchrec
        versions.update(torchrec=torchrec.__version__, fbgemm_gpu=fbgemm_gpu.__version__)
    print(json.dumps({"system": args.system, "size": args.size, "optimizer": args.optimizer,
                      "examples_per_s": BATCH / full, "ms_per_step": 1e3 * full,
                      "tables_ms_per_step": 1e3 * tables, "embedding_share": tables / full,
                      "versions": versions}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--system", choices=SYSTEMS, default=None,
                   help="run one system in this process (default: all, each in a subprocess); "
                        "none: the dense part alone, fed fixed embeddings; trec-*: TorchRec's "
                        "DLRM_DCN on embcore's or TorchRec's EmbeddingBagCollection")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS,
                   help="the systems a full run compares (default: all)")
    p.add_argument("--size", choices=sorted(SIZES), default=None)
    p.add_argument("--optimizer", choices=["adagrad", "rowwise"], default="adagrad")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; mlperf 4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each system, interleaved; the table shows their medians")
    p.add_argument("--json", action="store_true")
    p.add_argument("--peers-python", default=str(ROOT / ".venv-peers/bin/python"))
    args = p.parse_args()
    for name in ("steps", "threads", "max_rows", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.system is not None:
        args.size = args.size or "small"
        args.steps = args.steps or (4 if args.size == "mlperf" else 10)
        one(args)
        return
    results = []
    for size in [args.size] if args.size else ["small", "mlperf"]:
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # the systems interleaved: a slow spell hits all of them
            for system in args.systems:
                py = sys.executable if system in ("none", "embcore") else args.peers_python
                cmd = [py, __file__, "--system", system, "--size", size, "--optimizer",
                       args.optimizer, "--max-rows", str(args.max_rows), "--threads",
                       str(args.threads)] + (["--steps", str(args.steps)] if args.steps else [])
                r = subprocess.run(cmd, capture_output=True, text=True)
                line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
                res = json.loads(line[-1]) if r.returncode == 0 and line else {
                    "system": system, "size": size, "error": (r.stderr.strip() or "?")[-300:]}
                runs.setdefault(system, []).append(res)
                print(json.dumps(res), flush=True)
        results += [median_run(rs) for rs in runs.values()]
    print(table(results))


def median_run(runs: list[dict]) -> dict:
    """One system's runs of one size as one: the median of each timing (an error if any failed)."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    out = dict(runs[0])
    for key in ("ms_per_step", "tables_ms_per_step", "dense_ms_per_step", "readout_ms_per_step"):
        if key in out:
            out[key] = statistics.median(r[key] for r in runs)
    if "ms_per_step" in out:
        out["examples_per_s"] = 1e3 * BATCH / out["ms_per_step"]
        out["embedding_share"] = out["tables_ms_per_step"] / out["ms_per_step"]
    return out


def table(results: list[dict]) -> str:
    """The markdown table: per size and system, the step, the tables' cost and the ceiling."""
    out = ["| size | system | examples/s | ms/step | step - dense part (ms) | tables' ms/step "
           "(read-out) | embedding share | vs TorchRec | ceiling: tables free |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["system"] == "none":
            continue
        if "error" in r:
            out.append(f"| {r['size']} | {r['system']} | failed: {r['error'][-80:]} | | | | | | |")
            continue
        same = [q for q in results if q["size"] == r["size"] and "error" not in q]
        peer = next((q for q in same if q["system"] == PEER[r["system"]]), None)
        dense = next((q["dense_ms_per_step"] for q in same if q["system"] == "none"
                      and not r["system"].startswith("trec-")), None)  # (another dense model)
        vs = f"{r['examples_per_s'] / peer['examples_per_s']:.2f}x" if peer else "-"
        extra = f"{r['ms_per_step'] - dense:.1f}" if dense else "-"
        ceiling = (f"{peer['ms_per_step'] / dense:.2f}x"
                   if dense and peer and r["system"] == "embcore" else "")
        system = ("TorchRec model on embcore" if r["system"] == "trec-embcore" else
                  "TorchRec model on TorchRec" if r["system"] == "trec-torchrec" else r["system"])
        if dense and min(r["ms_per_step"], peer["ms_per_step"] if peer else dense) <= dense:
            extra, ceiling = "below the noise", ""  # the dense part's run-to-run spread
        out.append(f"| {r['size']} | {system} | {r['examples_per_s']:,.0f} | "
                   f"{r['ms_per_step']:.1f} | {extra} | {r['tables_ms_per_step']:.1f} | "
                   f"{100 * r['embedding_share']:.0f}% | {vs} | {ceiling} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
