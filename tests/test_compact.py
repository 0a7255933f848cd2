"""Compact rows (docs/semantics.md section 14): float16 / bfloat16 tables on the fused kernels.

The rounding (numerics/rounding.py, the torch reference; csrc/half.h, the kernels) bit for bit; its
statistics (unbiased, small updates that train); the update of every optimizer against a float32
reference rounded to the rows' dtype; and the same bits whatever the threads, the path, the
stacking, the budget or the number of processes.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import oracles
import pytest
import torch
from distributed import run_on
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import requires_native
from profiles import examples
from switches import kernels

import embcore as ec
from embcore.config.tables import INDEX_BYTES_PER_ROW, MAP_BYTES_PER_ROW
from embcore.kernels import cpu
from embcore.numerics import rounding
from embcore.ops.bags import Bags
from embcore.ops.bags import dedup as dedup_of
from embcore.ops.combine import OutputGrads
from embcore.ops.reference_optim import reference_update
from embcore.ops.update import update
from embcore.planning.plan import where_bytes

COMPACT = [torch.float16, torch.bfloat16]


def all_kinds_of_floats(n: int, seed: int) -> torch.Tensor:
    """float32 values of every kind: random bit patterns (subnormals, NaN, infinities, huge and
    tiny), ordinary magnitudes, and the edges of float16's range."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64)
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.99, 65520.0, 65535.99, 65536.0,
                          -65536.0, float("inf"), -float("inf"), float("nan"), 2**-24, 2**-25,
                          3 * 2**-26, 2**-14, 2**-14 * (1 - 2**-11), 1e-40, 2**-32, 2**-31,
                          -(2**-31), 3.0e38, -3.4e38])
    return torch.cat([bits.to(torch.int32).view(torch.float32),
                      torch.randn(n, generator=g) * 1e-6, torch.randn(n, generator=g) * 1e3,
                      edges])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as 16-bit values, every NaN equal to every NaN."""
    nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


def identities(segments: rounding.Segments, rows: torch.Tensor,
               key_rows: torch.Tensor | None = None) -> list[int]:
    """The identity of each updated row, by the rule ``Segments`` documents, in Python ints:
    row ``k`` (its key row when ``key_rows`` holds one) of segment ``t`` (the last whose start
    is at most ``k``; the first for rows before it) is ``bases[t] + (k - starts[t]) * muls[t]``."""
    n = segments.bases.numel()
    starts, bases = segments.starts.tolist()[:n], segments.bases.tolist()
    muls = segments.muls.tolist()
    out = []
    for r in rows.tolist():
        k = int(key_rows[r]) if key_rows is not None and r < key_rows.numel() else r
        t = max(sum(1 for s in starts if s <= k) - 1, 0)
        out.append(bases[t] + (k - starts[t]) * muls[t])
    return out


def oracle_round(values: torch.Tensor, dtype: torch.dtype, stochastic: bool,
                 ids: list[int] | None = None, step: int = 0, col0: int = 0) -> torch.Tensor:
    """(U, D) float32 ``values`` of rows of identities ``ids`` rounded to ``dtype`` at ``step``
    by tests/oracles.py (the documented rule in numpy, not numerics/rounding.py)."""
    name = str(dtype).removeprefix("torch.")
    x = values.float().numpy()
    if stochastic:
        assert ids is not None
        h = oracles.round_stochastic(x, oracles.random_bits(ids, step, x.shape[1], col0), name)
    else:
        h = oracles.round_nearest(x, name)
    return torch.from_numpy(h.astype(np.uint16).view(np.int16)).view(dtype)


# ------------------------------------------------------------------------------ the rounding
@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_the_kernels_round_as_the_reference_and_as_torch(dtype):
    x = all_kinds_of_floats(200_000, 1)
    assert same_bits(cpu.round16(x, dtype), x.to(dtype))  # to nearest: torch's rounding
    assert same_bits(cpu.round16(x, dtype), oracle_round(x[:, None], dtype, False)[:, 0])
    bits = torch.randint(0, 2**32, x.shape, generator=torch.Generator().manual_seed(2))
    name = str(dtype).removeprefix("torch.")
    want = oracles.round_stochastic(x.numpy(), bits.numpy(), name)  # the documented rule
    got = cpu.round16(x, dtype, bits).view(torch.int16).numpy()
    assert oracles.same_patterns(got, want, name)
    assert oracles.same_patterns(rounding.round_stochastic(x, bits, dtype).view(torch.int16)
                                 .numpy(), want, name)  # the torch reference too


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
@pytest.mark.parametrize("stochastic", [True, False])
def test_the_update_kernel_rounds_every_kind_of_float_as_the_reference(dtype, stochastic):
    """SGD at rate 1 from zero rows writes round(x) for any float32 x (subnormal, huge, infinite,
    NaN): the update kernel's stores (vectorized, F16C where built) give the reference's bits."""
    x = all_kinds_of_floats(20_000, 5)
    d = 24
    x = x[: x.numel() // d * d].reshape(-1, d)  # (n, D)
    n = x.shape[0]
    table = torch.zeros(n, d, dtype=dtype)
    rows = torch.arange(n)
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 4, n)
    r = rounding.Rounding(stochastic, seg, col0=3).at(17)
    update(table, {}, rows, -x, ec.SGD(learning_rate=1.0), 1.0, 17, round_to=r)
    with np.errstate(invalid="ignore"):  # (inf * 1, NaN: as float32 computes them)
        result = torch.from_numpy(np.float32(0) - np.float32(1) * -x.numpy())  # 0 - g (-0: +0)
    assert same_bits(table, oracle_round(result, dtype, stochastic, identities(seg, rows), 17, 3))


# Values where a rounding path can go wrong: zeros of both signs, float32 subnormals, float16's
# subnormal range and its ties, ties to even at 1.0 (float16, bfloat16), the edges around
# float16's largest finite value and bfloat16's, infinities and NaN.
_EDGES = [0.0, -0.0, 1e-40, -1e-40, 2**-149, 2**-24, 2**-25, 3 * 2**-25, 5 * 2**-25, 2**-14,
          2**-14 * (1 - 2**-11), -(2**-14), 2**-15 + 2**-25, 1 + 2**-11, 1 + 3 * 2**-11,
          -(1 + 2**-11), 1 + 2**-8, 1 + 3 * 2**-8, 65504.0, -65504.0, 65505.0, 65519.99, 65520.0,
          -65520.0, 65535.99, 65536.0, 3.3895313892515355e38, 3.4e38, -3.4e38, float("inf"),
          -float("inf"), float("nan")]
_VALUES = st.one_of(st.sampled_from(_EDGES), st.floats(width=32),
                    st.floats(-2.0**-13, 2.0**-13, width=32),
                    st.floats(6e4, 7e4, width=32).map(lambda v: -v))


@requires_native
@settings(max_examples=examples(80), deadline=None)
@given(st.sampled_from(COMPACT), st.booleans(), st.booleans(), st.integers(1, 4),
       st.integers(1, 72), st.integers(0, 2**20), st.integers(0, 2**40), st.data())
def test_the_simd_rounding_of_whole_rows_is_the_reference(dtype, stochastic, guard, n, d, col0,
                                                          step, data):
    """Rows of any width (SIMD blocks of 8 or 16 columns and a scalar tail) of edge values
    (negative zero, subnormals, ties, around 65504, infinities, NaN), any first column and step:
    the update kernel writes the reference's rounding of each float32 result; with the overflow
    guard, exactly the rows whose rounding overflows are left as they were."""
    x = torch.tensor(data.draw(st.lists(_VALUES, min_size=n * d, max_size=n * d)),
                     dtype=torch.float32).reshape(n, d)
    negative_zero = (x == 0) & torch.signbit(x)
    init = torch.where(negative_zero, -0.0, 0.0).to(dtype)  # (-0.0 - +0.0 keeps the -0.0)
    grad = init.float() - x  # the SGD step at rate 1 from init: init - grad, x's float32 bits
    wr = init.float() - grad
    rows = torch.arange(n)
    seg = rounding.shard_segments([("t", 0, rows)], 9, n)
    r = rounding.Rounding(stochastic, seg, col0=col0).at(step)
    want = oracle_round(wr, dtype, stochastic, identities(seg, rows), step, col0)
    table = init.clone()
    left = update(table, {}, rows, grad, ec.SGD(learning_rate=1.0), 1.0, step, round_to=r,
                  guard=guard)
    if not guard:
        assert left is None and same_bits(table, want)
        return
    wide = want.float()
    over = ((torch.isinf(wide) | torch.isnan(wide)) & torch.isfinite(wr)).any(dim=1)
    got = torch.zeros(n, dtype=torch.bool)
    if left is not None:
        got[left] = True
    assert torch.equal(got, over)
    assert same_bits(table[over], init[over]) and same_bits(table[~over], want[~over])


@pytest.mark.parametrize("dtype", COMPACT)
def test_stochastic_rounding_picks_a_neighbour_and_keeps_exact_values(dtype):
    x = all_kinds_of_floats(50_000, 3)
    x = x[torch.isfinite(x) & (x.abs() < torch.finfo(dtype).max)]
    bits = torch.randint(0, 2**32, x.shape, generator=torch.Generator().manual_seed(4))
    r = rounding.round_stochastic(x, bits, dtype).float()
    down = torch.where(x.abs() < 2**-32, 0.0, x.to(dtype).float())  # one neighbour...
    up = torch.nextafter(down.to(dtype), torch.where(x > down, torch.inf, -torch.inf).to(
        dtype)).float()  # ... and the other (toward x)
    lo, hi = torch.minimum(down, up), torch.maximum(down, up)
    inside = (x >= lo) & (x <= hi)
    ok = inside & ((r == down) | (r == up) | (r.abs() < 2**-24))
    assert bool(ok[x.abs() >= 2**-32].all())
    exact = x.to(dtype).float() == x
    assert torch.equal(r[exact], x[exact])  # a representable value never moves
    # the infinite edge: a float16 result beyond its range is infinite
    if dtype == torch.float16:
        big = torch.tensor([65536.0, 1e6, -7e4])
        zero_bits = torch.zeros(3, dtype=torch.int64)
        assert rounding.round_stochastic(big, zero_bits, dtype).isinf().all()


@pytest.mark.parametrize("dtype", COMPACT)
def test_stochastic_rounding_is_unbiased(dtype):
    """E[round(x)] = x: between two neighbours, the mean of many roundings lands at x."""
    lo = torch.tensor(1.0)
    ulp = float(torch.nextafter(lo.to(dtype), torch.tensor(2.0, dtype=dtype)).float() - 1)
    n = 200_000
    for frac in (0.03, 0.25, 0.5, 0.9):
        x = torch.full((n,), 1.0 + frac * ulp)
        keys = rounding.row_keys(torch.arange(n), rounding.step_key(7))
        r = rounding.round_stochastic(x, rounding.column_bits(keys, 1)[:, 0], dtype).float()
        p = float(((r - 1.0) / ulp).mean())
        assert abs(p - frac) < 5 * (frac * (1 - frac) / n) ** 0.5 + 1e-4, (frac, p)


def test_the_random_bits_are_a_function_of_identity_step_and_column_only():
    seg = rounding.shard_segments([("a", 0, torch.arange(5)), ("b", 5, torch.arange(3, 9, 2))],
                                  7, 8)
    ids = seg.identities(torch.arange(8))
    assert ids[1] - ids[0] == 1 and ids[6] - ids[5] == 2  # b's rows 3, 5, 7 of a row-mod shard
    alone = rounding.shard_segments([("b", 0, torch.arange(3, 9, 2))], 7, 3)
    assert torch.equal(alone.identities(torch.arange(3)), ids[5:])  # stacking does not matter
    k1 = rounding.row_keys(ids, rounding.step_key(1))
    assert not torch.equal(k1, rounding.row_keys(ids, rounding.step_key(2)))
    bits = rounding.column_bits(k1, 6)
    assert torch.equal(bits[:, 2:], rounding.column_bits(k1, 4, col0=2))  # a column split
    assert rounding.table_key(7, "a") != rounding.table_key(8, "a")
    assert rounding.table_key(7, "a") != rounding.table_key(7, "b")


# ------------------------------------------------------------------------------- the update
def _dyadic(shape, gen, scale=64):
    """Values k / scale: sums and products of a few of them are exact in float32, whatever the
    order, so paths that sum differently agree bit for bit."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).float() / scale


