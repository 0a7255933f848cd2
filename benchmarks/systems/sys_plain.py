"""Plain PyTorch: one ``nn.EmbeddingBag(sparse=True)`` per table + ``torch.optim.Adagrad``.

    python benchmarks/systems/sys_plain.py --workload W1 [--quick] --json
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import Batch, Workload  # noqa: E402

warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad


class PlainSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None) -> None:
        if optimizer != "adagrad":
            raise SystemExit("plain PyTorch has no row-wise Adagrad")
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(w.rows, w.dim, mode=w.combiner, sparse=True, include_last_offset=True)
            for _ in range(w.tables))  # T x (N, D)
        if init is not None:
            with torch.no_grad():
                for bag, t in zip(self.bags, init):
                    bag.weight.copy_(t)
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=common.LR,
                                       initial_accumulator_value=common.ACC0)  # eps 1e-10
        self.grads = grads  # T x (B, D)

    def prepare(self, batch: Batch) -> Batch:
        return batch

    def step(self, batch: Batch) -> None:
        outs = [bag(ids, batch.offsets) for bag, ids in zip(self.bags, batch.ids)]  # T x (B, D)
        torch.autograd.backward(outs, self.grads)  # sparse (nnz, D) gradients
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def tables(self) -> list[torch.Tensor]:
        return [bag.weight for bag in self.bags]

    def state_bytes(self) -> int:
        slots = sum(s["sum"].nbytes for s in self.opt.state.values() if "sum" in s)
        return sum(p.nbytes for p in self.bags.parameters()) + slots


if __name__ == "__main__":
    common.main("plain PyTorch", PlainSystem, {})
