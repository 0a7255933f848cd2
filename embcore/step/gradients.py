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
``check_gradients`` (kinds, dtypes and shapes of the gradients; none to check or convert when
each is already a tensor of its activation's shape in the update's dtype and device:
``exact_rows``), each optimizer's
``gradient_multiplier(step)`` (``gradient_multipliers``), the search for non-finite gradients,
the gradients' conversion to the tables' device and working dtype (``gradient_rows``) and, last,
``learning_rates``. With several processes these checks are local, so the processes agree on
their outcome before any collective of the exchange (``agree_gradients``: one all_reduce of a
status per process and a flag per optimizer with ``skip_nonfinite_gradients``): when one process
rejects its gradients, every process raises at once with nothing written (instead of the others
waiting in the exchange until the timeout), and the learning rates, evaluated only once all
processes passed, move a counting callable on every process or on none. A callable learning
rate that raises on some processes only is agreed on the same way (a second small all_reduce,
made only with W > 1 and a callable rate in the batch): every process raises at once, nothing
written (the callables of the processes where it did not raise have been called).
``apply_gradients`` skips, as a whole, the tables of an optimizer with
``skip_nonfinite_gradients`` whose gradients hold NaN or inf on any process (docs/semantics.md
section 3). A 16-bit table's rows whose update overflows its dtype are left as they were by the
update itself; ``apply_gradients`` reports them once every table is written (``overflowed``: a
warning under ``skip_nonfinite_gradients``, else the text of the error the engine raises once the
step is counted; docs/semantics.md section 14).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn, cast

import torch

from ..base.comm import CollectiveError, Communicator
from ..config.dtypes import working_dtype
from ..config.optimizers import Optimizer
from ..numerics.rounding import COMPACT
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
            assert isinstance(g, torch.Tensor)  # (checked)
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
        work = working_dtype(p.dtype)
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


def _callable_rates(prepared: Prepared, plan: ShardingPlan) -> bool:
    """Whether an optimizer of the batch's tables has a callable learning rate."""
    return any(callable(_optimizer(plan, tb.physical).learning_rate) for tb in prepared.tables)


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
               warn_on_none: bool, before_write: Callable[[], None]) -> str | None:
    """The third verb whole: checks a training batch's gradients, evaluates its gradient
    multipliers, finds its non-finite gradients, calls ``before_write()`` (the engine lets
    background lookups of later batches finish, they read the tables) and converts the gradients
    to the update's device and dtype; with several processes, agrees with the others that every
    process passed (``agree_gradients``: one small collective, which also carries the
    non-finite flags); then evaluates the learning rates (last: a counting callable moves only
    once everything else passed, on every process) and ``apply_gradients``; returns its result
    (the text of an overflow error to raise once the step is counted, or None).

    Args:
        prepared, answers: the training batch and what its lookup's exchange recorded.
        grads: per feature (flat order) the gradient of its activation, or None for zero.
        names: the features' names (flat order), for errors and warnings.
        store, comm: the rows and the communicator; step: updates applied so far.
        warn_on_none: warn when a None gradient still moves rows.

    Raises:
        TypeError / ValueError: as ``check_gradients``, or from a multiplier or learning rate.
            Nothing is written.
        ValueError / TypeError / RuntimeError: (W > 1) another process rejected its gradients
            (its error's kind, RuntimeError for any other exception), naming its rank and
            quoting its error (``agree_gradients``). Nothing is written, on any process.
    """
    plan = store.plan
    groups = _skip_groups(prepared, plan)
    failure: Exception | None = None
    try:
        parts = exact_rows(prepared, grads, plan, store.device)  # (None: to check, convert)
        checked = (check_gradients(prepared, grads, names, plan, warn_on_none) if parts is None
                   else cast(Sequence[torch.Tensor], grads))
        multipliers = gradient_multipliers(prepared, plan, step)
        nonfinite = (nonfinite_gradients(prepared, checked, names, plan) if groups
                     else {})  # (only the groups' tables are read)
        before_write()
        row_parts = parts if parts is not None else gradient_rows(prepared, checked, store)
    except Exception as e:
        if comm.world_size == 1:
            raise
        failure = e
    if failure is None:
        local = [any(p in nonfinite for p in tables) for tables, _ in groups]
    else:
        local = [False] * len(groups)
    if comm.world_size > 1:  # (raises on every process when one rejected its gradients)
        bad = agree_gradients(comm, failure, local, store.device)
    else:
        bad = local
    if comm.world_size == 1 or not _callable_rates(prepared, plan):
        lrs = learning_rates(prepared, plan)
    else:  # a callable may raise on some processes only: they agree once more before the
        # exchange, so every process raises at once (nothing written) instead of waiting
        failure = None
        try:
            lrs = learning_rates(prepared, plan)
        except Exception as e:
            failure = e
        agree_gradients(comm, failure, [False] * len(groups), store.device)
    skipped = _skipped(groups, bad, nonfinite, plan) if groups else set()
    return apply_gradients(prepared, answers, row_parts, store, comm, step, lrs, multipliers,
                           skipped)


