"""The Triton kernels (kernels/gpu/launch.py, kernels/gpu/rows.py) against the loop references.

On a machine with a CUDA GPU the kernels run compiled, on CUDA tensors. Without one, they run in
Triton's interpreter on CPU tensors: this file sets ``TRITON_INTERPRET=1`` itself before it imports
triton (triton reads it when it decorates a kernel and at run time, so it stays set) and forces
the choice points onto CPU tensors (``gpu.force_on_cpu``); tests/test_triton.py runs it in a fresh
interpreter. Skipped when triton is not
installed. The interpreter is slow: small shapes, few examples.

Tolerance: float32 kernels against float64 references, ``rtol=1e-4, atol=1e-5`` for the update
(as tests/test_ops_update.py) and ``rtol=1e-5, atol=1e-5`` for the sums. They are not compared
bitwise with the CPU fused kernel: it is compiled with ``-march=native`` and may fuse multiply-adds
(``w - lr * g`` as one rounding), which the interpreter (numpy) does not.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without a GPU the kernels run in Triton's interpreter, which triton chooses when it decorates a
# kernel, its own library's included (tl.zeros, tl.sum, ...), and checks again at run time:
# TRITON_INTERPRET=1 must be set before triton is first imported, and stay set (triton does not
# support switching it). No other test uses triton.
_TRITON_IMPORTED = "triton" in sys.modules
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from checks import check_rows_updated  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from profiles import examples  # noqa: E402
from strategies import any_optimizer, jagged, occurrences  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.inputs.canonical import canonicalize  # noqa: E402
from embcore.kernels import gpu  # noqa: E402
from embcore.ops.backend import TRITON  # noqa: E402
from embcore.ops.bags import Bags, dedup  # noqa: E402
from embcore.ops.combine import combine, combine_backward, combine_torch  # noqa: E402
from embcore.ops.reference import reference_lookup, reference_row_gradients  # noqa: E402
from embcore.ops.update import update, update_torch  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")


def _load_kernels() -> str | None:
    """Loads the kernels (interpreted without a GPU); returns why they cannot run, or None."""
    if CUDA:
        return None if gpu.available() else f"triton does not load: {gpu.error()}"
    loaded = gpu.available()
    if not loaded:
        return f"triton does not load: {gpu.error()}"
    if not gpu.interpreted():
        return ("no CUDA GPU, and triton or the kernels were loaded before this file set "
                "TRITON_INTERPRET=1: run it alone, or with TRITON_INTERPRET=1 set")
    return None


_why = _load_kernels()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)

SUM_TOL = {"rtol": 1e-5, "atol": 1e-5}
UPDATE_TOL = {"rtol": 1e-4, "atol": 1e-5}


@contextlib.contextmanager
def triton_path(enabled: bool = True) -> Iterator[None]:
    """The choice points take the Triton kernels for the block (CPU tensors: interpreted)."""
    previous = gpu.force_on_cpu(enabled and not CUDA)
    try:
        yield
    finally:
        gpu.force_on_cpu(previous)


@contextlib.contextmanager
def spy(*names: str) -> Iterator[dict[str, int]]:
    """Counts the calls of ``gpu.<name>`` for each name, in the block."""
    calls = dict.fromkeys(names, 0)
    real = {name: getattr(gpu, name) for name in names}

    def wrap(name):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)
        return wrapper

    for name in names:
        setattr(gpu, name, wrap(name))
    try:
        yield calls
    finally:
        for name in names:
            setattr(gpu, name, real[name])


# -- lookup and its gradient -----------------------------------------------------------------

@st.composite
def lookup_cases(draw):
    n = draw(st.integers(1, 30))
    d = draw(st.integers(1, 40))
    combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    dense = draw(st.booleans())
    batch = draw(st.integers(1, 8))
    if dense:  # one id per row: the unit lookup
        ids = torch.tensor(draw(st.lists(st.integers(0, n - 1), min_size=batch,
                                         max_size=batch)))
        weights = None
    else:  # bags, some empty, repeated ids
        rows = draw(st.lists(st.lists(st.integers(0, n - 1), max_size=5), min_size=batch,
                             max_size=batch))
        ids = jagged(rows, torch.int64)
        weights = None
        if draw(st.booleans()):
            weights = jagged([[draw(st.floats(-2, 2).map(lambda x: round(x, 3))) for _ in r]
                              for r in rows], torch.float32)
    return n, d, combiner, ids, weights, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=examples(25), deadline=None)
@given(lookup_cases())
def test_lookup_and_row_gradients_equal_reference(case):
    n, d, combiner, ids, weights, seed = case
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen)
    feature = ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=n, dim=d,
                                                    combiner=combiner, name="t"))
    bags = canonicalize(feature, "f", "t", ids, weights, DEVICE, TRITON)
    with triton_path(), spy("lookup", "row_gradients") as calls:
        out = combine(table.to(DEVICE), bags.ids, bags).cpu()  # (R, D)
    want = reference_lookup(table, feature, ids, weights)
    torch.testing.assert_close(out.double().reshape(want.shape), want, **SUM_TOL)
    if bags.unit:  # a plain copy
        assert torch.equal(out, table[bags.ids.cpu()])

    grad = torch.randn(out.shape, generator=gen)  # (R, D)
    dd = dedup(bags.ids)
    with triton_path(), spy("lookup", "row_gradients") as more:
        got = combine_backward(grad.to(DEVICE), bags, dd).cpu()  # (U, D)
    expected = reference_row_gradients(feature, ids, weights, grad.reshape(want.shape))
    assert sorted(expected) == dd.unique.cpu().tolist()
    for u, row in enumerate(dd.unique.cpu().tolist()):
        torch.testing.assert_close(got[u].double(), torch.tensor(expected[row],
                                                                 dtype=torch.float64), **SUM_TOL)
    assert calls == {"lookup": 1, "row_gradients": 0}  # the kernels ran, not the fallbacks
    assert more == {"lookup": 0, "row_gradients": 1}


def test_lookup_of_wide_rows_is_tiled_over_columns():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(6, 300, generator=gen)  # D > 256: two column blocks, the last masked
    ids = torch.tensor([0, 5, 5, 2, 1])
    bags = Bags(ids, torch.tensor([0, 2, 2, 5]), torch.tensor([0.5, -1.0, 2.0, 1.0, 0.25]))
    with triton_path():
        out = combine(table.to(DEVICE), ids.to(DEVICE), Bags(
            ids.to(DEVICE), bags.offsets.to(DEVICE), bags.scales.to(DEVICE))).cpu()
    want = torch.stack([0.5 * table[0] - table[5], torch.zeros(300),
                        2.0 * table[5] + table[2] + 0.25 * table[1]])
    torch.testing.assert_close(out, want, **SUM_TOL)


# -- the fused backward + update ---------------------------------------------------------------

@settings(max_examples=examples(30), deadline=None)
@given(any_optimizer(dense_adam=False), st.integers(1, 20), st.integers(1, 40),
       st.sampled_from(["summed", "outputs"]), st.booleans(), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_update_equals_reference(opt_case, n, d, source, unit, scaled, seed):
    opt, lr, step = opt_case
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen)
    slots = {s.name: (torch.full((n, 1 if s.rowwise else d), s.initial_value)
                      + (torch.rand(n, 1 if s.rowwise else d, generator=gen)
                         if s.name in ("accumulators", "velocities")
                         and not getattr(opt, "allow_zero_accumulator", False) else 0.0))
             for s in opt.slots}
    if source == "summed":
        rows = torch.randperm(n, generator=gen)[:int(torch.randint(0, n + 1, (1,), generator=gen))]
        row_grads = torch.randn(len(rows), d, generator=gen, dtype=torch.float64)
        grad = row_grads.float().to(DEVICE)
        row_grads = grad.cpu().double()  # what the kernel reads
        dev_rows = rows.to(DEVICE)
    else:
        grad, row_grads, rows = occurrences(gen, n, d, int(torch.randint(0, 3 * n, (1,),
                                                                         generator=gen)),
                                            unit, scaled, DEVICE)
        dev_rows = grad.dedup.unique
    new_table = table.to(DEVICE, copy=True)
    new_slots = {k: v.to(DEVICE, copy=True) for k, v in slots.items()}
    with triton_path(), spy("sparse_update") as calls:
        update(new_table, new_slots, dev_rows, grad, opt, lr, step)
    assert calls["sparse_update"] == 1  # the kernel ran, not a fallback
    new_table = new_table.cpu()
    new_slots = {k: v.cpu() for k, v in new_slots.items()}
    check_rows_updated(opt, lr, step, table, slots, rows, row_grads, new_table, new_slots,
                       UPDATE_TOL)


def test_update_of_wide_rows_and_many_rows():
    """D = 130 (a 256-column block, masked) and more rows than one program's tile."""
    gen = torch.Generator().manual_seed(1)
    n, d = 40, 130
    opt = ec.RowwiseAdagrad(learning_rate=0.3, clipvalue=0.5, weight_decay_factor=0.1)
    table = torch.randn(n, d, generator=gen)
    slots = {"accumulators": torch.rand(n, 1, generator=gen) + 0.1}
    grad, row_grads, rows = occurrences(gen, n, d, 90, False, True, DEVICE)
    new_table = table.to(DEVICE, copy=True)
    new_slots = {k: v.to(DEVICE, copy=True) for k, v in slots.items()}
    with triton_path():
        update(new_table, new_slots, grad.dedup.unique, grad, opt, 0.3, 0)
    check_rows_updated(opt, 0.3, 0, table, slots, rows, row_grads, new_table.cpu(),
                       {k: v.cpu() for k, v in new_slots.items()}, UPDATE_TOL)


