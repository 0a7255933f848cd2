"""The rows of one physical table on this process: a kind of table is an object, chosen once.

The plan decides, per physical table, where its shard lives; ``build.py`` turns that decision
into one rows object, and nothing after asks again. Three kinds, one interface (``Rows``):

- ``MemoryRows``: the shard held whole in fast memory (host memory, on huge pages where the
  system allows; device memory on a GPU), read and written in place;
- ``OffloadedRows``: the shard in a slow tier (mapped files, or pinned host memory for a GPU)
  with its hot rows in a write-back cache (tier/cache.py): every verb takes shard rows as always and
  resolves them to cache rows inside, reading misses and writing evicted updates back;
- ``MappedRows`` (mapped.py): raw ids, which a map per stacked table turns into rows of either
  kind above (its ``storage``).

Each object owns what depends on its kind: ``lookup`` (a batch's bags read here, a raw-id
table's map stepped first), ``combine``, ``gather``, ``update``, ``resolve`` (ids to shard
rows: the identity but for raw ids), the rounding keys of a 16-bit table's updated rows, and the
flags of the rows it wrote (``written``, for the next publish). The step calls these verbs and
never asks which kind it holds (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..base.comm import Communicator
from ..config.dtypes import SCALES
from ..config.optimizers import Optimizer
from ..kernels import cpu
from ..numerics.rounding import Rounding, widen
from ..ops.backend import Backend
from ..ops.bags import Bags, Dedup
from ..ops.combine import OutputGrads, TableCombine
from ..ops.update import TableUpdate, on_triton
from ..ops.workspace import Workspace
from .changes import ChangedRows
from .tier.cache import CachedRows

Segments = tuple[tuple[int, int], ...]  # a stack's runs of distinct ids: (member, count)
# per asking process the shard rows answered, and the map step they are valid at (None: ids
# are rows): what a lookup hands its update
Resolved = tuple[list[torch.Tensor], Any]
# (table, slots, at) -> None: writes new rows' values at rows ``at`` of ``table`` and ``slots``
Writer = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor], None]
# (updated shard rows, where the kernel writes them or None) -> the update's rounding
RoundingOf = Callable[[torch.Tensor, torch.Tensor | None], Rounding | None]


class Rows:
    """The verbs of one physical table's shard on this process (see the module's docstring).

    Args:
        p: the physical table's index in the plan.
        rounding: how its updates round (a float16 / bfloat16 table), else None.
        workspace: the store's buffers for the update's temporaries, kept across steps.
        backend: the kernels of its device (ops/backend.py), chosen once by the builder.
    """

    maps = False  # whether a batch's ids are raw ids that a map turns into rows
    # Whether a training ``resolve`` can refuse a batch (a map with more new ids than it holds):
    # the step then agrees on the outcome across processes before any row or map changes.
    may_refuse = False

    def __init__(self, p: int, rounding: Rounding | None, workspace: Workspace,
                 backend: Backend) -> None:
        self.p, self.rounding, self.workspace, self.backend = p, rounding, workspace, backend
        self.changes: ChangedRows | None = None  # rows written since publishes (``written``)
        self._update: TableUpdate | None = None  # the update of the table last updated
        self._left: torch.Tensor | None = None  # shard rows the last update left (overflow)

    # -- what the kinds implement
    @property
    def table(self) -> torch.Tensor:
        """(n, D_r) the tensor the kernels read: the shard, or its cache."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    def combine(self, index: torch.Tensor, bags: Bags, dedup: Dedup | None = None
                ) -> torch.Tensor:
        """(R, D) bags of shard rows ``index`` combined (``dedup``: the batch's distinct rows,
        when ``index`` is its ids: an offloaded table brings each distinct row in once)."""
        raise NotImplementedError

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, D_r) shard rows ``rows`` (into ``out`` when given); an 8-bit table's widened to
        float32 with their scales (what the exchange sends)."""
        raise NotImplementedError

    def held(self, rows: torch.Tensor, count: bool = True, write: bool = False
             ) -> contextlib.AbstractContextManager[
                 tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
        """``(table, slots, at)``: where distinct shard rows ``rows`` are, for the block's reads
        (``write``: and writes)."""
        raise NotImplementedError

    def renew(self, rows: torch.Tensor, write: Writer) -> None:
        """Gives distinct shard ``rows`` new values and slots: ``write(table, slots, at)``
        writes them where the rows are (their old values are not read)."""
        raise NotImplementedError

    def full(self, key: str) -> torch.Tensor:
        """The whole shard of ``key`` (``"parameters"`` or a slot), every row current."""
        raise NotImplementedError

    def read(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        """(n, C) copies of shard rows ``rows`` of ``key``, nothing moved."""
        raise NotImplementedError

    def to(self, device: torch.device, workspace: Workspace, backend: Backend) -> None:
        """Moves the rows the step reads to ``device`` (with the store's new workspace, and the
        device's backend)."""
        self.workspace, self.backend = workspace, backend

    def stats(self) -> dict[str, dict[str, float | int]]:
        """A slow tier's cache statistics per member table (none in fast memory)."""
        return {}

    def cache(self) -> CachedRows | None:
        """The slow tier and its cache, for an offloaded shard (benchmarks, tests)."""
        return None

    # -- the same for every kind but raw ids (mapped.py overrides them)
    def lookup(self, bags: Bags, dedup: Dedup, training: bool,
               segments: Segments | None = None, comm: Communicator | None = None,
               everyone: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, Resolved | None]:
        """``(out (R, D), resolved)``: a batch's bags of this table, held whole here, and what
        the update needs of the rows it read (None: the batch's distinct ids are its rows)."""
        return self.combine(bags.ids, bags, dedup), None

    def resolve(self, ids: list[torch.Tensor], training: bool,
                segments: Segments | None = None) -> Resolved:
        """The shard rows of ``ids`` (per asking process) and the map step they are valid at:
        ``ids`` themselves here (mapped.py: through the maps)."""
        return ids, None

    def check_step(self, ids: list[torch.Tensor], segments: Segments | None = None) -> None:
        """Raises what ``resolve``'s training step over ``ids`` would (nothing here)."""

    def takes_padded(self, optimizer: Optimizer | None) -> bool:
        """Whether a batch's lookup and its update under ``optimizer`` (None: no update) take
        a dedup of fixed capacity (ops/bags.py ``dedup_padded``): only the Triton kernels of
        a table held whole in fast memory (``MemoryRows``), which skip its padding rows."""
        return False

    def update(self, rows: torch.Tensor, grad: torch.Tensor | OutputGrads,
               optimizer: Optimizer, lr: float, step: int, *,
               gradient_multiplier: float | None = None, since: Any = None,
               rounding: RoundingOf | None = None) -> None:
        """Applies ``optimizer`` to distinct shard rows ``rows`` in place (ops/update.py), and
        flags them written; ``since``: a raw-id table's (mapped.py); ``rounding``: the rounding
        of the updated rows, when another object knows their identities."""
        raise NotImplementedError

    def overflowed(self) -> torch.Tensor | None:
        """The shard rows the last ``update`` left as they were, with their slots, because
        their rounding to the table's 16-bit dtype overflowed (None: none; docs/semantics.md
        section 14). A raw-id table's are its storage's: rows of its map."""
        inner = getattr(self, "storage", None)  # (MappedRows: the rows its map points into)
        return inner.overflowed() if isinstance(inner, Rows) else self._left

    def rounding_at(self, step: int, rows: torch.Tensor | None = None,
                    at: torch.Tensor | None = None,
                    ids: torch.Tensor | None = None) -> Rounding | None:
        """The rounding of an update at ``step`` (None: not 16-bit). ``ids``: the identities of
        the updated shard ``rows`` when they are not the rows' own (a raw-id table's), written
        where the kernel reads them, at ``at`` (an offloaded table's cache rows) or ``rows``."""
        r = self.rounding
        if r is None or not r.stochastic or (ids is None and at is None):
            return None if r is None else r.at(step, None) if r.stochastic else r
        assert rows is not None, "the keys are written for the updated rows"
        where = at if at is not None else rows
        n = self.table.shape[0]
        keys = self.workspace.get("round_keys", (n,), torch.int64, where.device)
        keys.index_copy_(0, where, rows if ids is None else ids)
        return r.at(step, keys)

    def _bound(self, table: torch.Tensor, slots: dict[str, torch.Tensor],
               optimizer: Optimizer) -> TableUpdate:
        """The update of ``table`` and ``slots`` (the ones the rows are in now: a moved shard or
        a grown cache holds new tensors) under ``optimizer``, its kernel chosen once."""
        bound = self._update
        if (bound is None or bound.optimizer is not optimizer or bound.table is not table
                or bound.slots is not slots):
            bound = self._update = TableUpdate(table, slots, optimizer, self.backend)
        return bound

    def track(self, changes: ChangedRows) -> None:
        """Flags the rows written from now on in ``changes`` (a publish started it)."""
        self.changes = changes

    def written(self, rows: torch.Tensor, every: bool = False) -> None:
        """Flags shard rows ``rows`` (``every``: all rows) written, for the next publish
        (nothing while nobody publishes)."""
        if self.changes is not None:
            if every:
                self.changes.mark_all(self.p)
            else:
                self.changes.mark(self.p, rows)


class MemoryRows(Rows):
    """A shard held whole in fast memory.

    Args:
        table: (n, D_r) its rows; slots: the optimizer's slots of them.
    """

    def __init__(self, p: int, table: torch.Tensor, slots: dict[str, torch.Tensor],
                 rounding: Rounding | None, workspace: Workspace, backend: Backend) -> None:
        super().__init__(p, rounding, workspace, backend)
        self._table, self.slots = table, slots
        self._combine = TableCombine(table, backend, slots.get(SCALES))

    @property
    def table(self) -> torch.Tensor:
        return self._table

    def combine(self, index: torch.Tensor, bags: Bags, dedup: Dedup | None = None
                ) -> torch.Tensor:
        return self._combine(index, bags)

    def takes_padded(self, optimizer: Optimizer | None) -> bool:
        return on_triton(self.backend, self._table, self.slots, optimizer)

    def lookup(self, bags: Bags, dedup: Dedup, training: bool,
               segments: Segments | None = None, comm: Communicator | None = None,
               everyone: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, Resolved | None]:
        return self._combine(bags.ids, bags), None  # (Rows.lookup, a call less: every step)

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        scales = self.slots.get(SCALES)
        if scales is not None:  # (n, D_r) float32
            got = widen(self._table[rows], scales[rows])
            return got if out is None else out.copy_(got)
        if out is None:
            return self._table[rows]
        return torch.index_select(self._table, 0, rows, out=out)

    @contextlib.contextmanager
    def held(self, rows: torch.Tensor, count: bool = True, write: bool = False
             ) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
        yield self._table, self.slots, rows

    def renew(self, rows: torch.Tensor, write: Writer) -> None:
        write(self._table, self.slots, rows.to(self._table.device))

    def update(self, rows: torch.Tensor, grad: torch.Tensor | OutputGrads,
               optimizer: Optimizer, lr: float, step: int, *,
               gradient_multiplier: float | None = None, since: Any = None,
               rounding: RoundingOf | None = None) -> None:
        round_to = (rounding(rows, None) if rounding is not None else
                    None if self.rounding is None else self.rounding_at(step))
        self._left = self._bound(self._table, self.slots, optimizer)(
            rows, grad, lr, step, self.workspace, gradient_multiplier=gradient_multiplier,
            round_to=round_to, guard=True)
        if self.changes is not None:
            if isinstance(grad, OutputGrads) and grad.bags.verdict is not None:
                # (a batch judged on the device may be masked, its ids out of range: flagged
                # within the table, a few unchanged rows at most)
                rows = rows.clamp(0, self._table.shape[0] - 1)
            self.written(rows, every=optimizer.updates_every_row)

    def full(self, key: str) -> torch.Tensor:
        return self._table if key == "parameters" else self.slots[key]

    def read(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        full = self.full(key)
        return full[rows.to(full.device)].cpu()

    def to(self, device: torch.device, workspace: Workspace, backend: Backend) -> None:
        super().to(device, workspace, backend)
        self._table = self._table.to(device)
        self.slots = {k: v.to(device) for k, v in self.slots.items()}
        self._combine = TableCombine(self._table, backend, self.slots.get(SCALES))


class OffloadedRows(Rows):
    """A shard in the slow tier behind its write-back cache (``CachedRows``): the verbs resolve
    shard rows to cache rows under the cache's lock (a background lookup may run beside a
    main-thread one)."""

    def __init__(self, p: int, cache: CachedRows, rounding: Rounding | None,
                 workspace: Workspace, backend: Backend) -> None:
        super().__init__(p, rounding, workspace, backend)
        self._cache = cache
        self._combine: TableCombine | None = None  # bound to the cache's table (it may grow)

    @property
    def table(self) -> torch.Tensor:
        return self._cache.table

    def cache(self) -> CachedRows:
        return self._cache

    def combine(self, index: torch.Tensor, bags: Bags, dedup: Dedup | None = None
                ) -> torch.Tensor:
        cache = self._cache
        if dedup is None:
            with cache.lock:
                at = self._cache_rows(index)  # (first: it may grow the cache)
                return self._combined(cache.table)(at, bags)
        with self.held(dedup.unique) as (table, _, at):
            return self._combined(table)(occurrences(at, dedup, self.backend), bags)

    def _combined(self, table: torch.Tensor) -> TableCombine:
        """The combine bound to ``table`` (the cache's: a grown or moved cache holds a new
        one)."""
        bound = self._combine
        if bound is None or bound.table is not table or bound.backend is not self.backend:
            bound = self._combine = TableCombine(table, self.backend)
        return bound

    def gather(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        with self._cache.lock:
            at = self._cache_rows(rows)  # (first: it may grow the cache)
            got = self._cache.table[at]
        if out is None:
            return got
        return out.copy_(got)

    def _cache_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The cache rows of shard rows ``rows`` (repeats allowed), brought in as needed."""
        if rows.numel() == 0:
            return rows
        unique, inverse = distinct(rows, self.backend)
        return self._cache.resolve(unique).index_select(0, inverse)

    @contextlib.contextmanager
    def held(self, rows: torch.Tensor, count: bool = True, write: bool = False
             ) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]]:
        """The cache's table and slots and the cache rows of ``rows``, brought in (``count``: a
        lookup, counted in the statistics) and held under the cache's lock; with ``write``
        they are marked updated (written back when they leave)."""
        cache = self._cache
        with cache.lock:
            at = cache.resolve(rows, count=count)
            try:
                yield cache.table, cache.slots, at
            finally:
                if write:
                    cache.touched(at)

    def renew(self, rows: torch.Tensor, write: Writer) -> None:
        with self._cache.lock:
            self._cache.renew(rows, write)

    def update(self, rows: torch.Tensor, grad: torch.Tensor | OutputGrads,
               optimizer: Optimizer, lr: float, step: int, *,
               gradient_multiplier: float | None = None, since: Any = None,
               rounding: RoundingOf | None = None) -> None:
        # distinct shard rows -> their cache rows (hits, unless evicted since the lookup)
        with self.held(rows, count=False, write=True) as (table, slots, at):
            if isinstance(grad, OutputGrads):
                d = grad.dedup
                grad = OutputGrads(grad.parts, grad.starts, grad.bags,
                                   Dedup(at, d.order, d.unique_offsets))
            round_to = (rounding(rows, at) if rounding is not None
                        else self.rounding_at(step, rows, at))
            left = self._bound(table, slots, optimizer)(
                at, grad, lr, step, self.workspace, gradient_multiplier=gradient_multiplier,
                round_to=round_to, guard=True)
        # (the cache rows left -> their shard rows)
        self._left = None if left is None else rows[torch.isin(at, left)]
        if self.changes is not None:
            self.written(rows, every=optimizer.updates_every_row)

    def full(self, key: str) -> torch.Tensor:
        cache = self._cache  # the slow tier, every row current: the cache written back and
        with cache.lock:     # emptied (a write through the view is then seen by the step)
            cache.drop()
        return cache.slow[key]

    def read(self, key: str, rows: torch.Tensor) -> torch.Tensor:
        with self._cache.lock:
            return self._cache.read(key, rows)

    def to(self, device: torch.device, workspace: Workspace, backend: Backend) -> None:
        super().to(device, workspace, backend)
        self._cache.to(device, backend)

    def stats(self) -> dict[str, dict[str, float | int]]:
        return self._cache.stats()


def occurrences(at: torch.Tensor, dedup: Dedup, backend: Backend) -> torch.Tensor:
    """(nnz,) ``at`` (U,), given per distinct row of ``dedup``, at each of its occurrences (on
    the kernels' threads where they apply: a torch op this large runs on torch's, whose workers
    then spin for milliseconds on the cores the next kernels use; benchmarks/RESULTS.md,
    W1-raw)."""
    if backend.fused_cpu:
        return cpu.expand(at, dedup.order, dedup.unique_offsets)
    return at.index_select(0, dedup.inverse)


def distinct(ids: torch.Tensor, backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """``(distinct, inverse)`` of int64 ``ids``: hashing on the kernels (first-occurrence
    order), else ``torch.unique`` (ascending); ``distinct[inverse] == ids``."""
    if backend.fused_cpu:
        return cpu.dedup_raw(ids.contiguous())[:2]
    return torch.unique(ids, return_inverse=True)