# A process's status in ``agree_gradients``: what its checks raised (0: they passed).
_PASSED, _VALUE_ERROR, _TYPE_ERROR, _OTHER_ERROR = 0, 1, 2, 3
_KINDS: dict[int, type[Exception]] = {_VALUE_ERROR: ValueError, _TYPE_ERROR: TypeError,
                                      _OTHER_ERROR: RuntimeError}
_MESSAGE_BYTES = 1024  # of a rejecting process's error carried to the others (UTF-8, cut)


def agree_gradients(comm: Communicator, failure: Exception | None, flags: Sequence[bool],
                    device: torch.device) -> list[bool]:
    """Every process's outcome of its local checks, before any collective of the exchange (a
    collective: every process calls it once per ``apply_gradients`` when W > 1).

    One ``all_reduce`` of ``W + len(flags)`` int32: at this rank's index its status (its checks
    passed, or raised a ValueError, a TypeError or another exception), then ``flags`` (per
    optimizer object with ``skip_nonfinite_gradients``: a gradient of its tables holds NaN or inf
    here), summed over the processes. When a process failed, a second collective (an
    ``all_gather``) carries each failed process's error message (its first ``_MESSAGE_BYTES``
    bytes), and every process raises: a failed one its own error (``failure``), the others an
    error of the first failed process's kind (ValueError, TypeError, else RuntimeError) naming
    it and quoting its message.

    Args:
        comm: the communicator (W > 1).
        failure: what this process's checks raised, or None.
        flags: this process's non-finite flags (the same length on every process).
        device: where the collective's tensors live (the tables' device: NCCL wants the GPU).

    Returns:
        Per flag, whether it is set on any process.

    Raises:
        ``failure`` on this process; ValueError / TypeError / RuntimeError when another process
        failed; CollectiveError when the collective fails (on a failed process: ``failure``).
    """
    w = comm.world_size
    status = _PASSED if failure is None else (
        _VALUE_ERROR if isinstance(failure, ValueError) else
        _TYPE_ERROR if isinstance(failure, TypeError) else _OTHER_ERROR)
    mine = [0] * (w + len(flags))  # (W + G,)
    mine[comm.rank] = status
    mine[w:] = [int(f) for f in flags]
    try:
        got = comm.all_reduce_sum(torch.tensor(mine, dtype=torch.int32, device=device)).tolist()
    except CollectiveError:
        if failure is not None:  # this process's own error first (the collective's: context)
            raise failure  # noqa: B904 - the collective's error stays its context
        raise
    statuses = got[:w]
    failed = [r for r, s in enumerate(statuses) if s != _PASSED]
    if not failed:
        return [n > 0 for n in got[w:]]
    text = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()
    text = text[:_MESSAGE_BYTES]
    message = torch.tensor(list(text) + [0] * (_MESSAGE_BYTES - len(text)), dtype=torch.uint8,
                           device=device)  # (_MESSAGE_BYTES,)
    try:
        messages = comm.all_gather(message)  # W x (_MESSAGE_BYTES,)
    except CollectiveError:
        if failure is not None:
            raise failure  # noqa: B904 - the collective's error stays its context
        raise
    if failure is not None:
        raise failure  # (as with one process)
    first = failed[0]
    raw = bytes(messages[first].cpu().tolist()).rstrip(b"\0")
    said = raw.decode("utf-8", errors="ignore") + ("..." if len(raw) == _MESSAGE_BYTES else "")
    who = (f"rank {first} of {comm.world_size} rejected its" if len(failed) == 1 else
           f"ranks {failed} of {comm.world_size} rejected their")
    raise _KINDS[statuses[first]](
        f"{who} gradients for this step, so no process applies them: nothing is "
        f"written on any process and the step is not counted; the batch still awaits its "
        f"gradients on every process (retry apply_gradients on all of them). Rank {first}'s "
        f"error: {said}")


