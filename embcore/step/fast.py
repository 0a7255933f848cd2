"""The fast path: one kernel call per verb and table for batches of dense one-id features.

Most steps of a recommender feed the simplest batch there is: every feature a dense tensor of ids
(``(B,)`` or ``(B, 1)``: one id per example, whatever the combiner), every table float32 (or
float16 / bfloat16: compact rows, widened and rounded inside the kernels) in this
process (in memory, or offloaded: its rows read and updated in its cache, ``RowStore.held``),
raw-id tables included, trained by an optimizer the fused kernels implement. The general
path (path.py, over preprocess.py, lookup.py and gradients.py) takes every input kind,
placement and optimizer; at small batches its Python costs more than the work itself (about
0.19 ms a step for two features of batch 16), and 26 features of raw ids cost it 0.5-1 ms a
step more. ``FastPath`` takes those batches straight to the kernels:

- ``prepare``: per physical table one ``native.concat_dedup``, which also checks the ids' range
  (a dynamic table's raw ids: one ``native.dedup_raw_runs``, a run per stacked member);
- ``lookup``: per physical table one ``native.lookup`` into one buffer, viewed per feature (a
  dynamic table's maps step first, as on the general path: lookup.py's ``dynamic_here``);
- ``apply``: per physical table one ``native.sparse_update`` that reads the activations'
  gradients where they are (multipliers and learning rates from gradients.py, before any write;
  a dynamic table's through ``RowStore.update``, which leaves rows given away since alone).

``prepare`` builds the very ``Prepared`` preprocess.py would, so the general path can take over
any of its batches. Every verb hands to the general path, having changed nothing, what it does
not cover: another input kind, dtype, device or layout, weights, a serving_config, a shape other
than the fixed one, an id out of range (``prepare``: the batch is then the general path's); a
table made differentiable or moved since (``lookup``); a gradient that is None or not exactly a
float32 CPU tensor of its activation's shape, an optimizer without a fused kernel or one that
skips non-finite gradients (``apply``). The general path then raises its errors.
tests/test_fast.py holds both paths bit-identical.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..inputs.features import Shapes
from ..ops import native
from ..ops.bags import Bags, Dedup, concat_dedup
from ..ops.combine import OutputGrads
from ..ops.rounding import ROW_TYPES
from ..ops.update import native_rule
from .exchange import Answered, Answers
from .gradients import gradient_multipliers, learning_rates
from .lookup import check_map_steps
from .path import Activations, Batch, GeneralPath, StepPath
from .preprocess import FeatureSlice, Prepared, TableBatch, dedup_members

_LAYOUTS_KEPT = 64  # batch layouts (each feature's shape) whose fixed arguments are kept
_enabled = True


def set_enabled(enabled: bool) -> bool:
    """Switches the fast path on or off for engines built from now on (tests compare it with
    the general path); returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


class _Table:
    """One physical table of the path: its features, their row offsets and vocabularies."""

    def __init__(self, physical: int, features: list[int], adds: list[int], limits: list[int],
                 rows: int, dim: int, rule: int | None, dynamic: bool = False) -> None:
        self.physical = physical
        self.features = features  # flat feature indices reading it, in flat order (stacked
        #                           dynamic tables: by member, then in flat order)
        self.adds = adds          # each feature's first row in the physical table
        self.limits = limits      # each feature's vocabulary size
        self.rows = rows
        self.dim = dim
        self.rule = rule          # the fused update's rule (None: none, or no optimizer)
        self.dynamic = dynamic    # raw ids, which its maps turn into rows
        self.of: list[int] | None = None  # stacked dynamic tables: each feature's member


class _Layout:
    """One physical table's share of a batch layout (each feature's shape): where its features'
    rows sit, and the kernel call with the layout's fixed arguments."""

    def __init__(self, t: _Table, shapes: list[tuple[int, ...]]) -> None:
        sizes = [math.prod(shapes[i]) for i in t.features]
        starts = [0, *itertools.accumulate(sizes)]
        self.slices = tuple(FeatureSlice(i, start, n, shapes[i])
                            for i, start, n in zip(t.features, starts, sizes))
        self.dedup = None if t.dynamic else native.ConcatDedup(sizes, t.adds, t.rows, t.limits)