@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from(COMPACT), st.booleans(), st.sampled_from(["summed", "outputs"]),
       st.integers(1, 40), st.sampled_from([1, 3, 8, 16, 20]), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_the_fused_sgd_update_is_the_float32_update_rounded(dtype, stochastic, source, n, d,
                                                            options, seed):
    """SGD on dyadic values (float32 exact on every path): the kernel's 16-bit rows are the
    float32 update's result rounded by the reference, to nearest or stochastically, whatever the
    segments and key rows."""
    gen = torch.Generator().manual_seed(seed)
    opt = (ec.SGD(learning_rate=0.125, clipvalue=(-0.5, 0.75), clip_weight_min=-2.0,
                  clip_weight_max=1.5) if options else ec.SGD(learning_rate=0.25))
    table = _dyadic((n, d), gen, 16).to(dtype)
    rows = torch.randperm(n, generator=gen)[:max(1, n // 2)]
    half = n // 2
    seg = rounding.shard_segments([("a", 0, torch.arange(half)),
                                   ("b", half, torch.arange(1, 1 + 3 * (n - half), 3))], 5, n)
    keys = torch.randint(-2**62, 2**62, (n,), generator=gen) if n % 3 == 0 else None
    r = rounding.Rounding(stochastic, seg, col0=n % 4).at(seed % 1000, keys)
    if source == "summed":
        grad = _dyadic((rows.numel(), d), gen)
        want_rows = grad
    else:  # occurrences of the rows in bags of size one
        occ = rows[torch.randint(0, rows.numel(), (3 * rows.numel(),), generator=gen)]
        occ = torch.cat([rows, occ])
        out = _dyadic((occ.numel(), d), gen)
        bags = Bags(ids=occ, offsets=None, scales=None, shape=(occ.numel(),))
        dedup = dedup_of(occ)
        grad = OutputGrads([out], [0, occ.numel()], bags, dedup)
        summed: dict[int, list[float]] = {}  # each row's occurrences summed, by a plain loop
        for k, row in enumerate(occ.tolist()):
            acc = summed.setdefault(row, [0.0] * d)
            for c in range(d):
                acc[c] += float(out[k, c])
        rows = torch.tensor(sorted(summed))
        want_rows = torch.tensor([summed[row] for row in sorted(summed)])
    # the optimizer's oracle (ops/reference_optim.py, Python floats; exact on dyadic values)
    new = torch.tensor(reference_update(opt, table[rows].float(), want_rows, {},
                                        lr=opt.learning_rate, step=0)[0], dtype=torch.float32)
    want = table.clone()
    want[rows] = oracle_round(new, dtype, stochastic, identities(seg, rows, keys),
                              seed % 1000, n % 4)
    update(table, {}, grad.dedup.unique if source == "outputs" else rows, grad, opt,
           opt.learning_rate, 0, round_to=r)
    assert same_bits(table, want)


@requires_native
@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(COMPACT), st.sampled_from(["sgd", "adagrad", "rowwise"]), st.booleans(),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_every_fused_rule_is_the_float32_rule_rounded(dtype, kind, stochastic, options, seed):
    """Adagrad and RowwiseAdagrad (and SGD with decay) take roots and quotients, computed in
    another order by the optimizers' math: the kernel's rows are the rounded float32 result, or
    (where float32 noise crosses a 16-bit boundary) its neighbour, never further."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(clipvalue=1.0, weight_decay_factor=0.01,
              gradient_multiplier=lambda step: 0.5) if options else {}
    opt = {"sgd": ec.SGD, "adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad}[kind](
        learning_rate=0.3, **kw)
    n, d = 64, 8
    table = torch.randn(n, d, generator=gen).to(dtype)
    slots = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen) + 0.1 for s in opt.slots}
    rows = torch.randperm(n, generator=gen)[:40]
    grad = torch.randn(40, d, generator=gen)
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 3, n)
    r = rounding.Rounding(stochastic, seg).at(11)
    # the optimizers' oracle (ops/reference_optim.py: Python floats, the multiplier from the
    # optimizer at step 0) and the documented rounding (tests/oracles.py)
    new_w, new_slots = reference_update(opt, table[rows].float(), grad,
                                        {k: v[rows] for k, v in slots.items()}, lr=0.3, step=0)
    new = torch.tensor(new_w, dtype=torch.float32)
    want = oracle_round(new, dtype, stochastic, identities(seg, rows), 11).float()
    update(table, slots, rows, grad, opt, 0.3, 0, round_to=r,
           gradient_multiplier=0.5 if options else None)
    got = table[rows].float()
    ulp = (torch.nextafter(want.to(dtype), torch.full_like(want, torch.inf).to(dtype)).float()
           - want).abs()
    assert bool(((got - want).abs() <= ulp * 1.01).all())
    assert float((got == want).float().mean()) > 0.97
    for k, v in new_slots.items():
        torch.testing.assert_close(slots[k][rows], torch.tensor(v, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the engine
def _constant(val):
    return functools.partial(torch.nn.init.constant_, val=val)


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_updates_below_half_an_ulp_train_stochastically_and_stall_to_nearest(dtype):
    """Each step adds 1/16 of a unit in the last place: rounding to nearest loses every one;
    stochastic rounding moves the rows' mean as float32 would."""
    ulp = float(torch.nextafter(torch.tensor(1.0, dtype=dtype), torch.tensor(2.0, dtype=dtype))
                .float() - 1)
    steps, n, d = 200, 256, 64
    means = {}
    for stochastic in (True, False):
        t = ec.TableConfig(vocabulary_size=n, dim=d, dtype=dtype, initializer=_constant(1.0),
                           stochastic_rounding=stochastic, name="t")
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=1.0))
        ids = torch.arange(n)
        for _ in range(steps):
            emb.enqueue({"f": ids})
            a = emb.dequeue()
            emb.apply_gradients({"f": torch.full_like(a["f"], -ulp / 16)})
        w = emb.embedding_tables["t"]
        assert w.dtype == dtype
        means[stochastic] = float(w.float().mean())
    want = 1.0 + steps * ulp / 16
    assert abs(means[True] - want) < 0.25 * ulp, (means, want)
    assert means[False] == 1.0