def reject_gradients(prepared: Prepared, plan: ShardingPlan, comm: Communicator,
                     device: torch.device, failure: Exception) -> NoReturn:
    """Raises ``failure``, after telling the other processes (W > 1: ``agree_gradients``, as
    ``apply_step`` would have) that this process rejects its gradients for ``prepared``: for a
    rejection before ``apply_step`` (the engine's flattening of the gradients' structure), so
    that the others raise at once instead of waiting in the exchange until the timeout."""
    if comm.world_size > 1:
        agree_gradients(comm, failure, [False] * len(_skip_groups(prepared, plan)), device)
    raise failure


def exact_rows(prepared: Prepared, grads: Sequence[object], plan: ShardingPlan,
               device: torch.device) -> dict[int, list[torch.Tensor]] | None:
    """``gradient_rows``' result without a copy, when every gradient is already what the update
    takes: a dense tensor (not requiring grad) of its activation's shape, in its table's working
    dtype, on ``device`` (then there is nothing to check or convert: each is viewed as its
    ``(R_f, D)`` rows, a column slice of a wider gradient read where it is). None otherwise:
    ``check_gradients`` and ``gradient_rows`` then check, convert or reject them."""
    out = {}
    for tb in prepared.tables:
        p = plan.physical[tb.physical]
        work, dim = working_dtype(p.dtype), p.dim
        parts = []
        for s in tb.slices:
            g = grads[s.feature]
            if (type(g) is not torch.Tensor or g.dtype is not work or g.is_nested
                    or g.layout is not torch.strided or g.requires_grad or g.device != device):
                return None
            if len(s.shape) == 1:
                if g.shape != (s.rows, dim):
                    return None
            elif g.shape != s.shape + (dim,) or not g.is_contiguous():
                return None
            else:
                g = g.view(s.rows, dim)
            parts.append(g)
        out[tb.physical] = parts
    return out


def gradient_rows(prepared: Prepared, grads: Sequence[torch.Tensor | None],
                  store: RowStore) -> dict[int, list[torch.Tensor]]:
    """``{physical table: per feature its (R_f, D) gradient rows}`` in the update's device and
    working dtype (zeros for None): the conversion, before any write."""
    plan = store.plan
    parts = {}
    for tb in prepared.tables:
        p = plan.physical[tb.physical]
        parts[tb.physical] = [_rows(grads[s.feature], s.rows, p.dim, working_dtype(p.dtype),
                                    store.device) for s in tb.slices]
    return parts


def apply_gradients(prepared: Prepared, answers: Answers,
                    parts: dict[int, list[torch.Tensor]], store: RowStore, comm: Communicator,
                    step: int, lrs: Mapping[int, float],
                    multipliers: Mapping[int, float | None], skipped: set[int]) -> str | None:
    """Applies each physical table's optimizer to the rows of ``prepared`` (a collective when a
    table is sharded): the writes, every check passed (``apply_step``). Returns ``overflowed``'s
    result: the text of the error to raise once the step is counted, or None.

    Args:
        prepared: the training batch; answers: what its lookup's exchange recorded.
        parts: ``gradient_rows``' result: per physical table, per feature its gradient rows in
            the update's device and dtype (consumed).
        store: the rows; comm: the communicator; step: updates applied so far.
        lrs, multipliers: ``learning_rates`` and ``gradient_multipliers`` of this batch.
        skipped: the physical tables this step leaves alone (``skip_nonfinite_gradients``), the
            same on every process.
    """
    plan = store.plan
    todo = [(tb, got) for tb, got in zip(prepared.tables, answers) if tb.physical not in skipped]
    left: dict[int, torch.Tensor] = {}  # per 16-bit table, the shard rows its update left
    for tb, got in todo:
        p = plan.physical[tb.physical]
        outputs = OutputGrads(parts.pop(tb.physical),
                              tb.slices.starts, tb.bags,
                              tb.dedup)
        opt = _optimizer(plan, tb.physical)
        lr, gmul = lrs[tb.physical], multipliers[tb.physical]
        if comm.world_size == 1:  # fused: row gradients formed in the update
            # (a dynamic table's rows: those its map gave the distinct ids at the lookup)
            store[tb.physical].update(tb.dedup.unique if got is None else got.rows[0],
                                      outputs, opt, lr, step, gradient_multiplier=gmul,
                                      since=None if got is None else got.since)
        else:
            g_unique = row_gradients(outputs, store.workspace, store.backend)  # (U, D)
            rows, g = gradients_at_owner(comm, p, tb, got.rows if got is not None else None,
                                         g_unique)
            store[tb.physical].update(rows, g, opt, lr, step, gradient_multiplier=gmul,
                                      since=got.since if got is not None else None)
        if p.dtype in COMPACT:
            overflow = store[tb.physical].overflowed()
            if overflow is not None:
                left[tb.physical] = overflow
    return overflowed(left, plan, comm.rank, step) if left else None



