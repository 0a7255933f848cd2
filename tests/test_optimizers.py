"""Optimizers: ``Optimizer.update`` against the loop reference, slot specs, validation, and the
translation of torch.optim classes (checked against torch.optim itself)."""

from __future__ import annotations

import dataclasses
import doctest
import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import embcore
import embcore.config.optimizers as eo
from embcore.config.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    LaProp,
    Optimizer,
    RowwiseAdagrad,
    SlotSpec,
)
from embcore.config.torch_optim import resolve_optimizer
from embcore.ops.reference_optim import reference_update, to_rows

MAX_EXAMPLES = 50
CLASSES = (SGD, Adagrad, RowwiseAdagrad, AdagradMomentum, Adam, FTRL, LaProp)


# -- strategies -------------------------------------------------------------------------------

def _values(low: float) -> st.SearchStrategy[float]:
    """0 or a magnitude in [1e-3, 3] (no float32 underflow of g*g); low: -1 any sign, 0
    non-negative, 1 positive."""
    pos = st.floats(0.001, 3).map(lambda x: float(torch.tensor(x, dtype=torch.float32)))
    if low > 0:
        return pos
    if low == 0:
        return st.one_of(st.just(0.0), pos)
    return st.one_of(st.just(0.0), pos, pos.map(lambda x: -x))


ANY, NONNEG, POSITIVE = _values(-1), _values(0), _values(1)


def half(step: int) -> float:
    return 0.5


def decaying(step: int) -> float:
    return 1.0 / (1 + step)


def flip(step: int) -> float:
    return -2.0


def zero(step: int) -> float:
    return 0.0


class Schedule:
    """A callable learning rate returning its values in turn."""

    def __init__(self, values: list[float]) -> None:
        self.values, self.calls = values, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.values[(self.calls - 1) % len(self.values)]

    def __repr__(self) -> str:
        return f"Schedule({self.values})"


@st.composite
def common_kwargs(draw: st.DrawFn) -> dict:
    kw: dict = {}
    if draw(st.booleans()):
        kw["clipvalue"] = draw(st.one_of(
            st.floats(0.05, 2),  # bounds 0 or >= 0.01 in size: the same in float32 and float64
            st.tuples(st.one_of(st.none(), st.just(0.0), st.floats(-2, -0.01),
                                st.floats(0.01, 0.5)),
                      st.one_of(st.none(), st.floats(0.5, 2)))))
    if draw(st.booleans()):
        kw["clip_weight_min"] = draw(st.one_of(st.none(), st.just(0.0), st.floats(-3, -0.01)))
        kw["clip_weight_max"] = draw(st.one_of(st.none(), st.just(0.0), st.floats(0.01, 3)))
    if draw(st.booleans()):
        kw["weight_decay_factor"] = draw(st.floats(0, 0.5))
        kw["multiply_weight_decay_factor_by_learning_rate"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["gradient_multiplier"] = draw(st.sampled_from([half, decaying, flip, zero]))
    return kw


@st.composite
def optimizers(draw: st.DrawFn) -> Optimizer:
    cls = draw(st.sampled_from(CLASSES))
    kw = draw(common_kwargs())
    lr_positive = False
    if cls in (Adagrad, RowwiseAdagrad):
        kw["initial_accumulator_value"] = draw(st.sampled_from([0.0, 0.1, 1.0]))
    elif cls is AdagradMomentum:
        kw.update(momentum=draw(st.sampled_from([0.0, 0.5, 0.9])), use_nesterov=draw(st.booleans()),
                  exponent=draw(st.sampled_from([1, 2, 3, 0.5])),
                  beta2=draw(st.sampled_from([1, 0.9, 0.5])),
                  epsilon=draw(st.sampled_from([1e-10, 1e-6, 0.1])))
    elif cls is Adam:
        kw.update(beta_1=draw(st.sampled_from([0.0, 0.5, 0.9])),
                  beta_2=draw(st.sampled_from([0.0, 0.9, 0.999])),
                  epsilon=draw(st.sampled_from([1e-7, 1e-3, 1.0])),
                  lazy_adam=draw(st.booleans()), sum_inside_sqrt=draw(st.booleans()))
    elif cls is FTRL:
        allow_zero = draw(st.booleans())
        kw.update(learning_rate_power=draw(st.sampled_from([-0.5, 0.0, -1.0, -1.5])),
                  l1_regularization_strength=draw(st.sampled_from([0.0, 0.01, 0.5])),
                  l2_regularization_strength=draw(st.sampled_from([0.0, 0.1, 1.0])),
                  beta=draw(st.sampled_from([0.0, 0.5])),
                  initial_accumulator_value=draw(st.sampled_from(
                      [0.0, 0.1] if allow_zero else [0.1, 1.0])),
                  multiply_linear_by_learning_rate=draw(st.booleans()),
                  allow_zero_accumulator=allow_zero)
        if not kw["multiply_linear_by_learning_rate"]:
            lr_positive = True
    elif cls is LaProp:
        kw.update(beta_1=draw(st.sampled_from([0.0, 0.5, 0.9])),
                  beta_2=draw(st.sampled_from([0.0, 0.5, 0.95])),
                  epsilon=draw(st.sampled_from([1e-30, 1e-8, 0.1])))
    rate = st.floats(0.01, 1.0) if lr_positive else st.one_of(st.just(0.0), st.floats(0.001, 1.0))
    schedules = st.lists(rate, min_size=4, max_size=4).map(Schedule)
    kw["learning_rate"] = draw(st.one_of(rate, schedules))
    return cls(**kw)


def _tensor(draw: st.DrawFn, shape: tuple[int, int], values: st.SearchStrategy[float],
            dtype: torch.dtype) -> torch.Tensor:
    flat = draw(st.lists(values, min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]))
    return torch.tensor(flat, dtype=dtype).reshape(shape)


