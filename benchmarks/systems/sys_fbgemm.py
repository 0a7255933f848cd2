"""FBGEMM's table-batched embeddings on CPU (``SplitTableBatchedEmbeddingBagsCodegen``, HOST/CPU)
with the optimizer fused into backward: EXACT_ADAGRAD, or EXACT_ROWWISE_ADAGRAD (``--optimizer
rowwise``). Runs in the peers' venv (fbgemm-gpu-cpu).

    .venv-peers/bin/python benchmarks/systems/sys_fbgemm.py \\
        --workload W1 [--optimizer rowwise] --json
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
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
except ImportError as e:  # reported as a "not installed" row
    common.not_installed("FBGEMM TBE", "rowwise" if "rowwise" in sys.argv else "adagrad",
                         sys.argv[sys.argv.index("--workload") + 1], e)

EPS = 1e-10  # FBGEMM: w -= lr * g / (sqrt(a) + eps); torch.optim.Adagrad's eps


class FbgemmSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None) -> None:
        self.w = w
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(w.rows, w.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * w.tables,
            optimizer=(OptimType.EXACT_ADAGRAD if optimizer == "adagrad"
                       else OptimType.EXACT_ROWWISE_ADAGRAD),
            learning_rate=common.LR, eps=EPS,
            pooling_mode=PoolingMode.SUM if w.combiner == "sum" else PoolingMode.MEAN)
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
        out = self.tbe(*native)  # (B, T*D)
        out.backward(self.grad)  # the update happens inside backward

    def tables(self) -> list[torch.Tensor]:
        return self.tbe.split_embedding_weights()

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tbe.split_embedding_weights()) + sum(
            s.nbytes for states in self.tbe.split_optimizer_states() for s in states)


if __name__ == "__main__":
    common.main("FBGEMM TBE", FbgemmSystem, {"fbgemm_gpu": fbgemm_gpu.__version__})
