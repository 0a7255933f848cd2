"""Plain PyTorch with raw ids (W1-raw's peer): a Python mapping raw id -> row per table, then one
``nn.EmbeddingBag(capacity, D, sparse=True)`` per table + ``torch.optim.Adagrad``.

    python benchmarks/systems/sys_raw_plain.py \\
        --workload W1 --capacity 100000 --mapping dict|lru --json

Each step, per table: ``torch.unique`` of the batch's raw ids, a Python loop over the distinct ids
only (``map(d.get, keys)`` for the hits, a loop over the misses), the rows gathered back through
the unique's inverse. A missing id takes the next free row; when the table is full it evicts:

- ``--mapping dict``: a ``dict``; the victim is chosen by a ring pointer over the rows (FIFO by
  row: the row filled longest ago goes first), skipping rows used by the current step.
- ``--mapping lru``: a ``collections.OrderedDict``: ``move_to_end`` on a hit, and
  ``popitem(last=False)`` (the least recently used id) when full.

Every admitted id's row (a free one or a victim's) gets new values, ``N(0, 1/D)`` like embcore's
stddev ``1/sqrt(D)`` (not truncated), and its Adagrad accumulator is reset to the initial value,
in one vectorized write per table. Stream mode by default (common.py, ``--fill``).
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict, deque
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # common, workloads
import common  # noqa: E402
from workloads import RAW_FILL, Batch, Workload, raw_ids  # noqa: E402

warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad

CAPACITY = common.take_option("--capacity", 100_000)
MAPPING = common.take_option("--mapping", "dict", str)
if MAPPING not in ("dict", "lru"):
    raise SystemExit(f"--mapping must be dict or lru, got {MAPPING!r}")


class RawPlainSystem:
    # check_raw.py sets it: after a step, its ids are moved to the end in ascending order, so that
    # ids last used in the same step leave in ascending id order, embcore's tie rule (otherwise
    # the hits of a step leave before its new ids: an LRU all the same; one more pass per table)
    exact_lru_order = False

    def __init__(self, w: Workload, optimizer: str, grads: list[torch.Tensor],
                 init: list[torch.Tensor] | None) -> None:
        if optimizer != "adagrad":
            raise SystemExit("plain PyTorch has no row-wise Adagrad")
        self.w, self.cap = w, CAPACITY
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(CAPACITY, w.dim, mode=w.combiner, sparse=True,
                            include_last_offset=True) for _ in range(w.tables))  # T x (C, D)
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=common.LR,
                                       initial_accumulator_value=common.ACC0)  # eps 1e-10
        self.sums = [self.opt.state[b.weight]["sum"] for b in self.bags]  # T x (C, D)
        self.std = w.dim ** -0.5
        self.grads = grads  # T x (B, D)
        self.maps: list[dict] = [OrderedDict() if MAPPING == "lru" else {}
                                 for _ in range(w.tables)]  # raw id -> row
        self.row_key = ([[0] * CAPACITY for _ in range(w.tables)]
                        if MAPPING == "dict" else [])  # dict: the id each row holds
        self.next_free = [0] * w.tables
        self.hand = [0] * w.tables  # dict: the ring pointer
        self.raw = [raw_ids(w.rows, t) for t in range(w.tables)]  # T x (N,) id -> raw id
        self.assign = self._assign_lru if MAPPING == "lru" else self._assign_dict

    def prepare(self, batch: Batch) -> tuple[list[torch.Tensor], torch.Tensor]:
        return [self.raw[t][ids] for t, ids in enumerate(batch.ids)], batch.offsets

    def _assign_dict(self, t: int, keys: list[int]) -> tuple[list, list[int], list[int]]:
        d = self.maps[t]
        rows = list(map(d.get, keys))  # None: not resident
        if None not in rows:
            return rows, [], []
        new, new_keys, cap, row_key = [], [], self.cap, self.row_key[t]
        busy = None  # rows used by this step, built the first time a victim is needed
        for i, r in enumerate(rows):
            if r is not None:
                continue
            k = keys[i]
            if self.next_free[t] < cap:
                r = self.next_free[t]
                self.next_free[t] += 1
            else:
                if busy is None:
                    busy = {x for x in rows if x is not None}
                h = self.hand[t]
                while h in busy:
                    h = h + 1 if h + 1 < cap else 0
                r = h
                del d[row_key[r]]
                self.hand[t] = h + 1 if h + 1 < cap else 0
                busy.add(r)
            d[k] = r
            row_key[r] = k
            rows[i] = r
            new.append(r)
            new_keys.append(k)
        return rows, new, new_keys

    def _assign_lru(self, t: int, keys: list[int]) -> tuple[list, list[int], list[int]]:
        od = self.maps[t]
        rows = list(map(od.get, keys))  # None: not resident
        hits = [k for k, r in zip(keys, rows) if r is not None]
        deque(map(od.move_to_end, hits), maxlen=0)  # the step's ids become the most recent
        if len(hits) == len(keys):
            return rows, [], []
        new, new_keys, cap = [], [], self.cap
        for i, r in enumerate(rows):
            if r is not None:
                continue
            if self.next_free[t] < cap:
                r = self.next_free[t]
                self.next_free[t] += 1
            else:
                r = od.popitem(last=False)[1]  # never one of this step's ids: they are at the end
            od[keys[i]] = r
            rows[i] = r
            new.append(r)
            new_keys.append(keys[i])
        if self.exact_lru_order:
            deque(map(od.move_to_end, keys), maxlen=0)
        return rows, new, new_keys

    def step(self, native: tuple[list[torch.Tensor], torch.Tensor]) -> None:
        raws, offsets = native
        outs = []
        for t, (bag, raw) in enumerate(zip(self.bags, raws)):
            uniq, inv = torch.unique(raw, return_inverse=True)  # (U,), (B*L,)
            rows, new, new_keys = self.assign(t, uniq.tolist())
            if new:
                idx = torch.tensor(new)  # (A,) rows of admitted ids
                with torch.no_grad():
                    bag.weight[idx] = self.initial_values(t, new_keys)
                    self.sums[t][idx] = common.ACC0
            outs.append(bag(torch.tensor(rows)[inv], offsets))  # (B, D)
        torch.autograd.backward(outs, self.grads)  # sparse (nnz, D) gradients
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def initial_values(self, t: int, ids: list[int]) -> torch.Tensor:
        """(A, D) values of table ``t``'s admitted raw ids (check_raw.py swaps in embcore's)."""
        return torch.randn(len(ids), self.w.dim) * self.std

    def tables(self) -> list[torch.Tensor]:
        return [bag.weight for bag in self.bags]

    def state_bytes(self) -> int:
        return sum(p.nbytes for p in self.bags.parameters()) + sum(s.nbytes for s in self.sums)

    def resident_ids(self) -> list[torch.Tensor]:
        return [torch.tensor(list(d), dtype=torch.int64) for d in self.maps]

    def map_bytes(self) -> int:
        """The Python objects of the maps (``sys.getsizeof``: the dict, its key and row ints; the
        ``dict`` mapping's row -> id list): an estimate that leaves out allocator overhead."""
        total = 0
        for t, d in enumerate(self.maps):
            total += sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(r)
                                            for k, r in d.items())
            if MAPPING == "dict":
                total += sys.getsizeof(self.row_key[t])
        return total


if __name__ == "__main__":
    common.main("plain-raw", RawPlainSystem, {}, fill=RAW_FILL,
                extra={"capacity": CAPACITY,
                       "mapping": "OrderedDict LRU" if MAPPING == "lru" else "dict FIFO ring"})