# -- the choice points -------------------------------------------------------------------------

def test_choice_points():
    with spy("sparse_update") as calls:
        check_choice_points(calls)


def check_choice_points(calls):
    rows, grad = torch.tensor([0, 2]), torch.ones(2, 3)
    # CPU tensors, not forced: never the Triton path (the CPU paths are unchanged)
    assert not gpu.usable(torch.zeros(1))
    update(torch.zeros(3, 3), {}, rows, grad, ec.SGD(learning_rate=0.1), 0.1, 0)
    assert calls["sparse_update"] == 0
    with triton_path():
        assert gpu.usable(torch.zeros(1, device=DEVICE))
        update(torch.zeros(3, 3, device=DEVICE), {}, rows.to(DEVICE), grad.to(DEVICE),
               ec.SGD(learning_rate=0.1), 0.1, 0)
        assert calls["sparse_update"] == 1
        # not supported: dense Adam (every row moves), float64 tables -> the torch paths
        dense = ec.Adam(learning_rate=0.1, lazy_adam=False)
        t = torch.zeros(3, 3, device=DEVICE)
        update(t, dense.init_slots(3, 3, device=DEVICE), rows.to(DEVICE), grad.to(DEVICE),
               dense, 0.1, 0)
        assert not gpu.update_supported(dense, t, {})
        t64 = torch.zeros(3, 3, dtype=torch.float64, device=DEVICE)
        update(t64, {}, rows.to(DEVICE), grad.double().to(DEVICE), ec.SGD(learning_rate=0.1),
               0.1, 0)
        assert calls["sparse_update"] == 1
        assert torch.equal(t64.cpu()[rows], torch.full((2, 3), -0.1, dtype=torch.float64))
        with pytest.raises(ValueError, match="learning_rate"):  # as Optimizer.update
            update(torch.zeros(3, 3, device=DEVICE), ec.FTRL(learning_rate=0.1).init_slots(
                3, 3, device=DEVICE), rows.to(DEVICE), grad.to(DEVICE),
                ec.FTRL(learning_rate=0.1), 0.0, 0)