@st.composite
def problems(draw: st.DrawFn, dtype: torch.dtype) -> tuple:
    """An optimizer, params, slots and the gradients of 1-4 consecutive steps."""
    opt = draw(optimizers())
    u, d, steps = draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
    params = _tensor(draw, (u, d), ANY, dtype)
    positive = isinstance(opt, FTRL) and not opt.allow_zero_accumulator
    kinds = {"accumulators": POSITIVE if positive else NONNEG, "velocities": NONNEG}
    slots = {s.name: _tensor(draw, (u, 1 if s.rowwise else d), kinds.get(s.name, ANY), dtype)
             for s in opt.slots}
    grads = [_tensor(draw, (u, d), ANY, dtype) for _ in range(steps)]
    return opt, params, slots, grads


def assert_matches(actual: torch.Tensor, expected: list[list[float]], rtol: float,
                   *inputs: torch.Tensor) -> None:
    """Equal up to rtol, with an absolute slack of rtol times the problem's largest magnitude."""
    want = torch.tensor(expected, dtype=torch.float64)
    scale = max([1.0] + [t.abs().max().item() for t in (want, *inputs)])
    torch.testing.assert_close(actual.to(torch.float64), want, rtol=rtol, atol=rtol * scale)


def step_matches_reference(opt: Optimizer, params: torch.Tensor, g: torch.Tensor,
                           slots: dict[str, torch.Tensor], step: int, rtol: float,
                           start: tuple | None = None) -> tuple:
    """One ``opt.update`` against ``reference_update`` started from ``start`` (the reference's
    own rows and slots) or, without it, from the same inputs: equal up to rtol
    (``assert_matches``). Returns the update's new params and slots, and the reference's."""
    lr = opt.current_learning_rate()
    new_params, new_slots = opt.update(params, g, slots, lr=lr, step=step)
    ref_params, ref_slots = start if start is not None else (params, slots)
    ref_w, ref_s = reference_update(opt, ref_params, g, ref_slots, lr=lr, step=step)
    inputs = (params, g, *slots.values())
    assert_matches(new_params, ref_w, rtol, *inputs)
    for k in slots:
        assert_matches(new_slots[k], ref_s[k], rtol, *inputs)
    return new_params, new_slots, (ref_w, ref_s)


# -- update == reference --------------------------------------------------------------------

@settings(max_examples=examples(MAX_EXAMPLES), deadline=None)
@given(problems(torch.float64))
def test_update_matches_reference_float64(problem: tuple) -> None:
    """Independent trajectories of several steps: torch update vs the loop reference."""
    opt, params, slots, grads = problem
    ref = to_rows(params), {k: to_rows(v) for k, v in slots.items()}
    for step, g in enumerate(grads):
        before = (params.clone(), g.clone(), {k: v.clone() for k, v in slots.items()})
        new_params, new_slots, ref = step_matches_reference(opt, params, g, slots, step, 1e-9,
                                                            start=ref)
        # inputs untouched, outputs new, dtypes as promised, everything finite
        assert torch.equal(params, before[0]) and torch.equal(g, before[1])
        assert all(torch.equal(slots[k], before[2][k]) for k in slots)
        assert new_params.dtype == torch.float64 and new_params.data_ptr() != params.data_ptr()
        assert set(new_slots) == set(slots)
        assert all(v.dtype == torch.float64 and v.shape == slots[k].shape
                   for k, v in new_slots.items())
        assert torch.isfinite(new_params).all()
        assert all(torch.isfinite(v).all() for v in new_slots.values())
        params, slots = new_params, new_slots


@settings(max_examples=examples(MAX_EXAMPLES), deadline=None)
@given(problems(torch.float32))
def test_update_matches_reference_float32(problem: tuple) -> None:
    """Along a float32 trajectory, each step agrees with the reference started from its state."""
    opt, params, slots, grads = problem
    for step, g in enumerate(grads):
        new_params, new_slots, _ = step_matches_reference(opt, params, g, slots, step, 1e-5)
        assert new_params.dtype == torch.float32
        assert all(v.dtype == torch.float32 for v in new_slots.values())
        params, slots = new_params, new_slots


@settings(max_examples=examples(MAX_EXAMPLES), deadline=None)
@given(problems(torch.float64))
def test_zero_gradient_is_noop_holds(problem: tuple) -> None:
    """When an optimizer says a zero gradient is a no-op, update(g = 0) changes nothing."""
    opt, params, slots, _ = problem
    if not opt.zero_gradient_is_noop:
        return
    new_params, new_slots = opt.update(params, torch.zeros_like(params), slots,
                                       lr=opt.current_learning_rate(), step=0)
    assert torch.equal(new_params, params)
    assert all(torch.equal(new_slots[k], slots[k]) for k in slots)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", CLASSES)
