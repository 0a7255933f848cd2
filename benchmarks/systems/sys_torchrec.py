"""TorchRec: ``FusedEmbeddingBagCollection`` (the optimizer fused into backward, FBGEMM kernels
underneath) fed ``KeyedJaggedTensor``s, with ``torch.optim.Adagrad`` or
``torchrec.optim.RowWiseAdagrad`` (``--optimizer rowwise``). Runs in the peers' venv.

    .venv-peers/bin/python benchmarks/systems/sys_torchrec.py \\
        --workload W1 [--optimizer rowwise] --json

``--dtype float16|bfloat16``: not supported (a "not supported" line). TorchRec 1.8.0's
``FusedEmbeddingBagCollection`` accepts ``EmbeddingBagConfig(data_type=DataType.FP16)`` but never
hands it to its FBGEMM module (``_BatchedFusedEmbeddingLookups`` drops ``data_type``): the tables
stay float32, so a run would be a float32 run under a 16-bit label.
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
    import torchrec
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad
except ImportError as e:  # reported as a "not installed" row
    common.not_installed("TorchRec", "rowwise" if "rowwise" in sys.argv else "adagrad",
                         sys.argv[sys.argv.index("--workload") + 1], e)

EPS = 1e-10


class TorchrecSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None, dtype: torch.dtype = torch.float32) -> None:
        if dtype != torch.float32:
            raise common.Unsupported(
                f"torchrec {torchrec.__version__} FusedEmbeddingBagCollection ignores "
                f"EmbeddingBagConfig.data_type (its FBGEMM tables stay float32), so "
                f"{str(dtype).removeprefix('torch.')} tables cannot be measured")
        pooling = PoolingType.SUM if w.combiner == "sum" else PoolingType.MEAN
        configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=w.dim, num_embeddings=w.rows,
                                      feature_names=[f"f{t}"], pooling=pooling)
                   for t in range(w.tables)]
        self.keys = [f"f{t}" for t in range(w.tables)]
        self.ebc = FusedEmbeddingBagCollection(
            tables=configs,
            optimizer_type=torch.optim.Adagrad if optimizer == "adagrad" else RowWiseAdagrad,
            optimizer_kwargs={"lr": common.LR, "eps": EPS}, device=torch.device("cpu"))
        self.tbes = [m._emb_module for m in self.ebc._emb_modules]  # the FBGEMM modules inside
        for tbe in self.tbes:
            for states in tbe.split_optimizer_states():  # FBGEMM starts them at 0
                states[0].fill_(common.ACC0)
        if init is not None:
            for dst, src in zip(self.tables(), init):
                dst.detach().copy_(src)  # (N, D)
        self.grad = torch.cat(grads, dim=1)  # (B, T*D)

    def prepare(self, batch: Batch) -> KeyedJaggedTensor:
        lengths = (batch.offsets[1:] - batch.offsets[:-1]).repeat(len(self.keys))  # (T*B,)
        return KeyedJaggedTensor(keys=self.keys, values=torch.cat(batch.ids), lengths=lengths)

    def step(self, kjt: KeyedJaggedTensor) -> None:
        out = self.ebc(kjt).values()  # KeyedTensor -> (B, T*D)
        out.backward(self.grad)  # the fused update happens inside backward

    def tables(self) -> list[torch.Tensor]:
        return [self.ebc.embedding_bags[f"t{t}"].weight for t in range(len(self.keys))]

    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tables()) + sum(
            s.nbytes for tbe in self.tbes for states in tbe.split_optimizer_states()
            for s in states)


if __name__ == "__main__":
    common.main("TorchRec", TorchrecSystem,
                {"fbgemm_gpu": fbgemm_gpu.__version__, "torchrec": torchrec.__version__})