def test_without_triton_everything_works(monkeypatch):
    """triton not importable: ``usable`` is False, the choice points take the torch paths."""
    from embcore.kernels.gpu import launch
    monkeypatch.setattr(launch, "_kernels", None)
    monkeypatch.setattr(launch, "_error", None)
    monkeypatch.setitem(sys.modules, "triton", None)
    for name in ("rows", "lang"):  # (lang imports triton for them)
        monkeypatch.delitem(sys.modules, f"embcore.kernels.gpu.{name}")
        monkeypatch.delattr(sys.modules["embcore.kernels.gpu"], name)
    monkeypatch.setattr(launch, "_forced", True)
    assert not gpu.available() and "triton" in gpu.error()
    assert not gpu.usable(torch.zeros(1))
    table = torch.randn(4, 3)
    bags = Bags(torch.tensor([1, 3]), None, None)
    assert torch.equal(combine(table, bags.ids, bags), table[bags.ids])


def test_engine_trains_the_same_on_the_triton_path():
    """Two steps of the engine (lookup, fused backward + update) with the kernels and without."""
    results = []
    for forced in (True, False):
        torch.manual_seed(0)
        t = ec.TableConfig(vocabulary_size=20, dim=5, combiner="mean", name="t")
        fc = {"d": ec.FeatureConfig(table=t), "j": ec.FeatureConfig(table=t)}
        emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.5, clipvalue=1.0), device=DEVICE)
        acts_seen = []
        with triton_path(forced):
            for step in range(2):
                ids = {"d": torch.tensor([1, 5, 1, step]).to(DEVICE),
                       "j": jagged([[5, 7, 5], [], [2], [step, 19]], torch.int64).to(DEVICE)}
                emb.enqueue(ids)
                acts = emb.dequeue()
                acts_seen.append({k: a.detach().cpu() for k, a in acts.items()})
                emb.apply_gradients({k: torch.full(a.shape, 0.1 * (step + 1), device=DEVICE)
                                     for k, a in acts.items()})
        results.append((acts_seen, emb.embedding_tables[t].detach().cpu()))
    (acts_a, table_a), (acts_b, table_b) = results
    for a, b in zip(acts_a, acts_b):
        for k in a:
            torch.testing.assert_close(a[k], b[k], **SUM_TOL)
    torch.testing.assert_close(table_a, table_b, **UPDATE_TOL)


