"""8-bit rows (float8_e4m3fn, float8_e5m2) in the fused CPU update (csrc/fp8.h, update.h): the
same codes, scales and slots, bit for bit, as the torch path's widening and quantization
(numerics/rounding.py ``widen``, ``Rounding.quantize``) around the fused kernel's float32 rule,
for every rule the kernel has and its options, to nearest and stochastically, with non-finite
values, whatever the threads. (The torch path's own float32 rule, ops/update.py
``update_torch``, may differ from the kernel's in a result's last bit, which a row's scale
shows: tests/test_fp8.py compares it within a code step.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import embcore as ec
from embcore.kernels import cpu
from embcore.numerics import rounding
from embcore.ops.bags import Bags
from embcore.ops.combine import TableCombine, combine_torch
from embcore.ops.update import TableUpdate, native_rule

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler for the kernels")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KINDS = {"sgd": ec.SGD, "adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _optimizer(kind: str, options: int):
    kw = {}
    if options & 1:
        kw["weight_decay_factor"] = 0.05
    if options & 2:
        kw["clipvalue"] = 0.7
    if options & 4:
        kw.update(clip_weight_min=-1.5, clip_weight_max=2.0)
    if options & 8:
        kw["gradient_multiplier"] = lambda step: 0.5 + step
    return KINDS[kind](learning_rate=0.3, **kw)


def _case(dtype, kind, options, seed, d, nonfinite):
    gen = torch.Generator().manual_seed(seed)
    opt = _optimizer(kind, options)
    n = 40
    x = torch.randn(n, d, generator=gen) * torch.rand(n, 1, generator=gen).exp2()
    x[3] = 0.0  # a row of zeros (scale 1)
    x[5, 0] = 1e-30  # subnormal quotients
    codes, scales = rounding.quantize(x, dtype)
    slots = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen) + 0.1
             for s in opt.slots}
    slots["accumulators" if "accumulators" in slots else "x"] = slots.get(
        "accumulators", torch.zeros(0))
    slots = {k: v for k, v in slots.items() if v.numel()}
    if "accumulators" in slots:
        slots["accumulators"][7] = 0.0  # a zero accumulator: no step where g is 0 too
    rows = torch.randperm(n, generator=gen)[:24]
    grad = torch.randn(24, d, generator=gen) * 3
    if nonfinite:
        grad[0, 0] = float("nan")
        grad[1, 1 % d] = float("inf")
        grad[2, 0] = -float("inf")
        codes.view(torch.uint8)[int(rows[3]), 0] = 0xFF  # a NaN code (negative)
        codes.view(torch.uint8)[int(rows[4]), 0] = 0x7F  # (e5m2: NaN; e4m3fn: NaN)
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 7, n)
    return opt, codes, scales, slots, rows, grad, seg


def _run(fused, dtype, opt, codes, scales, slots, rows, grad, r, step):
    table, sc = codes.clone(), scales.clone()
    st_ = {k: v.clone() for k, v in slots.items()}
    st_["scales"] = sc
    if fused:
        assert native_rule(opt, table) is not None
        TableUpdate(table, st_, opt)(rows, grad, 0.3, step, round_to=r)
        return table, st_
    # the oracle: the rows widened in torch, the fused float32 rule, quantized in torch
    wide = rounding.widen(table, sc)
    del st_["scales"]
    TableUpdate(wide, st_, opt)(rows, grad, 0.3, step)
    new_codes, new_scales = r.quantize(wide[rows], rows, dtype)
    table.view(torch.uint8)[rows] = new_codes.view(torch.uint8)
    sc[rows] = new_scales
    st_["scales"] = sc
    return table, st_


def _same(a, b):
    ta, sa = a
    tb, sb = b
    assert torch.equal(_bytes(ta), _bytes(tb))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(_bytes(sa[k]), _bytes(sb[k])), k


@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(FP8), st.sampled_from(sorted(KINDS)), st.integers(0, 15), st.booleans(),
       st.sampled_from([1, 5, 8, 33, 64]), st.booleans(), st.integers(0, 2**31 - 1))
def test_the_fused_8_bit_update_is_the_torch_path_bit_for_bit(dtype, kind, options, stochastic,
                                                              d, nonfinite, seed):
    opt, codes, scales, slots, rows, grad, seg = _case(dtype, kind, options, seed, d, nonfinite)
    r = rounding.Rounding(stochastic, seg).at(5)
    fused = _run(True, dtype, opt, codes, scales, slots, rows, grad, r, 1)
    torch_ = _run(False, dtype, opt, codes, scales, slots, rows, grad, r, 1)
    _same(fused, torch_)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("stochastic", [True, False])
def test_the_fused_8_bit_update_is_the_same_whatever_the_threads(dtype, stochastic):
    opt, codes, scales, slots, rows, grad, seg = _case(dtype, "adagrad", 1, 3, 64, True)
    rows = torch.arange(40)
    grad = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    r = rounding.Rounding(stochastic, seg).at(2)
    old = torch.get_num_threads()
    got = []
    try:
        for nt in (1, 2, 4):
            torch.set_num_threads(nt)
            got.append(_run(True, dtype, opt, codes, scales, slots, rows, grad, r, 0))
    finally:
        torch.set_num_threads(old)
    _same(got[0], got[1])
    _same(got[0], got[2])
    _same(got[0], _run(False, dtype, opt, codes, scales, slots, rows, grad, r, 0))


@pytest.mark.parametrize("dtype", FP8)
def test_an_8_bit_table_takes_the_fused_update_and_its_scales(dtype):
    codes, _ = rounding.quantize(torch.randn(4, 8), dtype)
    assert native_rule(ec.SGD(learning_rate=0.1), codes) is not None
    with pytest.raises(ValueError, match="row_scales"):
        cpu.SparseUpdate(cpu.SGD, codes, None)
    with pytest.raises(ValueError, match="row_scales"):
        cpu.SparseUpdate(cpu.SGD, torch.zeros(4, 8), None, torch.ones(4, 1))


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(FP8), st.sampled_from([1, 5, 8, 24, 128]), st.sampled_from(["one", "sum",
       "weighted"]), st.booleans(), st.integers(0, 2**31 - 1))
def test_the_fused_8_bit_lookup_is_the_torch_path_bit_for_bit(dtype, d, bags_kind, nonfinite,
                                                              seed):
    gen = torch.Generator().manual_seed(seed)
    n = 30
    codes, scales = rounding.quantize(torch.randn(n, d, generator=gen) * 5, dtype)
    scales.mul_(torch.rand(n, 1, generator=gen) * 1e3)
    if nonfinite:
        codes.view(torch.uint8)[2, 0] = 0xFF  # NaN
        scales[4] = float("inf")
    nnz = 50
    index = torch.randint(0, n, (nnz,), generator=gen)
    if bags_kind == "one":
        bags = Bags(index, None, None)
    else:
        cuts = torch.randint(0, nnz + 1, (9,), generator=gen).sort().values
        offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([nnz])])
        weights = (torch.randn(nnz, generator=gen) if bags_kind == "weighted"
                   else torch.ones(nnz))
        bags = Bags(index, offsets, weights)
    combined = TableCombine(codes, scales=scales)
    assert combined._fused is not None
    got = combined(index, bags)
    want = combine_torch(codes, index, bags, scales)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
