"""The rows objects of a plan on this process: each physical table's kind chosen once, allocated.

``build_rows`` reads the plan once per physical table and returns its rows object (rows.py): a
shard in memory (``MemoryRows``), in a slow tier behind a cache (``OffloadedRows``: the plan
offloads it under ``memory_budget``), or raw ids mapped onto either (``MappedRows``: a dynamic
table, mapped.py). The kind is not asked again: the step calls the object's verbs.

Static tables get their initial values here (per row, a function of the seed, the table and the
row: config/tables.py); a dynamic table's rows are zeros until ids are admitted, with one zero
row after them. A float16 / bfloat16 table gets its rounding (numerics/rounding.py); an 8-bit
table gets it too, and its row scales (``"scales"``, a row-wise float32 companion of the slots):
its initial values are quantized to nearest, a scale per row of the shard's columns.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping

import torch

from ..config.dtypes import SCALED, SCALES, slot_dtype
from ..config.optimizers import table_slots
from ..config.tables import INIT_BLOCK_ROWS, TableConfig, initial_rows
from ..numerics.rounding import COMPACT, Rounding, Segments, quantize, shard_segments, table_key
from ..ops.backend import Backend
from ..ops.memory import empty_table
from ..ops.workspace import Workspace
from ..planning.plan import PhysicalTable, ShardingPlan
from .mapped import MappedRows
from .rows import MemoryRows, OffloadedRows, Rows
from .tier.cache import CachedRows
from .tier.files import OffloadDir, record_layout, slow_log, slow_records, slow_tensor, slow_writes
from .vocab import torch_map as id_map
from .vocab.vocabulary import DynamicRows, DynamicStack


def init_blocks(first: int, stride: int, count: int) -> Iterator[tuple[int, int]]:
    """The local row ranges ``[i, j)`` in which a shard holding rows ``first + i * stride``
    (``Placement.span``) is initialized: at most ``INIT_BLOCK_ROWS`` rows each, no temporary
    larger, and each block of rows the initializer draws at once (``INIT_BLOCK_ROWS`` logical
    rows, config/tables.py) in one range only, so none is drawn twice."""
    logical = INIT_BLOCK_ROWS * max(1, stride)  # logical rows of one range
    i = 0
    while i < count:
        end = ((first + i * stride) // logical + 1) * logical  # the next boundary
        j = min(count, -(-(end - first) // stride))
        yield i, j
        i = j


class RowsBuilder:
    """Builds every physical table's rows object of ``plan`` on process ``rank``.

    Args:
        plan: the sharding plan; configs: ``{table name: TableConfig}`` (initializers).
        seed: the engine's seed (initial values depend on it, the table and the row only).
        rank: this process (its shard of each table).
        device: where tables and slots live.
        offload_dir: where the slow tier's files go (None: a temporary directory).
        workspace: the store's buffers, shared by its rows objects.
        backend: the kernels of ``device`` (ops/backend.py), handed to every rows object, map
            and cache built here.
    """

    def __init__(self, plan: ShardingPlan, configs: Mapping[str, TableConfig], seed: int,
                 rank: int, device: torch.device, offload_dir: str | os.PathLike | None,
                 workspace: Workspace, backend: Backend) -> None:
        self.plan, self.configs, self.seed, self.rank = plan, configs, seed, rank
        self.device, self.workspace, self.backend = device, workspace, backend
        self.offload = (OffloadDir(offload_dir, rank) if any(p.offloaded for p in plan.physical)
                        else None)
        # how the static tables' files write rows back: a log or in place (cache.slow_writes)
        self.writes = slow_writes(sum(
            p.row_counts[rank] * record_layout(self._fields(p))[1]
            for p in plan.physical if p.offloaded and not p.dynamic)) \
            if device.type == "cpu" and self.offload is not None else "in-place"

    def build(self) -> list[Rows]:
        """One rows object per physical table, in plan order.

        Raises:
            ValueError: the rows and slots do not fit in the device's memory (naming the
                tables and what to do).
        """
        self._check_fits()
        out: list[Rows] = []
        for p in self.plan.physical:
            try:
                out.append(self._rows(p))
            except RuntimeError as e:  # torch's allocator: out of memory
                if "alloc" not in str(e).lower() and "memory" not in str(e).lower():
                    raise
                held = sum(r.table.numel() * r.table.element_size() for r in out)
                raise ValueError(
                    f"tables {list(p.tables)}: their rows and slots on this process could not "
                    f"be allocated in {self.device} memory ({e}; {held} bytes of rows were "
                    f"allocated for the tables before them). Give the engine a memory_budget "
                    f"(their rows then go to a slow tier, hot rows cached), shard them over "
                    f"more processes, or make them smaller") from None
        return out

    def _check_fits(self) -> None:
        """A ``ValueError`` before anything is allocated when what the plan keeps in fast memory
        on this process (rows, slots, maps, caches: ``bytes_per_rank(fast=True)``) is more than
        the device has: the machine's physical memory on the CPU, the GPU's own."""
        need = self.plan.bytes_per_rank(fast=True)[self.rank]
        device = self.device
        if device.type == "cpu":
            have, where = id_map._physical_memory(), "this machine's"  # (as the maps' check)
        elif device.type == "cuda":
            have = torch.cuda.get_device_properties(device).total_memory
            where = f"{device}'s"
        else:
            return
        if have is None or need <= have:
            return
        big = sorted((p for p in self.plan.physical if not p.offloaded and p.row_counts[self.rank]),
                     key=lambda p: -p.row_counts[self.rank] * p.bytes_per_row)
        raise ValueError(
            f"tables {[n for p in big for n in p.tables]}: their rows and slots on this process "
            f"need {need} bytes of {device} memory, more than {where} {have} bytes. Give the "
            f"engine a memory_budget (their rows then go to a slow tier, hot rows cached), "
            f"shard them over more processes, or make them smaller")

    def _rows(self, p: PhysicalTable) -> Rows:
        """Physical table ``p``'s rows object: its kind, chosen here once."""
        rounding = self._rounding(p) if p.dtype in COMPACT + SCALED else None
        storage: Rows
        if p.offloaded:
            storage = OffloadedRows(p.index, self._offloaded(p), rounding, self.workspace,
                                    self.backend)
        else:
            table, slots = self._in_memory(p)
            storage = MemoryRows(p.index, table, slots, rounding, self.workspace,
                                 self.backend)
        if not p.dynamic:
            return storage
        rank = self.rank
        members = [self.plan.table(name) for name in p.tables]
        stack = DynamicStack(
            [DynamicRows(self.configs[m.name], m.name, self.seed, m.row_counts[rank],
                         self.device, self.backend) for m in members],
            [m.local_offsets[rank] for m in members], p.row_counts[rank])
        keys = (torch.tensor([table_key(self.seed, n) for n in p.tables], dtype=torch.int64)
                if rounding is not None and len(p.tables) > 1 else None)
        fills = {s.name: s.initial_value for s in table_slots(p.optimizer, p.dtype)}
        return MappedRows(stack, storage, p.columns[rank], fills, keys)

    def _rounding(self, p: PhysicalTable) -> Rounding:
        """How updates of a 16-bit physical table round: the rows' identities (per member, its
        key plus the logical row; a dynamic table's key plus the raw id), its first column.

        A stack of dynamic tables has one segment of base 0 and stride 1, and each updated row's
        key is its member's key plus its raw id (``MappedRows.rounding_at``): the identity the
        member has alone (its key as the base, the raw id as the row)."""
        rank = self.rank
        stochastic = self.configs[p.tables[0]].stochastic_rounding
        if p.dynamic and len(p.tables) > 1:
            i64 = torch.int64
            return Rounding(stochastic,
                            Segments(torch.tensor([0, p.row_counts[rank] + 1], dtype=i64),
                                     torch.zeros(1, dtype=i64), torch.ones(1, dtype=i64)),
                            col0=p.columns[rank][0])
        if p.dynamic:
            members = [(p.tables[0], 0, torch.arange(0))]
        else:
            # (a placement's rows are evenly spaced: its first two give the whole segment)
            members = [(name, self.plan.table(name).local_offsets[rank],
                        self.plan.table(name).placement.held_block(rank, 0, 2))
                       for name in p.tables]
        return Rounding(stochastic, shard_segments(members, self.seed, p.row_counts[rank]),
                        col0=p.columns[rank][0])

    def _in_memory(self, p: PhysicalTable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Physical table ``p``'s shard and slots in fast memory, initialized."""
        configs, plan, rank, device = self.configs, self.plan, self.rank, self.device
        c0, c1 = p.columns[rank]
        n_local = p.row_counts[rank] + (1 if p.dynamic else 0)  # (a dynamic table's zero row)
        w = empty_table((n_local, c1 - c0), p.dtype, device)  # (N_r, D_r)
        scaled = p.dtype in SCALED
        scales = torch.ones(n_local, 1, device=device) if scaled else None  # (N_r, 1)
        if p.dynamic:  # rows get values at admission
            w.zero_()
        for name in (p.tables if not p.dynamic else ()):
            place = plan.table(name)
            start = place.local_offsets[rank]
            for i, j in init_blocks(*place.placement.span(rank)):
                rows = place.placement.held_block(rank, i, j)
                at = slice(start + i, start + j)
                if scales is not None:  # 8-bit rows: quantized to nearest, a scale each
                    values = initial_rows(configs[name], name, self.seed, rows,
                                          out=torch.empty(len(rows), p.dim))  # (n, D)
                    codes, scales[at] = quantize(values[:, c0:c1], p.dtype)
                    w[at] = codes.to(device)
                elif (c0, c1) == (0, p.dim):  # whole rows: initialised in place
                    initial_rows(configs[name], name, self.seed, rows, out=w[at])
                else:
                    values = initial_rows(configs[name], name, self.seed, rows)  # (n, D)
                    w[at] = values[:, c0:c1].to(device)
        slots_in = slot_dtype(p.dtype)
        opt = p.optimizer
        slots = (opt.init_slots(n_local, c1 - c0, dtype=slots_in, device=device,
                                allocate=lambda shape, dtype, _: empty_table(shape, dtype, device))
                 if opt is not None else {})
        if scales is not None:
            slots[SCALES] = scales
        return w, slots

    def _fields(self, p: PhysicalTable) -> list[tuple[torch.dtype, int]]:
        """``(dtype, width)`` of physical table ``p``'s parameters and slots on this process:
        the fields of its slow tier's records (``slow_records``)."""
        c0, c1 = p.columns[self.rank]
        slots_in = slot_dtype(p.dtype)
        specs = list(p.optimizer.slots) if p.optimizer is not None else []
        return [(p.dtype, c1 - c0)] + [(slots_in, 1 if s.rowwise else c1 - c0) for s in specs]

    def _offloaded(self, p: PhysicalTable) -> CachedRows:
        """Physical table ``p``'s shard in the slow tier and its empty cache.

        On the CPU a static table's rows and slots are one file of records (``slow_records``: a
        row and its slots side by side), initialized in one pass in blocks of rows (memory stays
        bounded; each page written once). A dynamic table keeps a file per array: its rows are
        zeros until ids are admitted (the parameters' file is reserved on disk, unwritten) and its
        zero row comes after them. For a GPU: pinned host memory, an array each."""
        rank, device = self.rank, self.device
        c0, c1 = p.columns[rank]
        n_local = p.row_counts[rank] + (1 if p.dynamic else 0)
        offload = self.offload
        assert offload is not None
        pin = device.type == "cuda"
        # files on the CPU; host memory where the GPU kernels apply (a CUDA device, or CPU
        # tensors under Triton's interpreter in tests): the cache's index and moves on the device
        files = device.type == "cpu" and not self.backend.triton
        slots_in = slot_dtype(p.dtype)
        opt = p.optimizer
        specs = list(opt.slots) if opt is not None else []
        slots: dict[str, torch.Tensor]
        log = None
        if files and not p.dynamic:
            path = offload.file(f"p{p.index}.bin")
            fields = self._fields(p)
            if self.writes == "log":
                views, log = slow_log(path, n_local, fields)
            else:
                views = slow_records(path, n_local, fields)
            w, slots = views[0], {s.name: v for s, v in zip(specs, views[1:])}
        else:
            numbers = itertools.count(1)  # (a file per array)

            def allocate(shape: tuple[int, ...], dtype: torch.dtype,
                         _: torch.device | None = None, sums: int = 0) -> torch.Tensor:
                path = offload.file(f"p{p.index}-{next(numbers)}.bin") if files else None
                return slow_tensor(path, shape, dtype, pin, sums)

            w = allocate((n_local, c1 - c0), p.dtype, sums=n_local)  # (the rows' checksums
            # after the parameters, in their file)
            if p.dynamic and not files:  # (a new file reads as zeros)
                w.zero_()
            slots = (opt.init_slots(n_local, c1 - c0, dtype=slots_in, device="cpu",
                                    allocate=allocate) if opt is not None else {})
        for name in (p.tables if not p.dynamic else ()):
            place = self.plan.table(name)
            start = place.local_offsets[rank]
            for i, j in init_blocks(*place.placement.span(rank)):
                block = place.placement.held_block(rank, i, j)
                at = slice(start + i, start + j)
                w[at] = initial_rows(self.configs[name], name, self.seed,
                                     block)[:, c0:c1]  # (n, C)
                if files:  # (the records' slots, in the same pass)
                    for spec in specs:
                        slots[spec.name][at].fill_(spec.initial_value)
        bounds = [self.plan.table(n).local_offsets[rank] for n in p.tables] + [n_local]
        plan = self.plan

        def logical(member: int, row: int) -> int:  # (a static member's row, for messages)
            return int(plan.table(p.tables[member]).held_rows(rank)[row])

        return CachedRows(p.tables[0], {"parameters": w, **slots}, p.cache_rows[rank], device,
                          bounds, p.tables, mapped=files, log=log,
                          logical=None if p.dynamic else logical, backend=self.backend)