# -- compact rows (float16 / bfloat16; docs/semantics.md section 14) ---------------------------

def _dyadic(shape, gen, scale=64):
    """k / scale values: sums and products of a few are exact in float32 in any order."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).float() / scale


@settings(max_examples=examples(12), deadline=None)
@given(st.sampled_from([torch.float16, torch.bfloat16]), st.booleans(), st.booleans(),
       st.integers(1, 20), st.sampled_from([1, 5, 16]), st.integers(0, 2**31 - 1))
def test_compact_rows_lookup_widened_and_update_rounded_as_the_reference(
        dtype, stochastic, summed, n, d, seed):
    """The lookup reads 16-bit rows as float32; the SGD update of dyadic values (exact in
    float32) rounds its result as numerics/rounding.py does, bit for bit, to nearest or stochastically
    (row keys through segments and key rows)."""
    from embcore.numerics import rounding
    gen = torch.Generator().manual_seed(seed)
    table = _dyadic((n, d), gen, 16).to(dtype)
    ids = torch.randint(0, n, (7,), generator=gen)
    bags = Bags(ids, torch.tensor([0, 3, 3, 7]), torch.ones(7) * 0.5)
    with triton_path(), spy("lookup") as calls:
        acts = combine(table.to(DEVICE), ids.to(DEVICE), Bags(
            ids.to(DEVICE), bags.offsets.to(DEVICE), bags.scales.to(DEVICE)))
    assert calls["lookup"] == 1 and acts.dtype == torch.float32
    torch.testing.assert_close(acts.cpu(), combine(table.float(), ids, bags), **SUM_TOL)
    opt = ec.SGD(learning_rate=0.125, clipvalue=0.75)
    seg = rounding.shard_segments([("a", 0, torch.arange(n // 2)),
                                   ("b", n // 2, torch.arange(2, 2 + 3 * (n - n // 2), 3))], 9, n)
    keys = torch.randint(-2**40, 2**40, (n,), generator=gen) if seed % 2 else None
    r = rounding.Rounding(stochastic, seg, col0=seed % 3).at(seed % 97, keys)
    if summed:
        rows = torch.randperm(n, generator=gen)[:max(1, n // 2)]
        g = _dyadic((rows.numel(), d), gen)
        want_rows, grad, dev_rows = g, g.to(DEVICE), rows.to(DEVICE)
    else:  # occurrences in unit bags, their gradients in two parts
        from embcore.ops.combine import OutputGrads
        occ = torch.randint(0, n, (2 * n,), generator=gen)
        out = _dyadic((occ.numel(), d), gen)
        dd = dedup(occ.to(DEVICE))
        rows = dd.unique.cpu()
        half = occ.numel() // 2
        grad = OutputGrads([out[:half].to(DEVICE), out[half:].to(DEVICE)], [0, half, occ.numel()],
                           Bags(occ.to(DEVICE), None, None), dd)
        want_rows = torch.zeros(n, d).index_add_(0, occ, out)[rows]
        dev_rows = dd.unique
    want = table.clone()
    new = opt.update(table[rows].float(), want_rows.clamp(-0.75, 0.75), {}, lr=0.125, step=0)[0]
    want[rows] = r.round(new, rows, dtype)
    got = table.to(DEVICE, copy=True)
    with triton_path(), spy("sparse_update") as calls:
        update(got, {}, dev_rows, grad, opt, 0.125, 0, round_to=r)
    assert calls["sparse_update"] == 1
    got = got.cpu()
    nan = torch.isnan(got.float()) & torch.isnan(want.float())
    assert bool(((got.view(torch.int16) == want.view(torch.int16)) | nan).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compact_rowwise_adagrad_is_the_float32_rule_rounded(dtype):
    from embcore.numerics import rounding
    gen = torch.Generator().manual_seed(3)
    n, d = 30, 12
    opt = ec.RowwiseAdagrad(learning_rate=0.3, weight_decay_factor=0.01)
    table = torch.randn(n, d, generator=gen).to(dtype)
    acc = torch.rand(n, 1, generator=gen) + 0.1
    rows = torch.randperm(n, generator=gen)[:20]
    g = torch.randn(20, d, generator=gen)
    r = rounding.Rounding(True, rounding.shard_segments([("t", 0, torch.arange(n))], 1, n)).at(5)
    new, new_slots = opt.update(table[rows].float(), g, {"accumulators": acc[rows]}, lr=0.3,
                                step=0)
    want = r.round(new, rows, dtype).float()
    got, got_acc = table.to(DEVICE, copy=True), acc.to(DEVICE, copy=True)
    with triton_path():
        update(got, {"accumulators": got_acc}, rows.to(DEVICE), g.to(DEVICE), opt, 0.3, 0,
               round_to=r)
    got = got.cpu()[rows].float()
    ulp = (torch.nextafter(want.to(dtype), torch.full_like(want, torch.inf).to(dtype)).float()
           - want).abs()
    assert bool(((got - want).abs() <= ulp * 1.01).all())
    assert float((got == want).float().mean()) > 0.95
    torch.testing.assert_close(got_acc.cpu()[rows], new_slots["accumulators"], **UPDATE_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compact_rounding_of_every_kind_of_float_as_the_reference(dtype):
    """SGD at rate 1 from zero rows stores round(0 - (-x)) for any float32 x (subnormal, huge,
    infinite, NaN): the kernel's stochastic rounding gives numerics/rounding.py's bits."""
    from embcore.numerics import rounding
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-2**31, 2**31 - 1, (3000,), generator=g).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(1000, generator=g) * 1e-6,
                   torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65535.99, 65536.0, 2**-24, 2**-25,
                                 3 * 2**-26, 2**-14 * (1 - 2**-11), float("nan"), float("inf")])])
    d = 16
    x = x[: x.numel() // d * d].reshape(-1, d)
    n = x.shape[0]
    r = rounding.Rounding(True, rounding.shard_segments([("t", 0, torch.arange(n))], 4, n),
                          col0=3).at(17)
    table = torch.zeros(n, d, dtype=dtype, device=DEVICE)
    with triton_path(), spy("sparse_update") as calls:
        update(table, {}, torch.arange(n, device=DEVICE), (-x).to(DEVICE),
               ec.SGD(learning_rate=1.0), 1.0, 17, round_to=r)
    assert calls["sparse_update"] == 1
    got, want = table.cpu(), r.round(torch.zeros(n, d) - 1.0 * -x, torch.arange(n), dtype)
    nan = torch.isnan(got.float()) & torch.isnan(want.float())
    assert bool(((got.view(torch.int16) == want.view(torch.int16)) | nan).all())


# -- 8-bit rows (float8_e4m3fn / float8_e5m2): the kernels, the torch path's bits ----------------

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _codes_equal(got, want):
    """8-bit tables equal code for code (a NaN's sign aside: not kept across devices)."""
    nan = torch.isnan(got.float()) & torch.isnan(want.float())
    return bool(((got.view(torch.uint8) == want.view(torch.uint8)) | nan).all())


@pytest.mark.parametrize("dtype", FP8)
def test_8_bit_lookup_widens_every_code_with_its_row_scale(dtype):
    """Every one of the 256 codes, widened and multiplied by its row's scale, unit bags (a copy:
    the torch path's bits) and weighted bags (the same sums within float rounding)."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.arange(256, dtype=torch.uint8).reshape(32, 8).view(dtype)
    scales = torch.rand(32, 1, generator=gen) + 0.5
    ids = torch.randint(0, 32, (40,), generator=gen)
    for bags in (Bags(torch.arange(32), None, None),
                 Bags(ids, torch.tensor([0, 3, 3, 17, 40]), torch.rand(40, generator=gen))):
        with triton_path(), spy("lookup") as calls:
            got = combine(codes.to(DEVICE), bags.ids.to(DEVICE), Bags(
                bags.ids.to(DEVICE), None if bags.offsets is None else bags.offsets.to(DEVICE),
                None if bags.scales is None else bags.scales.to(DEVICE)),
                scales=scales.to(DEVICE))
        assert calls["lookup"] == 1 and got.dtype == torch.float32
        want = combine_torch(codes, bags.ids, bags, scales)
        if bags.offsets is None:
            assert torch.equal(got.cpu().nan_to_num(9.0), want.nan_to_num(9.0))
        else:
            torch.testing.assert_close(got.cpu(), want, equal_nan=True, **SUM_TOL)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", FP8)
def test_8_bit_rounding_of_every_kind_of_float_as_the_torch_path(dtype, stochastic):
    """SGD at rate 1 from zero rows stores quantize(0 - (-x)) for any float32 x (subnormal, huge,
    infinite, NaN, ties, past max_finite): the kernel's new codes and scales are the torch
    path's (numerics/rounding.py's ``quantize``), bit for bit."""
    from embcore.numerics import rounding
    g = torch.Generator().manual_seed(2)
    bits = torch.randint(-2**31, 2**31 - 1, (3000,), generator=g).to(torch.int32)
    top = torch.finfo(dtype).max
    x = torch.cat([bits.view(torch.float32), torch.randn(1000, generator=g) * 1e-6,
                   torch.randn(1000, generator=g),
                   torch.tensor([0.0, -0.0, top, -top, top * 1.03, top * 1.07, 2.0**-9, 2.0**-10,
                                 3 * 2.0**-11, 2.0**-16, 2.0**-17, 3 * 2.0**-18, float("nan"),
                                 float("inf"), -float("inf"), 1e-45, -1e-45, 0.0])])
    d = 16
    x = x[: x.numel() // d * d].reshape(-1, d)
    x[-1] = torch.tensor([top, 2.5 * 2.0**-9 * top / 448, 3.5, -3.25, 0.5 * top / 448, 1.125,
                          1.0625, 1.1875, 240.0, 232.0, -0.0, 1e-30, 7.0, 0.0, 5.0, 6.5])  # ties
    n = x.shape[0]
    r = rounding.Rounding(stochastic, rounding.shard_segments([("t", 0, torch.arange(n))], 4, n),
                          col0=3).at(17)
    got = torch.zeros(n, d, dtype=dtype, device=DEVICE)
    got_scales = torch.ones(n, 1, device=DEVICE)
    with triton_path(), spy("sparse_update") as calls:
        update(got, {"scales": got_scales}, torch.arange(n, device=DEVICE), (-x).to(DEVICE),
               ec.SGD(learning_rate=1.0), 1.0, 17, round_to=r)
    assert calls["sparse_update"] == 1
    want, want_scales = torch.zeros(n, d, dtype=dtype), torch.ones(n, 1)
    update_torch(want, {"scales": want_scales}, torch.arange(n), -x, ec.SGD(learning_rate=1.0),
                 1.0, 17, round_to=r)
    assert _codes_equal(got.cpu(), want) and torch.equal(got_scales.cpu(), want_scales)


@settings(max_examples=examples(12), deadline=None)
@given(any_optimizer(dense_adam=False), st.sampled_from(FP8), st.booleans(),
       st.sampled_from(["summed", "outputs"]), st.integers(1, 12), st.sampled_from([1, 3, 16]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_8_bit_update_is_the_float32_update_quantized(opt_case, dtype, stochastic, source, n, d,
                                                      nonfinite, seed):
    """Every optimizer, both formats, to nearest or stochastically, from summed gradients or
    the output gradients' occurrences (some NaN or infinite): the fused update of an 8-bit
    table gives its rows the codes and scales of ``rounding.quantize`` (the torch path's rule)
    of the kernel's own float32 update of the widened rows, bit for bit, and the same slots."""
    from embcore.numerics import rounding
    opt, lr, step = opt_case
    gen = torch.Generator().manual_seed(seed)
    codes, scales = rounding.quantize(torch.randn(n, d, generator=gen) * 3, dtype)
    slots = {s.name: (torch.full((n, 1 if s.rowwise else d), s.initial_value)
                      + (torch.rand(n, 1 if s.rowwise else d, generator=gen)
                         if s.name in ("accumulators", "velocities")
                         and not getattr(opt, "allow_zero_accumulator", False) else 0.0))
             for s in opt.slots}
    if source == "summed":
        rows = torch.randperm(n, generator=gen)[:int(torch.randint(1, n + 1, (1,), generator=gen))]
        grad = torch.randn(len(rows), d, generator=gen)
        if nonfinite:
            grad.view(-1)[torch.randint(0, grad.numel(), (2,), generator=gen)] = torch.tensor(
                [float("nan"), float("inf")])
        dev_rows = grad_rows = rows.to(DEVICE)
        grad = grad.to(DEVICE)
    else:
        grad, _, rows = occurrences(gen, n, d, int(torch.randint(1, 3 * n, (1,), generator=gen)),
                                    bool(seed % 2), True, DEVICE)
        if nonfinite:
            grad.parts[0].view(-1)[:1] = float("inf")
        dev_rows = grad_rows = grad.dedup.unique
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 5, n)
    r = rounding.Rounding(stochastic, seg, col0=seed % 3).at(step)
    wide = rounding.widen(codes, scales)  # (n, d) float32
    wide_slots = {k: v.to(DEVICE, copy=True) for k, v in slots.items()}
    got, got_scales = codes.to(DEVICE, copy=True), scales.to(DEVICE, copy=True)
    got_slots = {k: v.to(DEVICE, copy=True) for k, v in slots.items()}
    with triton_path(), spy("sparse_update") as calls:
        update(got, {**got_slots, "scales": got_scales}, dev_rows, grad, opt, lr, step,
               round_to=r)
        wide_dev = wide.to(DEVICE, copy=True)
        update(wide_dev, wide_slots, dev_rows, grad, opt, lr, step)
    assert calls["sparse_update"] == 2  # the kernel ran both, not a fallback
    rows = grad_rows.cpu()
    want, want_scales = codes.clone(), scales.clone()
    new_codes, new_scales = r.quantize(wide_dev.cpu()[rows], rows, dtype)
    want.view(torch.uint8)[rows] = new_codes.view(torch.uint8)
    want_scales[rows] = new_scales
    assert _codes_equal(got.cpu(), want)
    assert torch.equal(got_scales.cpu(), want_scales)
    for k, v in got_slots.items():
        assert torch.equal(v.cpu().nan_to_num(7.0), wide_slots[k].cpu().nan_to_num(7.0)), k


