"""A rejected ``apply_gradients`` changes nothing, and the opt-in skip of non-finite gradients.

docs/semantics.md sections 3 and 8: every gradient is checked (kind, layout, dtype, device,
shape) and every optimizer's learning rate and gradient multiplier evaluated before the first
table is written, so a bad gradient or multiplier on any physical table raises with every table,
slot and the step as they were; the batch still awaits its gradients and a retry applies exactly
once. ``skip_nonfinite_gradients=True`` skips an optimizer's step when a gradient holds NaN / inf.

Each case runs with the fused CPU kernels on and off (torch ops in place, or the optimizer's math)
and with SGD, Adagrad, RowwiseAdagrad and Adam.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from switches import kernels

import embcore as ec

OPTIMIZERS = {
    "sgd": lambda **kw: ec.SGD(learning_rate=0.1, **kw),
    "adagrad": lambda **kw: ec.Adagrad(learning_rate=0.1, **kw),
    "rowwise": lambda **kw: ec.RowwiseAdagrad(learning_rate=0.1, **kw),
    "adam": lambda **kw: ec.Adam(learning_rate=0.1, **kw),
}
DIMS = {"a": 4, "b": 3}           # different dims: two physical tables, "a" first
FEATURE = {"a": "fa", "b": "fb"}
BATCH = {"fa": torch.tensor([1, 2, 2, 7]), "fb": torch.tensor([3, 5, 3, 0])}




class Multiplier:
    """A gradient multiplier that counts its calls and can be made to misbehave."""

    def __init__(self) -> None:
        self.calls = 0
        self.bad = None   # None, or step -> what to return (or raise)

    def __call__(self, step: int):
        self.calls += 1
        return 0.5 + 0.25 * step if self.bad is None else self.bad(step)


def make(kind: str, *, b_kw=None, **kw) -> ec.Embedding:
    """Tables "a" (the engine's optimizer, ``kw``) and "b" (its own, ``b_kw``), fixed seed."""
    torch.manual_seed(0)
    a = ec.TableConfig(vocabulary_size=10, dim=DIMS["a"], combiner="sum", name="a")
    b = ec.TableConfig(vocabulary_size=12, dim=DIMS["b"], combiner="mean", name="b",
                       optimizer=None if b_kw is None else OPTIMIZERS[kind](**b_kw))
    emb = ec.Embedding({"fa": ec.FeatureConfig(table=a), "fb": ec.FeatureConfig(table=b)},
                       OPTIMIZERS[kind](**kw))
    assert (emb.plan.table("a").physical, emb.plan.table("b").physical) == (0, 1)
    return emb


def good_grads(step: int) -> dict[str, torch.Tensor]:
    return {f"f{t}": torch.linspace(-1.0, 1.0 + step, 4 * d).reshape(4, d) * (1 + step)
            for t, d in DIMS.items()}


def step(emb: ec.Embedding, n: int, grads=None) -> None:
    emb.enqueue(BATCH)
    emb.dequeue()
    emb.apply_gradients(good_grads(n) if grads is None else grads)


def snapshot(emb: ec.Embedding) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in emb.state_dict().items()}


def assert_same(got: dict, want: dict, skip=()) -> None:
    assert set(got) == set(want)
    for k in want:
        if k not in skip:
            assert torch.equal(got[k], want[k]), k


def check_rejected_then_retry(emb: ec.Embedding, reference: ec.Embedding, bad: dict,
                              error: type[BaseException], match: str):
    """Step 0 good; step 1 ``bad`` raises ``error`` changing nothing; the retry with good
    gradients gives exactly ``reference``'s two good steps."""
    step(emb, 0)
    emb.enqueue(BATCH)
    emb.dequeue()
    before = snapshot(emb)
    with pytest.raises(error, match=match) as info:
        emb.apply_gradients(bad)
    assert_same(snapshot(emb), before)
    assert emb.step == 1
    with pytest.raises(RuntimeError):  # the batch still awaits its gradients
        emb.dequeue()
    emb.apply_gradients(good_grads(1))  # the retry
    assert emb.step == 2
    step(reference, 0)
    step(reference, 1)
    assert_same(snapshot(emb), snapshot(reference))
    return info


