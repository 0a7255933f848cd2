"""Sparse optimizers: hyper-parameters, slot specs and the update of one step's touched rows.

Each optimizer is a small frozen object: TensorFlow's argument names and defaults, validated on
construction, and ``update``, the pure math of docs/semantics.md sections 3-4 on the rows a step
touched. The engine owns the tables and slots; it gathers the touched rows, calls ``update`` and
scatters the result.
``embcore.ops.reference_optim`` is the same math as plain loops: the specification.

Each optimizer is declared once, here: its class (hyper-parameters with TF's defaults, and
``_rule``, the torch math of step 3 below; its base, ``Optimizer``, is optimizer_base.py's) and,
beside it, its ``OptimizerRecord`` (optimizer_base.py too; ``@_declare``:
the ranges its hyper-parameters are checked against, its slots, the name users may give, and which
kernel runs it: the name of its kernels' rule (kernels/rules.py), the Triton kernel's own
hyper-parameters, the torch-ops in-place rule). Everything else reads the records
(``records()``, ``record_of``): the spec's names, ``resolve_optimizer``'s names, and the kernel
choice of ``ops/update.py`` and ``kernels/gpu/launch.py``. Adding an optimizer is a class and its
record here, its loop in ``ops/reference_optim.py``, and the kernel sources if a kernel runs it.

The update of a touched row with summed gradient ``g`` (weights ``w``, learning rate ``lr``):

    1. g = g * gradient_multiplier(step)             if gradient_multiplier
    2. g = clip(g, lo, hi)                           if clipvalue
    3. w = rule(w, g, slots, lr)                     the optimizer's own rule
    4. w = w - wd * w_before                         if weight_decay_factor (wd, times lr if
                                                     multiply_weight_decay_factor_by_learning_rate)
    5. w = clip(w, clip_weight_min, clip_weight_max)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .optimizer_base import LearningRate, Optimizer, Range, Slot, Slots, _declare
from .optimizer_base import OptimizerRecord as OptimizerRecord
from .optimizer_base import SlotSpec as SlotSpec
from .optimizer_base import listed as listed
from .optimizer_base import record_of as record_of
from .optimizer_base import records as records
from .optimizer_base import table_slots as table_slots


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, or 0 where ``den == 0`` (an empty accumulator takes no step); a NaN
    ``den`` (from a NaN gradient) gives NaN, as every kernel does: non-finite gradients
    propagate unless the optimizer skips them (``skip_nonfinite_gradients``)."""
    return torch.where(den == 0, 0.0, num / den)


def _nonnegative(x: float) -> bool:
    return x >= 0


def _positive(x: float) -> bool:
    return x > 0


def _decay(x: float) -> bool:
    return 0 <= x < 1


@_declare(alias="sgd", rule="SGD", in_place="sgd")
@dataclass(frozen=True, eq=False, repr=False)
class SGD(Optimizer):
    """Stochastic gradient descent on the touched rows; no slots.

    Args:
        learning_rate: a float >= 0, or a zero-argument callable returning one.

    Every optimizer also takes the common keyword-only args of ``Optimizer``.

    Update: ``w = w - lr * g``

    Example:
        >>> import torch, embcore as ec
        >>> ec.SGD(learning_rate=0.5).update(torch.ones(1, 2), torch.ones(1, 2), {}, lr=0.5,
        ...                                  step=0)[0]
        tensor([[0.5000, 0.5000]])
    """

    learning_rate: LearningRate = 0.01

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        return w - lr * g, {}                                         # (U, D)


_ACCUMULATOR_RANGE = Range("initial_accumulator_value", ">= 0", _nonnegative)


@_declare(alias="adagrad", ranges=(_ACCUMULATOR_RANGE,),
          slots=(Slot("accumulators", "initial_accumulator_value"),),
          rule="ADAGRAD", in_place="adagrad")
@dataclass(frozen=True, eq=False, repr=False)
class Adagrad(Optimizer):
    """Adagrad: a per-entry sum of squared gradients scales the step.

    Args:
        learning_rate: a float >= 0, or a zero-argument callable returning one.
        initial_accumulator_value: >= 0, the start value of slot ``accumulators``.

    Update: ``a = a + g*g;  w = w - lr * g / sqrt(a)`` (no step where ``a == 0``).

    Example:
        >>> import torch, embcore as ec
        >>> opt = ec.Adagrad(learning_rate=0.1, initial_accumulator_value=0.0)
        >>> w, s = opt.update(torch.ones(1, 2), torch.full((1, 2), 2.0), opt.init_slots(1, 2),
        ...                   lr=0.1, step=0)
        >>> w, s["accumulators"]
        (tensor([[0.9000, 0.9000]]), tensor([[4., 4.]]))
    """

    learning_rate: LearningRate = 0.001
    initial_accumulator_value: float = 0.1

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        a = s["accumulators"] + g * g                                 # (U, D)
        return w - lr * _safe_div(g, a.sqrt()), {"accumulators": a}   # (U, D)


