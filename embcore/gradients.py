"""Apply gradients (the third verb of a step): activation gradients -> optimizer updates of rows.

For each physical table of a prepared training batch, the features' activation gradients become
one summed gradient per distinct row (docs/semantics.md section 3), which is applied once by the
table's optimizer where the row is held:

- rows all held here (one process, a replicated table at W = 1): the store's update forms the row
  gradients from the output gradients itself (fused into the update on the CPU kernels);
- sharded: ``combine_backward`` gives this process's (U, D) row gradients, ``gradients_at_owner``
  sums them at the processes holding the rows (exchange.py), and those update them.

``check_gradients`` and ``learning_rates`` run first and raise before any table is written.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch

from .comm import Communicator
from .exchange import gradients_at_owner
from .lookup import Received
from .ops.combine import OutputGrads, row_gradients
from .optimizers import Optimizer
from .plan import ShardingPlan
from .preprocess import Prepared
from .store import RowStore


def check_gradients(prepared: Prepared, grads: Sequence[object], names: Sequence[str],
                    plan: ShardingPlan, warn_none: bool) -> list[torch.Tensor | None]:
    """Validates the flat gradients of a batch; returns them detached.

    Raises:
        TypeError / ValueError: a gradient that is not a tensor or None, or of the wrong shape,
            naming the feature.
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
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"gradient of feature {names[s.feature]!r} must be a tensor or "
                                f"None, got {type(g).__name__}")
            if g.shape != s.shape + (p.dim,):
                raise ValueError(f"gradient of feature {names[s.feature]!r} has shape "
                                 f"{list(g.shape)}, expected {list(s.shape + (p.dim,))} (the "
                                 f"shape of its activation)")
            out[s.feature] = g.detach() if g.requires_grad else g
    if warn_none and not quiet_none:
        noisy = sorted({names[s.feature] for tb in prepared.tables for s in tb.slices
                        if grads[s.feature] is None and not _optimizer(plan, tb.physical)
                        .zero_gradient_is_noop})
        warnings.warn(f"features {noisy} got a None gradient; their optimizer changes rows even "
                      f"on a zero gradient (momentum, Adam, FTRL, weight decay or clipping), so "
                      f"their looked-up rows still move", stacklevel=3)
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


def apply_gradients(prepared: Prepared, received: Received,
                    grads: Sequence[torch.Tensor | None], store: RowStore, comm: Communicator,
                    lrs: Mapping[int, float], step: int) -> None:
    """Applies each physical table's optimizer to the rows of ``prepared`` (a collective when a
    table is sharded).

    Args:
        prepared: the training batch; received: what its lookup's exchange recorded.
        grads: per feature (flat order) its activation's gradient, or None for zero.
        store: the rows; comm: the communicator.
        lrs: ``learning_rates(prepared, plan)``; step: updates applied so far.
    """
    plan = store.plan
    for tb, got in zip(prepared.tables, received):
        p = plan.physical[tb.physical]
        work = torch.float64 if p.dtype == torch.float64 else torch.float32
        parts = [_rows(grads[s.feature], s.rows, p.dim, work, store.device)
                 for s in tb.slices]  # (R_f, D) each
        outputs = OutputGrads(parts, [s.start for s in tb.slices] + [tb.bags.num_rows],
                              tb.bags, tb.dedup)
        opt = _optimizer(plan, tb.physical)
        if tb.route is None and comm.world_size == 1:
            store.update(tb.physical, tb.dedup.unique, outputs, opt, lrs[tb.physical], step)
            continue
        g_unique = row_gradients(outputs, store.workspace)  # (U, D)
        rows, g = gradients_at_owner(comm, p, tb, got, g_unique)
        store.update(tb.physical, rows, g, opt, lrs[tb.physical], step)


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
