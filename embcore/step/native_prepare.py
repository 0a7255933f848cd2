"""The native preprocess: one fused kernel call per physical table for dense one-id batches.

Most steps of a recommender feed the simplest batch there is: every feature a dense tensor of ids
(``(B,)`` or ``(B, 1)``: one id per example, whatever the combiner), no weights. For those
``NativePrepare.prepare`` builds the very ``Prepared`` that ``preprocess`` (preprocess.py) would,
with one kernel call per physical table: ``cpu.ConcatDedup`` (concatenate the features' ids,
shift them to the table's rows, deduplicate, and check the ids' range), or for raw ids
``concat_dedup`` / ``dedup_members`` (a run per stacked member). At small batches the general
preprocess's Python costs more than the work itself (about 0.1 ms a step for two features of
batch 16).

The step's path (path.py) asks it first, once per batch, where the engine allows it (``of``:
one process on the CPU with the kernels built, tables of float32, float16 or bfloat16 held
whole here, in memory or offloaded, raw ids included; no sequence feature or ``output_shape``).
A batch it does not take (another input kind or layout, weights, a serving_config, a shape other
than the fixed one, an id out of range) it declines having changed nothing, and ``preprocess``
prepares it (and raises its errors). Per batch layout (each feature's shape) the kernel's fixed
arguments are kept. The lookup and the update are the same for every batch (lookup.py,
gradients.py). tests/test_fast.py holds both preprocesses' steps bit-identical.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from ..base.comm import Communicator
from ..inputs.features import Features, Shapes
from ..kernels import cpu
from ..numerics.rounding import ROW_TYPES
from ..ops.backend import FUSED_CPU
from ..ops.bags import Bags, Dedup
from ..planning.plan import ShardingPlan
from ..state.store import RowStore
from .preprocess import FeatureSlice, Prepared, Slices, TableBatch, dedup_members

_LAYOUTS_KEPT = 64  # batch layouts (each feature's shape) whose fixed arguments are kept
_enabled = True


def set_enabled(enabled: bool) -> bool:
    """Switches the native preprocess on or off for engines built from now on (tests compare
    it with ``preprocess``); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


class _Table:
    """One physical table of a batch: its features, their row offsets and vocabularies."""

    def __init__(self, physical: int, features: list[int], adds: list[int], limits: list[int],
                 bound: int | None) -> None:
        self.physical = physical
        self.features = features  # flat feature indices reading it, in flat order (stacked
        #                           dynamic tables: by member, then in flat order)
        self.adds = adds          # each feature's first row in the physical table
        self.limits = limits      # each feature's vocabulary size
        self.bound = bound        # the shifted ids' bound (rows); None: raw ids, mapped to rows
        self.of: list[int] | None = None  # stacked dynamic tables: each feature's member


class _Layout:
    """One physical table's share of a batch layout (each feature's shape): where its features'
    rows sit, and the kernel call with the layout's fixed arguments."""

    def __init__(self, t: _Table, shapes: list[tuple[int, ...]]) -> None:
        sizes = [math.prod(shapes[i]) for i in t.features]
        starts = [0, *itertools.accumulate(sizes)]
        self.slices = Slices(FeatureSlice(i, start, n, shapes[i])
                             for i, start, n in zip(t.features, starts, sizes))
        self.dedup = (None if t.bound is None
                      else cpu.ConcatDedup(sizes, t.adds, t.bound, t.limits))


