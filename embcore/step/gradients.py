"""Apply gradients (the third verb of a step): activation gradients -> optimizer updates of rows.

For each physical table of a prepared training batch, the features' activation gradients become
one summed gradient per distinct row (docs/semantics.md section 3), which is applied once by the
table's optimizer where the row is held:

- rows all held here (one process, a replicated table at W = 1): the store's update forms the row
  gradients from the output gradients itself (fused into the update on the CPU kernels);
- sharded: ``combine_backward`` gives this process's (U, D) row gradients, ``gradients_at_owner``
  sums them at the processes holding the rows (exchange.py), and those update them;
- a dynamic table (raw ids): as when sharded, with the rows its map resolved at the lookup; the
  store drops the gradients of ids not resident and of rows given to another id since.

Everything that can reject a call runs before the first table is written (``apply_step``):
``check_gradients`` (kinds, dtypes and shapes of the gradients), each optimizer's
``gradient_multiplier(step)`` (``gradient_multipliers``) and ``learning_rates``, then, at the
start of ``apply_gradients``, the gradients' conversion to the tables' device and working dtype.
``apply_gradients`` also skips, as a whole, the tables of an optimizer with
``skip_nonfinite_gradients`` whose gradients hold NaN or inf (docs/semantics.md section 3).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from ..base.comm import Communicator
from ..config.optimizers import Optimizer
from ..ops.combine import OutputGrads, row_gradients
from ..planning.plan import ShardingPlan
from ..state.store import RowStore
from .exchange import Answers, gradients_at_owner
from .preprocess import Prepared


def check_gradients(prepared: Prepared, grads: Sequence[object], names: Sequence[str],
                    plan: ShardingPlan, warn_none: bool) -> list[torch.Tensor | None]:
    """Validates the flat gradients of a batch; returns them detached (None: zero).

    A gradient is None or a dense (``torch.strided``, not nested) floating-point tensor holding
    values (not on the meta device), of its activation's shape, on any device (it is moved to the
    tables' at the update).

    Raises:
        TypeError: a gradient that is not a tensor or None, a sparse, nested or other non-strided
            tensor, or a tensor whose dtype is not floating point (integer, bool, complex),
            naming the feature.
        ValueError: a gradient on the meta device or of the wrong shape, naming the feature.
    """
    out: list[torch.Tensor | None] = [None] * prepared.num_features
    quiet_none = True
    for tb in prepared.tables:
        p = plan.physical[tb.physical]
        for s in tb.slices:
            g = grads[s.feature]
            if g is None:
                assert p.optimizer is not None, "a training batch has optimizers"
                quiet_none = quiet_none and p.optimizer.zero_gradient_is_noop
                continue
            _check_gradient(g, names[s.feature], s.shape + (p.dim,))
            out[s.feature] = g.detach() if g.requires_grad else g
    if warn_none and not quiet_none:
        noisy = sorted({names[s.feature] for tb in prepared.tables for s in tb.slices
                        if grads[s.feature] is None and not _optimizer(plan, tb.physical)
                        .zero_gradient_is_noop})
        warnings.warn(f"features {noisy} got a None gradient; their optimizer changes rows even "
                      f"on a zero gradient (momentum, Adam, FTRL, weight decay or clipping), so "
                      f"their looked-up rows still move", stacklevel=3)
    return out


def _check_gradient(g: object, name: str, shape: tuple[int, ...]) -> None:
    """Raises unless ``g`` is a dense floating-point tensor with values, of ``shape``."""
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"gradient of feature {name!r} must be a tensor or None, got "
                        f"{type(g).__name__}")
    if g.is_nested or g.layout != torch.strided:
        kind = f"is a nested tensor (layout {g.layout})" if g.is_nested else \
            f"has layout {g.layout}"
        raise TypeError(f"gradient of feature {name!r} {kind}; a gradient must be a dense "
                        f"(torch.strided) tensor of its activation's shape {list(shape)}, e.g. "
                        f"the activation's .grad (a sparse one: .to_dense())")
    if g.is_meta:
        raise ValueError(f"gradient of feature {name!r} is on the meta device, so it holds no "
                         f"values; pass the gradient itself (e.g. the activation's .grad)")
    if not g.is_floating_point():
        raise TypeError(f"gradient of feature {name!r} has dtype {g.dtype}; a gradient must be "
                        f"floating point (float32, float64, float16 or bfloat16)")
    if g.shape != shape:
        raise ValueError(f"gradient of feature {name!r} has shape {list(g.shape)}, expected "
                         f"{list(shape)} (the shape of its activation)")


def nonfinite_gradients(prepared: Prepared, grads: Sequence[torch.Tensor | None],
                        names: Sequence[str], plan: ShardingPlan) -> dict[int, list[str]]:
    """``{physical table: [feature names]}``: the features whose (checked) gradient holds a NaN
    or inf on this process, among the tables whose optimizer has ``skip_nonfinite_gradients``
    (one ``isfinite().all()`` pass per such gradient, in its table's working dtype, so a float64
    value beyond a float32 table's range counts as inf)."""
    out: dict[int, list[str]] = {}
    for tb in prepared.tables:
        p = plan.physical[tb.physical]
        if not _optimizer(plan, tb.physical).skip_nonfinite_gradients:
            continue
        work = _work_dtype(p.dtype)
        for s in tb.slices:
            g = grads[s.feature]
            if g is None:
                continue
            if g.dtype == torch.float64 and work != torch.float64:
                g = g.to(work)  # (the values the update would see)
            if not bool(torch.isfinite(g).all()):
                out.setdefault(tb.physical, []).append(names[s.feature])
    return out


def learning_rates(prepared: Prepared, plan: ShardingPlan) -> dict[int, float]:
    """``{physical table: lr}``, each optimizer's learning rate evaluated once (a bad value
    raises here, before any table is written)."""
    by_optimizer: dict[int, float] = {}
    out = {}
    for tb in prepared.tables:
        opt = _optimizer(plan, tb.physical)
        if id(opt) not in by_optimizer:
            by_optimizer[id(opt)] = opt.current_learning_rate()
        out[tb.physical] = by_optimizer[id(opt)]
    return out


def gradient_multipliers(prepared: Prepared, plan: ShardingPlan,
                         step: int) -> dict[int, float | None]:
    """``{physical table: gradient multiplier}``, each optimizer's ``gradient_multiplier(step)``
    evaluated once and checked (None where it has none): a bad value, or an exception of the
    callable, raises here, before any table is written."""
    by_optimizer: dict[int, float | None] = {}
    out = {}
    for tb in prepared.tables:
        opt = _optimizer(plan, tb.physical)
        if id(opt) not in by_optimizer:
            by_optimizer[id(opt)] = opt.current_gradient_multiplier(step)
        out[tb.physical] = by_optimizer[id(opt)]
    return out


def apply_step(prepared: Prepared, answers: Answers, grads: Sequence[object],
               names: Sequence[str], store: RowStore, comm: Communicator, step: int,
               warn_on_none: bool, before_write: Callable[[], None]) -> None:
    """The third verb whole: checks a training batch's gradients, evaluates its gradient
    multipliers and learning rates (in that order: a bad multiplier raises before a counting
    learning-rate callable moves) and finds its non-finite gradients, all before any write;
    then ``before_write()`` (the engine lets background lookups of later batches finish, they
    read the tables) and ``apply_gradients``.

    Args:
        prepared, answers: the training batch and what its lookup's exchange recorded.
        grads: per feature (flat order) the gradient of its activation, or None for zero.
        names: the features' names (flat order), for errors and warnings.
        store, comm: the rows and the communicator; step: updates applied so far.
        warn_on_none: warn when a None gradient still moves rows.

    Raises:
        TypeError / ValueError: as ``check_gradients``, or from a multiplier or learning rate.
            Nothing is written.
    """
    plan = store.plan
    checked = check_gradients(prepared, grads, names, plan, warn_on_none)
    multipliers = gradient_multipliers(prepared, plan, step)
    lrs = learning_rates(prepared, plan)
    nonfinite = nonfinite_gradients(prepared, checked, names, plan)
    before_write()
    apply_gradients(prepared, answers, checked, store, comm, step, lrs, multipliers, nonfinite)


def apply_gradients(prepared: Prepared, answers: Answers,
                    grads: Sequence[torch.Tensor | None], store: RowStore, comm: Communicator,
                    step: int, lrs: Mapping[int, float],
                    multipliers: Mapping[int, float | None],
                    nonfinite: Mapping[int, list[str]]) -> None:
    """Applies each physical table's optimizer to the rows of ``prepared`` (a collective when a
    table is sharded, or when an optimizer has ``skip_nonfinite_gradients`` and W > 1).

    Before the first write: the skipped tables are decided (``skip_nonfinite_gradients``, with a
    warning) and every gradient is converted to the tables' device and working dtype.

    Args:
        prepared: the training batch; answers: what its lookup's exchange recorded.
        grads: ``check_gradients``' result: per feature (flat order) its activation's gradient,
            or None for zero.
        store: the rows; comm: the communicator; step: updates applied so far.
        lrs, multipliers, nonfinite: ``learning_rates``, ``gradient_multipliers`` and
            ``nonfinite_gradients`` of this batch, evaluated by the caller before this call (the
            multipliers first: a bad one raises before a counting learning-rate callable moves).
    """
    plan = store.plan
    skipped = _skipped(prepared, plan, nonfinite, comm, store.device)
    todo = [(tb, got) for tb, got in zip(prepared.tables, answers) if tb.physical not in skipped]
    parts = {}  # physical table -> (R_f, D) per feature, in the update's device and dtype
    for tb, _ in todo:
        p = plan.physical[tb.physical]
        parts[tb.physical] = [_rows(grads[s.feature], s.rows, p.dim, _work_dtype(p.dtype),
                                    store.device) for s in tb.slices]
    for tb, got in todo:
        p = plan.physical[tb.physical]
        outputs = OutputGrads(parts.pop(tb.physical),
                              [s.start for s in tb.slices] + [tb.bags.num_rows], tb.bags,
                              tb.dedup)
        opt = _optimizer(plan, tb.physical)
        lr, gmul = lrs[tb.physical], multipliers[tb.physical]
        if comm.world_size == 1:  # fused: row gradients formed in the update
            # (a dynamic table's rows: those its map gave the distinct ids at the lookup)
            store.update(tb.physical, tb.dedup.unique if got is None else got.rows[0], outputs,
                         opt, lr, step, gradient_multiplier=gmul,
                         since=None if got is None else got.since)
            continue
        g_unique = row_gradients(outputs, store.workspace)  # (U, D)
        rows, g = gradients_at_owner(comm, p, tb, got.rows if got is not None else None,
                                     g_unique)
        store.update(tb.physical, rows, g, opt, lr, step, gradient_multiplier=gmul,
                     since=got.since if got is not None else None)


def _skipped(prepared: Prepared, plan: ShardingPlan, nonfinite: Mapping[int, list[str]],
             comm: Communicator, device: torch.device) -> set[int]:
    """The physical tables this step leaves alone: every table of an optimizer object with
    ``skip_nonfinite_gradients`` that got a NaN or inf gradient on any process (one
    ``all_reduce`` of a flag per such optimizer when W > 1); warns naming the features."""
    groups: dict[int, list[int]] = {}  # id(optimizer) -> its physical tables, in table order
    opts: dict[int, Optimizer] = {}
    for tb in prepared.tables:
        opt = _optimizer(plan, tb.physical)
        if opt.skip_nonfinite_gradients:
            groups.setdefault(id(opt), []).append(tb.physical)
            opts[id(opt)] = opt
    if not groups:
        return set()
    keys = list(groups)  # the same order on every process
    local = [any(p in nonfinite for p in groups[k]) for k in keys]
    if comm.world_size > 1:  # every process skips the same tables (their collectives included)
        flags = comm.all_reduce_sum(torch.tensor(local, dtype=torch.int64, device=device))
        bad = [bool(f) for f in flags.tolist()]
    else:
        bad = local
    out: set[int] = set()
    for k, skip in zip(keys, bad):
        if not skip:
            continue
        out.update(groups[k])
        tables = [t for p in groups[k] for t in plan.physical[p].tables]
        features = [f for p in groups[k] for f in nonfinite.get(p, ())]
        where = (f"the gradients of features {features} hold" if features else
                 "a gradient on another process holds")
        warnings.warn(f"{type(opts[k]).__name__} with skip_nonfinite_gradients=True: {where} "
                      f"NaN or inf, so this step's update of tables {tables} is skipped (their "
                      f"rows and slots are unchanged)", RuntimeWarning, stacklevel=4)
    return out


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the update computes in for a table of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(g: torch.Tensor | None, rows: int, dim: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """A feature's activation gradient as (R_f, D) rows (zeros for None)."""
    if g is None:
        return torch.zeros(rows, dim, dtype=dtype, device=device)
    return g.reshape(rows, dim).to(device, dtype)


def _optimizer(plan: ShardingPlan, physical: int) -> Optimizer:
    opt = plan.physical[physical].optimizer
    assert opt is not None, "a training enqueue checked that every table has an optimizer"
    return opt
