"""FBGEMM's table-batched embeddings on CPU (``SplitTableBatchedEmbeddingBagsCodegen``, HOST/CPU)
with the optimizer fused into backward: EXACT_ADAGRAD, or EXACT_ROWWISE_ADAGRAD (``--optimizer
rowwise``). Runs in the peers' venv (fbgemm-gpu-cpu).

    .venv-peers/bin/python benchmarks/systems/sys_fbgemm.py \\
        --workload W1 [--optimizer rowwise] [--dtype float16] --json

``--dtype float16|bfloat16``: ``weights_precision=SparseType.FP16 / BF16`` with
``stochastic_rounding=True`` (FBGEMM's default; spelled out); ``output_dtype`` stays FP32, so the
forward returns float32 activations (as embcore's) and takes the float32 upstream gradient.
fbgemm-gpu-cpu 1.8.0: FP16 runs, but its CPU update rounds to nearest whatever
``stochastic_rounding`` says (an update below half a unit in the last place is lost); BF16 has no
CPU forward kernel: a one-row probe finds that and the run prints a "not supported" line.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import Batch, Workload  # noqa: E402

try:
    import fbgemm_gpu
    from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
except ImportError as e:  # reported as a "not installed" row
    common.not_installed("FBGEMM TBE", "rowwise" if "rowwise" in sys.argv else "adagrad",
                         sys.argv[sys.argv.index("--workload") + 1], e)

EPS = 1e-10  # FBGEMM: w -= lr * g / (sqrt(a) + eps); torch.optim.Adagrad's eps
PRECISION = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16,
             torch.bfloat16: SparseType.BF16}  # --dtype -> weights_precision


def probe(precision: SparseType, optim: OptimType, pooling: PoolingMode, dim: int) -> None:
    """One step of a one-row TBE with these settings: raises ``common.Unsupported`` when this
    FBGEMM build lacks a CPU kernel for them (e.g. BF16 weights), before the real tables exist."""
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(1, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=optim,
        learning_rate=common.LR, eps=EPS, pooling_mode=pooling, weights_precision=precision,
        stochastic_rounding=True)
    try:
        out = tbe(torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1]))
        out.backward(torch.ones_like(out))
    except (NotImplementedError, RuntimeError) as e:
        raise common.Unsupported(f"fbgemm_gpu {fbgemm_gpu.__version__} CPU TBE, "
                                 f"weights_precision={precision.name}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0]}") from e


class FbgemmSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None, dtype: torch.dtype = torch.float32) -> None:
        self.w = w
        optim = (OptimType.EXACT_ADAGRAD if optimizer == "adagrad"
                 else OptimType.EXACT_ROWWISE_ADAGRAD)
        pooling = PoolingMode.SUM if w.combiner == "sum" else PoolingMode.MEAN
        # float32: FBGEMM's defaults, as before --dtype existed; 16 bits: stochastic rounding
        precision = ({} if dtype == torch.float32 else
                     {"weights_precision": PRECISION[dtype], "stochastic_rounding": True})
        if precision:
            probe(PRECISION[dtype], optim, pooling, w.dim)
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(w.rows, w.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * w.tables,
            optimizer=optim, learning_rate=common.LR, eps=EPS, pooling_mode=pooling,
            **precision)
        for states in self.tbe.split_optimizer_states():  # FBGEMM starts them at 0
            states[0].fill_(common.ACC0)
        if init is not None:
            for dst, src in zip(self.tbe.split_embedding_weights(), init):
                dst.copy_(src)  # (N, D)
        self.grad = torch.cat(grads, dim=1)  # (B, T*D): output is (B, T*D), feature-major cols

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.cat(batch.ids)  # (T*B*L,) feature-major
        bag = batch.offsets[1:] - batch.offsets[:-1]  # (B,)
        lengths = bag.repeat(self.w.tables)  # (T*B,)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])  # (T*B+1,)
        return indices, offsets

    def step(self, native: tuple[torch.Tensor, torch.Tensor]) -> None:
        out = self.tbe(*native)  # (B, T*D) float32 (output_dtype FP32, whatever the weights)
        out.backward(self.grad)  # the update happens inside backward

    def tables(self) -> list[torch.Tensor]:
        return self.tbe.split_embedding_weights()

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tbe.split_embedding_weights()) + sum(
            s.nbytes for states in self.tbe.split_optimizer_states() for s in states)


if __name__ == "__main__":
    common.main("FBGEMM TBE", FbgemmSystem, {"fbgemm_gpu": fbgemm_gpu.__version__})
