"""Translating what ``EmbeddingLayer(optimizer=...)`` accepts into an embcore optimizer.

Names (the optimizers' records' ``alias``: "sgd", "adagrad", "adam", ...) and ``torch.optim``
classes (SGD, Adagrad, Adam) become the embcore optimizer with the same math, or a clear error
saying why they cannot.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .optimizers import SGD, Adagrad, Adam, Optimizer, listed, records

_BY_NAME: dict[str, type[Optimizer]] = {r.alias: r.cls for r in records() if r.alias is not None}
_NAMES = listed([repr(name) for name in _BY_NAME])            # 'sgd', 'adagrad', ... or '...'
_CLASSES = ", ".join(f"ec.{r.name}" for r in records())       # ec.SGD, ec.Adagrad, ...
_NO_MATH = ("foreach", "fused", "capturable", "differentiable")  # torch kernel choices only
_WHY = {
    "momentum": "its momentum buffers decay every row every step, which a row-sparse update "
                "cannot do; use ec.AdagradMomentum(momentum=...) or ec.Adam",
    "nesterov": "it needs momentum; use ec.AdagradMomentum(use_nesterov=True)",
    "weight_decay": "torch adds weight_decay * w to the gradient of every row every step (coupled "
                    "L2), while embcore updates only the rows a batch touches; use the embcore "
                    "optimizer's weight_decay_factor= (decoupled decay of touched rows)",
    "lr_decay": "use ec.Adagrad with a callable learning_rate",
    "amsgrad": "embcore's Adam keeps no maximum-velocity slot",
    "maximize": "negate the loss, or use the embcore optimizer with "
                "gradient_multiplier=lambda step: -1.0",
}


class _TorchAdamLearningRate:
    """torch.optim.Adam's bias correction as a learning rate: ``lr*sqrt(1-b2**t)/(1-b1**t)``,
    with ``t`` the number of calls so far (one per apply_gradients)."""

    def __init__(self, lr: float, beta_1: float, beta_2: float) -> None:
        self.lr, self.beta_1, self.beta_2, self.t = lr, beta_1, beta_2, 0

    def __call__(self) -> float:
        self.t += 1
        return self.lr * math.sqrt(1 - self.beta_2 ** self.t) / (1 - self.beta_1 ** self.t)

    def __repr__(self) -> str:
        return (f"torch_adam_bias_correction(lr={self.lr!r}, betas=({self.beta_1!r}, "
                f"{self.beta_2!r}), t={self.t})")


def resolve_optimizer(spec: Any) -> Optimizer:
    """Turns what ``EmbeddingLayer(optimizer=...)`` accepts into an embcore optimizer.

    Args:
        spec: an embcore optimizer (returned as is); an optimizer's name (its record's
            ``alias``: ``"sgd"``, ``"adagrad"``, ``"adam"``, ...; any case, the optimizer's
            defaults); or ``torch.optim.SGD``, ``Adagrad`` or ``Adam``
            as the class, ``functools.partial(cls, **kwargs)``, ``(cls, kwargs)`` or an instance
            (its hyper-parameters; the parameters it was given are not used), translated
            to the embcore optimizer with the same math (torch's defaults apply):

            - ``SGD(lr)`` -> ``ec.SGD(learning_rate=lr)``.
            - ``Adagrad(lr, initial_accumulator_value)`` -> ``ec.Adagrad`` with both. ``eps`` is
              not modelled: embcore divides by ``sqrt(a)`` (no step where a == 0), torch by
              ``sqrt(a) + eps``.
            - ``Adam(lr, betas, eps)`` -> ``ec.Adam(beta_1, beta_2, epsilon=eps,
              lazy_adam=False, sum_inside_sqrt=False)`` whose learning rate is a callable
              applying torch's bias correction ``lr * sqrt(1 - b2**t) / (1 - b1**t)``, ``t``
              counting its own calls (one per ``apply_gradients``; not saved in checkpoints).
              The one difference is epsilon: torch's update is this one with epsilon
              ``eps * sqrt(1 - b2**t)``, so embcore's eps weighs more in early steps.

            Kernel choices (foreach, fused, capturable, differentiable) are ignored; any other
            argument away from torch's default is refused.

    Raises:
        ValueError: an unknown name or torch class, or an argument embcore cannot reproduce
            (momentum, weight_decay, lr_decay, amsgrad, maximize, ...), saying why.
        TypeError: an unknown keyword argument, or a ``spec`` of another kind.

    Example:
        >>> import functools, torch, embcore.config.torch_optim as eo
        >>> eo.resolve_optimizer(functools.partial(torch.optim.Adagrad, lr=0.1))
        Adagrad(learning_rate=0.1, initial_accumulator_value=0)
    """
    if isinstance(spec, Optimizer):
        return spec
    if isinstance(spec, str):
        if spec.lower() in _BY_NAME:
            return _BY_NAME[spec.lower()]()
        raise ValueError(f"unknown optimizer name {spec!r}: use {_NAMES}, or an optimizer "
                         "object such as ec.Adagrad(learning_rate=0.1)")
    if isinstance(spec, torch.optim.Optimizer):  # an instance: its hyper-parameters
        cls = type(spec)
        if cls not in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam):
            raise ValueError(f"torch.optim.{cls.__name__} cannot be translated; embcore "
                             "translates torch.optim.SGD, Adagrad and Adam")
        names = set(inspect.signature(cls).parameters) - {"params"}
        kwargs = {k: v for k, v in spec.defaults.items() if k in names}
        for group in spec.param_groups:
            differ = sorted(k for k in kwargs if k in group and group[k] != kwargs[k])
            if differ:
                raise ValueError(f"the torch.optim.{cls.__name__} instance has parameter "
                                 f"groups with their own {differ}; embcore applies one set of "
                                 f"hyper-parameters per table: pass the class with them instead")
        return _from_torch(cls, kwargs)
    cls, kwargs = _class_and_kwargs(spec)
    if issubclass(cls, Optimizer):
        return cls(**kwargs)
    if cls not in (torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adam):
        raise ValueError(f"torch.optim.{cls.__name__} cannot be translated; embcore translates "
                         "torch.optim.SGD, torch.optim.Adagrad and torch.optim.Adam; use an "
                         f"embcore optimizer ({_CLASSES})")
    return _from_torch(cls, kwargs)


def _class_and_kwargs(spec: Any) -> tuple[type, dict[str, Any]]:
    cls, kwargs = spec, {}
    if isinstance(spec, functools.partial):
        if spec.args:
            raise TypeError(f"functools.partial({getattr(spec.func, '__name__', spec.func)}, ...) "
                            f"has positional arguments {spec.args!r}; give keyword arguments only")
        cls, kwargs = spec.func, dict(spec.keywords)
    elif isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[1], Mapping):
        cls, kwargs = spec[0], dict(spec[1])
    if isinstance(cls, type) and issubclass(cls, (Optimizer, torch.optim.Optimizer)):
        return cls, kwargs
    raise TypeError(f"optimizer must be an embcore optimizer (ec.SGD(...), ec.Adagrad(...), ...), "
                    f"one of {_NAMES}, or torch.optim.SGD / Adagrad / Adam given as the class, "
                    "functools.partial(cls, **kwargs) or (cls, kwargs); got "
                    f"{type(spec).__name__} {repr(spec)[:80]}")


def _from_torch(cls: type, kwargs: dict[str, Any]) -> Optimizer:
    name = f"torch.optim.{cls.__name__}"
    params = {k: p.default for k, p in inspect.signature(cls).parameters.items() if k != "params"}
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise TypeError(f"{name} got unexpected keyword argument(s) {unknown}")
    args = {**params, **kwargs}
    used = {torch.optim.SGD: ("lr", "dampening"),  # dampening acts only on momentum, which is 0
            torch.optim.Adagrad: ("lr", "initial_accumulator_value", "eps"),
            torch.optim.Adam: ("lr", "betas", "eps")}[cls]
    for arg, value in args.items():
        if arg not in used and arg not in _NO_MATH and value != params[arg]:
            raise ValueError(f"{name}({arg}={value!r}) cannot be translated to embcore: "
                             f"{_WHY.get(arg, 'it has no embcore equivalent')}")
    lr = args["lr"].item() if isinstance(args["lr"], Tensor) else args["lr"]
    if cls is torch.optim.SGD:
        return SGD(learning_rate=lr)
    if cls is torch.optim.Adagrad:
        return Adagrad(learning_rate=lr,
                       initial_accumulator_value=args["initial_accumulator_value"])
    betas = args["betas"]
    if not isinstance(betas, (tuple, list)):
        raise TypeError(f"{name}(betas={betas!r}): betas must be a pair (beta_1, beta_2)")
    if len(betas) != 2:
        raise ValueError(f"{name}(betas={betas!r}): betas must be a pair (beta_1, beta_2)")
    b1, b2 = (b.item() if isinstance(b, Tensor) else b for b in betas)
    Adam(learning_rate=lr, beta_1=b1, beta_2=b2, epsilon=args["eps"])  # validates the values
    return Adam(learning_rate=_TorchAdamLearningRate(lr, b1, b2), beta_1=b1, beta_2=b2,
                epsilon=args["eps"], lazy_adam=False, sum_inside_sqrt=False)
