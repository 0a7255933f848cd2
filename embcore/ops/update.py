"""Fast in-place optimizer updates of the touched rows (torch ops).

``Optimizer.update`` is the readable, pure form of every rule (it returns new rows and never
writes its inputs); the engine gathers rows, calls it and scatters the result. For the optimizers
that dominate recommendation training, without the extra options (gradient multiplier, clipping,
weight decay), this module does the same math in place on the gathered rows: two gathers, the
arithmetic in the gathered buffers, two scatters, and no other (U, D) temporaries. It is tested
against ``Optimizer.update`` on random inputs.
"""

from __future__ import annotations

import torch

from ..optimizers import SGD, Adagrad, Optimizer, RowwiseAdagrad
from .workspace import Workspace


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
