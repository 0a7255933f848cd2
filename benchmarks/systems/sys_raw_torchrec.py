"""TorchRec with raw ids (W1-raw's peer): ``ManagedCollisionEmbeddingBagCollection``, one
``MCHManagedCollisionModule`` per table (``zch_size`` = ``--capacity``, ``LRU_EvictionPolicy`` or
``--eviction lfu``, ``eviction_interval=1``: the map is updated at every step, before the lookup)
in front of an unsharded ``EmbeddingBagCollection`` fed ``KeyedJaggedTensor``s. Runs in the peers'
venv on the CPU.

    .venv-peers/bin/python benchmarks/systems/sys_raw_torchrec.py \\
        --workload W1 --capacity 100000 --json

What runs, and why (torchrec 1.8.0, read in its source and checked here):

- ``ManagedCollisionEmbeddingBagCollection`` accepts an ``EmbeddingBagCollection`` only (a
  ``FusedEmbeddingBagCollection`` fails its config check: no ``embedding_configs``), whose
  ``nn.EmbeddingBag``s are dense: we set ``sparse=True`` on each and train with
  ``torch.optim.Adagrad`` (sparse gradients, as plain PyTorch does), not a fused optimizer.
- The MCH map does admit and evict (its sorted raw ids change every step; the result's
  ``probe_evicted`` counts ids that left it), but ``mc_embedding_modules.evict(evictions, ebc)``,
  which MC-EBC's forward calls with the slots it reassigned, is ``# TODO: write function`` /
  ``return``: a reassigned slot keeps the previous id's trained row and Adagrad state. By default
  this script puts a reset there (the slots' rows get TorchRec's default init, uniform in
  ``+-sqrt(1/N)``, and their accumulators the initial value), as embcore and plain do for a new
  id; ``--no-reset`` runs the stock no-op. Either way the reset comes after MC-EBC's lookup in the
  same forward (that is where torchrec calls ``evict``): a new id's first activation reads the
  slot's old values; the update lands on the reset row.
- The last slot of each table (``zch_size - 1``) is MCH's shared row for ids not (yet) resident:
  a table holds at most ``capacity - 1`` ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import RAW_FILL, Batch, Workload, raw_ids  # noqa: E402

CAPACITY = common.take_option("--capacity", 100_000)
EVICTION = common.take_option("--eviction", "lru", str)
RESET = "--no-reset" not in sys.argv
if not RESET:
    sys.argv.remove("--no-reset")

try:
    import fbgemm_gpu  # noqa: F401  (torchrec's kernels; imported for its version)
    import torchrec
    import torchrec.modules.mc_embedding_modules as mc_ebc
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
    from torchrec.modules.mc_modules import (LFU_EvictionPolicy, LRU_EvictionPolicy,
                                             ManagedCollisionCollection,
                                             MCHManagedCollisionModule)
except ImportError as e:  # reported as a "not installed" row
    common.not_installed("TorchRec MC-EBC", "adagrad",
                         sys.argv[sys.argv.index("--workload") + 1], e)

EMPTY = torch.iinfo(torch.int64).max  # MCH's free-slot marker


class RawTorchrecSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None) -> None:
        if optimizer != "adagrad":
            raise SystemExit("this peer runs exact Adagrad only")
        cpu = torch.device("cpu")
        pooling = PoolingType.SUM if w.combiner == "sum" else PoolingType.MEAN
        configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=w.dim, num_embeddings=CAPACITY,
                                      feature_names=[f"f{t}"], pooling=pooling)
                   for t in range(w.tables)]
        policy = LRU_EvictionPolicy if EVICTION == "lru" else LFU_EvictionPolicy
        self.mch = {c.name: MCHManagedCollisionModule(zch_size=CAPACITY, device=cpu,
                                                      eviction_policy=policy(),
                                                      eviction_interval=1)
                    for c in configs}
        ebc = EmbeddingBagCollection(tables=configs, device=cpu)
        self.bags = dict(ebc.embedding_bags.items())  # {table: nn.EmbeddingBag (C, D)}
        for bag in self.bags.values():
            bag.sparse = True
        self.mc = mc_ebc.ManagedCollisionEmbeddingBagCollection(
            ebc, ManagedCollisionCollection(self.mch, configs))
        self.opt = torch.optim.Adagrad(ebc.parameters(), lr=common.LR,
                                       initial_accumulator_value=common.ACC0)  # eps 1e-10
        self.sums = {k: self.opt.state[b.weight]["sum"] for k, b in self.bags.items()}
        self.bound = (1.0 / CAPACITY) ** 0.5  # torchrec's default init: U(-sqrt(1/N), sqrt(1/N))
        if RESET:
            mc_ebc.evict = self._reset  # what MC-EBC's forward calls with the reassigned slots
        self.keys = [f"f{t}" for t in range(w.tables)]
        self.maps = [raw_ids(w.rows, t) for t in range(w.tables)]  # T x (N,) id -> raw id
        self.grad = torch.cat(grads, dim=1)  # (B, T*D)

    @torch.no_grad()
    def _reset(self, evictions: dict, ebc: torch.nn.Module) -> None:
        for table, slots in evictions.items():
            if slots is not None and slots.numel():
                bag = self.bags[table]
                bag.weight.data[slots] = torch.empty(slots.numel(), bag.weight.shape[1]
                                                     ).uniform_(-self.bound, self.bound)
                self.sums[table][slots] = common.ACC0

    def prepare(self, batch: Batch) -> KeyedJaggedTensor:
        lengths = (batch.offsets[1:] - batch.offsets[:-1]).repeat(len(self.keys))  # (T*B,)
        values = torch.cat([self.maps[t][ids] for t, ids in enumerate(batch.ids)])  # raw ids
        return KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths)

    def step(self, kjt: KeyedJaggedTensor) -> None:
        out, _ = self.mc(kjt)  # KeyedTensor (B, T*D)
        out.values().backward(self.grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def tables(self) -> list[torch.Tensor]:
        return [b.weight for b in self.bags.values()]

    def state_bytes(self) -> int:
        return sum(b.weight.nbytes for b in self.bags.values()) + sum(
            s.nbytes for s in self.sums.values())

    def resident_ids(self) -> list[torch.Tensor]:
        out = []
        for m in self.mch.values():
            ids = m._mch_sorted_raw_ids
            out.append(ids[ids != EMPTY].clone())
        return out

    def map_bytes(self) -> int:
        """Every tensor the MCH modules hold (buffers, history accumulator), each storage once."""
        seen: dict[int, int] = {}
        for m in self.mch.values():
            tensors = [*m.buffers(), *(v for v in vars(m).values() if isinstance(v, torch.Tensor))]
            for v in tensors:
                st = v.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())


if __name__ == "__main__":
    common.main("TorchRec MC-EBC", RawTorchrecSystem,
                {"fbgemm_gpu": fbgemm_gpu.__version__, "torchrec": torchrec.__version__},
                fill=RAW_FILL,
                extra={"capacity": CAPACITY,
                       "mapping": f"MCH {EVICTION}" + (" + row reset" if RESET else
                                                        " (stock: rows not reset)"),
                       "note": "MC-EBC over EmbeddingBagCollection(sparse=True) + "
                               "torch.optim.Adagrad; torchrec's evict() is a no-op (TODO): "
                               + ("this script resets reassigned rows in its place"
                                  if RESET else "reassigned rows keep old values")})