def _budget(tables_rows, dim=8):
    """A memory budget that offloads every table behind a small cache (test_fast.py's)."""
    return sum(n * where_bytes(False) + dim * 4 * 3 + INDEX_BYTES_PER_ROW
               for n in tables_rows) + 400


def _train(dtype, stochastic=True, steps=4, budget=None, threads=None, two_tables=True,
           opt=None, fast=True, dynamic=False, seed=0):
    """A small engine trained on dyadic gradients (each table's batches and gradients from its
    own generator); returns its state and the engine."""
    torch.manual_seed(seed)
    mk = lambda n, name: ec.TableConfig(  # noqa: E731
        vocabulary_size=n, dim=8, dtype=dtype, stochastic_rounding=stochastic, name=name,
        dynamic=ec.DynamicVocabulary() if dynamic else None)
    tables = {"b": mk(50, "b")}
    if two_tables:
        tables = {"a": mk(30, "a"), **tables}
    feats = {k: ec.FeatureConfig(table=t) for k, t in tables.items()}
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings(), kernels(fast):
            warnings.simplefilter("ignore")
            emb = ec.Embedding(feats, opt or ec.Adagrad(learning_rate=0.25),
                               memory_budget=budget)
            gens = {k: torch.Generator().manual_seed(seed + ord(k)) for k in tables}
            for _ in range(steps):
                batch = {k: torch.randint(0, t.vocabulary_size, (64,), generator=gens[k]) *
                         (1000003 if dynamic else 1) for k, t in tables.items()}
                emb.enqueue(batch)
                acts = emb.dequeue()
                emb.apply_gradients({k: _dyadic(a.shape, gens[k]) for k, a in acts.items()})
            return {k: v.clone() for k, v in emb.state_dict().items()}, emb
    finally:
        torch.set_num_threads(old)