@pytest.mark.parametrize("dtype", FP8)
def test_8_bit_tables_take_the_fused_kernels_on_the_device(dtype):
    """An engine's 8-bit table on the device runs the Triton lookup and update (not the torch
    fallback) and trains as the same engine on the CPU (no Triton kernel there): the same
    activations within float rounding, the rows' values within a code (the kernel's float32
    arithmetic may round differently from the CPU's: its row mean's order, a fused
    multiply-add)."""
    step_of_code = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    for opt in (ec.SGD(learning_rate=0.5), ec.RowwiseAdagrad(learning_rate=0.5)):
        t8 = torch.zeros(4, 3, dtype=dtype, device=DEVICE)
        with triton_path():
            assert gpu.lookup_supported(t8)
            assert gpu.update_supported(opt, t8, {**opt.init_slots(4, 3, device=DEVICE),
                                                  "scales": torch.ones(4, 1, device=DEVICE)})
            assert not gpu.update_supported(opt, t8, opt.init_slots(4, 3, device=DEVICE))
        results = []
        for device in (DEVICE, torch.device("cpu")):
            torch.manual_seed(0)
            t = ec.TableConfig(vocabulary_size=20, dim=5, combiner="mean", name="t", dtype=dtype)
            fc = {"d": ec.FeatureConfig(table=t), "j": ec.FeatureConfig(table=t)}
            acts_seen = []
            with triton_path(device == DEVICE), spy("sparse_update", "lookup") as calls:
                emb = ec.Embedding(fc, opt, device=device)  # (its kernels chosen here)
                for step in range(2):
                    ids = {"d": torch.tensor([1, 5, 1, step]).to(device),
                           "j": jagged([[5, 7, 5], [], [2], [step, 19]], torch.int64).to(device)}
                    emb.enqueue(ids)
                    acts = emb.dequeue()
                    acts_seen.append({k: a.detach().cpu() for k, a in acts.items()})
                    emb.apply_gradients({k: torch.full(a.shape, 0.1 * (step + 1), device=device)
                                         for k, a in acts.items()})
            assert (calls["sparse_update"] == 2 and calls["lookup"] > 0) == (device == DEVICE)
            sd = emb.state_dict()
            results.append((acts_seen, sd["t/parameters"].cpu(), sd["t/scales"].cpu()))
        (acts_a, codes_a, scales_a), (acts_b, codes_b, scales_b) = results
        for a, b in zip(acts_a, acts_b):
            for k in a:
                torch.testing.assert_close(a[k], b[k], **SUM_TOL)
        assert not torch.equal(scales_a, torch.ones_like(scales_a))
        torch.testing.assert_close(codes_a.float() * scales_a, codes_b.float() * scales_b,
                                   rtol=step_of_code, atol=1e-6)
