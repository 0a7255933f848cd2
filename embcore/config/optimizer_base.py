"""The base of the sparse optimizers (config/optimizers.py) and their records.

``Optimizer``: the common hyper-parameters, their checks on construction, the learning rate and
gradient multiplier evaluated (and checked) each step, fresh slots, and ``update``: steps 1-5 of
config/optimizers.py's docstring around each optimizer's own rule (``_rule``, step 3). Two
optimizers with the same class and hyper-parameters are equal (their tables may share one
physical table).

``OptimizerRecord``: each optimizer declared once (``@_declare`` beside its class), with what the
package reads of it besides its math: the ranges its hyper-parameters are checked against, its
slots, the name users may give, and which kernel runs it. The spec's names,
``resolve_optimizer``'s names and the kernel choice of ``ops/update.py`` and
``kernels/gpu/launch.py`` read the records (``records()``, ``record_of``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from .dtypes import SCALED, SCALES, working_dtype

LearningRate = float | Callable[[], float]
ClipValue = float | tuple[float | None, float | None] | None
Slots = dict[str, Tensor]
# (shape, dtype, device) -> an uninitialized tensor: how init_slots gets its memory.
Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device | None], Tensor]
# The Triton kernel's own hyper-parameters of a rule: ((h1, ..., h5), F1, F2), fewer h's padded.
KernelArgs = tuple[tuple[float, ...], bool, bool]


@dataclass(frozen=True)
class SlotSpec:
    """One per-row optimizer state tensor, stored beside its table.

    Args:
        name: TF's slot name (``"accumulators"``, ``"momenta"``, ``"velocities"``, ``"linears"``),
            also the checkpoint key ``<table>/<name>``.
        initial_value: the value of every entry of a fresh slot.
        rowwise: True for one value per row, shape ``(N, 1)``; else ``(N, D)`` like the table.
    """

    name: str
    initial_value: float
    rowwise: bool = False

    @property
    def nonnegative(self) -> bool:
        """Whether every value must be >= 0: accumulated squares (``accumulators`` of the
        Adagrad family and FTRL, Adam's ``velocities``), whose square roots the rules take."""
        return self.name in ("accumulators", "velocities")


@dataclass(frozen=True)
class Range:
    """The values one hyper-parameter takes, checked at construction (``ValueError`` naming it).

    Args:
        name: the hyper-parameter (a field of the optimizer).
        what: the range as the error says it (``">= 0"``, ``"in [0, 1)"``).
        ok: the test of a value (a real number, finite: ``Optimizer._number`` checks that first,
            a ``TypeError`` otherwise).
    """

    name: str
    what: str
    ok: Callable[[float], bool]


@dataclass(frozen=True)
class Slot:
    """A slot as a record declares it; ``spec(opt)`` is the ``SlotSpec`` of one optimizer.

    Args:
        name: TF's slot name (the checkpoint key ``<table>/<name>``).
        initial: the initial value, or the name of the hyper-parameter that holds it.
        rowwise: one value per row, ``(N, 1)``.
    """

    name: str
    initial: float | str = 0.0
    rowwise: bool = False

    def spec(self, opt: Optimizer) -> SlotSpec:
        value = getattr(opt, self.initial) if isinstance(self.initial, str) else self.initial
        return SlotSpec(self.name, float(value), self.rowwise)


def _no_args(opt: Any) -> KernelArgs:
    return (), False, False


@dataclass(frozen=True)
class OptimizerRecord:
    """One optimizer, declared once (``@_declare`` beside its class): what the package reads.

    The torch rule is the class's own (``cls._rule``, the pure math every optimizer has); the
    kernels are optional. The kernels update the touched rows only: an optimizer whose
    ``updates_every_row`` is True (``Adam(lazy_adam=False)``) takes the torch path whatever its
    record says. Rule ids are plain ints (config/ lies below ops/); tests/test_optimizer_records.py
    holds them equal to the kernels' constants.

    Attributes:
        cls: the class (``ec.<name>``).
        name: its name in a spec (``"class"``) and in ``ec``: the class's name.
        alias: the lower-case name ``EmbeddingLayer(optimizer=...)`` also takes (with the
            defaults), or None.
        ranges: its own hyper-parameters' ranges, checked at construction in this order (a check
            that depends on another hyper-parameter stays in the class's ``_check``).
        slots: its slots, in order (``Optimizer.slots``).
        rule: the name of its fused kernels' rule (``Rule`` of kernels/rules.py, where the
            numbers and the kernels implementing each are written), or None. The fused CPU
            kernel (``rules.NATIVE``) takes every option, float32 / float16 / bfloat16 rows; the
            Triton kernel (``rules.TRITON``) takes ``triton_args`` too.
        triton_args: ``opt -> ((h1..h5), F1, F2)``, the Triton kernel's own hyper-parameters of
            this rule (the common ones reach every kernel as ``Hyper`` (kernels/hyper.py)).
        in_place: the torch-ops in-place rule (``ops/update.py apply_in_place``: ``"sgd"``,
            ``"adagrad"``, ``"rowwise_adagrad"``), or None; it runs without options only.
    """

    cls: type[Optimizer]
    name: str
    alias: str | None = None
    ranges: tuple[Range, ...] = ()
    slots: tuple[Slot, ...] = ()
    rule: str | None = None
    triton_args: Callable[[Any], KernelArgs] = _no_args
    in_place: str | None = None


_RECORDS: dict[type, OptimizerRecord] = {}


def records() -> tuple[OptimizerRecord, ...]:
    """Every optimizer's record, in the order of their declaration."""
    return tuple(_RECORDS.values())


def record_of(opt: Optimizer | type) -> OptimizerRecord | None:
    """The record of this optimizer's exact class (or of the class itself); None for a class
    declared elsewhere (a user's subclass has no kernel and no name in a spec)."""
    return _RECORDS.get(opt if isinstance(opt, type) else type(opt))


def table_slots(opt: Optimizer | None, dtype: torch.dtype) -> tuple[SlotSpec, ...]:
    """What a table of ``dtype`` keeps beside its rows under ``opt`` (None: no optimizer): the
    optimizer's slots, then an 8-bit table's scales (row-wise float32, checkpoint key
    ``<table>/scales``), which move with the rows as a row-wise slot does; the update reads
    and writes them, the optimizer's math never sees them."""
    own = opt.slots if opt is not None else ()
    return own + ((SlotSpec(SCALES, 1.0, rowwise=True),) if dtype in SCALED else ())


def listed(words: list[str], last: str = "or") -> str:
    """``"a, b, c or d"``: names for an error message."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {last} {words[-1]}"


_COMMON = ("use_gradient_accumulation", "clip_weight_min", "clip_weight_max", "weight_decay_factor",
           "multiply_weight_decay_factor_by_learning_rate", "clipvalue", "gradient_multiplier",
           "skip_nonfinite_gradients")


@dataclass(frozen=True, eq=False, repr=False)
class Optimizer:
    """Base of the embcore optimizers (not exported: use ec.SGD, ec.Adagrad, ...).

    Every optimizer takes these common keyword-only args (TF's names and defaults).

    Args:
        use_gradient_accumulation: must stay True; embcore always sums duplicate ids' gradients.
        clip_weight_min: clamp the weights from below after the update (None: unbounded).
        clip_weight_max: clamp the weights from above after the update (None: unbounded).
        weight_decay_factor: decoupled decay ``w -= wd * w_before`` of touched rows (None: off).
        multiply_weight_decay_factor_by_learning_rate: ``wd = weight_decay_factor * lr``.
        clipvalue: clip the gradient: ``c`` means ``(-c, c)``; ``(lo, hi)`` with None unbounded.
        gradient_multiplier: ``step -> float`` scaling the gradient first (TF's
            ``experimental_gradient_multiplier_fn``); ``step`` counts the ``apply_gradients``
            calls already completed (the engine's ``step``).
            The engine calls it once per ``apply_gradients`` per optimizer object, before any
            table changes; a value that is not a finite real number rejects the call
            (``current_gradient_multiplier``).
        skip_nonfinite_gradients: not TF's (TF does not check). False (the default): NaN and
            inf gradients are applied like any other value. True: before any table changes,
            ``apply_gradients`` checks every gradient reaching this optimizer's tables (one
            ``isfinite().all()`` pass each, in the table's working dtype); if one holds a NaN
            or inf, on any process, the step is skipped for every table this optimizer object
            trains: their rows and slots stay as they were, a ``RuntimeWarning`` names the
            features, and the call otherwise completes (the batch is consumed, ``step`` counts
            the call, tables of other optimizers are updated). For loss scaling in mixed
            precision, where an overflowed step is dropped (docs/semantics.md section 3).
            A float16 / bfloat16 row whose update overflows its dtype is left as it was either
            way; True reports it with a ``RuntimeWarning``, False with an ``OverflowError``
            once the step is done (docs/semantics.md section 14).

    Raises:
        TypeError: a hyper-parameter of the wrong type (a number that is not a real number, a
            gradient_multiplier that is not callable, a non-bool use_gradient_accumulation or
            skip_nonfinite_gradients), naming it and its value.
        ValueError: a hyper-parameter of the right type with an invalid value (out of range,
            not finite, inconsistent with another), naming it and its value.
    """

    _record: ClassVar[OptimizerRecord | None] = None  # set by @_declare (subclasses inherit it)

    learning_rate: LearningRate = 0.01
    _: KW_ONLY
    use_gradient_accumulation: bool = True
    clip_weight_min: float | None = None
    clip_weight_max: float | None = None
    weight_decay_factor: float | None = None
    multiply_weight_decay_factor_by_learning_rate: bool | None = None
    clipvalue: ClipValue = None
    gradient_multiplier: Callable[[int], float] | None = None
    skip_nonfinite_gradients: bool = False

    def __post_init__(self) -> None:
        if type(self) is Optimizer:
            raise TypeError("Optimizer is the abstract base; use "
                            + listed([f"ec.{r.name}" for r in records()]))
        if not callable(self.learning_rate):
            self._check_lr(self._number("learning_rate", self.learning_rate))
        if not isinstance(self.use_gradient_accumulation, bool):
            raise TypeError(f"{self._name}: use_gradient_accumulation must be a bool, got "
                            f"{self.use_gradient_accumulation!r}")
        if not self.use_gradient_accumulation:
            raise ValueError(
                f"{self._name}: use_gradient_accumulation={self.use_gradient_accumulation!r} is "
                "not supported: embcore always sums the gradients of duplicate ids (across "
                "features, examples and processes) and updates each touched row once per step, "
                "which is use_gradient_accumulation=True; leave it at its default")
        lo_w, hi_w = (None if v is None else self._number(arg, v) for arg, v in
                      (("clip_weight_min", self.clip_weight_min),
                       ("clip_weight_max", self.clip_weight_max)))
        if lo_w is not None and hi_w is not None and lo_w > hi_w:
            raise ValueError(f"{self._name}: clip_weight_min={self.clip_weight_min!r} is greater "
                             f"than clip_weight_max={self.clip_weight_max!r}")
        if self.weight_decay_factor is not None:
            self._require("weight_decay_factor", ">= 0", lambda x: x >= 0)
        if self.multiply_weight_decay_factor_by_learning_rate and self.weight_decay_factor is None:
            raise ValueError(f"{self._name}: multiply_weight_decay_factor_by_learning_rate=True "
                             "needs a weight_decay_factor")
        clip = self.clipvalue
        if isinstance(clip, (tuple, list)):
            bounds = [None if c is None else self._number("clipvalue", c) for c in clip]
            lo, hi = (bounds + [None, None])[:2]
            if len(bounds) != 2 or (lo is not None and hi is not None and lo > hi):
                raise ValueError(f"{self._name}: clipvalue must be a number c > 0 or a pair "
                                 f"(lo, hi) with lo <= hi, got {clip!r}")
            object.__setattr__(self, "clipvalue", tuple(clip))  # hashable, once, at construction
        elif clip is not None:
            self._require("clipvalue", "> 0 (or a pair (lo, hi))", lambda x: x > 0)
        if self.gradient_multiplier is not None and not callable(self.gradient_multiplier):
            raise TypeError(f"{self._name}: gradient_multiplier must be a callable step -> float, "
                             f"got {self.gradient_multiplier!r}")
        if not isinstance(self.skip_nonfinite_gradients, bool):
            raise TypeError(f"{self._name}: skip_nonfinite_gradients must be a bool, got "
                            f"{self.skip_nonfinite_gradients!r}")
        self._check()

    def _check(self) -> None:
        """Validates the optimizer's own hyper-parameters: its record's ranges (a class adds the
        checks that depend on another hyper-parameter)."""
        for r in self._record.ranges if self._record is not None else ():
            self._require(r.name, r.what, r.ok)

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _number(self, arg: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{self._name}: {arg} must be a real number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{self._name}: {arg} must be finite, got {value!r}")
        return float(value)

    def _require(self, arg: str, what: str, ok: Callable[[float], bool]) -> None:
        value = getattr(self, arg)
        if not ok(self._number(arg, value)):
            raise ValueError(f"{self._name}: {arg} must be {what}, got {value!r}")

    # -- what the engine reads ------------------------------------------------------------------
    @property
    def slots(self) -> tuple[SlotSpec, ...]:
        """The slot tensors kept per table (names are checkpoint keys): its record's."""
        return tuple(s.spec(self) for s in self._record.slots) if self._record is not None else ()

    @property
    def updates_every_row(self) -> bool:
        """True when every row must be updated every step (with g = 0 where untouched)."""
        return False

    @property
    def zero_gradient_is_noop(self) -> bool:
        """True when ``update`` with g = 0 returns the params and slots unchanged."""
        lo, hi = self.clip_bounds
        return (self._rule_zero_noop and not self.weight_decay_factor
                and self.clip_weight_min is None and self.clip_weight_max is None
                and not (lo is not None and lo > 0) and not (hi is not None and hi < 0))

    _rule_zero_noop = True

    @property
    def clip_bounds(self) -> tuple[float | None, float | None]:
        """``clipvalue`` as ``(lo, hi)``; ``(None, None)`` when the gradient is not clipped."""
        clip = self.clipvalue
        if clip is None:
            return None, None
        if isinstance(clip, tuple):
            return clip
        return -float(clip), float(clip)

    def current_learning_rate(self) -> float:
        """The learning rate of this step: the float, or the callable's value (checked).

        Raises:
            TypeError: the callable returns something other than a real number.
            ValueError: the callable returns a negative or non-finite number (or 0 for FTRL
                without multiply_linear_by_learning_rate).
        """
        lr = self.learning_rate
        if not callable(lr):
            return float(lr)
        raw = lr()
        value = self._real(raw, f"learning_rate callable {lr!r} returned {raw!r}",
                           "it must return a real number")
        self._check_lr(value)
        return value

    def current_gradient_multiplier(self, step: int) -> float | None:
        """``gradient_multiplier(step)``, checked; None when the optimizer has no multiplier.

        Args:
            step: the number of updates already applied (0 on the first).

        Raises:
            TypeError: the callable returns something other than a real number (a bool, a
                string, a tensor of more than one element, ...).
            ValueError: the callable returns NaN or inf.
            Exception: whatever the callable raises, unchanged, with a note naming this
                optimizer.
        """
        fn = self.gradient_multiplier
        if fn is None:
            return None
        try:
            value = fn(step)
        except Exception as e:
            if hasattr(e, "add_note"):  # Python >= 3.11
                e.add_note(f"raised by the gradient_multiplier {fn!r} of {self._name} at step "
                           f"{step}")
            raise
        return self._multiplier(value, f"gradient_multiplier {fn!r} returned {value!r} at step "
                                       f"{step}")

    def _multiplier(self, value: Any, what: str) -> float:
        """A gradient multiplier's value as a finite float (TypeError / ValueError otherwise)."""
        value = self._real(value, what, "a gradient multiplier must be a real number (not a bool)")
        if not math.isfinite(value):
            raise ValueError(f"{self._name}: {what}; a gradient multiplier must be finite")
        return value

    def _real(self, value: Any, what: str, rule: str) -> float:
        """A callable's result as a float (a one-element tensor too); TypeError otherwise."""
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{self._name}: {what}; {rule}")
        return float(value)

    def _check_lr(self, lr: float) -> None:
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"{self._name}: learning_rate must be a finite number >= 0, got "
                             f"{lr!r}" + (f" from {self.learning_rate!r}"
                                          if callable(self.learning_rate) else ""))

    def init_slots(self, num_rows: int, dim: int, *, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None,
                   allocate: Allocator | None = None) -> dict[str, Tensor]:
        """Fresh slots for ``num_rows`` rows of width ``dim``: ``{name: (N, D) or (N, 1)}``.

        Args:
            num_rows: ``N``.
            dim: ``D`` (row-wise slots are ``(N, 1)`` whatever it is).
            dtype: the slots' dtype.
            device: where they live (None: torch's default device).
            allocate: how to get the memory of each slot: ``allocate(shape, dtype, device)``
                returns an uninitialized tensor of that shape, dtype and device, which is
                then filled with the slot's initial value (e.g. an allocator placing large
                slots on huge pages). None: ``torch.full``.
        """
        if allocate is None:
            return {s.name: torch.full((num_rows, 1 if s.rowwise else dim), s.initial_value,
                                       dtype=dtype, device=device) for s in self.slots}
        where = torch.device(device) if device is not None else None
        return {s.name: allocate((num_rows, 1 if s.rowwise else dim), dtype, where)
                .fill_(s.initial_value) for s in self.slots}

    def update(self, params: Tensor, grads: Tensor, slots: Mapping[str, Tensor], *, lr: float,
               step: int, gradient_multiplier: float | None = None
               ) -> tuple[Tensor, dict[str, Tensor]]:
        """Applies steps 1-5 (config/optimizers.py) to the touched rows; never writes inputs.

        Args:
            params: (U, D) the touched rows, any float dtype.
            grads: (U, D) the summed gradient of each row.
            slots: ``{name: (U, D) or (U, 1)}`` the rows' slot values.
            lr: the evaluated learning rate (``current_learning_rate()``).
            step: the number of updates already applied (0 on the first).
            gradient_multiplier: the multiplier of step 1, already evaluated (the engine calls
                ``current_gradient_multiplier(step)`` once per step, before any write): used
                instead of calling ``self.gradient_multiplier``. None (the default): this
                method evaluates ``current_gradient_multiplier(step)`` itself.

        Returns:
            New ``(params, slots)``: params in the input dtype, slots in float32 (float64 when the
            params are float64). The math runs in that slot dtype.
        """
        self._check_lr(lr)
        shapes = {s.name: (len(params), 1 if s.rowwise else params.shape[-1]) for s in self.slots}
        got = {name: tuple(t.shape) for name, t in slots.items()}
        if params.dim() != 2 or grads.shape != params.shape or got != shapes:
            raise ValueError(f"{self._name}.update: expected params and grads (U, D) and slots "
                             f"{shapes}; got {tuple(params.shape)}, {tuple(grads.shape)}, {got}")
        dtype = working_dtype(params.dtype)
        w = params.to(dtype)                                          # (U, D)
        g = grads.to(dtype)                                           # (U, D)
        if gradient_multiplier is None:
            gradient_multiplier = self.current_gradient_multiplier(step)
        else:
            gradient_multiplier = self._multiplier(
                gradient_multiplier, f"update got gradient_multiplier={gradient_multiplier!r}")
        if gradient_multiplier is not None:
            g = g * gradient_multiplier                               # (U, D)
        lo, hi = self.clip_bounds
        if lo is not None or hi is not None:
            g = g.clamp(min=lo, max=hi)                               # (U, D)
        state = {name: t.to(dtype) for name, t in slots.items()}
        new_w, new_state = self._rule(w, g, state, float(lr))        # (U, D), slots
        if self.weight_decay_factor:
            wd = self.weight_decay_factor * (
                lr if self.multiply_weight_decay_factor_by_learning_rate else 1.0)
            new_w = new_w - wd * w                                    # (U, D)
        if self.clip_weight_min is not None or self.clip_weight_max is not None:
            new_w = new_w.clamp(min=self.clip_weight_min, max=self.clip_weight_max)
        return new_w.to(params.dtype), new_state

    def _rule(self, w: Tensor, g: Tensor, s: Slots, lr: float) -> tuple[Tensor, Slots]:
        raise NotImplementedError

    # -- identity -------------------------------------------------------------------------------
    def stacking_key(self) -> tuple:
        """Hashable; equal for optimizers with the same class and hyper-parameters (callables by
        identity), i.e. the same math, so their tables may share one physical table."""
        return (type(self),) + tuple((f.name, _ByIdentity.wrap(getattr(self, f.name)))
                                     for f in fields(self) if f.name != "_")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Optimizer):
            return NotImplemented
        return self.stacking_key() == other.stacking_key()

    def __hash__(self) -> int:
        return hash(self.stacking_key())

    def __repr__(self) -> str:
        own = [f for f in fields(self) if f.name not in _COMMON]
        common = [f for f in fields(self)
                  if f.name in _COMMON and getattr(self, f.name) != f.default]
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in own + common]
        return f"{self._name}({', '.join(shown)})"


