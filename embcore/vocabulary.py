"""Dynamic tables on this process: raw ids -> shard rows, admission, and how a new row starts.

A dynamic table (``TableConfig(dynamic=ec.DynamicVocabulary(...))``, docs/semantics.md section 9) is
its own physical table. Its shard on a process has the ``n`` rows of its placement plus one more,
row ``n``, which stays zero: ids that are not resident are looked up there, and gradients to it are
dropped. ``DynamicRows`` holds the shard's ``VocabMap`` (ops/vocab.py) and translates the ids that
reach this process into rows (``resolve``), admitting and evicting in a training step; the store
then writes the new rows' initial values (``initial_values``: a function of the table's seed and
the id alone) and resets their optimizer slots.
"""

from __future__ import annotations

import math
import threading

import torch

from .config import TableConfig, default_initializer, init_seed
from .ops import hashing
from .ops.vocab import VocabMap

# Truncated normal cut at two standard deviations: the CDF of the cut points.
_PHI_LO = 0.5 * math.erfc(2 / math.sqrt(2))
_PHI_HI = 1.0 - _PHI_LO


def table_seed(base_seed: int, name: str) -> int:
    """A dynamic table's seed: new rows' values depend on it and the id alone."""
    return init_seed(base_seed, name, -1)


def initial_values(table: TableConfig, name: str, seed: int, ids: torch.Tensor) -> torch.Tensor:
    """(n, D) float32 initial values of raw ids ``ids`` (n,) of a dynamic table.

    The default initializer (TF's truncated normal, stddev ``1/sqrt(D)``, cut at 2 stddevs) is
    computed from counter-based hashes of ``(seed, id, column)`` in a few vectorized ops. A
    callable initializer is run once per id, on a ``(1, D)`` block drawn from a generator seeded
    by ``(seed, id)``: exact, but slower when many ids are admitted per step.
    """
    n, dim = ids.numel(), table.dim
    if table.initializer is None:
        u = hashing.uniform(seed, ids, dim)  # (n, D) in (0, 1)
        p = _PHI_LO + u * (_PHI_HI - _PHI_LO)
        return (torch.special.ndtri(p) / math.sqrt(dim)).to(torch.float32)
    out = torch.empty(n, dim, dtype=torch.float32)  # (n, D)
    init = table.initializer if callable(table.initializer) else default_initializer(dim)
    from .config import _fill  # one place that runs initializers and checks what they leave
    keys = hashing.splitmix64(ids.cpu() ^ hashing._signed(seed & hashing.MASK64)).tolist()
    for k, key in enumerate(keys):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key & ((1 << 63) - 1))
            _fill(init, out[k:k + 1], name)
    return out


class DynamicRows:
    """One dynamic table's shard on this process: its id -> row map and its seed.

    Args:
        table: the config; name: its resolved name; base_seed: the engine's seed.
        rows: the shard's rows (its capacity on this process; the zero row comes after them).
        device: where the map lives.
    """

    def __init__(self, table: TableConfig, name: str, base_seed: int, rows: int,
                 device: torch.device) -> None:
        assert table.dynamic is not None
        self.table, self.name = table, name
        self.seed = table_seed(base_seed, name)
        self.zero_row = rows
        dyn = table.dynamic
        self.map = VocabMap(max(rows, 1), eviction=dyn.eviction, admit_after=dyn.admit_after,
                            ttl_steps=dyn.ttl_steps, name=f"table {name!r}", device=device)
        self.capacity = rows
        self.lock = threading.Lock()  # evaluation lookups may run beside a pipelined step

    def resolve(self, ids: torch.Tensor, training: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shard rows of distinct sorted raw ids ``ids`` (U,): a training step of the map, or a
        search (evaluation).

        Returns:
            ``(rows (U,), new_ids (A,), new_rows (A,))``: each id's row (``zero_row`` when not
            resident) and the ids admitted by this step with their rows (for the caller to
            initialize).

        Raises:
            ValueError: more ids to admit than rows to give them (nothing changes).
        """
        with self.lock:
            if self.capacity == 0:  # a process holding no rows of the table
                empty = ids.new_empty(0)
                return torch.full_like(ids, self.zero_row), empty, empty
            if training:
                rows, new_ids, new_rows = self.map.train_step(ids)
            else:
                rows = self.map.find(ids)
                new_ids = new_rows = ids.new_empty(0)
        return torch.where(rows < 0, self.zero_row, rows), new_ids, new_rows

    def valid(self, rows: torch.Tensor, since: int) -> torch.Tensor:
        """(n,) bool: rows that still hold the id they held after map step ``since``."""
        if self.capacity == 0:
            return torch.zeros_like(rows, dtype=torch.bool)
        with self.lock:
            return (rows != self.zero_row) & self.map.valid(rows.clamp(max=self.capacity - 1),
                                                            since)

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (R,) ascending, rows (R,)) of the ids resident in this shard."""
        with self.lock:
            if self.capacity == 0:
                empty = torch.empty(0, dtype=torch.int64)
                return empty, empty
            ids, rows = self.map.resident()
            return ids.clone(), rows.clone()

    @property
    def step(self) -> int:
        return self.map.step