@_declare(ranges=(_ACCUMULATOR_RANGE,),
          slots=(Slot("accumulators", "initial_accumulator_value", rowwise=True),),
          rule="ROWWISE_ADAGRAD", in_place="rowwise_adagrad")
@dataclass(frozen=True, eq=False, repr=False)
class RowwiseAdagrad(Adagrad):
    """Adagrad with one accumulator per row, shape (N, 1): D times less slot memory.

    Args:
        learning_rate: a float >= 0, or a zero-argument callable returning one.
        initial_accumulator_value: >= 0, the start value of slot ``accumulators``.

    Update: ``a = a + mean(g*g over the row's D values);  w = w - lr * g / sqrt(a)``
    (no step where ``a == 0``).

    Example:
        >>> import torch, embcore as ec
        >>> opt = ec.RowwiseAdagrad(learning_rate=0.1, initial_accumulator_value=0.0)
        >>> w, s = opt.update(torch.zeros(1, 2), torch.tensor([[3.0, 4.0]]),
        ...                   opt.init_slots(1, 2), lr=0.1, step=0)
        >>> s["accumulators"]
        tensor([[12.5000]])
    """

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        a = s["accumulators"] + (g * g).mean(dim=1, keepdim=True)     # (U, 1)
        return w - lr * _safe_div(g, a.sqrt()), {"accumulators": a}   # (U, D)


@_declare(ranges=(Range("momentum", ">= 0", _nonnegative), Range("exponent", "> 0", _positive),
                  Range("beta2", "in (0, 1]", lambda x: 0 < x <= 1),
                  Range("epsilon", "> 0", _positive)),
          slots=(Slot("accumulators"), Slot("momenta")), rule="MOMENTUM",
          triton_args=lambda o: ((o.momentum, o.beta2, o.epsilon, -1.0 / o.exponent),
                                 bool(o.use_nesterov), o.beta2 == 1))
@dataclass(frozen=True, eq=False, repr=False)
class AdagradMomentum(Optimizer):
    """Adagrad scaling followed by (optionally Nesterov) momentum.

    Args:
        learning_rate: a float >= 0, or a zero-argument callable returning one.
        momentum: >= 0, the momentum decay.
        use_nesterov: use Nesterov momentum.
        exponent: > 0, the accumulator's root (2: square root, as Adagrad).
        beta2: in (0, 1], the accumulator's decay; 1 keeps a plain sum.
        epsilon: > 0, added to the accumulator before the root.

    Update (slots ``accumulators`` = 0, ``momenta`` = 0)::

        a = a + g*g  if beta2 == 1  else  beta2*a + (1 - beta2)*g*g
        s = g * (a + epsilon) ** (-1/exponent)
        m = momentum*m + s
        w = w - lr * (momentum*m + s  if use_nesterov  else  m)

    A zero gradient still rewrites ``m`` (and ``a`` if beta2 < 1): not a no-op.

    Example:
        >>> import embcore as ec
        >>> opt = ec.AdagradMomentum(learning_rate=0.01, momentum=0.9, use_nesterov=True)
    """

    learning_rate: LearningRate = 0.001
    momentum: float = 0.0
    use_nesterov: bool = False
    exponent: float = 2
    beta2: float = 1
    epsilon: float = 1e-10

    _rule_zero_noop = False

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        a = s["accumulators"]                                         # (U, D)
        a = a + g * g if self.beta2 == 1 else self.beta2 * a + (1 - self.beta2) * g * g
        scaled = g * (a + self.epsilon).pow(-1.0 / self.exponent)     # (U, D)
        m = self.momentum * s["momenta"] + scaled                     # (U, D)
        step = self.momentum * m + scaled if self.use_nesterov else m  # (U, D)
        return w - lr * step, {"accumulators": a, "momenta": m}


@_declare(alias="adam", ranges=(Range("beta_1", "in [0, 1)", _decay),
                               Range("beta_2", "in [0, 1)", _decay),
                               Range("epsilon", "> 0", _positive)),
          slots=(Slot("momenta"), Slot("velocities")), rule="ADAM",
          triton_args=lambda o: ((o.beta_1, 1 - o.beta_1, o.beta_2, 1 - o.beta_2, o.epsilon),
                                 bool(o.sum_inside_sqrt), False))