def _same_state(a, b, keys=None):
    for k in keys or a:
        if isinstance(a[k], torch.Tensor) and a[k].is_floating_point():
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_the_same_bits_whatever_the_threads_the_stacking_and_the_budget(dtype):
    ref, emb = _train(dtype)
    assert emb.plan.physical[0].tables == ("a", "b")  # stacked
    assert ref["b/parameters"].dtype == dtype and ref["b/accumulators"].dtype == torch.float32
    _same_state(ref, _train(dtype, threads=1)[0])
    _same_state(ref, _train(dtype, threads=2)[0])
    alone, _ = _train(dtype, two_tables=False)  # b's rows and keys: the seed and its name
    _same_state(ref, alone, ["b/parameters", "b/accumulators"])
    offloaded, emb = _train(dtype, budget=_budget([30, 50]))
    assert any(p.offloaded for p in emb.plan.physical)
    _same_state(ref, offloaded)


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_dynamic_tables_stack_with_stochastic_rounding(dtype):
    """16-bit dynamic tables with stochastic rounding stack (a row's identity: its member's
    key plus its raw id) and round as they do alone, whatever the threads, the path and the
    budget."""
    ref, emb = _train(dtype, dynamic=True)
    assert emb.plan.physical[0].tables == ("a", "b")  # stacked
    alone, _ = _train(dtype, dynamic=True, two_tables=False)
    _same_state(ref, alone, ["b/parameters", "b/accumulators"])
    _same_state(ref, _train(dtype, dynamic=True, threads=1)[0])
    _same_state(ref, _train(dtype, dynamic=True, fast=False)[0])
    offloaded, emb2 = _train(dtype, dynamic=True,
                             budget=_budget([30, 50]) + MAP_BYTES_PER_ROW * 80)
    assert any(p.offloaded for p in emb2.plan.physical)
    _same_state(ref, offloaded)
    nearest, emb3 = _train(dtype, dynamic=True, stochastic=False)  # (it stacked before too)
    assert emb3.plan.physical[0].tables == ("a", "b")
    assert not all(torch.equal(nearest[k], ref[k]) for k in ("a/parameters", "b/parameters"))


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_the_kernels_and_the_torch_paths_agree(dtype):
    """Kernels on and off (the optimizers' math, numerics/rounding.py's rounding): on dyadic SGD
    steps, the same bits."""
    opt = ec.SGD(learning_rate=0.125)
    _same_state(_train(dtype, opt=opt)[0], _train(dtype, opt=opt, fast=False)[0])
    _same_state(_train(dtype, opt=opt, dynamic=True)[0],
                _train(dtype, opt=opt, dynamic=True, fast=False)[0])


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_a_dynamic_compact_table_trains_in_memory_and_offloaded_alike(dtype):
    ref, emb = _train(dtype, dynamic=True)
    assert emb.embedding_tables["b"].dtype == dtype
    ids, _ = emb.vocabulary("b")
    assert ids.numel() > 0
    offloaded, emb2 = _train(dtype, dynamic=True, budget=_budget([30, 50]) + MAP_BYTES_PER_ROW * 80)
    assert any(p.offloaded for p in emb2.plan.physical)
    _same_state(ref, offloaded)