# ------------------------------------------------------------------------------ bad gradients
def _nested(g: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor(list(g), layout=torch.jagged)  # (4, j) rows of D


BAD_GRADIENTS = {  # name: (make the bad gradient from a good one, error, words in the message)
    "sparse_coo": (lambda g: g.to_sparse(), TypeError, "sparse_coo"),
    "nested_jagged": (_nested, TypeError, "nested"),
    "meta": (lambda g: torch.empty(g.shape, device="meta"), ValueError, "meta device"),
    "int64": (lambda g: g.long(), TypeError, "int64"),
    "bool": (lambda g: g > 0, TypeError, "bool"),
    "complex64": (lambda g: g.to(torch.complex64), TypeError, "complex64"),
    "wrong_shape": (lambda g: torch.ones(g.shape[0], g.shape[1] + 1), ValueError, "shape"),
    "non_tensor": (lambda g: g.tolist(), TypeError, "must be a tensor"),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("table", ["b", "a"], ids=["second", "first"])
@pytest.mark.parametrize("bad", sorted(BAD_GRADIENTS))
def test_bad_gradient_changes_nothing_and_the_retry_applies_once(bad, table, kind, fused):
    make_bad, error, words = BAD_GRADIENTS[bad]
    grads = good_grads(1)
    feature = FEATURE[table]
    grads[feature] = make_bad(grads[feature])
    with kernels(fused):
        check_rejected_then_retry(make(kind), make(kind), grads, error,
                                  rf"(?s)feature '{feature}'.*{words}")


def test_cuda_gradients_still_reach_a_cpu_engine():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    emb, reference = make("adagrad"), make("adagrad")
    step(emb, 0, {k: v.cuda() for k, v in good_grads(0).items()})
    step(reference, 0)
    assert_same(snapshot(emb), snapshot(reference))


def test_low_precision_gradients_are_accepted():
    emb, reference = make("adagrad"), make("adagrad")
    grads = {k: v.to(torch.bfloat16) for k, v in good_grads(0).items()}
    step(emb, 0, grads)
    step(reference, 0, {k: v.float() for k, v in grads.items()})
    assert_same(snapshot(emb), snapshot(reference))


# ------------------------------------------------------------------------ gradient multipliers
def _raises(step: int):
    raise ZeroDivisionError("multiplier blew up")


BAD_MULTIPLIERS = {  # name: (bad(step), error, words in the message)
    "raises": (_raises, ZeroDivisionError, "multiplier blew up"),
    "string": (lambda step: "x", TypeError, "real number"),
    "bool": (lambda step: True, TypeError, "real number"),
    "nan": (lambda step: math.nan, ValueError, "finite"),
    "inf": (lambda step: torch.tensor(math.inf), ValueError, "finite"),
    "two_elements": (lambda step: torch.tensor([1.0, 2.0]), TypeError, "real number"),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad", sorted(BAD_MULTIPLIERS))
def test_bad_multiplier_on_the_second_table_changes_nothing(bad, kind, fused):
    fn, error, words = BAD_MULTIPLIERS[bad]
    mult, ref_mult = Multiplier(), Multiplier()
    emb = make(kind, b_kw=dict(gradient_multiplier=mult))
    reference = make(kind, b_kw=dict(gradient_multiplier=ref_mult))
    name = type(emb.plan.physical[1].optimizer).__name__
    with kernels(fused):
        step(emb, 0)
        mult.bad = fn
        emb.enqueue(BATCH)
        emb.dequeue()
        before = snapshot(emb)
        with pytest.raises(error, match=words) as info:
            emb.apply_gradients(good_grads(1))
        assert_same(snapshot(emb), before)
        assert emb.step == 1
        mult.bad = None
        emb.apply_gradients(good_grads(1))  # the retry
        step(reference, 0)
        step(reference, 1)
    assert_same(snapshot(emb), snapshot(reference))
    text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert name in text and "step 1" in text


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_multiplier_called_once_per_step_and_its_value_used(kind, fused):
    """One optimizer object over two physical tables: one call per step, and the same updates
    as a constant multiplier of that value."""
    mult = Multiplier()
    with kernels(fused):  # (the backend is chosen when the engine is made: made inside)
        emb = make(kind, gradient_multiplier=mult)
        for n in range(3):
            step(emb, n)
            assert mult.calls == n + 1
        # the same steps with a fresh multiplier per step that returns the value at that step
        values = iter([0.5, 0.75, 1.0])
        reference = make(kind, gradient_multiplier=lambda s: next(values))
        for n in range(3):
            step(reference, n)
    assert_same(snapshot(emb), snapshot(reference))


def test_update_uses_a_given_multiplier_instead_of_calling_it():
    opt = ec.Adagrad(learning_rate=0.1, gradient_multiplier=_raises)
    params, grads = torch.ones(2, 3), torch.full((2, 3), 2.0)
    with pytest.raises(ZeroDivisionError) as info:
        opt.update(params, grads, opt.init_slots(2, 3), lr=0.1, step=4)  # default: calls it
    assert any("Adagrad" in n and "step 4" in n for n in info.value.__notes__)
    w, s = opt.update(params, grads, opt.init_slots(2, 3), lr=0.1, step=4,
                      gradient_multiplier=0.5)
    plain = ec.Adagrad(learning_rate=0.1)
    want_w, want_s = plain.update(params, grads * 0.5, plain.init_slots(2, 3), lr=0.1, step=4)
    assert torch.equal(w, want_w) and torch.equal(s["accumulators"], want_s["accumulators"])
    with pytest.raises(ValueError, match="finite"):
        opt.update(params, grads, opt.init_slots(2, 3), lr=0.1, step=0,
                   gradient_multiplier=math.inf)


def test_current_gradient_multiplier():
    assert ec.SGD().current_gradient_multiplier(3) is None
    assert ec.SGD(gradient_multiplier=lambda s: s / 2).current_gradient_multiplier(3) == 1.5
    one = ec.SGD(gradient_multiplier=lambda s: torch.tensor([2.0]))
    assert one.current_gradient_multiplier(0) == 2.0
    with pytest.raises(TypeError, match=r"SGD: gradient_multiplier .* returned 'x' at step 0"):
        ec.SGD(gradient_multiplier=lambda s: "x").current_gradient_multiplier(0)


# ----------------------------------------------------------------- skip_nonfinite_gradients
def _poisoned(feature: str, value: float, n: int = 1) -> dict[str, torch.Tensor]:
    grads = good_grads(n)
    grads[feature][2, 1] = value
    return grads


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("feature", ["fb", "fa"])
def test_skip_nonfinite_skips_the_step_and_warns(feature, value, kind, fused):
    emb = make(kind, skip_nonfinite_gradients=True)
    reference = make(kind, skip_nonfinite_gradients=True)
    with kernels(fused):
        step(emb, 0)
        emb.enqueue(BATCH)
        emb.dequeue()
        before = snapshot(emb)
        with pytest.warns(RuntimeWarning, match=rf"features \['{feature}'\].*tables \['a', 'b'\]"):
            emb.apply_gradients(_poisoned(feature, value))
        assert_same(snapshot(emb), before, skip={"step"})
        assert emb.step == 2          # the call counts as a step; the batch is consumed
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step(emb, 2)              # the next batch goes through
        step(reference, 0)
        step(reference, 2)
    assert_same(snapshot(emb), snapshot(reference), skip={"step"})


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_skip_is_per_optimizer(kind, fused):
    """Only the tables of the optimizer that skips stay; another optimizer's tables update (and
    get the NaN, as TF does, when its option is off)."""
    emb = make(kind, b_kw=dict(skip_nonfinite_gradients=True))
    reference = make(kind, b_kw=dict(skip_nonfinite_gradients=True))
    with kernels(fused):
        step(emb, 0)
        before = snapshot(emb)
        with pytest.warns(RuntimeWarning, match=r"features \['fb'\].*tables \['b'\]"):
            step(emb, 1, _poisoned("fb", math.nan))
        after = snapshot(emb)
        step(reference, 0)
        step(reference, 1)
        want = snapshot(reference)
        for k in after:
            if k.startswith("b/"):
                assert torch.equal(after[k], before[k]), k      # skipped
            elif k.startswith("a/"):
                assert torch.equal(after[k], want[k]), k        # updated as usual
        with warnings.catch_warnings():
            warnings.simplefilter("error")                      # no skip, no warning
            step(emb, 2, _poisoned("fa", math.nan, 2))
    assert nan_in(emb, "a")


def nan_in(emb: ec.Embedding, name: str) -> bool:
    """Whether a NaN reached table ``name``'s parameters or slots (where depends on the rule:
    Adagrad's guard leaves the row and poisons the accumulator)."""
    return any(bool(v.isnan().any()) for k, v in emb.state_dict().items()
               if k.startswith(name + "/"))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_nonfinite_gradients_are_applied_by_default(kind, fused):
    emb = make(kind)
    with kernels(fused), warnings.catch_warnings():
        warnings.simplefilter("error")
        step(emb, 0, _poisoned("fb", math.nan, 0))
    assert nan_in(emb, "b") and not nan_in(emb, "a")
    assert emb.step == 1


def test_float64_gradient_overflowing_a_float32_table_is_skipped():
    emb = make("adagrad", skip_nonfinite_gradients=True)
    before = snapshot(emb)
    grads = {k: v.double() for k, v in good_grads(0).items()}
    grads["fa"][0, 0] = 1e300  # finite in float64, inf in the table's float32
    with pytest.warns(RuntimeWarning, match=r"\['fa'\]"):
        step(emb, 0, grads)
    assert_same(snapshot(emb), before, skip={"step"})


def test_skip_nonfinite_gradients_is_a_checked_bool():
    with pytest.raises(TypeError, match="skip_nonfinite_gradients must be a bool"):
        ec.Adagrad(skip_nonfinite_gradients=1)
    opt = ec.Adagrad(skip_nonfinite_gradients=True)
    assert "skip_nonfinite_gradients=True" in repr(opt)
    assert "skip_nonfinite_gradients" not in repr(ec.Adagrad())
    assert opt != ec.Adagrad()  # different math: never stacked together


# ------------------------------------------------------------------------------ W = 2 (gloo)
def _skip_worker(rank, world, init):
    import torch.distributed as dist  # noqa: F401 - the group is joined by init()
    init()
    torch.manual_seed(0)
    a = ec.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="a")
    b = ec.TableConfig(vocabulary_size=12, dim=3, combiner="mean", name="b")
    emb = ec.Embedding({"fa": ec.FeatureConfig(table=a), "fb": ec.FeatureConfig(table=b)},
                       ec.Adagrad(learning_rate=0.1, skip_nonfinite_gradients=True),
                       sharding={"a": "row_mod", "b": "replicated"}, timeout=60)

    def state():
        return {k: v.clone() for k, v in emb.embedding_tables.items()}

    step(emb, 0)
    before = state()
    grads = _poisoned("fb", math.nan) if rank == 1 else good_grads(1)  # NaN on rank 1 only
    words = r"features \['fb'\]" if rank == 1 else "another process"
    with pytest.warns(RuntimeWarning, match=words):
        step(emb, 1, grads)  # every process skips, so the collectives stay matched
    after = state()
    assert all(torch.equal(after[t], before[t]) for t in before)
    assert emb.step == 2
    step(emb, 2)  # and the next step goes through
    assert not all(torch.equal(state()[t], before[t]) for t in before)


@pytest.mark.slow
def test_skip_nonfinite_is_agreed_by_every_process():
    from distributed import run_on
    run_on(2, _skip_worker)


@pytest.mark.parametrize("rowwise", [False, True], ids=["adagrad", "rowwise_adagrad"])
def test_a_nan_gradient_lands_in_the_same_places_on_every_path(rowwise):
    """Without skip_nonfinite_gradients a NaN gradient propagates, the same way whichever kernel
    applies it: the fused kernels, the torch ops in place, the optimizer's own math (an option
    forces it): Adagrad the element's weight and accumulator, RowwiseAdagrad the row's weights
    and accumulator; nothing else."""
    from embcore.kernels import cpu
    found = []
    for kernels, option in ((True, {}), (False, {}), (False, {"clipvalue": 1e9})):
        torch.manual_seed(0)
        t = ec.TableConfig(vocabulary_size=4, dim=3, name="t", combiner="sum")
        cls = ec.RowwiseAdagrad if rowwise else ec.Adagrad
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, cls(learning_rate=0.1, **option))
        before = cpu.set_enabled(kernels)
        try:
            emb.enqueue({"f": torch.tensor([1, 2])})
            act = emb.dequeue()["f"]
            g = torch.ones_like(act)
            g[0, 1] = float("nan")
            emb.apply_gradients({"f": g})
        finally:
            cpu.set_enabled(before)
        state = emb.state_dict()
        found.append((state["t/parameters"].isnan(), state["t/accumulators"].isnan()))
    want_w = torch.zeros(4, 3, dtype=torch.bool)
    want_w[1] = True if rowwise else torch.tensor([False, True, False])
    want_a = torch.zeros(4, 1 if rowwise else 3, dtype=torch.bool)
    want_a[1, 0 if rowwise else 1] = True
    for w, a in found:
        assert torch.equal(w, want_w) and torch.equal(a, want_a)