def test_low_precision_params_compute_in_float32(cls: type, dtype: torch.dtype) -> None:
    opt = cls(learning_rate=0.1)
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(3, 4, generator=gen).to(dtype)
    grads = torch.randn(3, 4, generator=gen).to(dtype)
    slots = opt.init_slots(3, 4)
    new_params, new_slots = opt.update(params, grads, slots, lr=0.1, step=0)
    want_params, want_slots = opt.update(params.float(), grads.float(), slots, lr=0.1, step=0)
    assert new_params.dtype == dtype
    assert torch.equal(new_params, want_params.to(dtype))
    assert all(v.dtype == torch.float32 and torch.equal(v, want_slots[k])
               for k, v in new_slots.items())


def test_adagrad_empty_accumulator_takes_no_step() -> None:
    for opt in (Adagrad(learning_rate=1.0, initial_accumulator_value=0.0),
                RowwiseAdagrad(learning_rate=1.0, initial_accumulator_value=0.0)):
        w, s = opt.update(torch.ones(2, 3), torch.zeros(2, 3), opt.init_slots(2, 3), lr=1.0, step=0)
        assert torch.equal(w, torch.ones(2, 3))
        assert torch.equal(s["accumulators"], torch.zeros_like(s["accumulators"]))


def test_ftrl_zero_accumulator_gives_no_nan() -> None:
    opt = FTRL(learning_rate=0.1, initial_accumulator_value=0.0, allow_zero_accumulator=True)
    slots = {"accumulators": torch.zeros(2, 2), "linears": torch.tensor([[1.0, -1.0], [0.0, 2.0]])}
    w, s = opt.update(torch.ones(2, 2), torch.zeros(2, 2), slots, lr=0.1, step=0)
    assert torch.isfinite(w).all() and torch.equal(w, torch.zeros(2, 2))


def test_rowwise_adagrad_mean_over_row() -> None:
    opt = RowwiseAdagrad(learning_rate=0.5, initial_accumulator_value=1.0)
    w, s = opt.update(torch.zeros(1, 2), torch.tensor([[3.0, 4.0]]), opt.init_slots(1, 2),
                      lr=0.5, step=0)
    assert s["accumulators"].shape == (1, 1) and s["accumulators"].item() == 13.5
    torch.testing.assert_close(w, -0.5 * torch.tensor([[3.0, 4.0]]) / math.sqrt(13.5))


def test_order_of_steps() -> None:
    """multiplier, then clip, then rule, then decay of the weight before the rule, then clamp."""
    opt = SGD(learning_rate=0.1, gradient_multiplier=lambda step: 10.0 * step, clipvalue=(None, 5),
              weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True,
              clip_weight_max=1.9)
    w, _ = opt.update(torch.tensor([[2.0, 2.0]]), torch.tensor([[1.0, -1.0]]), {}, lr=0.1, step=1)
    # g = (10, -10) -> (5, -10); w = 2 - 0.1*g = (1.5, 3); -= 0.05*2 -> (1.4, 2.9); clamp 1.9
    torch.testing.assert_close(w, torch.tensor([[1.4, 1.9]]))


def test_update_checks_its_arguments() -> None:
    opt = Adagrad()
    with pytest.raises(ValueError, match=r"slots \{'accumulators': \(2, 3\)\}.*\(2, 1\)"):
        opt.update(torch.ones(2, 3), torch.ones(2, 3), {"accumulators": torch.ones(2, 1)},
                   lr=0.1, step=0)
    with pytest.raises(ValueError, match=r"slots \{'accumulators': \(2, 3\)\}; got .*\{\}"):
        opt.update(torch.ones(2, 3), torch.ones(2, 3), {}, lr=0.1, step=0)
    with pytest.raises(ValueError, match="learning_rate.*-1"):
        opt.update(torch.ones(2, 3), torch.ones(2, 3), opt.init_slots(2, 3), lr=-1.0, step=0)


# -- what the engine reads --------------------------------------------------------------------

@pytest.mark.parametrize("opt, slots", [
    (SGD(), ()),
    (Adagrad(initial_accumulator_value=0.3), (SlotSpec("accumulators", 0.3),)),
    (RowwiseAdagrad(), (SlotSpec("accumulators", 0.1, rowwise=True),)),
    (AdagradMomentum(), (SlotSpec("accumulators", 0.0), SlotSpec("momenta", 0.0))),
    (Adam(), (SlotSpec("momenta", 0.0), SlotSpec("velocities", 0.0))),
    (FTRL(initial_accumulator_value=0.2),
     (SlotSpec("accumulators", 0.2), SlotSpec("linears", 0.0))),
    (LaProp(), (SlotSpec("momenta", 0.0), SlotSpec("velocities", 0.0))),
])
def test_slot_specs(opt: Optimizer, slots: tuple) -> None:
    assert opt.slots == slots
    init = opt.init_slots(5, 3)
    assert list(init) == [s.name for s in slots]
    for s in slots:
        assert init[s.name].shape == ((5, 1) if s.rowwise else (5, 3))
        assert init[s.name].dtype == torch.float32
        assert torch.all(init[s.name] == s.initial_value)