SHARDED = {"a": "row_div", "b": "row_mod", "c": "column", "d": "table", "e": "replicated",
           "f": "hash"}
SIZES = {"a": 37, "b": 23, "c": 41, "d": 19, "e": 11, "f": 64}  # f: dynamic, raw ids


def _sharded_engine(dtype, **kw):
    torch.manual_seed(7)
    tables = {n: ec.TableConfig(vocabulary_size=v, dim=8, dtype=dtype, name=n,
                                dynamic=ec.DynamicVocabulary() if n == "f" else None)
              for n, v in SIZES.items()}
    return ec.Embedding({n: ec.FeatureConfig(table=t) for n, t in tables.items()},
                        ec.SGD(learning_rate=0.125), **kw)


def _sharded_steps(step, world):
    """Per rank: its batch and its dyadic gradients."""
    g = torch.Generator().manual_seed(100 + step)
    return [({n: torch.randint(0, v, (4,), generator=g) * (7919 if n == "f" else 1)
              for n, v in SIZES.items()},
             {n: _dyadic((4, 8), g) for n in SIZES}) for _ in range(world)]


def _sharded_worker(rank, world, init, dtype, steps):
    ref = _sharded_engine(dtype)
    for s in range(steps):
        per_rank = _sharded_steps(s, world)
        ref.enqueue({n: torch.cat([b[n] for b, _ in per_rank]) for n in SIZES})
        ref.dequeue()
        ref.apply_gradients({n: torch.cat([g[n] for _, g in per_rank]) for n in SIZES})
    want = {t.name: v.clone() for t, v in ref.embedding_tables.items()}
    init()
    emb = _sharded_engine(dtype, sharding=SHARDED, timeout=60)
    for s in range(steps):
        batch, grads = _sharded_steps(s, world)[rank]
        emb.enqueue(batch)
        emb.dequeue()
        emb.apply_gradients(grads)
    got = {t.name: v for t, v in emb.embedding_tables.items()}
    for name, v in want.items():
        assert got[name].dtype == dtype, name
        if name == "f":  # a dynamic table: its rows are placed per process; compare by id
            v, got_f = _by_id(ref, "f", v), _by_id(emb, "f", got[name])
            assert v.keys() == got_f.keys() and len(v) > 0
            assert all(torch.equal(v[i], got_f[i]) for i in v), name
            continue
        assert torch.equal(got[name], v), (name, SHARDED[name])


