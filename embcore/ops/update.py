"""The update: one entry point (``update``) for every optimizer, kernel and gradient source.

``update(table, slots, rows, grad, optimizer, lr, step)`` applies the optimizer to distinct rows of
a table held here, in place (docs/semantics.md section 3). The gradient comes either summed per row
(a ``(U, D)`` tensor: sharded tables, after the exchange) or as the output rows' gradients
(``OutputGrads``: a table held here, whose row gradients can be formed inside the update). The
gradient multiplier is evaluated once per call, or given already evaluated
(``gradient_multiplier=``: the engine evaluates it once per step, before any write), and every
kernel uses that value. The kernel is chosen in this module and nowhere else, once per table by
``TableUpdate`` (which the rows objects keep; ``update`` binds one for its call), from the
backend of the table's device (ops/backend.py) and the optimizer's record
(``config/optimizers.py OptimizerRecord``: the name of its kernels' rule, whose number and
kernels kernels/rules.py gives):

1. the fused CPU kernel (``cpu.sparse_update``, the records' ``rule`` in ``rules.NATIVE``: SGD,
   Adagrad and RowwiseAdagrad) with every option, float32, float16 and bfloat16 tables on the CPU
   (a 16-bit row widened, updated in float32 and rounded back in the same pass); each touched row
   and its accumulator are read and written once, and from ``OutputGrads`` the row gradients are
   summed in the same pass (no ``(U, D)`` temporary at all);
2. on CUDA, the Triton kernel (``gpu.sparse_update``, the records' ``rule`` in ``rules.TRITON``):
   the same contract for SGD, Adagrad, RowwiseAdagrad, AdagradMomentum, lazy Adam and FTRL with
   every option, float32, float16 and bfloat16 tables (16-bit rows rounded as on the CPU) and
   8-bit tables (new codes and row scales as ``rounding.quantize``, in the same pass), float32
   slots (the output gradients' parts are concatenated first);
3. torch ops in place (``apply_in_place``, the records' ``in_place``: SGD, Adagrad and
   RowwiseAdagrad) without options (two gathers, the arithmetic in the gathered buffers, two
   scatters);
4. the optimizer's own math (``Optimizer.update``, pure): every optimizer and option, any float
   dtype, any device; the rows are gathered (16-bit ones widened), updated and written back
   (rounded by ``numerics/rounding.py``, the kernels' rule bit for bit). 8-bit tables
   (float8_e4m3fn, float8_e5m2) take this path off CUDA: a row is widened with its
   scale (``slots["scales"]``), updated, and written back as new codes and a new scale
   (``rounding.quantize``). ``Adam(lazy_adam=False)``
   updates every row, untouched ones with a zero gradient.

Hyper-parameters reach the kernel by name (``cpu.Hyper``, mirrored by ``EcHyper`` in C++).
Every path is tested against ``ops/reference_optim.py`` (tests/test_ops_update.py,
tests/test_native.py).
"""

from __future__ import annotations

import torch

from ..config.dtypes import SCALED, SCALES, is_working
from ..config.optimizers import Optimizer, record_of
from ..kernels import cpu, gpu, rules
from ..kernels.hyper import HyperValues
from ..numerics import rounding
from ..numerics.rounding import COMPACT, Rounding
from .backend import FUSED_CPU, TRITON, Backend, choose
from .combine import OutputGrads, row_gradients
from .workspace import Workspace

_NEAREST = rounding.nearest()
# The in-place rules of ``apply_in_place`` (a record's ``in_place``).
_IN_PLACE = ("sgd", "adagrad", "rowwise_adagrad")