def test_defaults_are_tf_defaults() -> None:
    assert SGD().learning_rate == 0.01
    assert Adagrad().learning_rate == 0.001 and Adagrad().initial_accumulator_value == 0.1
    a = Adam()
    assert (a.learning_rate, a.beta_1, a.beta_2, a.epsilon, a.lazy_adam, a.sum_inside_sqrt) == (
        0.001, 0.9, 0.999, 1e-07, True, True)
    m = AdagradMomentum()
    assert (m.momentum, m.use_nesterov, m.exponent, m.beta2, m.epsilon) == (0.0, False, 2, 1, 1e-10)
    f = FTRL()
    assert (f.learning_rate_power, f.l1_regularization_strength, f.l2_regularization_strength,
            f.beta, f.initial_accumulator_value, f.multiply_linear_by_learning_rate,
            f.allow_zero_accumulator) == (-0.5, 0.0, 0.0, 0.0, 0.1, False, False)
    assert Adagrad(0.5, 0.2).initial_accumulator_value == 0.2   # TF's positional order
    with pytest.raises(TypeError):
        SGD(0.1, True)  # common arguments are keyword-only


def test_every_row_update_only_for_non_lazy_adam() -> None:
    assert Adam(lazy_adam=False).updates_every_row
    assert not Adam().updates_every_row
    assert not any(cls().updates_every_row for cls in (SGD, Adagrad, RowwiseAdagrad,
                                                  AdagradMomentum, FTRL))


@pytest.mark.parametrize("opt, noop", [
    (SGD(), True), (Adagrad(), True), (RowwiseAdagrad(), True),
    (AdagradMomentum(), False), (Adam(), False), (FTRL(), False), (LaProp(), False),
    (SGD(gradient_multiplier=half, clipvalue=1.0), True),
    (SGD(weight_decay_factor=0.0), True),
    (SGD(weight_decay_factor=0.1), False), (Adagrad(clip_weight_min=-1.0), False),
    (SGD(clip_weight_max=1.0), False), (SGD(clipvalue=(0.1, 1.0)), False),
    (SGD(clipvalue=(-1.0, -0.1)), False), (SGD(clipvalue=(None, 0.0)), True),
])
def test_zero_gradient_is_noop_values(opt: Optimizer, noop: bool) -> None:
    assert opt.zero_gradient_is_noop is noop
    if not noop:  # and there is a row that a zero gradient changes
        w = torch.tensor([[5.0, -5.0]])
        slots = {k: v + 1.0 for k, v in opt.init_slots(1, 2).items()}
        new_w, new_slots = opt.update(w, torch.zeros(1, 2), slots, lr=0.1, step=0)
        assert not torch.equal(new_w, w) or any(not torch.equal(new_slots[k], slots[k])
                                                for k in slots)


def test_current_learning_rate() -> None:
    assert Adam(learning_rate=0.5).current_learning_rate() == 0.5
    values = iter([0.1, 0.2])
    opt = Adam(learning_rate=lambda: next(values))
    assert [opt.current_learning_rate(), opt.current_learning_rate()] == [0.1, 0.2]
    with pytest.raises(ValueError, match=r"learning_rate.*-0\.5"):
        SGD(learning_rate=lambda: -0.5).current_learning_rate()
    with pytest.raises(TypeError, match="learning_rate"):
        SGD(learning_rate=lambda: "fast").current_learning_rate()
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        FTRL(learning_rate=lambda: 0.0).current_learning_rate()
    assert FTRL(learning_rate=lambda: 0.0,
                multiply_linear_by_learning_rate=True).current_learning_rate() == 0.0


def test_identity_repr_and_immutability() -> None:
    fn = decaying
    a, b = Adam(learning_rate=0.1, beta_1=0.5), Adam(learning_rate=0.1, beta_1=0.5)
    assert a.stacking_key() == b.stacking_key() and a == b and hash(a) == hash(b)
    assert a.stacking_key() != Adam(learning_rate=0.1).stacking_key()
    assert Adagrad().stacking_key() != RowwiseAdagrad().stacking_key()
    assert SGD(gradient_multiplier=fn) == SGD(gradient_multiplier=fn)
    assert SGD(gradient_multiplier=fn) != SGD(gradient_multiplier=lambda s: fn(s))
    assert len({Adam(), Adam(), SGD(clipvalue=[-1, 1]), SGD(clipvalue=(-1, 1))}) == 2
    text = repr(FTRL(learning_rate=0.05, l1_regularization_strength=0.25, clipvalue=2.0))
    assert text.startswith("FTRL(learning_rate=0.05")
    assert "l1_regularization_strength=0.25" in text and "clipvalue=2.0" in text
    assert "clip_weight_min" not in text   # common arguments only when set
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(a, "beta_1", 0.8)
    with pytest.raises(TypeError, match="abstract"):
        Optimizer()


