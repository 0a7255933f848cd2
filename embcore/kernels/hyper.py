"""The hyper-parameters every update kernel takes (the fused CPU kernel as csrc/update.h's
``EcHyper``, whose layout the CPU library's loader checks; the Triton kernel as scalars)."""

from __future__ import annotations

import ctypes
import math
from typing import NamedTuple


class Hyper(ctypes.Structure):
    """The optimizer hyper-parameters of ``sparse_update``, by name: csrc/update.h's ``EcHyper``.

    The fields (doubles, in this order, as the C++ struct; ``_load`` checks that both sides
    agree) and their "option off" defaults:

    - ``learning_rate``: required;
    - ``gradient_multiplier``: the gradient is multiplied by it first (default 1.0);
    - ``clip_min``, ``clip_max``: then clipped to ``[clip_min, clip_max]`` (default -inf, +inf);
    - ``weight_decay``: after the rule, ``w -= weight_decay * w_before`` (default 0.0);
    - ``weight_min``, ``weight_max``: then the weights are clipped (default -inf, +inf).

    Example: ``Hyper(learning_rate=0.1, clip_min=-1.0, clip_max=1.0)``.
    """

    _fields_ = [
        ("learning_rate", ctypes.c_double),
        ("gradient_multiplier", ctypes.c_double),
        ("clip_min", ctypes.c_double),
        ("clip_max", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("weight_min", ctypes.c_double),
        ("weight_max", ctypes.c_double),
    ]

    def __init__(self, learning_rate: float, *, gradient_multiplier: float = 1.0,
                 clip_min: float = -math.inf, clip_max: float = math.inf,
                 weight_decay: float = 0.0, weight_min: float = -math.inf,
                 weight_max: float = math.inf) -> None:
        super().__init__(float(learning_rate), float(gradient_multiplier), float(clip_min),
                         float(clip_max), float(weight_decay), float(weight_min),
                         float(weight_max))

    def as_dict(self) -> dict[str, float]:
        """``{field name: value}`` in field order."""
        return {field[0]: getattr(self, field[0]) for field in self._fields_}

    def __repr__(self) -> str:
        return "Hyper(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Hyper):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    # (__eq__ without __hash__: unhashable, mutable like every ctypes.Structure)


class HyperValues(NamedTuple):
    """``Hyper``'s fields as a plain tuple, by the same names: what the Triton kernel takes
    (scalars read by name), built in traced code (``torch.compile`` cannot build a ctypes
    structure)."""

    learning_rate: float
    gradient_multiplier: float = 1.0
    clip_min: float = -math.inf
    clip_max: float = math.inf
    weight_decay: float = 0.0
    weight_min: float = -math.inf
    weight_max: float = math.inf
