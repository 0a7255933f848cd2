"""The readable oracle of the optimizers: docs/semantics.md sections 3-4 (the order of the steps
and every rule) as plain loops.

Everything here runs on Python floats, one row and one column at a time, with no vectorisation and
no torch math: it is the specification that ``Optimizer.update`` is tested against. Hyper-parameters
are read from the optimizer object; the arithmetic is written out again below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..config.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    LaProp,
    Optimizer,
    RowwiseAdagrad,
)

Rows = list[list[float]]


def to_rows(values: torch.Tensor | Sequence[Sequence[float]]) -> Rows:
    """A (U, D) tensor or nested sequence as a list of rows of Python floats, element by element."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    return [[float(x) for x in row] for row in values]


def reference_update(opt: Optimizer, params: torch.Tensor | Sequence[Sequence[float]],
                     grads: torch.Tensor | Sequence[Sequence[float]],
                     slots: Mapping[str, torch.Tensor | Sequence[Sequence[float]]], *,
                     lr: float, step: int) -> tuple[Rows, dict[str, Rows]]:
    """One update of the touched rows, row by row, column by column.

    Args:
        opt: the optimizer whose hyper-parameters are used.
        params: (U, D) the touched rows.
        grads: (U, D) the summed gradient of each row.
        slots: ``{name: (U, D) or (U, 1)}``.
        lr: the learning rate of this step.
        step: the number of updates already applied.

    Returns:
        ``(params, slots)`` as new lists of rows of floats.
    """
    w_rows, g_rows = to_rows(params), to_rows(grads)
    slot_rows = {name: to_rows(v) for name, v in slots.items()}
    new_w: Rows = []
    new_slots: dict[str, Rows] = {name: [] for name in slot_rows}
    for r in range(len(w_rows)):
        w_before = w_rows[r]
        g = [_prepare_gradient(opt, x, step) for x in g_rows[r]]                 # steps 1-2
        row_slots = {name: list(rows[r]) for name, rows in slot_rows.items()}
        w = _rule(opt, list(w_before), g, row_slots, lr)                          # step 3
        for c in range(len(w)):
            w[c] = _finish_weight(opt, w[c], w_before[c], lr)                     # steps 4-5
        new_w.append(w)
        for name in slot_rows:
            new_slots[name].append(row_slots[name])
    return new_w, new_slots


def _prepare_gradient(opt: Optimizer, g: float, step: int) -> float:
    if opt.gradient_multiplier is not None:
        g = g * float(opt.gradient_multiplier(step))
    if opt.clipvalue is not None:
        if isinstance(opt.clipvalue, tuple):
            lo, hi = opt.clipvalue
        else:
            lo, hi = -opt.clipvalue, opt.clipvalue
        if lo is not None and g < lo:
            g = float(lo)
        if hi is not None and g > hi:
            g = float(hi)
    return g


def _finish_weight(opt: Optimizer, w: float, w_before: float, lr: float) -> float:
    if opt.weight_decay_factor is not None:
        wd = opt.weight_decay_factor
        if opt.multiply_weight_decay_factor_by_learning_rate:
            wd = wd * lr
        w = w - wd * w_before
    if opt.clip_weight_min is not None and w < opt.clip_weight_min:
        w = float(opt.clip_weight_min)
    if opt.clip_weight_max is not None and w > opt.clip_weight_max:
        w = float(opt.clip_weight_max)
    return w