# -- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("make, match", [
    (lambda: SGD(learning_rate=-0.1), r"learning_rate.*-0\.1"),
    (lambda: Adam(learning_rate=float("nan")), r"learning_rate.*nan"),
    (lambda: Adagrad(initial_accumulator_value=-1.0), r"initial_accumulator_value.*-1\.0"),
    (lambda: RowwiseAdagrad(initial_accumulator_value=-0.5), r"initial_accumulator_value.*-0\.5"),
    (lambda: FTRL(initial_accumulator_value=0.0), r"initial_accumulator_value.*0\.0"),
    (lambda: FTRL(initial_accumulator_value=-0.1, allow_zero_accumulator=True),
     r"initial_accumulator_value.*-0\.1"),
    (lambda: FTRL(learning_rate=0.0), r"learning_rate must be > 0.*0\.0"),
    (lambda: AdagradMomentum(epsilon=0.0), r"epsilon.*0\.0"),
    (lambda: Adam(epsilon=-1e-7), r"epsilon.*-1e-07"),
    (lambda: Adam(beta_1=1.0), r"beta_1.*1\.0"),
    (lambda: Adam(beta_1=-0.1), r"beta_1.*-0\.1"),
    (lambda: Adam(beta_2=1.5), r"beta_2.*1\.5"),
    (lambda: AdagradMomentum(momentum=-0.9), r"momentum.*-0\.9"),
    (lambda: AdagradMomentum(exponent=0), r"exponent.*0"),
    (lambda: AdagradMomentum(beta2=0.0), r"beta2.*0\.0"),
    (lambda: AdagradMomentum(beta2=1.1), r"beta2.*1\.1"),
    (lambda: FTRL(learning_rate_power=0.5), r"learning_rate_power.*0\.5"),
    (lambda: FTRL(l1_regularization_strength=-1.0), r"l1_regularization_strength.*-1\.0"),
    (lambda: FTRL(l2_regularization_strength=-2.0), r"l2_regularization_strength.*-2\.0"),
    (lambda: FTRL(beta=-0.3), r"beta.*-0\.3"),
    (lambda: SGD(weight_decay_factor=-0.01), r"weight_decay_factor.*-0\.01"),
    (lambda: SGD(multiply_weight_decay_factor_by_learning_rate=True),
     "multiply_weight_decay_factor_by_learning_rate"),
    (lambda: SGD(clip_weight_min=1.0, clip_weight_max=-1.0),
     r"clip_weight_min=1\.0.*clip_weight_max=-1\.0"),
    (lambda: SGD(clipvalue=0.0), r"clipvalue.*0\.0"),
    (lambda: SGD(clipvalue=-1.0), r"clipvalue.*-1\.0"),
    (lambda: SGD(clipvalue=(1.0, -1.0)), r"clipvalue.*\(1\.0, -1\.0\)"),
    (lambda: SGD(clipvalue=(1.0, 2.0, 3.0)), r"clipvalue.*\(1\.0, 2\.0, 3\.0\)"),
    (lambda: Adagrad(use_gradient_accumulation=False),
     r"use_gradient_accumulation=False.*sums the gradients of duplicate ids"),
    (lambda: LaProp(beta_1=1.0), r"LaProp: beta_1 must be in \[0, 1\), got 1\.0"),
    (lambda: LaProp(beta_1=-0.5), r"beta_1.*-0\.5"),
    (lambda: LaProp(beta_2=1.0), r"LaProp: beta_2 must be in \[0, 1\), got 1\.0"),
    (lambda: LaProp(epsilon=0.0), r"LaProp: epsilon must be > 0, got 0\.0"),
    (lambda: LaProp(epsilon=float("inf")), r"epsilon must be finite, got inf"),
    (lambda: LaProp(learning_rate=-1.0), r"learning_rate.*-1\.0"),
])
def test_invalid_hyper_parameters(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_hyper_parameter_of_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"learning_rate must be a real number, got '0\.1'"):
        SGD(learning_rate="0.1")
    with pytest.raises(TypeError, match=r"momentum must be a real number, got None"):
        AdagradMomentum(momentum=None)
    with pytest.raises(TypeError, match=r"gradient_multiplier.*2\.0"):   # was ValueError
        SGD(gradient_multiplier=2.0)
    with pytest.raises(TypeError, match=r"use_gradient_accumulation must be a bool, got 1"):
        Adagrad(use_gradient_accumulation=1)
    with pytest.raises(TypeError, match=r"clip_weight_min must be a real number, got '0'"):
        SGD(clip_weight_min="0")
    with pytest.raises(TypeError, match=r"clipvalue must be a real number, got '1'"):
        SGD(clipvalue=(None, "1"))
    with pytest.raises(TypeError, match=r"beta_1 must be a real number, got True"):
        Adam(beta_1=True)
    with pytest.raises(TypeError, match=r"LaProp: epsilon must be a real number, got '1e-8'"):
        LaProp(epsilon="1e-8")
    with pytest.raises(TypeError, match=r"LaProp: beta_2 must be a real number, got None"):
        LaProp(beta_2=None)


def test_init_slots_with_an_allocator() -> None:
    calls = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | None) -> torch.Tensor:
        calls.append((shape, dtype, device))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)  # filled afterwards

    opt = FTRL(initial_accumulator_value=0.25)
    slots = opt.init_slots(4, 3, dtype=torch.float64, device="cpu", allocate=allocate)
    assert calls == [((4, 3), torch.float64, torch.device("cpu"))] * 2
    assert torch.equal(slots["accumulators"], torch.full((4, 3), 0.25, dtype=torch.float64))
    assert torch.equal(slots["linears"], torch.zeros(4, 3, dtype=torch.float64))
    calls.clear()
    rowwise = RowwiseAdagrad(initial_accumulator_value=0.5).init_slots(2, 7, allocate=allocate)
    assert calls == [((2, 1), torch.float32, None)]
    assert torch.equal(rowwise["accumulators"], torch.full((2, 1), 0.5))
    assert SGD().init_slots(3, 2, allocate=allocate) == {}
    for opt in (Adagrad(), Adam(), AdagradMomentum()):  # the default: the same values
        a, b = opt.init_slots(3, 2), opt.init_slots(3, 2, allocate=allocate)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- resolve_optimizer ------------------------------------------------------------------------