def _by_id(emb, name, table):
    ids, rows = emb.whole_vocabulary(name)
    return {int(i): table[int(r)].clone() for i, r in zip(ids, rows)}


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_sharded_compact_tables_round_as_one_process_does(dtype):
    """Every strategy, W = 2 against W = 1 on dyadic SGD steps (sums exact in any order): the
    same random bits for the same rows and columns, so the same 16-bit tables."""
    run_on(2, _sharded_worker, dtype, 3)


# ------------------------------------------------------ checkpoints, serving, the spec, configs
def test_checkpoints_keep_the_rows_dtype_and_load_into_another(tmp_path):
    """Rows are saved in their dtype; loading into another dtype converts (widening exactly,
    narrowing to nearest); the float32 slots travel as they are."""
    half, emb = _train(torch.float16, steps=2)
    ec.save(tmp_path / "c", emb)
    _, same = _train(torch.float16, steps=0, seed=5)
    ec.load(tmp_path / "c", same)
    _same_state(half, same.state_dict())
    _, wide = _train(torch.float32, steps=0, seed=5)
    ec.load(tmp_path / "c", wide)
    got = wide.state_dict()
    assert got["b/parameters"].dtype == torch.float32
    assert torch.equal(got["b/parameters"], half["b/parameters"].float())
    assert torch.equal(got["b/accumulators"], half["b/accumulators"])
    ec.save(tmp_path / "w", wide)
    _, bf = _train(torch.bfloat16, steps=0, seed=5)
    ec.load(tmp_path / "w", bf)
    assert torch.equal(bf.state_dict()["b/parameters"],
                       half["b/parameters"].float().to(torch.bfloat16))