def _rule(opt: Optimizer, w: list[float], g: list[float], s: dict[str, list[float]],
          lr: float) -> list[float]:
    """Step 3 on one row: returns the new weights, updates the row's slot lists in place."""
    if isinstance(opt, SGD):
        return [w[c] - lr * g[c] for c in range(len(w))]
    if isinstance(opt, RowwiseAdagrad):  # before Adagrad, its base class
        a = s["accumulators"]                                  # one value per row
        total = 0.0
        for c in range(len(w)):
            total = total + g[c] * g[c]
        a[0] = a[0] + total / len(w)
        for c in range(len(w)):
            w[c] = w[c] - lr * (g[c] / math.sqrt(a[0]) if a[0] > 0 else 0.0)
        return w
    if isinstance(opt, Adagrad):
        a = s["accumulators"]
        for c in range(len(w)):
            a[c] = a[c] + g[c] * g[c]
            w[c] = w[c] - lr * (g[c] / math.sqrt(a[c]) if a[c] > 0 else 0.0)
        return w
    if isinstance(opt, AdagradMomentum):
        a, m = s["accumulators"], s["momenta"]
        for c in range(len(w)):
            if opt.beta2 == 1:
                a[c] = a[c] + g[c] * g[c]
            else:
                a[c] = opt.beta2 * a[c] + (1 - opt.beta2) * g[c] * g[c]
            scaled = g[c] * (a[c] + opt.epsilon) ** (-1.0 / opt.exponent)
            m[c] = opt.momentum * m[c] + scaled
            step = opt.momentum * m[c] + scaled if opt.use_nesterov else m[c]
            w[c] = w[c] - lr * step
        return w
    if isinstance(opt, Adam):
        m, v = s["momenta"], s["velocities"]
        for c in range(len(w)):
            m[c] = opt.beta_1 * m[c] + (1 - opt.beta_1) * g[c]
            v[c] = opt.beta_2 * v[c] + (1 - opt.beta_2) * g[c] * g[c]
            if opt.sum_inside_sqrt:
                den = math.sqrt(v[c] + opt.epsilon * opt.epsilon)
            else:
                den = math.sqrt(v[c]) + opt.epsilon
            w[c] = w[c] - lr * (m[c] / den)
        return w
    if isinstance(opt, FTRL):
        return _ftrl_row(opt, w, g, s, lr)
    if isinstance(opt, LaProp):
        return _laprop_row(opt, w, g, s, lr)
    raise TypeError(f"no reference rule for {type(opt).__name__}")


def _ftrl_row(opt: FTRL, w: list[float], g: list[float], s: dict[str, list[float]],
              lr: float) -> list[float]:
    p = -opt.learning_rate_power
    l1, l2, beta = opt.l1_regularization_strength, opt.l2_regularization_strength, opt.beta
    a, lin = s["accumulators"], s["linears"]
    for c in range(len(w)):
        a_new = a[c] + g[c] * g[c]
        if opt.multiply_linear_by_learning_rate:
            lin[c] = lin[c] + lr * g[c] - (a_new ** p - a[c] ** p) * w[c]
            quad = a_new ** p + 2 * lr * l2 + beta
            threshold = lr * l1
        else:
            sigma = (a_new ** p - a[c] ** p) / lr
            lin[c] = lin[c] + g[c] - sigma * w[c]
            quad = a_new ** p / lr + 2 * l2 + beta / lr
            threshold = l1
        if abs(lin[c]) > threshold and quad > 0:
            sign = 1.0 if lin[c] > 0 else -1.0
            w[c] = (sign * threshold - lin[c]) / quad
        else:
            w[c] = 0.0
        a[c] = a_new
    return w


def _laprop_row(opt: LaProp, w: list[float], g: list[float], s: dict[str, list[float]],
                lr: float) -> list[float]:
    """LaProp: the velocity first, then the momentum of the gradient divided by its root."""
    m, v = s["momenta"], s["velocities"]
    b1, b2, eps = opt.beta_1, opt.beta_2, opt.epsilon
    weight = math.sqrt(1.0 - b1 * b1)        # the momentum's weight of the new term
    for c in range(len(w)):
        v[c] = b2 * v[c] + (1.0 - b2) * (g[c] * g[c] + eps)
        if v[c] > 0:
            normalized = g[c] / math.sqrt(v[c])
        else:                                 # only when g*g + eps underflows: no step
            normalized = 0.0
        m[c] = b1 * m[c] + weight * normalized
        w[c] = w[c] - lr * m[c]
    return w