class NativePrepare:
    """The native preprocess of one engine (see the module's docstring); ``of`` gives it where
    the engine's configuration allows one, else None.

    Args:
        features, plan, store: the engine's features, plan and rows (held whole in this
            process on the CPU).
    """

    def __init__(self, features: Features, plan: ShardingPlan, store: RowStore) -> None:
        self.features, self.plan = features, plan
        by_table: dict[int, _Table] = {}
        for i, name in enumerate(features.tables):
            place = plan.table(name)
            t = by_table.get(place.physical)
            if t is None:
                t = by_table[place.physical] = _Table(place.physical, [], [], [],
                                                      plan.physical[place.physical].id_bound)
            t.features.append(i)
            t.adds.append(place.row_offset)
            t.limits.append(features.configs[i].table.vocabulary_size)
        for physical, t in by_table.items():
            names = plan.physical[physical].tables
            if plan.physical[physical].by_member:  # stacked dynamic tables (preprocess.py)
                member = {n: k for k, n in enumerate(names)}
                got = sorted((member[features.tables[i]], i, a, lim)
                             for i, a, lim in zip(t.features, t.adds, t.limits))
                t.of, t.features, t.adds, t.limits = (list(c) for c in zip(*got))
        self.tables = [by_table[p] for p in sorted(by_table)]  # physical table order
        self.layouts: dict[tuple[tuple[int, ...], ...], list[_Layout]] = {}

    @staticmethod
    def of(features: Features, plan: ShardingPlan, store: RowStore,
           comm: Communicator) -> NativePrepare | None:
        """The engine's native preprocess, or None when its configuration leaves no batch to
        it: more than one process, a backend other than the fused CPU kernels (on the CPU,
        where they are built and switched on), a sequence feature or one
        with ``output_shape``, a table that is not float32, float16 or bfloat16 (or
        ``set_enabled(False)``)."""
        if not _enabled or comm.world_size != 1 or not store.backend.fused_cpu:
            return None
        for f in features.configs:
            if f.sequence_length or f.output_shape is not None:
                return None
        for p, phys in enumerate(plan.physical):
            if not phys.placement.held_everywhere:
                return None
            t = store[p].table
            if t.dtype not in ROW_TYPES or not t.is_contiguous():
                return None
        return NativePrepare(features, plan, store)

    def prepare(self, batch: Any, training: bool, shapes: Shapes) -> Prepared | None:
        """The batch prepared as preprocess.py would, or None when it does not take it (then
        nothing changed).

        Args:
            batch: the user's ids (no weights).
            training: whether ``apply_gradients`` will follow.
            shapes: how its shapes meet those fixed so far (features.py).
        """
        flat = self.features.flat_dict(batch)  # (another structure: preprocess.py's)
        if flat is None:
            return None
        fixed, declared = self.features.shapes, self.features.declared
        natural: list[tuple[int, ...]] = []
        steps: list[int] | None = None  # elements between ids, when a part is not contiguous
        for i, x in enumerate(flat):
            if (type(x) is not torch.Tensor or x.dtype is not torch.int64 or x.is_nested
                    or x.layout is not torch.strided or not x.is_cpu):
                return None
            s = tuple(x.shape)
            if len(s) >= 2 and s[-1] == 1:
                s = s[:-1]
            if not x.is_contiguous():  # a column of a wider batch: read where it is
                if len(s) != 1:
                    return None
                if steps is None:
                    steps = [1] * len(flat)
                steps[i] = x.stride(0)
            if not s or x.numel() == 0:
                return None
            if shapes is not Shapes.ANY and (fixed[i] != s if fixed[i] is not None
                                    else declared[i] is not None):
                return None
            natural.append(s)
        key = tuple(natural)
        layout = self.layouts.get(key)
        if layout is None:
            if len(self.layouts) >= _LAYOUTS_KEPT:  # (lookups of many batch shapes)
                self.layouts.clear()
            layout = self.layouts[key] = [_Layout(t, natural) for t in self.tables]
        tables = []
        for t, lay in zip(self.tables, layout):
            if lay.dedup is None:  # raw ids (any int64), deduplicated per member
                parts = [x if x.dim() == 1 and x.is_contiguous() else x.reshape(-1)
                         for x in (flat[i] for i in t.features)]  # (a copy: a column's ids)
                segments = None
                if t.of is None:
                    ids, dd = FUSED_CPU.dedup(parts, t.adds, None)
                else:
                    ids, dd, segments = dedup_members(parts, t.of, FUSED_CPU)
                tables.append(TableBatch(t.physical, Bags(ids, None, None), dd, lay.slices, None,
                                         segments))
                continue
            got = lay.dedup([flat[i] for i in t.features],
                            None if steps is None else [steps[i] for i in t.features])
            if isinstance(got, int):  # an id out of range: preprocess.py names it
                return None
            ids, unique, order, uoff = got
            tables.append(TableBatch(t.physical, Bags(ids, None, None), Dedup(unique, order, uoff),
                                     lay.slices, None))
        if shapes is Shapes.FIX:
            for i, s in enumerate(natural):
                if fixed[i] is None:
                    fixed[i] = s
        return Prepared(training, tuple(tables), len(flat))