@dataclass(frozen=True, eq=False, repr=False)
class Adam(Optimizer):
    """Adam without bias correction (as on TPU); lazy by default.

    Args:
        learning_rate: a float >= 0, or a zero-argument callable returning one.
        beta_1: in [0, 1), the first moment's decay.
        beta_2: in [0, 1), the second moment's decay.
        epsilon: > 0, see the update.
        lazy_adam: True updates the touched rows only; False decays the moments and moves every
            row every step as with g = 0 (``updates_every_row``), like TF's non-lazy Adam.
        sum_inside_sqrt: where epsilon enters, see the update.

    Update (slots ``momenta`` = 0, ``velocities`` = 0)::

        m = beta_1*m + (1 - beta_1)*g
        v = beta_2*v + (1 - beta_2)*g*g
        w = w - lr * m / sqrt(v + epsilon**2)    if sum_inside_sqrt
        w = w - lr * m / (sqrt(v) + epsilon)     otherwise

    Bias correction is a learning-rate schedule: a callable learning rate returning
    ``lr0 * sqrt(1 - b2**t) / (1 - b1**t)`` at the t-th update (t = 1, 2, ...).

    Example:
        >>> import itertools, math, embcore as ec
        >>> lr0, b1, b2, updates = 0.001, 0.9, 0.999, itertools.count(1)
        >>> def bias_corrected() -> float:   # the engine calls it once per apply_gradients
        ...     t = next(updates)
        ...     return lr0 * math.sqrt(1 - b2**t) / (1 - b1**t)
        >>> opt = ec.Adam(learning_rate=bias_corrected, beta_1=b1, beta_2=b2)
        >>> round(opt.current_learning_rate(), 8)   # t = 1
        0.00031623
    """

    learning_rate: LearningRate = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-07
    lazy_adam: bool = True
    sum_inside_sqrt: bool = True

    _rule_zero_noop = False

    @property
    def updates_every_row(self) -> bool:
        return not self.lazy_adam

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        m = self.beta_1 * s["momenta"] + (1 - self.beta_1) * g        # (U, D)
        v = self.beta_2 * s["velocities"] + (1 - self.beta_2) * g * g  # (U, D)
        if self.sum_inside_sqrt:
            den = (v + self.epsilon * self.epsilon).sqrt()            # (U, D)
        else:
            den = v.sqrt() + self.epsilon                             # (U, D)
        return w - lr * (m / den), {"momenta": m, "velocities": v}


@_declare(alias="ftrl", ranges=(Range("learning_rate_power", "<= 0", lambda x: x <= 0),
                               Range("l1_regularization_strength", ">= 0", _nonnegative),
                               Range("l2_regularization_strength", ">= 0", _nonnegative),
                               Range("beta", ">= 0", _nonnegative)),
          slots=(Slot("accumulators", "initial_accumulator_value"), Slot("linears")),
          rule="FTRL",
          triton_args=lambda o: ((-o.learning_rate_power, o.l1_regularization_strength,
                                  o.l2_regularization_strength, o.beta),
                                 bool(o.multiply_linear_by_learning_rate), False))
@dataclass(frozen=True, eq=False, repr=False)
class FTRL(Optimizer):
    """Follow-the-regularized-leader: the weights are recomputed from two slots each update.

    Args:
        learning_rate: > 0 (>= 0 with multiply_linear_by_learning_rate), or a callable.
        learning_rate_power: <= 0; the update uses ``p = -learning_rate_power``.
        l1_regularization_strength: >= 0.
        l2_regularization_strength: >= 0.
        beta: >= 0.
        initial_accumulator_value: > 0 (>= 0 with allow_zero_accumulator).
        multiply_linear_by_learning_rate: slot ``linears`` stores ``lr * linear``, which allows
            a zero or fast-changing learning rate.
        allow_zero_accumulator: allow initial_accumulator_value = 0 (entries whose quadratic
            term ``quad`` is 0 get w = 0, never inf or NaN).

    Update (slots ``accumulators`` = initial_accumulator_value, ``linears`` = 0)::

        a_new = a + g*g
        lin   = lin + g - (a_new**p - a**p) / lr * w
        quad  = a_new**p / lr + 2*l2 + beta/lr
        w     = (sign(lin)*l1 - lin) / quad   if |lin| > l1   else 0
        a     = a_new
    and with multiply_linear_by_learning_rate::

        lin   = lin + lr*g - (a_new**p - a**p) * w
        quad  = a_new**p + 2*lr*l2 + beta
        w     = (sign(lin)*lr*l1 - lin) / quad   if |lin| > lr*l1   else 0

    Example:
        >>> import embcore as ec
        >>> opt = ec.FTRL(learning_rate=0.05, l1_regularization_strength=0.001)
    """

    learning_rate: LearningRate = 0.001
    learning_rate_power: float = -0.5
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    beta: float = 0.0
    initial_accumulator_value: float = 0.1
    multiply_linear_by_learning_rate: bool = False
    allow_zero_accumulator: bool = False

    _rule_zero_noop = False

    def _check(self) -> None:
        super()._check()  # the record's ranges; the accumulator's depends on another argument
        if self.allow_zero_accumulator:
            self._require("initial_accumulator_value", ">= 0", lambda x: x >= 0)
        else:
            self._require("initial_accumulator_value",
                          "> 0 (>= 0 with allow_zero_accumulator=True)", lambda x: x > 0)

    def _check_lr(self, lr: float) -> None:
        super()._check_lr(lr)
        if lr == 0 and not self.multiply_linear_by_learning_rate:
            raise ValueError(f"{self._name}: learning_rate must be > 0 (FTRL divides by it), got "
                             f"{lr!r}; multiply_linear_by_learning_rate=True allows 0")

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        p, l1 = -self.learning_rate_power, self.l1_regularization_strength
        l2, beta = self.l2_regularization_strength, self.beta
        a = s["accumulators"]                                         # (U, D)
        a_new = a + g * g                                             # (U, D)
        grown = a_new.pow(p) - a.pow(p)                               # (U, D)
        if self.multiply_linear_by_learning_rate:
            lin = s["linears"] + lr * g - grown * w                   # (U, D)
            quad = a_new.pow(p) + 2 * lr * l2 + beta                  # (U, D)
            threshold = lr * l1
        else:
            lin = s["linears"] + g - grown / lr * w                   # (U, D)
            quad = a_new.pow(p) / lr + 2 * l2 + beta / lr             # (U, D)
            threshold = l1
        keep = (lin.abs() > threshold) & (quad > 0)                   # (U, D)
        w = torch.where(keep, (torch.sign(lin) * threshold - lin) / quad, 0.0)  # (U, D)
        return w, {"accumulators": a_new, "linears": lin}


