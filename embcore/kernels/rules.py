"""The optimizer rules of the fused update kernels, numbered once.

An optimizer's record (config/optimizers.py) names its rule (``rule="ADAGRAD"``); the kernels
implement some of them: the fused CPU kernel (csrc/update.h, whose ``enum Rule`` takes these
numbers from the compiler's ``-DEC_RULE_<NAME>`` flags, ``DEFINES``) the first three, the Triton
kernel (gpu/rows.py, whose ``RULE`` constants are these numbers) all of them. ``NONE`` is
the Triton kernel's pass that only sums the gradients (the combine's backward).

>>> Rule["ADAGRAD"] in NATIVE, Rule["ADAM"] in NATIVE, Rule["ADAM"] in TRITON
(True, False, True)
"""

from __future__ import annotations

import enum


class Rule(enum.IntEnum):
    NONE = 0
    SGD = 1
    ADAGRAD = 2
    ROWWISE_ADAGRAD = 3
    MOMENTUM = 4  # AdagradMomentum
    ADAM = 5
    FTRL = 6


NATIVE = frozenset({Rule.SGD, Rule.ADAGRAD, Rule.ROWWISE_ADAGRAD})  # csrc/update.h
TRITON = frozenset(Rule) - {Rule.NONE}                              # gpu/rows.py

# the C compiler's definitions: the C enum's values (kernels/cpu/library.py passes them)
DEFINES = tuple(f"-DEC_RULE_{r.name}={r.value}" for r in Rule)


def of(name: str | None, kernel: frozenset[Rule]) -> Rule | None:
    """The rule a record names, if ``kernel`` (``NATIVE`` or ``TRITON``) implements it."""
    if name is None:
        return None
    rule = Rule[name]
    return rule if rule in kernel else None