@requires_native
@pytest.mark.parametrize("dtype", COMPACT)
def test_compact_rows_serve_float32_activations_and_quantize(dtype):
    _, emb = _train(dtype, steps=2)
    t = emb.embedding_tables["b"]
    ids = torch.tensor([0, 3, 49, 3])
    want = t[ids].float()
    acts = emb.lookup({"a": torch.tensor([1, 2, 3, 4]), "b": ids})
    assert acts["b"].dtype == torch.float32 and torch.equal(acts["b"], want)
    layer_tables = {cfg: v for cfg, v in emb.embedding_tables.items()}
    served = ec.serving_embedding_lookup(
        {"b": ids}, None, {k: v for k, v in layer_tables.items() if k.name == "b"},
        {"b": next(f for k, f in emb.feature_config.items() if k == "b")})
    assert served["b"].dtype == torch.float32 and torch.equal(served["b"], want)
    q = ec.quantize_table(t, "int8")
    assert (q.rows(ids) - want).abs().max() <= (t.float().amax(1) - t.float().amin(1)).max() / 255
    assert torch.equal(ec.quantize_table(t, "fp16").rows(ids), want.half().float())


def test_the_spec_carries_the_dtype_and_the_rounding():
    t = ec.TableConfig(vocabulary_size=10, dim=4, dtype=torch.bfloat16,
                       stochastic_rounding=False, name="t")
    spec = ec.EmbeddingSpec({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    d = spec.to_dict()
    assert d["tables"]["t"]["dtype"] == "bfloat16"
    assert d["tables"]["t"]["stochastic_rounding"] is False
    back = ec.EmbeddingSpec.from_dict(d)
    cfg = back.feature_config["f"].table
    assert cfg.dtype == torch.bfloat16 and cfg.stochastic_rounding is False
    d["tables"]["t"].pop("stochastic_rounding")  # (specs written before it: the default)
    assert ec.EmbeddingSpec.from_dict(d).feature_config["f"].table.stochastic_rounding is True


def test_stochastic_rounding_must_be_a_bool_and_splits_stacks():
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool"):
        ec.TableConfig(vocabulary_size=10, dim=4, stochastic_rounding=1)
    mk = lambda n, sr: ec.TableConfig(vocabulary_size=10, dim=4, dtype=torch.float16,  # noqa
                                      stochastic_rounding=sr, name=n)
    emb = ec.Embedding({"a": ec.FeatureConfig(table=mk("a", True)),
                        "b": ec.FeatureConfig(table=mk("b", False)),
                        "c": ec.FeatureConfig(table=mk("c", True))}, ec.SGD(learning_rate=0.1))
    assert sorted(p.tables for p in emb.plan.physical) == [("a", "c"), ("b",)]


@requires_native
def test_publish_and_follow_compact_rows(tmp_path):
    """Snapshots and deltas carry the rows in their dtype; a follower serves them as they are,
    and a resume continues bit for bit."""
    _, emb = _train(torch.float16, steps=1)
    ec.publish(tmp_path, emb, slots=True)
    served = ec.load_published(tmp_path)
    gen = torch.Generator().manual_seed(9)
    emb.enqueue({"a": torch.arange(64) % 30, "b": torch.full((64,), 3)})
    acts = emb.dequeue()
    emb.apply_gradients({k: _dyadic(a.shape, gen) for k, a in acts.items()})
    assert ec.publish(tmp_path, emb, slots=True)["kind"] == "delta"
    assert served.refresh() == 1
    assert served.b.dtype == torch.float16
    assert torch.equal(served.b, emb.embedding_tables["b"])
    _, resumed = _train(torch.float16, steps=0, seed=3)
    ec.load(tmp_path, resumed)
    _same_state(emb.state_dict(), resumed.state_dict())


@requires_native
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 builds")
@pytest.mark.parametrize("arch", ["x86-64", "haswell"])
def test_other_builds_give_the_same_bits(tmp_path, arch):
    """The kernels built for plain x86-64 (no F16C, no AVX: the integer conversions, the portable
    rounding) and for AVX2 + F16C without AVX-512 (F16C's conversions, the vectorized loop for
    stochastic rounding) pass this file's bit-for-bit tests of the rounding, the lookup and the
    update."""
    import os
    import subprocess
    import sys
    # the embcore this process tests (a worktree's, not the one installed), found from tests/
    root = os.path.dirname(os.path.dirname(os.path.abspath(ec.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "EMBCORE_NATIVE_ARCH": arch, "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
         "-o", "addopts=", __file__, "-k",
         "round_as_the_reference or every_kind or fused_sgd or threads or agree or simd"],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(__file__))
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, tail
    assert "skipped" not in proc.stdout and "deselected" in proc.stdout, tail



def test_the_planner_counts_compact_rows_at_their_bytes():
    def plan_bytes(dtype):
        t = ec.TableConfig(vocabulary_size=1000, dim=64, dtype=dtype, name="t")
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.RowwiseAdagrad(learning_rate=0.1))
        return emb.plan.bytes_per_rank()[0]
    assert plan_bytes(torch.float32) == 1000 * (64 * 4 + 4)
    assert plan_bytes(torch.float16) == plan_bytes(torch.bfloat16) == 1000 * (64 * 2 + 4)


@requires_native
@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(COMPACT), st.sampled_from(["sgd", "adagrad"]), st.booleans(),
       st.booleans(), st.integers(1, 140), st.data())
def test_a_row_updated_in_two_column_splits_is_the_row_updated_whole(dtype, kind, stochastic,
                                                                     options, d, data):
    """The update takes a 16-bit row's columns a block at a time (16 in registers, then the
    rest): each column's result depends on its own values and its column number only, so a
    table updated whole and in two column splits (the second with its first column's number)
    have the same bits, wherever the blocks fall."""
    k = data.draw(st.integers(0, d))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    kw = dict(clipvalue=1.0, weight_decay_factor=0.01, clip_weight_min=-2.0,
              clip_weight_max=1.5, gradient_multiplier=lambda step: 0.5) if options else {}
    opt = {"sgd": ec.SGD, "adagrad": ec.Adagrad}[kind](learning_rate=0.3, **kw)
    n = 24
    table = torch.randn(n, d, generator=gen).to(dtype)
    slots = {s.name: torch.rand(n, d, generator=gen) for s in opt.slots}
    rows = torch.randperm(n, generator=gen)[:16]
    grad = torch.randn(16, d, generator=gen)
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 3, n)
    parts = [(0, k), (k, d)] if 0 < k < d else [(0, d)]
    split = [(table[:, a:b].clone(), {s: v[:, a:b].clone() for s, v in slots.items()}, a, b)
             for a, b in parts]
    update(table, slots, rows, grad, opt, 0.3, 5, round_to=rounding.Rounding(stochastic, seg).at(5),
           gradient_multiplier=0.5 if options else None)
    for t, s, a, b in split:
        r = rounding.Rounding(stochastic, seg, col0=a).at(5)
        update(t, s, rows, grad[:, a:b].contiguous(), opt, 0.3, 5, round_to=r,
               gradient_multiplier=0.5 if options else None)
        assert same_bits(t, table[:, a:b])
        assert all(torch.equal(s[name], slots[name][:, a:b]) for name in s)


