"""GPU: embcore's Triton kernels, embcore's torch-ops path and plain PyTorch on one CUDA GPU.

    .venv/bin/python benchmarks/studies/gpu.py            # W1, W2, DLRM; Adagrad
    .venv/bin/python benchmarks/studies/gpu.py --workloads W1 --optimizer adam --steps 50
    .venv/bin/python benchmarks/studies/gpu.py --workloads W2 --optimizer rowwise --dtype float16
    .venv/bin/python benchmarks/studies/gpu.py --smoke    # no GPU: tiny sizes on the CPU, the
                                                          # Triton path in its interpreter (a
                                                          # check that the script runs, no timing)

Workloads (one feature per table, ids uniform over the table):

- W1: 26 tables x 100k rows x D64, batch 4096, one id per feature;
- W2: 8 tables x 1M rows x D128, batch 2048, bags of 20 ids (sum);
- DLRM: 26 tables x 1M rows x D128, batch 2048, one id per feature (Criteo-like; ~27 GB of
  tables + Adagrad accumulators per system).

Systems, each timed alone (the previous one freed): ``embcore-triton`` (``ec.Embedding`` on
``device="cuda"``; lookup and fused backward + update in kernels/gpu/rows.py), ``embcore-torch``
(the same engine with the Triton kernels switched off: embedding_bag and the optimizers' torch
ops) and ``plain`` (one ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table and
``torch.optim.Adagrad`` / ``torch.optim.SparseAdam``).

Forward = enqueue + dequeue (dedup and lookup; ``plain``: the EmbeddingBag forwards under
no_grad); backward + update = apply_gradients with fixed upstream gradients (``plain``: forward
with autograd, backward, optimizer step, minus the forward time). Times: CUDA events around
``--steps`` steps after ``--warmup``, median of ``--repeats`` loops.

Achieved bandwidth = bytes a step must move / time / the GPU's peak. Bytes (float32):
forward: the rows read (nnz x D x 4) + the activations written (B x T x D x 4) + the ids (8 each);
backward + update: the activation gradients read once per occurrence (nnz x D x 4) + per touched
row, the row and its slots read and written (Adagrad / Adam: 2 x (1 + slots) x D x 4 each);
U (touched rows) is counted on the batches. Peak: a table of known GPUs (H100 SXM 3.35 TB/s, H200
4.8 TB/s, ...), else a measured device-to-device copy (read + write).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is first imported
    import os
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402
from embcore.kernels.gpu import launch  # noqa: E402

# Peak memory bandwidth (bytes/s) by a substring of torch.cuda.get_device_name().
PEAKS = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12),
         ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12),
         ("A10G", 0.6e12), ("V100", 0.9e12), ("RTX 4090", 1.008e12)]
LR = 0.01


@dataclass(frozen=True)
class Workload:
    name: str
    tables: int
    rows: int
    dim: int
    batch: int
    bag: int  # ids per feature; 1: one id per example (dense ids)


WORKLOADS = {
    "W1": Workload("W1", 26, 100_000, 64, 4096, 1),
    "W2": Workload("W2", 8, 1_000_000, 128, 2048, 20),
    "DLRM": Workload("DLRM", 26, 1_000_000, 128, 2048, 1),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SMOKE = {name: Workload(w.name, 3, 50, 8 if w.dim == 64 else 12, 16, w.bag)
         for name, w in WORKLOADS.items()}


def make_batches(w: Workload, n: int, device: torch.device, seed: int = 0) -> list[list[torch.Tensor]]:
    """``n`` batches: per table, (B * L,) int64 ids."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, w.rows, (w.batch * w.bag,), generator=gen).to(device)
             for _ in range(w.tables)] for _ in range(n)]