class _ByIdentity:
    """Wraps a callable so that keys compare it by identity."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    @staticmethod
    def wrap(value: Any) -> Any:
        return _ByIdentity(value) if callable(value) else value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


OptimizerClass = TypeVar("OptimizerClass", bound=type[Optimizer])


def _declare(*, alias: str | None = None, ranges: tuple[Range, ...] = (),
             slots: tuple[Slot, ...] = (), rule: str | None = None,
             triton_args: Callable[[Any], KernelArgs] = _no_args,
             in_place: str | None = None) -> Callable[[OptimizerClass], OptimizerClass]:
    """Registers the optimizer class's record (the arguments, see ``OptimizerRecord``); the
    class is a frozen dataclass of its hyper-parameters (``@dataclass(frozen=True, eq=False,
    repr=False)`` under this decorator)."""
    def declare(cls: OptimizerClass) -> OptimizerClass:
        if cls.__name__ in {r.name for r in _RECORDS.values()}:
            raise TypeError(f"optimizer {cls.__name__!r} is declared twice")
        if "__dataclass_fields__" not in vars(cls):
            raise TypeError(f"optimizer {cls.__name__}: declare it a dataclass "
                            f"(@dataclass(frozen=True, eq=False, repr=False)) under @_declare")
        record = OptimizerRecord(cls, cls.__name__, alias, ranges, slots, rule, triton_args,
                                 in_place)
        cls._record = record
        _RECORDS[cls] = record
        return cls
    return declare