@requires_native
@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(COMPACT), st.sampled_from(["sgd", "adagrad", "rowwise"]), st.booleans(),
       st.booleans(), st.integers(1, 140), st.integers(0, 2**31 - 1))
def test_every_rule_on_rows_of_any_width_is_the_float32_rule_rounded(dtype, kind, stochastic,
                                                                      options, d, seed):
    """Rows of any width (whole 16-column blocks and a tail, or a tail only), every rule, to
    nearest or stochastically: the rounded float32 result or, where float32 noise crosses a
    16-bit boundary, its neighbour, never further (as the test of every rule above, width 8)."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(clipvalue=1.0, weight_decay_factor=0.01, clip_weight_min=-2.0,
              clip_weight_max=1.5, gradient_multiplier=lambda step: 0.5) if options else {}
    opt = {"sgd": ec.SGD, "adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad}[kind](
        learning_rate=0.3, **kw)
    n = 24
    table = torch.randn(n, d, generator=gen).to(dtype)
    slots = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen) + 0.1 for s in opt.slots}
    rows = torch.randperm(n, generator=gen)[:16]
    grad = torch.randn(16, d, generator=gen)
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 3, n)
    new_w, _ = reference_update(opt, table[rows].float(), grad,
                                {k: v[rows] for k, v in slots.items()}, lr=0.3, step=0)
    want = oracle_round(torch.tensor(new_w, dtype=torch.float32), dtype, stochastic,
                        identities(seg, rows), 11).float()
    update(table, slots, rows, grad, opt, 0.3, 0,
           round_to=rounding.Rounding(stochastic, seg).at(11),
           gradient_multiplier=0.5 if options else None)
    got = table[rows].float()
    ulp = (torch.nextafter(want.to(dtype), torch.full_like(want, torch.inf).to(dtype)).float()
           - want).abs()
    assert bool(((got - want).abs() <= ulp * 1.01).all())
    assert float((got == want).float().mean()) > 0.9