@_declare(alias="laprop", ranges=(Range("beta_1", "in [0, 1)", _decay),
                                 Range("beta_2", "in [0, 1)", _decay),
                                 Range("epsilon", "> 0", _positive)),
          slots=(Slot("momenta"), Slot("velocities")))
@dataclass(frozen=True, eq=False, repr=False)
class LaProp(Optimizer):
    """LaProp (Ziyin et al., 2020; jax-tpu-embedding's SparseCore LaProp): Adam's two moving
    averages, with the momentum taken of the gradient already divided by its RMS. No bias
    correction; lazy (the touched rows only).

    Args:
        learning_rate: a float >= 0, or a zero-argument callable returning one.
        beta_1: in [0, 1), the momentum's decay (0: RMSProp).
        beta_2: in [0, 1), the velocity's decay.
        epsilon: > 0, added to ``g*g`` inside the velocity.

    Update (slots ``momenta`` = 0, ``velocities`` = 0)::

        v = beta_2*v + (1 - beta_2)*(g*g + epsilon)
        m = beta_1*m + sqrt(1 - beta_1**2) * g / sqrt(v)     (g / sqrt(v) = 0 where v == 0)
        w = w - lr * m

    ``sqrt(1 - beta_1**2)`` (not ``1 - beta_1``) is jax-tpu-embedding's momentum weight. Its
    defaults are jax-tpu-embedding's too. A zero gradient still decays ``m`` and ``v``: not a
    no-op.

    No bias correction inside the engine: ``v`` decays by ``beta_2`` at every update.
    jax-tpu-embedding, given the step ``t`` (0 first), decays it by
    ``beta_2 * (1 - beta_2**t) / (1 - beta_2**(t+1))`` instead, which makes ``v`` the
    bias-corrected average (and uses ``beta_2``, as here, without a step). Unlike Adam's, this
    correction acts inside the momentum, so a learning-rate schedule only approximates it:
    ``lr0 * sqrt(1 - beta_2**t)`` at the t-th update (t = 1, 2, ...) corrects that update's new
    term but not the terms ``m`` carries from earlier updates.

    Example:
        >>> import torch, embcore as ec
        >>> opt = ec.LaProp(learning_rate=0.1, beta_1=0.0, beta_2=0.0)   # a step of lr*sign(g)
        >>> w, s = opt.update(torch.ones(1, 2), torch.tensor([[2.0, -3.0]]),
        ...                   opt.init_slots(1, 2), lr=0.1, step=0)
        >>> w
        tensor([[0.9000, 1.1000]])
    """

    learning_rate: LearningRate = 0.001
    beta_1: float = 0.9
    beta_2: float = 0.95
    epsilon: float = 1e-30

    _rule_zero_noop = False

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        v = self.beta_2 * s["velocities"] + (1 - self.beta_2) * (g * g + self.epsilon)  # (U, D)
        normalized = _safe_div(g, v.sqrt())                           # (U, D)
        m = self.beta_1 * s["momenta"] + math.sqrt(1 - self.beta_1 ** 2) * normalized  # (U, D)
        return w - lr * m, {"momenta": m, "velocities": v}