def update(table: torch.Tensor, slots: dict[str, torch.Tensor], rows: torch.Tensor,
           grad: torch.Tensor | OutputGrads, optimizer: Optimizer, lr: float, step: int,
           workspace: Workspace | None = None, *,
           gradient_multiplier: float | None = None, round_to: Rounding | None = None,
           guard: bool = False, backend: Backend | None = None) -> torch.Tensor | None:
    """Applies ``optimizer`` to ``table[rows]`` and its slots, in place, each row once.

    A float16 / bfloat16 table's rows are widened, updated in float32 and rounded back by
    ``round_to`` (numerics/rounding.py; None: to nearest), on every path. With ``guard``, a
    16-bit row whose rounded result holds an infinity or NaN where its float32 result is finite
    (the rounding overflowed the row's dtype) is left as it was, its slots too, on every path
    (the fused kernel checks each row before it keeps it); the rows so left are returned.

    Args:
        table: (N, D) parameters held here.
        slots: ``{name: (N, D) or (N, 1)}`` the optimizer's slots of ``table``.
        rows: (U,) distinct rows (``grad.dedup.unique`` for ``OutputGrads``).
        grad: (U, D) summed gradient of each row, or the output rows' gradients.
        optimizer: its rule and options; lr: this step's learning rate; step: updates so far.
        workspace: buffers for the temporaries, kept across steps (None allocates them).
        gradient_multiplier: ``optimizer.current_gradient_multiplier(step)`` already evaluated
            (the engine evaluates it once per step, before any write), used by every kernel;
            None: evaluated here, once.
        round_to: how a 16-bit table's results are rounded (its ``at(step, ...)`` already).
        guard: leave the rows whose rounding overflows as they were (16-bit tables).
        backend: the kernels of the table's device (ops/backend.py); None: chosen for
            ``table``'s device now (``TableUpdate`` keeps the choice for a table).

    Returns:
        With ``guard``, the rows left as they were (a subset of ``rows``), or None when none
        was; None without it (and on CUDA, where the Triton kernel does not guard).
    """
    return TableUpdate(table, slots, optimizer, backend)(
        rows, grad, lr, step, workspace, gradient_multiplier=gradient_multiplier,
        round_to=round_to, guard=guard)


def update_torch(table: torch.Tensor, slots: dict[str, torch.Tensor], rows: torch.Tensor,
                 grad: torch.Tensor | OutputGrads, optimizer: Optimizer, lr: float, step: int,
                 workspace: Workspace | None = None, *,
                 gradient_multiplier: float | None = None, round_to: Rounding | None = None,
                 guard: bool = False, backend: Backend | None = None) -> torch.Tensor | None:
    """``update`` in torch ops, on any device: in place where the optimizer has an in-place
    rule without options, else its own math (``Optimizer.update``) and a write-back (the
    ``backend`` sums an ``OutputGrads``'s row gradients)."""
    if gradient_multiplier is None and optimizer.gradient_multiplier is not None:
        gradient_multiplier = optimizer.current_gradient_multiplier(step)
    compact = table.dtype in COMPACT
    guard = guard and compact
    scales = slots.get(SCALES) if table.dtype in SCALED else None  # (N, 1) an 8-bit row's
    if scales is not None:
        slots = {k: v for k, v in slots.items() if k != SCALES}
    summed = (row_gradients(grad, workspace, backend) if isinstance(grad, OutputGrads)
              else grad)  # (U, D)
    if gradient_multiplier is None and in_place_supported(optimizer, table):
        apply_in_place(optimizer, table, slots, rows, summed, lr, workspace)
        return None
    if optimizer.updates_every_row:  # every row moves, untouched ones with g = 0
        full = torch.zeros(table.shape, dtype=summed.dtype, device=summed.device)  # (N, D)
        full[rows] = summed
        rows, summed = torch.arange(table.shape[0], device=table.device), full
    w = table[rows]
    if scales is not None:
        w = rounding.widen(w, scales[rows])  # (U, D) float32
    new_w, new_slots = optimizer.update(w.float() if compact else w, summed,
                                        {k: v[rows] for k, v in slots.items()}, lr=lr, step=step,
                                        gradient_multiplier=gradient_multiplier)
    left = None
    if compact:  # the float32 result rounded to the rows' dtype
        wide, new_w = new_w, (round_to or _NEAREST).round(new_w, rows, table.dtype)
        if guard:
            over = (torch.isfinite(wide) & ~torch.isfinite(new_w)).any(dim=1)  # (U,)
            if bool(over.any()):  # those rows and their slots left as they were
                left, kept = rows[over], ~over
                rows, new_w = rows[kept], new_w[kept]
                new_slots = {k: v[kept] for k, v in new_slots.items()}
    if scales is not None:  # new codes and scales (no torch index_copy_ of 8-bit floats)
        codes, new_scales = (round_to or _NEAREST).quantize(new_w, rows, table.dtype)
        table.view(torch.uint8).index_copy_(0, rows, codes.view(torch.uint8))
        scales.index_copy_(0, rows, new_scales)
    else:
        table.index_copy_(0, rows, new_w)
    for k, v in new_slots.items():
        slots[k].index_copy_(0, rows, v)
    return left


