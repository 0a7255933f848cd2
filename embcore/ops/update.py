"""Fast in-place optimizer updates of the touched rows (torch ops).

``Optimizer.update`` is the readable, pure form of every rule (it returns new rows and never
writes its inputs); the engine gathers rows, calls it and scatters the result. For the optimizers
that dominate recommendation training, without the extra options (gradient multiplier, clipping,
weight decay), this module does the same math in place on the gathered rows: two gathers, the
arithmetic in the gathered buffers, two scatters, and no other (U, D) temporaries. It is tested
against ``Optimizer.update`` on random inputs.

On the CPU with float32 tables, SGD, Adagrad and RowwiseAdagrad (with every option: gradient
multiplier, clipping, weight decay, weight clipping) run as one fused kernel instead
(``native.sparse_update``): each touched row and its accumulator are read and written once, in
place, and with a local table the summed gradient is formed from the output gradients inside the
same pass (``update_from_outputs``), so no (U, D) temporary exists at all.
"""

from __future__ import annotations

import torch

from ..optimizers import SGD, Adagrad, Optimizer, RowwiseAdagrad
from ..preprocess import TableBatch
from . import native
from .workspace import Workspace

_RULES = {SGD: native.SGD, Adagrad: native.ADAGRAD, RowwiseAdagrad: native.ROWWISE_ADAGRAD}


def native_rule(opt: Optimizer, table: torch.Tensor) -> int | None:
    """The fused kernel's rule for this optimizer and table, or None when it does not apply."""
    rule = _RULES.get(type(opt))
    if rule is None or table.dtype != torch.float32 or not table.is_contiguous():
        return None
    return rule if native.usable(table) else None


def _hyper(opt: Optimizer, lr: float, step: int) -> native.Hyper:
    """The fused kernel's hyper-parameters of ``opt`` at ``step``, by name."""
    inf = float("inf")
    gmul = 1.0 if opt.gradient_multiplier is None else float(opt.gradient_multiplier(step))
    lo, hi = opt.clip_bounds
    wd = float(opt.weight_decay_factor or 0.0)
    if opt.multiply_weight_decay_factor_by_learning_rate:
        wd *= lr
    return native.Hyper(
        learning_rate=lr, gradient_multiplier=gmul,
        clip_min=-inf if lo is None else float(lo), clip_max=inf if hi is None else float(hi),
        weight_decay=wd,
        weight_min=-inf if opt.clip_weight_min is None else float(opt.clip_weight_min),
        weight_max=inf if opt.clip_weight_max is None else float(opt.clip_weight_max))


def update_from_outputs(rule: int, opt: Optimizer, table: torch.Tensor,
                        slots: dict[str, torch.Tensor], tb: TableBatch,
                        grads: list[torch.Tensor], lr: float, step: int) -> None:
    """Backward and update in one pass: each of ``tb.unique``'s rows gets the scaled sum of its
    occurrences' output gradients, then the rule, in place.

    Args:
        rule: ``native_rule(opt, table)``.
        table: (N, D) the whole physical table (held here: one process or replicated).
        slots: its slots.
        tb: the batch.
        grads: per feature slice of ``tb``, its (R_f, D) output gradient (float32, contiguous).
        lr: the learning rate; step: updates applied so far (for the gradient multiplier).
    """
    starts = [s.start for s in tb.slices] + [tb.num_rows]
    native.sparse_update(rule, table, slots.get("accumulators"), tb.unique, _hyper(opt, lr, step),
                         grads, starts, tb.unique_offsets, tb.order,
                         None if tb.unit else tb.bags, tb.scales)


def update_rows(rule: int, opt: Optimizer, table: torch.Tensor, slots: dict[str, torch.Tensor],
                rows: torch.Tensor, grad: torch.Tensor, lr: float, step: int) -> None:
    """The fused update of distinct ``rows`` with their summed (U, D) gradients, in place."""
    native.sparse_update(rule, table, slots.get("accumulators"), rows.contiguous(),
                         _hyper(opt, lr, step), [grad.to(torch.float32).contiguous()])


def fast_update_supported(opt: Optimizer, params: torch.Tensor) -> bool:
    """Whether ``apply_in_place`` handles this optimizer and table dtype."""
    if type(opt) not in (SGD, Adagrad, RowwiseAdagrad):
        return False
    if params.dtype not in (torch.float32, torch.float64):
        return False
    plain = (opt.gradient_multiplier is None and opt.clipvalue is None
             and not opt.weight_decay_factor and opt.clip_weight_min is None
             and opt.clip_weight_max is None)
    # A zero accumulator could meet a zero gradient (0 / 0): the pure path guards that case.
    positive = isinstance(opt, SGD) or opt.initial_accumulator_value > 0
    return plain and positive


def apply_in_place(opt: Optimizer, table: torch.Tensor, slots: dict[str, torch.Tensor],
                   rows: torch.Tensor, grad: torch.Tensor, lr: float,
                   workspace: Workspace | None = None) -> None:
    """Updates ``table[rows]`` (and slots) in place; ``rows`` unique.

    Args:
        opt: SGD, Adagrad or RowwiseAdagrad (see ``fast_update_supported``).
        table: (N, D) parameters.
        slots: ``{"accumulators": (N, D) or (N, 1)}`` (none for SGD).
        rows: (U,) unique row ids.
        grad: (U, D) summed gradient of each row, in the table's dtype.
        lr: the learning rate.
        workspace: buffers for the gathered rows (None allocates them).
    """
    g = grad.to(table.dtype)
    if isinstance(opt, SGD):
        table.index_add_(0, rows, g, alpha=-lr)
        return
    acc = slots["accumulators"]
    a = _gather(acc, rows, "acc_rows", workspace)  # (U, D) or (U, 1)
    if isinstance(opt, RowwiseAdagrad):
        a.add_(g.square().mean(dim=1, keepdim=True))
    else:
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