def overflowed(left: Mapping[int, torch.Tensor], plan: ShardingPlan, rank: int,
               step: int) -> str | None:
    """Reports the rows of 16-bit tables that this step's update left as they were, their
    rounding to the table's dtype having overflowed (``left``: per physical table, its shard
    rows here): a ``RuntimeWarning`` per table whose optimizer has
    ``skip_nonfinite_gradients``; for the others, the text of the ``OverflowError`` the engine
    raises once the step is counted (None: none to raise). Names the tables and rows."""
    errors = []
    for physical, rows in left.items():
        p = plan.physical[physical]
        opt = _optimizer(plan, physical)
        what = (f"step {step}'s update of {p.rows_named(plan, rows, rank)} overflows "
                f"{str(p.dtype).removeprefix('torch.')} (its largest finite value is "
                f"{torch.finfo(p.dtype).max:.6g}): those rows and their slots are left as they "
                f"were")
        if opt.skip_nonfinite_gradients:
            warnings.warn(f"{type(opt).__name__} with skip_nonfinite_gradients=True: {what} "
                          f"(this step's other rows are updated)", RuntimeWarning, stacklevel=4)
        else:
            errors.append(what)
    if not errors:
        return None
    return ("; ".join(errors) + ". The step is otherwise applied and counted (its other rows "
            "are updated; nothing to retry). Lower the learning rate, clip the gradients "
            "(clipvalue) or the weights (clip_weight_min / clip_weight_max), use wider rows "
            "(bfloat16 or float32), or build the optimizer with skip_nonfinite_gradients=True "
            "to leave such rows with a warning instead of this error")


def _skip_groups(prepared: Prepared, plan: ShardingPlan) -> list[tuple[list[int], Optimizer]]:
    """Per optimizer object with ``skip_nonfinite_gradients`` (in table order: the same on every
    process), its physical tables in this batch, and the optimizer."""
    groups: dict[int, tuple[list[int], Optimizer]] = {}
    for tb in prepared.tables:
        opt = _optimizer(plan, tb.physical)
        if opt.skip_nonfinite_gradients:
            groups.setdefault(id(opt), ([], opt))[0].append(tb.physical)
    return list(groups.values())


def _skipped(groups: Sequence[tuple[list[int], Optimizer]], bad: Sequence[bool],
             nonfinite: Mapping[int, list[str]], plan: ShardingPlan) -> set[int]:
    """The physical tables this step leaves alone: every table of an optimizer object with
    ``skip_nonfinite_gradients`` that got a NaN or inf gradient on any process (``bad``: per
    group of ``_skip_groups``, agreed by every process); warns naming the features."""
    out: set[int] = set()
    for (physical, opt), skip in zip(groups, bad):
        if not skip:
            continue
        out.update(physical)
        tables = [t for p in physical for t in plan.physical[p].tables]
        features = [f for p in physical for f in nonfinite.get(p, ())]
        where = (f"the gradients of features {features} hold" if features else
                 "a gradient on another process holds")
        warnings.warn(f"{type(opt).__name__} with skip_nonfinite_gradients=True: {where} "
                      f"NaN or inf, so this step's update of tables {tables} is skipped (their "
                      f"rows and slots are unchanged)", RuntimeWarning, stacklevel=3)
    return out


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