def test_resolve_names_objects_and_ec_classes() -> None:
    opt = FTRL(learning_rate=0.3)
    assert resolve_optimizer(opt) is opt
    for name, cls in [("sgd", SGD), ("ADAGRAD", Adagrad), ("Adam", Adam), ("ftrl", FTRL)]:
        assert resolve_optimizer(name) == cls()
    assert resolve_optimizer(Adagrad) == Adagrad()
    assert resolve_optimizer(functools.partial(Adam, beta_1=0.5)) == Adam(beta_1=0.5)
    assert resolve_optimizer((FTRL, {"beta": 0.1})) == FTRL(beta=0.1)


def test_resolve_torch_classes() -> None:
    assert resolve_optimizer(torch.optim.SGD) == SGD(learning_rate=1e-3)  # torch's default lr
    assert resolve_optimizer(functools.partial(torch.optim.SGD, lr=0.3)) == SGD(learning_rate=0.3)
    assert resolve_optimizer((torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.5,
                                                    "foreach": False})) == Adagrad(0.2, 0.5)
    assert resolve_optimizer(torch.optim.Adagrad) == Adagrad(0.01, 0.0)
    adam = resolve_optimizer((torch.optim.Adam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}))
    assert isinstance(adam, Adam) and callable(adam.learning_rate)
    assert (adam.beta_1, adam.beta_2, adam.epsilon, adam.lazy_adam, adam.sum_inside_sqrt) == (
        0.8, 0.99, 1e-6, False, False)
    assert adam.updates_every_row
    assert adam.current_learning_rate() == pytest.approx(0.01 * math.sqrt(1 - 0.99) / (1 - 0.8))
    assert adam.current_learning_rate() == pytest.approx(
        0.01 * math.sqrt(1 - 0.99**2) / (1 - 0.8**2))


@pytest.mark.parametrize("spec, error, match", [
    ("rmsprop", ValueError, r"'rmsprop'.*'sgd', 'adagrad', 'adam'"),
    (42, TypeError, r"int 42"),
    (None, TypeError, r"NoneType"),
    (torch.optim.RMSprop, ValueError, r"torch\.optim\.RMSprop cannot be translated"),
    ((torch.optim.SGD, {"lrr": 0.1}), TypeError, r"torch\.optim\.SGD.*'lrr'"),
    ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), ValueError,
     r"SGD\(momentum=0\.9\).*AdagradMomentum"),
    ((torch.optim.SGD, {"weight_decay": 1e-4}), ValueError, r"weight_decay=0\.0001.*every row"),
    ((torch.optim.SGD, {"nesterov": True}), ValueError, r"nesterov=True"),
    ((torch.optim.Adagrad, {"lr_decay": 0.1}), ValueError, r"lr_decay=0\.1"),
    ((torch.optim.Adagrad, {"weight_decay": 0.1}), ValueError, r"weight_decay=0\.1"),
    ((torch.optim.Adam, {"amsgrad": True}), ValueError, r"amsgrad=True"),
    ((torch.optim.Adam, {"weight_decay": 0.01}), ValueError, r"weight_decay=0\.01"),
    ((torch.optim.Adam, {"maximize": True}), ValueError, r"maximize=True.*gradient_multiplier"),
    ((torch.optim.Adam, {"eps": 0.0}), ValueError, r"epsilon.*0\.0"),
    (functools.partial(torch.optim.SGD, [torch.zeros(1)]), TypeError, "positional"),
    (torch.optim.SGD([torch.zeros(1, requires_grad=True)], momentum=0.9), ValueError,
     r"SGD\(momentum=0\.9\)"),
    (torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)], "lr": 0.5},
                      {"params": [torch.zeros(1, requires_grad=True)]}], lr=0.1), ValueError,
     r"parameter groups with their own \['lr'\]"),
    (torch.optim.RMSprop([torch.zeros(1, requires_grad=True)]), ValueError, "cannot be translated"),
])
def test_resolve_errors(spec, error: type, match: str) -> None:
    """(A torch.optim instance is translated from its hyper-parameters, as TF takes a Keras
    optimizer instance; its parameter groups must agree.)"""
    with pytest.raises(error, match=match):
        resolve_optimizer(spec)


