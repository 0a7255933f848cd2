"""The in-place fast update against the pure optimizer math (Optimizer.update)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embcore as ec
from embcore.ops.update import apply_in_place, in_place_supported


@settings(max_examples=60, deadline=None)
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