class FastPath:
    """The fast path of one engine, in front of its general path (see the module's docstring);
    ``of`` gives it where the engine's configuration allows one, else the general path.

    Args:
        general: the engine's general path (its features, plan and rows, held whole in this
            process on the CPU), which takes what this path declines.
    """

    def __init__(self, general: GeneralPath) -> None:
        self.general = general
        self.features = features = general.features
        self.plan = plan = general.plan
        self.store = store = general.store
        by_table: dict[int, _Table] = {}
        for i, name in enumerate(features.tables):
            place = plan.table(name)
            t = by_table.get(place.physical)
            if t is None:
                p = plan.physical[place.physical]
                opt, rows = p.optimizer, store[place.physical]
                rule = (native_rule(opt, rows.table) if opt is not None
                        and not opt.skip_nonfinite_gradients else None)
                t = by_table[place.physical] = _Table(place.physical, [], [], [], p.rows, p.dim,
                                                      rule, rows.maps)
            t.features.append(i)
            t.adds.append(place.row_offset)
            t.limits.append(features.configs[i].table.vocabulary_size)
        for p, t in by_table.items():
            names = plan.physical[p].tables
            if t.dynamic and len(names) > 1:  # stacked dynamic tables: by member (preprocess.py)
                member = {n: k for k, n in enumerate(names)}
                got = sorted((member[features.tables[i]], i, a, lim)
                             for i, a, lim in zip(t.features, t.adds, t.limits))
                t.of, t.features, t.adds, t.limits = (list(c) for c in zip(*got))
        self.tables = [by_table[p] for p in sorted(by_table)]  # physical table order
        self.by_physical = by_table
        self.layouts: dict[tuple[tuple[int, ...], ...], list[_Layout]] = {}

    @staticmethod
    def of(general: GeneralPath) -> StepPath:
        """The engine's path: a fast path in front of ``general``, or ``general`` alone when
        the configuration leaves no batch to a fast path: more than one process, not the CPU,
        no fused kernels, a sequence feature or one with ``output_shape``, a table that is not
        float32, float16 or bfloat16 (or ``set_enabled(False)``). An offloaded table's rows are
        read and updated in its cache (``RowStore.held``; a dynamic table's through
        ``RowStore.combine`` and ``update``, as on the general path); a dynamic table's maps
        step as in the general path (``RowStore.resolve``)."""
        store, plan = general.store, general.plan
        if (not _enabled or general.comm.world_size != 1 or store.device.type != "cpu"
                or not native.available()):
            return general
        for f in general.features.configs:
            if f.sequence_length or f.output_shape is not None:
                return general
        for p, phys in enumerate(plan.physical):
            if not phys.placement.held_everywhere:
                return general
            t = store[p].table
            if t.dtype not in ROW_TYPES or not t.is_contiguous():
                return general
        return FastPath(general)

    def prepare(self, features: Any, weights: Any, training: bool, shapes: Shapes,
                template: Any = None) -> Batch:
        prepared = (self._prepare(features, training, shapes)
                    if weights is None and template is None else None)
        if prepared is None:
            return self.general.prepare(features, weights, training, shapes, template)
        return Batch(self, prepared)

    def staged(self, features: Any, weights: Any,
               training: bool) -> Callable[[], tuple[Batch, Activations | None, Answers]]:
        return self.general.staged(features, weights, training)  # (the worker's: one thread)

    def lookup(self, prepared: Prepared) -> tuple[Activations, Answers]:
        got = self._lookup(prepared)
        if got is None:
            return self.general.lookup(prepared)
        return got

    def apply(self, prepared: Prepared, answers: Answers, grads: Sequence[object], step: int,
              warn_on_none: bool, before_write: Callable[[], None]) -> None:
        parts = self._gradients(prepared, grads)
        if parts is None:
            self.general.apply(prepared, answers, grads, step, warn_on_none, before_write)
            return
        multipliers = gradient_multipliers(prepared, self.plan, step)  # these may raise: before
        lrs = learning_rates(prepared, self.plan)  # any write (lrs last: a callable may count)
        before_write()
        self._update(prepared, answers, parts, lrs, multipliers, step)

    # ------------------------------------------------------------------------------ prepare
    def _prepare(self, batch: Any, training: bool, shapes: Shapes) -> Prepared | None:
        """The batch prepared as preprocess.py would, or None when the path does not cover it.

        Args:
            batch: the user's ids (no weights).
            training: whether ``apply_gradients`` will follow.
            shapes: how its shapes meet those fixed so far (features.py).
        """
        flat = self.features.flat_dict(batch)  # (another structure: the general path's)
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
                    ids, dd = concat_dedup(parts, t.adds, None)
                else:
                    ids, dd, segments = dedup_members(parts, t.of)
                tables.append(TableBatch(t.physical, Bags(ids, None, None), dd, lay.slices, None,
                                         segments))
                continue
            got = lay.dedup([flat[i] for i in t.features],
                            None if steps is None else [steps[i] for i in t.features])
            if isinstance(got, int):  # an id out of range: the general path names it
                return None
            ids, unique, order, uoff = got
            tables.append(TableBatch(t.physical, Bags(ids, None, None), Dedup(unique, order, uoff),
                                     lay.slices, None))
        if shapes is Shapes.FIX:
            for i, s in enumerate(natural):
                if fixed[i] is None:
                    fixed[i] = s
        return Prepared(training, tuple(tables), len(flat))

    # ------------------------------------------------------------------------------- lookup
    def _lookup(self, prepared: Prepared) -> tuple[Activations, Answers] | None:
        """Per feature (flat order) its activation ``shape + (D,)``, and per table what the
        apply needs (a raw-id table's rows and map step); or None to decline (a table made
        differentiable or moved since: the general lookup handles it)."""
        flat: list[torch.Tensor | None] = [None] * prepared.num_features
        answers: list[Answered | None] = [None] * len(prepared.tables)
        for tb in prepared.tables:  # (all checked first: declining after a cached table's rows
            table = self.store[tb.physical].table  # were brought in, or a map stepped, would
            if table.requires_grad or not table.is_cpu:  # count them twice)
                return None
        comm = self.general.comm
        if prepared.training:  # a batch that one map cannot place changes no map
            check_map_steps(prepared, self.store, comm)
        for k, tb in enumerate(prepared.tables):
            out, got = self.store[tb.physical].lookup(tb.bags, tb.dedup, prepared.training,
                                                      tb.segments, comm)  # (R, D)
            if got is not None:
                answers[k] = Answered(*got)
            d = out.shape[1]
            parts = out.split_with_sizes([s.rows for s in tb.slices])  # (one call: views)
            for s, a in zip(tb.slices, parts):
                flat[s.feature] = a if len(s.shape) == 1 else a.view(*s.shape, d)
        return flat, tuple(answers)

    # -------------------------------------------------------------------------------- apply
    def _gradients(self, prepared: Prepared,
                   grads: Sequence[object]) -> list[list[torch.Tensor]] | None:
        """Per table of the batch, its features' gradients as ``(R_f, D)`` float32 rows; None to
        decline: a gradient that is None or not a float32 CPU tensor of its activation's shape
        (the general path converts or rejects it), or a table whose optimizer has no fused
        kernel or skips non-finite gradients. Reads only (``_update`` writes)."""
        out = []
        for tb in prepared.tables:
            t = self.by_physical[tb.physical]
            if t.rule is None:
                return None
            parts = []
            for s in tb.slices:
                g = grads[s.feature]
                if (type(g) is not torch.Tensor or g.dtype is not torch.float32 or g.is_nested
                        or g.layout is not torch.strided or not g.is_cpu):
                    return None
                if len(s.shape) == 1:
                    if g.shape != (s.rows, t.dim) or (t.dim > 1 and g.stride(1) != 1):
                        return None
                elif g.shape != s.shape + (t.dim,) or not g.is_contiguous():
                    return None
                else:
                    g = g.view(s.rows, t.dim)
                parts.append(g)
            out.append(parts)
        return out

    def _update(self, prepared: Prepared, answers: Answers, parts: list[list[torch.Tensor]],
                lrs: Mapping[int, float], multipliers: Mapping[int, float | None],
                step: int) -> None:
        """Applies each table's optimizer to the batch's rows (``answers``: the lookup's;
        ``parts``: ``_gradients``' result; ``lrs`` / ``multipliers``: as gradients.py evaluates
        them, before any write; ``step``: the updates so far, for a 16-bit table's rounding)."""
        for tb, got, g in zip(prepared.tables, answers, parts):
            opt = self.plan.physical[tb.physical].optimizer
            assert opt is not None
            starts = [s.start for s in tb.slices] + [tb.bags.num_rows]
            self.store[tb.physical].update(
                tb.dedup.unique if got is None else got.rows[0],
                OutputGrads(g, starts, tb.bags, tb.dedup), opt, lrs[tb.physical], step,
                gradient_multiplier=multipliers[tb.physical],
                since=None if got is None else got.since)