def _flags(rows: torch.Tensor, workspace: Workspace | None) -> torch.Tensor:
    """(U,) uint8 flags for the fused kernel's guard, which writes every one (a workspace
    buffer when given; not zeroed here: a torch op on the hot path wakes torch's threads, which
    then spin beside the kernel's)."""
    if workspace is None:
        return torch.empty(rows.numel(), dtype=torch.uint8)
    return workspace.get("overflow", (rows.numel(),), torch.uint8, rows.device)


def _left(rows: torch.Tensor, flags: torch.Tensor | None, count: int) -> torch.Tensor | None:
    """The rows the fused kernel's guard flagged (``count`` of them), or None."""
    if flags is None or not count:
        return None
    return rows[flags.bool()]


class TableUpdate:
    """``update`` for one table and its slots under one optimizer, the kernel chosen once by
    the backend of the table's device.

    A rows object (state/rows.py) keeps one per optimizer: its table's dtype, layout and device
    are fixed while it holds it, so the kernel is chosen here, when the object is made: the
    fused CPU kernel (its table's arguments bound, ``cpu.SparseUpdate``), the Triton kernel, or
    torch ops (``update_torch``), by the backend and what each kernel implements (the records'
    rules, the table's dtype and layout). The fused kernel's hyper-parameters are kept per
    learning rate and gradient multiplier (a schedule: the last few). Every backend gives the
    same values (tests/test_bound_kernels.py, tests/triton_cases.py).

    Args:
        table, slots: as ``update``'s, held by the caller for this object's life.
        optimizer: the rule applied to them.
        backend: the table's device's backend (None: ``backend.choose(table.device)``).
    """

    _HYPERS_KEPT = 8  # hyper-parameter sets kept (a constant rate needs one)

    def __init__(self, table: torch.Tensor, slots: dict[str, torch.Tensor],
                 optimizer: Optimizer, backend: Backend | None = None) -> None:
        self.table, self.slots, self.optimizer = table, slots, optimizer
        self.backend = backend = backend if backend is not None else choose(table.device)
        self._hypers: dict[tuple[float, float | None], cpu.Hyper] = {}
        rule = native_rule(optimizer, table) if backend.fused_cpu else None
        self._kernel = (None if rule is None else
                        cpu.SparseUpdate(rule, table, slots.get("accumulators"),
                                         slots.get(SCALES) if table.dtype in SCALED else None))
        self._triton = backend.triton and gpu.update_supported(optimizer, table, slots)

    def __call__(self, rows: torch.Tensor, grad: torch.Tensor | OutputGrads, lr: float,
                 step: int, workspace: Workspace | None = None, *,
                 gradient_multiplier: float | None = None,
                 round_to: Rounding | None = None, guard: bool = False) -> torch.Tensor | None:
        """``update(table, slots, rows, grad, optimizer, lr, step, workspace, ...)``."""
        opt = self.optimizer
        kernel = self._kernel
        if kernel is None:
            if self._triton:
                if gradient_multiplier is None and opt.gradient_multiplier is not None:
                    gradient_multiplier = opt.current_gradient_multiplier(step)
                _gpu_update(self.table, self.slots, rows, grad, opt, lr, gradient_multiplier,
                            round_to)
                return None
            return update_torch(self.table, self.slots, rows, grad, opt, lr, step, workspace,
                                gradient_multiplier=gradient_multiplier, round_to=round_to,
                                guard=guard, backend=self.backend)
        if gradient_multiplier is None and opt.gradient_multiplier is not None:
            gradient_multiplier = opt.current_gradient_multiplier(step)
        hyper = self._hypers.get((lr, gradient_multiplier))
        if hyper is None:
            if len(self._hypers) >= self._HYPERS_KEPT:
                self._hypers.clear()
            hyper = self._hypers[(lr, gradient_multiplier)] = _hyper(
                opt, lr, gradient_multiplier=gradient_multiplier)
        rows, grads, starts, uoff, order, bags, scales = _fused_sources(rows, grad)
        flags = _flags(rows, workspace) if guard and self.table.dtype in COMPACT else None
        return _left(rows, flags, kernel(rows, hyper, grads, starts, uoff, order, bags, scales,
                                         round_to, flags))


