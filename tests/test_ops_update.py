"""The update entry point (ops/update.py) on its torch-ops paths against the optimizers' math and
the loop reference (ops/reference_optim.py)."""

from __future__ import annotations

import torch
from checks import check_rows_updated
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples
from strategies import any_optimizer, common_options, occurrences, rounded
from switches import kernels

import embcore as ec
from embcore.kernels import gpu
from embcore.ops.combine import OutputGrads
from embcore.ops.update import apply_in_place, in_place_supported, native_rule, update


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(["sgd", "adagrad", "rowwise"]), st.integers(1, 30), st.integers(1, 6),
       st.floats(0.001, 1.0), st.sampled_from([torch.float32, torch.float64]),
       st.integers(0, 2**31 - 1))
def test_in_place_update_equals_pure_update(kind, n, d, lr, dtype, seed):
    opt = {"sgd": ec.SGD(learning_rate=lr), "adagrad": ec.Adagrad(learning_rate=lr),
           "rowwise": ec.RowwiseAdagrad(learning_rate=lr)}[kind]
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen, dtype=dtype)
    slots = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen, dtype=dtype) + 0.05
             for s in opt.slots}
    rows = torch.randperm(n, generator=gen)[:max(1, n // 2)]
    grad = torch.randn(len(rows), d, generator=gen, dtype=dtype)
    want_w, want_s = opt.update(table[rows], grad, {k: v[rows] for k, v in slots.items()},
                                lr=lr, step=0)
    assert in_place_supported(opt, table)
    before = table.clone()
    apply_in_place(opt, table, slots, rows, grad, lr)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(table[rows], want_w, **tol)
    for k, v in want_s.items():
        torch.testing.assert_close(slots[k][rows], v.to(dtype), **tol)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(table[untouched], before[untouched])


def test_options_fall_back_to_the_pure_path():
    w = torch.zeros(2, 2)
    assert not in_place_supported(ec.Adagrad(learning_rate=0.1, clipvalue=1.0), w)
    assert not in_place_supported(ec.Adagrad(learning_rate=0.1, initial_accumulator_value=0.0), w)
    assert not in_place_supported(ec.Adam(learning_rate=0.1), w)
    assert not in_place_supported(ec.SGD(learning_rate=0.1), w.half())


# --------------------------------------------------------------------------------------------
# The update entry point on its torch-ops paths (fused kernels off) against the loop reference,
# every optimizer with random options: the same sweep as the fused kernel's (test_native.py).

def _gradient(gen, n, d, dtype, source, unit):
    """``(rows, grad, row_grads)``: distinct rows and their gradient, summed per row
    (``source`` "summed") or as output rows' gradients (``OutputGrads``), with the float64 sums
    the reference takes."""
    if source == "summed":
        rows = torch.randperm(n, generator=gen)[:int(torch.randint(0, n + 1, (1,), generator=gen))]
        row_grads = torch.randn(len(rows), d, generator=gen, dtype=torch.float64)
        return rows, row_grads.to(dtype), row_grads
    grad, row_grads, _ = occurrences(gen, n, d, int(torch.randint(0, 3 * n, (1,), generator=gen)),
                                     unit)
    grad = OutputGrads([p.to(dtype) for p in grad.parts], grad.starts, grad.bags, grad.dedup)
    return grad.dedup.unique, grad, row_grads


@settings(max_examples=examples(120), deadline=None)
@given(any_optimizer(), st.integers(1, 20), st.sampled_from([1, 3, 8]),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from(["summed", "outputs"]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_update_entry_point_torch_ops_equals_reference(opt_case, n, d, dtype, source, unit,
                                                       seed):
    opt, lr, step = opt_case
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen, dtype=dtype)
    slots = {s.name: (torch.full((n, 1 if s.rowwise else d), s.initial_value, dtype=dtype)
                      + (torch.rand(n, 1 if s.rowwise else d, generator=gen, dtype=dtype)
                         if s.name in ("accumulators", "velocities") else 0.0))
             for s in opt.slots}
    rows, grad, row_grads = _gradient(gen, n, d, dtype, source, unit)
    new_table, new_slots = table.clone(), {k: v.clone() for k, v in slots.items()}
    with kernels(False):
        update(new_table, new_slots, rows, grad, opt, lr, step)
    touched = rows
    if opt.updates_every_row:  # every row moves; untouched ones with a zero gradient
        full = torch.zeros(n, d, dtype=torch.float64)
        full[rows] = row_grads
        touched, row_grads = torch.arange(n), full
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9,
                                                                        "atol": 1e-9}
    check_rows_updated(opt, lr, step, table, slots, touched, row_grads, new_table, new_slots, tol)


# --------------------------------------------------------------------------------------------
# LaProp: no kernel runs it (its record names none), so the entry point takes the optimizer's own
# math, with the kernels on; against the loop reference, every common option drawn at random.

@st.composite
def laprop_cases(draw):
    """(LaProp with random hyper-parameters and options, lr, step)."""
    lr = rounded(draw, 0.01, 1.0)
    opt = ec.LaProp(learning_rate=lr, beta_1=rounded(draw, 0.0, 0.95),
                    beta_2=rounded(draw, 0.0, 0.99),
                    epsilon=draw(st.sampled_from([1e-30, 1e-8, 1e-3, 0.5])), **common_options(draw))
    return opt, lr, draw(st.integers(0, 5))


def test_laprop_takes_the_pure_path():
    opt = ec.LaProp(learning_rate=0.1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        table = torch.zeros(3, 2, dtype=dtype)
        assert native_rule(opt, table) is None and not in_place_supported(opt, table)
    assert gpu.update_rule(opt) is None


@settings(max_examples=examples(60), deadline=None)
@given(laprop_cases(), st.integers(1, 20), st.sampled_from([1, 3, 8]),
       st.sampled_from([torch.float32, torch.float64]), st.sampled_from(["summed", "outputs"]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_update_entry_point_laprop_equals_reference(opt_case, n, d, dtype, source, unit, seed):
    opt, lr, step = opt_case
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen, dtype=dtype)
    slots = {"momenta": torch.randn(n, d, generator=gen, dtype=dtype),
             "velocities": torch.rand(n, d, generator=gen, dtype=dtype)}
    rows, grad, row_grads = _gradient(gen, n, d, dtype, source, unit)
    new_table, new_slots = table.clone(), {k: v.clone() for k, v in slots.items()}
    update(new_table, new_slots, rows, grad, opt, lr, step)
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9,
                                                                        "atol": 1e-9}
    check_rows_updated(opt, lr, step, table, slots, rows, row_grads, new_table, new_slots, tol)
