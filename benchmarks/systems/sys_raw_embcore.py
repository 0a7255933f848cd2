"""embcore with raw ids (W1-raw): every table dynamic, ids replaced by random 63-bit values.

    python benchmarks/systems/sys_raw_embcore.py --workload W1 --capacity 100000 [--quick] --json

The ids are W1's (the same Zipf frequencies) sent through a fixed random one-to-one map per table
into [0, 2^63) (``workloads.raw_ids``); each table is ``dynamic`` with ``--capacity`` rows (100k:
every id fits, nothing is evicted; 50k: eviction every step). Stream mode by default (common.py:
``--fill`` untimed steps, default ``workloads.RAW_FILL``, then every step a new batch). The result
line adds the maps' resident ids and bytes (``map_bytes``: every tensor of each table's
``VocabMap``, found through the store's raw-id rows objects' stacks) and one more step's admitted /
evicted ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import RAW_FILL, Batch, Workload, raw_ids  # noqa: E402

import embcore as ec  # noqa: E402

CAPACITY = common.take_option("--capacity", 100_000)
EVICTION = common.take_option("--eviction", "lru", str)


class RawEmbcoreSystem:
    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None) -> None:
        cls = ec.Adagrad if optimizer == "adagrad" else ec.RowwiseAdagrad
        opt = cls(learning_rate=common.LR, initial_accumulator_value=common.ACC0)
        self.w = w
        dyn = ec.DynamicVocabulary(eviction=EVICTION)
        self.configs = [ec.TableConfig(vocabulary_size=CAPACITY, dim=w.dim, combiner=w.combiner,
                                       name=f"t{t}", dynamic=dyn) for t in range(w.tables)]
        fc = {f"f{t}": ec.FeatureConfig(table=self.configs[t]) for t in range(w.tables)}
        self.emb = ec.Embedding(fc, opt)
        self.emb.build(per_replica_batch_size=w.batch)
        self.maps = [raw_ids(w.rows, t) for t in range(w.tables)]  # T x (N,) id -> raw id
        self.grads = {f"f{t}": g for t, g in enumerate(grads)}  # {f: (B, D)}

    def prepare(self, batch: Batch) -> dict[str, torch.Tensor]:
        if self.w.bag == 1:
            return {f"f{t}": self.maps[t][ids] for t, ids in enumerate(batch.ids)}
        return {f"f{t}": torch.nested.nested_tensor_from_jagged(self.maps[t][ids], batch.offsets)
                for t, ids in enumerate(batch.ids)}

    def step(self, native: dict[str, torch.Tensor]) -> None:
        self.emb.enqueue(native)
        self.emb.dequeue()
        self.emb.apply_gradients(self.grads)

    def tables(self) -> list[torch.Tensor]:
        return [self.emb.embedding_tables[c] for c in self.configs]

    def state_bytes(self) -> int:
        return sum(v.nbytes for k, v in self.emb.state_dict().items() if k != "step")

    def resident_ids(self) -> list[torch.Tensor]:
        return [self.emb.vocabulary(c)[0] for c in self.configs]  # T x (R_t,)

    def map_bytes(self) -> int:
        """Bytes of every tensor the tables' maps hold (their storages, each counted once)."""
        seen: dict[int, int] = {}
        for stack in (r.stack for r in self.emb._store if r.maps):  # (the tables stack: a map each)
            for v in (v for m in stack.members for v in vars(m.map).values()):
                if isinstance(v, torch.Tensor):
                    st = v.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())


if __name__ == "__main__":
    common.main("embcore-raw", RawEmbcoreSystem, {"embcore": ec.__version__}, fill=RAW_FILL,
                extra={"capacity": CAPACITY, "mapping": f"VocabMap {EVICTION}"})