_Opt = torch.Tensor | None


def _fused_sources(rows: torch.Tensor, grad: torch.Tensor | OutputGrads
                   ) -> tuple[torch.Tensor, list[torch.Tensor], list[int] | None, _Opt, _Opt,
                              _Opt, _Opt]:
    """The fused kernel's rows and gradient source (``sparse_update``'s ``rows, grads, starts,
    unique_offsets, order, bags, scales``): the output gradients' parts, the backward fused
    into the update (a part whose columns are consecutive, as a column slice of a wider
    gradient from torch.cat's backward, is read where it is, with its row stride); or one
    (U, D) summed gradient."""
    if isinstance(grad, OutputGrads):
        dd, bags = grad.dedup, grad.bags
        return (dd.unique, [p if p.shape[1] <= 1 or p.stride(1) == 1 else p.contiguous()
                            for p in grad.parts], grad.starts, dd.unique_offsets, dd.order,
                None if bags.offsets is None else bags.bag_of(FUSED_CPU), bags.scales)
    return rows.contiguous(), [grad.to(torch.float32).contiguous()], None, None, None, None, None


def _gpu_update(table: torch.Tensor, slots: dict[str, torch.Tensor], rows: torch.Tensor,
                grad: torch.Tensor | OutputGrads, optimizer: Optimizer, lr: float,
                gradient_multiplier: float | None, round_to: Rounding | None) -> None:
    """The Triton kernel (CUDA): the fused kernel's contract, for every rule ``gpu`` supports."""
    optimizer._check_lr(lr)  # as Optimizer.update (FTRL refuses lr = 0)
    hyper = _hyper_values(optimizer, lr, gradient_multiplier=gradient_multiplier)
    if isinstance(grad, OutputGrads):  # the backward fused into the update
        g = grad
        out = g.parts[0].contiguous() if len(g.parts) == 1 else torch.cat(g.parts)  # (R, D)
        gpu.sparse_update(optimizer, table, slots, g.dedup.unique, hyper, out,
                          g.dedup.unique_offsets, g.dedup.order,
                          None if g.bags.unit else g.bags.bag_of(TRITON), g.bags.scales,
                          round_to, g.bags.verdict)
    else:
        gpu.sparse_update(optimizer, table, slots, rows, hyper, grad, round_to=round_to)


def on_triton(backend: Backend, table: torch.Tensor, slots: dict[str, torch.Tensor],
              optimizer: Optimizer | None) -> bool:
    """Whether ``table``'s lookup (``TableCombine``) and its update under ``optimizer`` (None:
    no update) are the Triton kernels on ``backend``."""
    return (backend.triton and gpu.lookup_supported(table)
            and (optimizer is None or gpu.update_supported(optimizer, table, slots)))


def native_rule(opt: Optimizer, table: torch.Tensor) -> int | None:
    """The fused CPU kernel's rule for this optimizer and table (its record's ``rule``, where
    the kernel implements it, for the table's dtype and layout), or None."""
    record = record_of(opt)
    rule = None if record is None or opt.updates_every_row else rules.of(record.rule, rules.NATIVE)
    if rule is None or table.dtype not in cpu.UPDATE_ROW_TYPES or not table.is_contiguous():
        return None
    return rule