def peak_bandwidth(device: torch.device) -> tuple[float, str]:
    """(bytes/s, where it comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAKS:
            if key in name:
                return peak, f"{name}: table"
    else:
        name = "CPU"
    src = torch.ones(256 * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        times.append(_timed(lambda: dst.copy_(src), device))
    return 2 * src.numel() * 4 / min(times), f"{name}: measured copy"


def _timed(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn`` (CUDA events on a GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    import time
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_bytes(w: Workload, batches: list[list[torch.Tensor]], slots: int,
               row_bytes: int = 4) -> tuple[float, float]:
    """(forward bytes, backward + update bytes) per step, mean over the batches; rows of
    ``row_bytes`` an element (4 float32, 2 float16 / bfloat16), activations, gradients and slots
    float32 (Adagrad's slot is (N, D); ``slots`` of them)."""
    nnz = w.tables * w.batch * w.bag
    fwd = nnz * w.dim * row_bytes + w.tables * w.batch * w.dim * 4 + nnz * 8
    touched = statistics.mean(sum(int(torch.unique(ids).numel()) for ids in b) for b in batches)
    bwd = nnz * w.dim * 4 + touched * 2 * (row_bytes + slots * 4) * w.dim + nnz * 8
    return fwd, bwd


class Embcore:
    def __init__(self, w: Workload, optimizer: str, device: torch.device, triton: bool,
                 dtype: torch.dtype = torch.float32):
        self.w, self.device = w, device
        self.triton = triton
        opt = {"adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad, "adam": ec.Adam}[optimizer](
            learning_rate=LR)
        tables = [ec.TableConfig(vocabulary_size=w.rows, dim=w.dim, combiner="sum", name=f"t{i}",
                                 dtype=dtype) for i in range(w.tables)]
        self.emb = ec.Embedding({f"f{i}": ec.FeatureConfig(table=t) for i, t in enumerate(tables)},
                                opt, device=device)
        gen = torch.Generator().manual_seed(1)
        self.grads = {f"f{i}": torch.randn(w.batch, w.dim, generator=gen).to(device)
                      for i in range(w.tables)}
        self.offsets = torch.arange(0, w.batch * w.bag + 1, w.bag, device=device)

    def inputs(self, batch: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.w.bag == 1:
            return {f"f{i}": ids for i, ids in enumerate(batch)}
        return {f"f{i}": torch.nested.nested_tensor_from_jagged(ids, self.offsets)
                for i, ids in enumerate(batch)}

    def forward(self, native) -> None:
        with _triton(self.triton):
            self.emb.enqueue(native, training=False)
            self.emb.dequeue()

    def train(self, native) -> None:
        with _triton(self.triton):
            self.emb.enqueue(native)
            self.emb.dequeue()
            self.emb.apply_gradients(self.grads)


class Plain:
    def __init__(self, w: Workload, optimizer: str, device: torch.device):
        self.w = w
        self.bags = [torch.nn.EmbeddingBag(w.rows, w.dim, mode="sum", sparse=True).to(device)
                     for _ in range(w.tables)]
        params = [p for b in self.bags for p in b.parameters()]
        self.opt = (torch.optim.Adagrad(params, lr=LR, initial_accumulator_value=0.1)
                    if optimizer == "adagrad" else torch.optim.SparseAdam(params, lr=LR))
        gen = torch.Generator().manual_seed(1)
        self.grads = [torch.randn(w.batch, w.dim, generator=gen).to(device)
                      for _ in range(w.tables)]
        self.offsets = torch.arange(0, w.batch * w.bag, w.bag, device=device)

    def inputs(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return batch

    def _outputs(self, native) -> list[torch.Tensor]:
        return [b(ids, self.offsets) for b, ids in zip(self.bags, native)]

    def forward(self, native) -> None:
        with torch.no_grad():
            self._outputs(native)

    def train(self, native) -> None:
        torch.autograd.backward(self._outputs(native), self.grads)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _triton:
    """Switches embcore's Triton kernels off for a block (``gpu.usable`` is then False)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        self.saved = launch._kernels
        if not self.enabled:
            launch._kernels = False
        elif launch._kernels is False:
            raise SystemExit(f"triton does not load: {gpu.error()}")

    def __exit__(self, *exc):
        launch._kernels = self.saved


def time_loop(fn, natives, steps: int, warmup: int, repeats: int, device) -> float:
    """Median seconds per step over ``repeats`` loops of ``steps`` steps."""
    for k in range(warmup):
        fn(natives[k % len(natives)])
    loops = []
    for _ in range(repeats):
        def loop():
            for k in range(steps):
                fn(natives[k % len(natives)])
        loops.append(_timed(loop, device) / steps)
    return statistics.median(loops)


def run(w: Workload, system: str, args, device, peak: float) -> str:
    dtype = DTYPES[args.dtype]
    if system == "plain":
        if args.optimizer == "rowwise" or dtype != torch.float32:
            return f"| {w.name} | {system} | (no {args.optimizer} / {args.dtype} in plain) |"
        s = Plain(w, args.optimizer, device)
    else:
        s = Embcore(w, args.optimizer, device, triton=system == "embcore-triton", dtype=dtype)
    batches = make_batches(w, args.batches, device)
    natives = [s.inputs(b) for b in batches]
    fwd = time_loop(s.forward, natives, args.steps, args.warmup, args.repeats, device)
    both = time_loop(s.train, natives, args.steps, args.warmup, args.repeats, device)
    bwd = both - fwd
    slots = {"adagrad": 1, "rowwise": 1 / w.dim, "adam": 2}[args.optimizer]
    fb, bb = step_bytes(w, batches, slots=slots, row_bytes=dtype.itemsize)
    del s, natives
    if device.type == "cuda":
        torch.cuda.empty_cache()
    back = (f"{w.batch / bwd:,.0f} | {bb / bwd / peak:.1%}" if bwd > 0.02 * both
            else "n/a (noise) | n/a")
    return (f"| {w.name} | {system} | {w.batch / fwd:,.0f} | {fb / fwd / peak:.1%} | "
            f"{back} | {w.batch / both:,.0f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--systems", nargs="+", default=["embcore-triton", "embcore-torch", "plain"],
                   choices=["embcore-triton", "embcore-torch", "plain"])
    p.add_argument("--optimizer", default="adagrad", choices=["adagrad", "rowwise", "adam"])
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="embcore's rows (float16 / bfloat16: compact rows, stochastic rounding)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--smoke", action="store_true",
                   help="no GPU needed: tiny workloads on the CPU, the Triton kernels in "
                        "Triton's interpreter; checks that the script runs (numbers meaningless)")
    args = p.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        args.steps, args.warmup, args.repeats, args.batches = 1, 1, 1, 2
        workloads = [SMOKE[n] for n in args.workloads]
        if "embcore-triton" in args.systems:
            if not gpu.available():
                raise SystemExit(f"triton does not load: {gpu.error()}")
            gpu.force_on_cpu(True)
    else:
        if not torch.cuda.is_available():
            print("benchmarks/studies/gpu.py needs a CUDA GPU (torch.cuda.is_available() is "
                  "False on this machine); --smoke runs tiny sizes on the CPU to check the script",
                  file=sys.stderr)
            return 2
        if "embcore-triton" in args.systems and not gpu.available():
            print(f"triton does not load ({gpu.error()}): pip install triton", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        workloads = [WORKLOADS[n] for n in args.workloads]
    peak, source = peak_bandwidth(device)
    print(f"device: {source}, peak {peak / 1e12:.2f} TB/s; optimizer {args.optimizer}; "
          f"rows {args.dtype}; torch {torch.__version__}")
    print("| workload | system | fwd ex/s | fwd BW/peak | bwd+upd ex/s | bwd+upd BW/peak | "
          "step ex/s |")
    print("|---|---|---|---|---|---|---|")
    for w in workloads:
        for system in args.systems:
            print(run(w, system, args, device, peak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
