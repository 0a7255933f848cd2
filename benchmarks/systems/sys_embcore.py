"""embcore's engine (``ec.Embedding``) on a standard workload: enqueue, dequeue, apply_gradients.

    python benchmarks/systems/sys_embcore.py --workload W1 [--optimizer rowwise] [--quick] --json

``--dtype float16|bfloat16``: compact tables (``ec.TableConfig(dtype=...)``, stochastic rounding
on, the default): rows stored in 16 bits, activations float32, each update computed in float32
and rounded back.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import Batch, Workload  # noqa: E402

import embcore as ec  # noqa: E402


class EmbcoreSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None, dtype: torch.dtype = torch.float32) -> None:
        cls = ec.Adagrad if optimizer == "adagrad" else ec.RowwiseAdagrad
        opt = cls(learning_rate=common.LR, initial_accumulator_value=common.ACC0)
        self.w = w
        self.configs = [ec.TableConfig(vocabulary_size=w.rows, dim=w.dim, combiner=w.combiner,
                                       name=f"t{t}", dtype=dtype, stochastic_rounding=True)
                        for t in range(w.tables)]
        fc = {f"f{t}": ec.FeatureConfig(table=self.configs[t]) for t in range(w.tables)}
        self.emb = ec.Embedding(fc, opt)
        self.emb.build(per_replica_batch_size=w.batch)
        if init is not None:
            for cfg, t in zip(self.configs, init):
                self.emb.embedding_tables[cfg].copy_(t)  # (N, D); copy_ converts the dtype
        self.grads = {f"f{t}": g for t, g in enumerate(grads)}  # {f: (B, D)}

    def prepare(self, batch: Batch) -> dict[str, torch.Tensor]:
        if self.w.bag == 1:  # dense (B,) ids: one id per example
            return {f"f{t}": ids for t, ids in enumerate(batch.ids)}
        # jagged (B, None) ids: bags of L, combined by the table's combiner
        return {f"f{t}": torch.nested.nested_tensor_from_jagged(ids, batch.offsets)
                for t, ids in enumerate(batch.ids)}

    def step(self, native: dict[str, torch.Tensor]) -> None:
        self.emb.enqueue(native)
        self.emb.dequeue()                       # {f: (B, D)} activations
        self.emb.apply_gradients(self.grads)     # the fixed upstream gradient

    def tables(self) -> list[torch.Tensor]:
        return [self.emb.embedding_tables[c] for c in self.configs]

    def state_bytes(self) -> int:
        return sum(v.nbytes for k, v in self.emb.state_dict().items() if k != "step")


if __name__ == "__main__":
    common.main("embcore", EmbcoreSystem, {"embcore": ec.__version__})
