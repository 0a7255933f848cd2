"""The row store: this process's rows of every physical table, one rows object each.

``RowStore`` is the container. Its rows objects (rows.py: in memory, offloaded behind a cache,
or raw ids mapped onto either, mapped.py) are chosen once per physical table when the store is
built (build.py); the step reads and writes rows through them (``store[p]``: ``lookup``,
``combine``, ``gather``, ``resolve``, ``update``) and never asks which kind it holds.

The store owns what the rows look like outside the step: a logical table's rows on this process
(``local``, ``read``), whole tables (``whole``), a dynamic table's vocabulary, the checkpoint view
(``state_dict`` / ``load_state_dict``: views.py), the record of rows written since a publish
(``track``: changes.py) and the move to another device.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..base.comm import Communicator
from ..config.tables import TableConfig
from ..ops.backend import Backend, choose, named
from ..ops.workspace import Workspace
from ..planning.plan import ShardingPlan
from . import views
from .build import RowsBuilder
from .changes import ChangedRows
from .dtensors import gather_whole
from .mapped import MappedRows
from .rows import Rows
from .tier.cache import CachedRows
from .vocab.vocabulary import VOCAB, DynamicRows, whole_vocabulary


class RowStore:
    """Every physical table's shard on this process, with its slots (``store[p]``: its rows
    object).

    Args:
        plan: the sharding plan.
        configs: ``{table name: TableConfig}`` (initializers).
        seed: the engine's seed (initial values depend on it, the table and the row only).
        comm: the communicator (its rank picks the shard).
        device: where tables and slots live.
        offload_dir: where the slow tier's files go (tables the plan offloads; None: a
            temporary directory).
    """

    def __init__(self, plan: ShardingPlan, configs: Mapping[str, TableConfig], seed: int,
                 comm: Communicator, device: torch.device,
                 offload_dir: str | os.PathLike | None = None) -> None:
        self.plan, self.comm, self.device = plan, comm, device
        self.configs = dict(configs)
        self.workspace = Workspace()  # the update's temporaries, kept across steps
        self.changes: ChangedRows | None = None  # rows written since publishes (``track``)
        # the kernels of the device, chosen once (the plan's, which prints it)
        self.backend = named(plan.backend) if plan.backend else choose(device)
        builder = RowsBuilder(plan, self.configs, seed, comm.rank, device, offload_dir,
                              self.workspace, self.backend)
        self._rows = builder.build()
        self._offload = builder.offload  # (the slow tier's directory lives as long as the store)
        self.maps = any(rows.maps for rows in self._rows)  # (a raw-id table: maps step)
        self.may_refuse = any(rows.may_refuse for rows in self._rows)  # (Rows.may_refuse)

    def __getitem__(self, p: int) -> Rows:
        """Physical table ``p``'s rows object."""
        return self._rows[p]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Rows]:
        return iter(self._rows)

    def track(self) -> ChangedRows:
        """The record of written rows, started now if it was not (``publish``)."""
        if self.changes is None:
            self.changes = ChangedRows([p.row_counts[self.comm.rank] for p in self.plan.physical])
            for rows in self._rows:
                rows.track(self.changes)
        return self.changes

    def to(self, device: torch.device, backend: Backend | None = None) -> None:
        """Moves every table and slot to ``device``, whose ``backend`` runs them from now on
        (None: ``choose(device)``; the workspace is dropped); an offloaded table moves its cache
        (its slow tier stays in host memory or files)."""
        self.device, self.workspace = device, Workspace()
        self.backend = backend if backend is not None else choose(device)
        for rows in self._rows:
            rows.to(device, self.workspace, self.backend)

    def cache_stats(self) -> dict[str, dict[str, float | int]]:
        """``{table: {"hits", "misses", "new", "hit_rate"}}`` of the offloaded tables on this
        process (``CachedRows.stats``)."""
        out: dict[str, dict[str, float | int]] = {}
        for rows in self._rows:
            out.update(rows.stats())
        return out

    def caches(self) -> list[CachedRows]:
        """The offloaded tables' slow tiers and caches (benchmarks and tests read them)."""
        return [c for c in (rows.cache() for rows in self._rows) if c is not None]

    # ------------------------------------------------------------------------ outside the step
    def local(self, name: str, key: str = "parameters") -> torch.Tensor:
        """This process's rows of a logical table's parameters or slot ``key`` (a view), or of
        a dynamic table's ``vocabulary/<ids, last_use or frequency>`` (a copy, ``(n, 1)``). An
        offloaded table's view is its slow tier, every row current (the cache written back and
        emptied: a write through the view is then seen by the step)."""
        if key.startswith(VOCAB):
            return self.member(name).row_state(key[len(VOCAB):])
        place = self.plan.table(name)
        full = self._rows[place.physical].full(key)
        start = place.local_offsets[self.comm.rank]
        return full[start:start + place.row_counts[self.comm.rank]]

    def read(self, name: str, key: str, rows: torch.Tensor) -> torch.Tensor:
        """(n, C) copies of rows ``rows`` (n,) of this process's rows of a logical table (as
        ``local`` numbers them) in its parameters, a slot, or a dynamic table's
        ``vocabulary/<ids, last_use or frequency>``. An offloaded table's rows come from its
        cache where they are there (updated or not) and from the slow tier otherwise; the cache
        is left as it was."""
        if key.startswith(VOCAB):
            return self.member(name).row_state(key[len(VOCAB):], rows)
        place = self.plan.table(name)
        return self._rows[place.physical].read(key, rows + place.local_offsets[self.comm.rank])

    def whole(self, name: str, key: str = "parameters") -> torch.Tensor:
        """The whole ``(N, C)`` logical table: a view with one process, else a gathered copy (a
        collective)."""
        place = self.plan.table(name)
        return gather_whole(place, self.plan.physical[place.physical], self.local(name, key),
                            self.comm)

    def _mapped(self, name: str) -> tuple[MappedRows, int]:
        """A dynamic table's physical table's rows object and its member index there."""
        place = self.plan.table(name)
        rows = self._rows[place.physical]
        if not isinstance(rows, MappedRows):
            raise ValueError(f"table {name!r} is not dynamic: its ids are its rows (give it "
                             f"TableConfig(dynamic=ec.DynamicVocabulary()) for raw ids)")
        return rows, self.plan.physical[place.physical].tables.index(name)

    def member(self, name: str) -> DynamicRows:
        """A dynamic table's map on this process (its member of its physical table's stack).

        Raises:
            ValueError: the table is not dynamic.
        """
        rows, k = self._mapped(name)
        return rows.member(k)

    def in_use(self, p: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(used (N,) bool, ids (N,) int64)`` of physical table ``p``'s shard rows (those
        holding a raw id, and the ids), or None when its ids are its rows."""
        rows = self._rows[p]
        return rows.in_use() if isinstance(rows, MappedRows) else None

    def counts_ids(self, name: str) -> bool:
        """Whether a table counts ids before admitting them (``admit_after > 1``)."""
        dynamic = self.configs[name].dynamic
        return dynamic is not None and dynamic.admit_after > 1

    def vocabulary(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic table's resident ids on this process and their rows in its shard
        (``Embedding.vocabulary``).

        Raises:
            ValueError: the table is not dynamic.
        """
        return self.member(name).resident()

    def whole_vocabulary(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A dynamic table's resident ids on every process and their rows of the whole logical
        table (a collective when sharded)."""
        ids, rows = self.vocabulary(name)
        return whole_vocabulary(ids, rows, self.plan.table(name).placement, self.comm)

    def pending(self, name: str) -> torch.Tensor:
        """A dynamic table's ``vocabulary/pending``: (P, 3) int64, the ids counted for
        admission on every process, ascending, their counts and last steps seen (a collective
        when sharded)."""
        place = self.plan.table(name)
        mine = self.member(name).pending()  # (P_r, 3)
        if place.placement.held_everywhere:
            return mine
        got = torch.cat(self.comm.all_to_all([mine] * self.comm.world_size))  # (P, 3)
        return got[torch.argsort(got[:, 0])]

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{"<table>/<key>": shape}`` of every logical table's state (views.py)."""
        return views.state_shapes(self)

    def state_dict(self) -> dict[str, Any]:
        """Views of whole logical tables with one process; checkpoint shards when sharded (a
        collective: see ``Embedding.state_dict``; views.py)."""
        return views.state_dict(self)

    def load_state_dict(self, values: Mapping[str, Any], strict: bool = True,
                        saturate: bool = False) -> None:
        """Copies a state in, checked before the first write (views.py)."""
        views.load_state_dict(self, values, strict, saturate)