def _torch_vs_embcore(spec, make_torch, steps: int = 6, before_torch_step=None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense (4, 3) float64 table, every row gets a gradient every step, both optimizers."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    grads = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(steps)]
    p = torch.nn.Parameter(start.clone())
    torch_opt = make_torch([p])
    for t, g in enumerate(grads, start=1):
        if before_torch_step is not None:
            before_torch_step(torch_opt, t)
        p.grad = g.clone()
        torch_opt.step()
    opt = resolve_optimizer(spec)
    w, slots = start.clone(), opt.init_slots(4, 3, dtype=torch.float64)
    for step, g in enumerate(grads):
        w, slots = opt.update(w, g, slots, lr=opt.current_learning_rate(), step=step)
    return w, p.detach()


def test_translated_sgd_matches_torch() -> None:
    ours, theirs = _torch_vs_embcore(functools.partial(torch.optim.SGD, lr=0.3),
                                     lambda ps: torch.optim.SGD(ps, lr=0.3))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_translated_adagrad_matches_torch_up_to_eps() -> None:
    kw = {"lr": 0.2, "initial_accumulator_value": 0.1, "eps": 1e-10}
    ours, theirs = _torch_vs_embcore((torch.optim.Adagrad, kw),
                                     lambda ps: torch.optim.Adagrad(ps, **kw))
    torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=1e-8)
    ours, theirs = _torch_vs_embcore(torch.optim.Adagrad, lambda ps: torch.optim.Adagrad(ps))
    torch.testing.assert_close(ours, theirs, rtol=1e-8, atol=1e-8)


def test_translated_adam_matches_torch_up_to_eps_term() -> None:
    kw = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-8}
    ours, theirs = _torch_vs_embcore((torch.optim.Adam, kw), lambda ps: torch.optim.Adam(ps, **kw))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    # a large eps shows the one difference: embcore is torch with eps / sqrt(1 - b2**t) for eps
    kw = {"lr": 0.05, "betas": (0.9, 0.999), "eps": 1e-3}
    ours, theirs = _torch_vs_embcore((torch.optim.Adam, kw), lambda ps: torch.optim.Adam(ps, **kw))
    assert not torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4)

    def rescale_eps(torch_opt: torch.optim.Optimizer, t: int) -> None:
        torch_opt.param_groups[0]["eps"] = 1e-3 / math.sqrt(1 - 0.999**t)

    ours, theirs = _torch_vs_embcore((torch.optim.Adam, kw), lambda ps: torch.optim.Adam(ps, **kw),
                                     before_torch_step=rescale_eps)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)


# -- LaProp ------------------------------------------------------------------------------------

def test_laprop_defaults_are_jax_tpu_embeddings() -> None:
    o = LaProp()
    assert (o.learning_rate, o.beta_1, o.beta_2, o.epsilon) == (0.001, 0.9, 0.95, 1e-30)
    assert not o.updates_every_row and not o.zero_gradient_is_noop
    assert LaProp(0.5).learning_rate == 0.5   # learning_rate positional, as every optimizer's


def test_laprop_one_step_by_hand() -> None:
    """v = 0.75*0.25 + 0.25*(1 + 0.25) = 0.5; m = sqrt(1 - 0.25) * 1/sqrt(0.5) = sqrt(1.5)."""
    opt = LaProp(learning_rate=0.1, beta_1=0.5, beta_2=0.75, epsilon=0.25)
    slots = {"momenta": torch.zeros(1, 1, dtype=torch.float64),
             "velocities": torch.full((1, 1), 0.25, dtype=torch.float64)}
    w, s = opt.update(torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                      slots, lr=0.1, step=0)
    assert s["velocities"].item() == pytest.approx(0.5, rel=1e-15)
    assert s["momenta"].item() == pytest.approx(math.sqrt(1.5), rel=1e-15)
    assert w.item() == pytest.approx(1 - 0.1 * math.sqrt(1.5), rel=1e-15)
    ref_w, _ = reference_update(opt, [[1.0]], [[1.0]], {k: v.tolist() for k, v in slots.items()},
                                lr=0.1, step=0)
    assert ref_w == [[pytest.approx(w.item(), rel=1e-15)]]
    # the momentum carries on: a zero gradient still moves the row and decays both slots
    w2, s2 = opt.update(w, torch.zeros(1, 1, dtype=torch.float64), s, lr=0.1, step=1)
    assert s2["momenta"].item() == pytest.approx(0.5 * math.sqrt(1.5), rel=1e-15)
    assert s2["velocities"].item() == pytest.approx(0.75 * 0.5 + 0.25 * 0.25, rel=1e-15)
    assert w2.item() == pytest.approx(w.item() - 0.1 * 0.5 * math.sqrt(1.5), rel=1e-15)


def test_laprop_underflowing_velocity_takes_no_step() -> None:
    """In float32 an epsilon of 1e-46 is 0: a zero gradient on a zero velocity gives 0 / 0,
    which the rule takes as no step (never NaN), as the reference does."""
    opt = LaProp(learning_rate=1.0, beta_1=0.0, beta_2=0.0, epsilon=1e-46)
    w, s = opt.update(torch.ones(2, 3), torch.zeros(2, 3), opt.init_slots(2, 3), lr=1.0, step=0)
    assert torch.equal(w, torch.ones(2, 3)) and torch.equal(s["momenta"], torch.zeros(2, 3))
    ref_w, _ = reference_update(opt, [[1.0]], [[0.0]], {"momenta": [[0.0]], "velocities": [[0.0]]},
                                lr=1.0, step=0)
    assert ref_w == [[1.0]]