def _hyper(opt: Optimizer, lr: float, *, gradient_multiplier: float | None) -> cpu.Hyper:
    """The fused kernel's hyper-parameters of ``opt`` by name, with this step's learning rate and
    evaluated gradient multiplier (``opt.current_gradient_multiplier(step)``; None: 1)."""
    return cpu.Hyper(**_hyper_values(opt, lr, gradient_multiplier=gradient_multiplier)._asdict())


def _hyper_values(opt: Optimizer, lr: float, *, gradient_multiplier: float | None
                  ) -> HyperValues:
    """``_hyper``'s fields as a plain tuple (the Triton kernel's: traceable)."""
    inf = float("inf")
    gmul = 1.0 if gradient_multiplier is None else float(gradient_multiplier)
    lo, hi = opt.clip_bounds
    wd = float(opt.weight_decay_factor or 0.0)
    if opt.multiply_weight_decay_factor_by_learning_rate:
        wd *= lr
    return HyperValues(
        learning_rate=lr, gradient_multiplier=gmul,
        clip_min=-inf if lo is None else float(lo), clip_max=inf if hi is None else float(hi),
        weight_decay=wd,
        weight_min=-inf if opt.clip_weight_min is None else float(opt.clip_weight_min),
        weight_max=inf if opt.clip_weight_max is None else float(opt.clip_weight_max))


def in_place_supported(opt: Optimizer, params: torch.Tensor) -> bool:
    """Whether ``apply_in_place`` handles this optimizer (its record's ``in_place`` rule, without
    options) and table dtype."""
    record = record_of(opt)
    if record is None or record.in_place not in _IN_PLACE or opt.updates_every_row:
        return False
    if not is_working(params):
        return False
    plain = (opt.gradient_multiplier is None and opt.clipvalue is None
             and not opt.weight_decay_factor and opt.clip_weight_min is None
             and opt.clip_weight_max is None)
    # A zero accumulator could meet a zero gradient (0 / 0): the pure path guards that case (the
    # in-place rules divide by the square root of their one slot; SGD has none).
    positive = all(s.initial_value > 0 for s in opt.slots)
    return plain and positive


def apply_in_place(opt: Optimizer, table: torch.Tensor, slots: dict[str, torch.Tensor],
                   rows: torch.Tensor, grad: torch.Tensor, lr: float,
                   workspace: Workspace | None = None) -> None:
    """Updates ``table[rows]`` (and slots) in place with torch ops; ``rows`` distinct.

    Args:
        opt: an optimizer whose record names an in-place rule (see ``in_place_supported``).
        table: (N, D) parameters.
        slots: ``{"accumulators": (N, D) or (N, 1)}`` (none for SGD).
        rows: (U,) distinct row ids.
        grad: (U, D) summed gradient of each row.
        lr: the learning rate.
        workspace: buffers for the gathered rows (None allocates them).
    """
    record = record_of(opt)
    rule = None if record is None else record.in_place
    if rule not in _IN_PLACE:
        raise ValueError(f"apply_in_place: {type(opt).__name__} has no in-place rule "
                         f"({rule!r}); see in_place_supported")
    g = grad.to(table.dtype)
    if rule == "sgd":
        table.index_add_(0, rows, g, alpha=-lr)
        return
    acc = slots["accumulators"]
    a = _gather(acc, rows, "acc_rows", workspace)  # (U, D) or (U, 1)
    if rule == "rowwise_adagrad":
        a.add_(g.square().mean(dim=1, keepdim=True))
    else:  # adagrad
        a.addcmul_(g, g)
    acc.index_copy_(0, rows, a)
    w = _gather(table, rows, "param_rows", workspace)  # (U, D)
    w.addcdiv_(g, a.sqrt_(), value=-lr)
    table.index_copy_(0, rows, w)


def _gather(src: torch.Tensor, rows: torch.Tensor, name: str,
            workspace: Workspace | None) -> torch.Tensor:
    """``src[rows]``, into a workspace buffer when one is given."""
    if workspace is None:
        return src.index_select(0, rows)
    out = workspace.get(name, (rows.numel(), src.shape[1]), src.dtype, src.device)
    return torch.index_select(src, 0, rows, out=out)