def test_laprop_by_name_and_in_a_spec() -> None:
    assert resolve_optimizer("laprop") == LaProp() and resolve_optimizer("LaProp") == LaProp()
    assert resolve_optimizer((LaProp, {"beta_2": 0.5})) == LaProp(beta_2=0.5)
    assert embcore.LaProp is LaProp
    with pytest.raises(ValueError, match=r"'lion'.*'ftrl' or 'laprop'"):
        resolve_optimizer("lion")


@st.composite
def laprops(draw: st.DrawFn) -> LaProp:
    """A LaProp with random hyper-parameters, common options and a float learning rate."""
    return LaProp(learning_rate=draw(st.floats(0.001, 1.0)),
                  beta_1=draw(st.sampled_from([0.0, 0.5, 0.9])),
                  beta_2=draw(st.sampled_from([0.0, 0.5, 0.95])),
                  epsilon=draw(st.sampled_from([1e-30, 1e-8, 0.1])), **draw(common_kwargs()))


@settings(max_examples=examples(25), deadline=None)
@given(laprops(), st.integers(1, 12), st.sampled_from([1, 3]), st.integers(1, 5),
       st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_engine_trains_laprop_as_the_reference(opt: LaProp, n: int, d: int, b: int, steps: int,
                                               seed: int) -> None:
    """ec.Embedding with LaProp, a few steps of jagged bags of two ids (combiner sum), against a
    hand-rolled model: the lookup as a sum of rows, each touched row's gradient summed over its
    occurrences, then the loop reference (ops/reference_optim.py) on the touched rows."""
    table = embcore.TableConfig(vocabulary_size=n, dim=d, combiner="sum", name="t",
                                dtype=torch.float64)
    emb = embcore.Embedding({"f": embcore.FeatureConfig(table=table)}, opt)
    w = emb.state_dict()["t/parameters"].clone()                      # (N, D)
    slots = {"momenta": torch.zeros(n, d, dtype=torch.float64),
             "velocities": torch.zeros(n, d, dtype=torch.float64)}
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, n, (b, 2), generator=gen)              # (B, 2)
        emb.enqueue({"f": torch.nested.nested_tensor_from_jagged(      # B bags of 2 ids
            ids.reshape(-1), torch.arange(b + 1) * 2)})
        acts = emb.dequeue()["f"]                                     # (B, D)
        torch.testing.assert_close(acts, w[ids].sum(dim=1), rtol=1e-12, atol=1e-12)
        grads = torch.randn(b, d, generator=gen, dtype=torch.float64)  # (B, D)
        emb.apply_gradients({"f": grads})
        summed = torch.zeros(n, d, dtype=torch.float64).index_add_(
            0, ids.reshape(-1), grads.repeat_interleave(2, dim=0))     # (N, D)
        rows = torch.unique(ids)                                      # (U,)
        new_w, new_s = reference_update(opt, w[rows], summed[rows],
                                        {k: v[rows] for k, v in slots.items()},
                                        lr=opt.current_learning_rate(), step=step)
        w[rows] = torch.tensor(new_w, dtype=torch.float64)
        for k in slots:
            slots[k][rows] = torch.tensor(new_s[k], dtype=torch.float64)
    state = emb.state_dict()
    torch.testing.assert_close(state["t/parameters"], w, rtol=1e-9, atol=1e-9)
    for k in slots:
        torch.testing.assert_close(state[f"t/{k}"], slots[k], rtol=1e-9, atol=1e-9)


# -- docstring examples -----------------------------------------------------------------------

def test_docstring_examples_run(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SGD", "Adagrad", "RowwiseAdagrad", "AdagradMomentum", "Adam", "FTRL", "LaProp"):
        if not hasattr(embcore, name):  # the package exports them; tolerate a partial checkout
            monkeypatch.setattr(embcore, name, getattr(eo, name), raising=False)
    result = doctest.testmod(eo, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 10 and result.failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cls", CLASSES)
def test_cuda_matches_cpu(cls: type) -> None:
    opt = cls(learning_rate=0.1, clipvalue=(-1.0, None), weight_decay_factor=0.01)
    gen = torch.Generator().manual_seed(2)
    params, grads = (torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    slots = opt.init_slots(5, 4, dtype=torch.float64)
    want_w, want_s = opt.update(params, grads, slots, lr=0.1, step=3)
    got_w, got_s = opt.update(params.cuda(), grads.cuda(), {k: v.cuda() for k, v in slots.items()},
                              lr=0.1, step=3)
    assert got_w.is_cuda
    torch.testing.assert_close(got_w.cpu(), want_w, rtol=1e-12, atol=1e-12)
    for k in want_s:
        torch.testing.assert_close(got_s[k].cpu(), want_s[k], rtol=1e-12, atol=1e-12)


def test_torch_optimizer_instance_is_translated_like_its_class():
    p = [torch.zeros(1, requires_grad=True)]
    assert resolve_optimizer(torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.5)) == \
        resolve_optimizer(functools.partial(torch.optim.Adagrad, lr=0.2,
                                            initial_accumulator_value=0.5))
    assert resolve_optimizer(torch.optim.SGD(p, lr=0.3)) == SGD(learning_rate=0.3)
    adam = resolve_optimizer(torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.9)))
    assert isinstance(adam, Adam) and (adam.beta_1, adam.beta_2) == (0.8, 0.9)
