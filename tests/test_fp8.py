"""8-bit rows with a float32 scale per row (docs/semantics.md section 14): float8_e4m3fn and
float8_e5m2 tables.

The quantization (numerics/rounding.py ``quantize``) against an oracle written from the documented
rule in Python ints and floats; its statistics (unbiased, subnormals included; never overflows);
the update of the optimizers against the float32 rule quantized; and the engine: the same bits
whatever the threads, the stacking and the path.
"""

from __future__ import annotations

import math
import struct
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples
from switches import kernels

import embcore as ec
from embcore.numerics import rounding
from embcore.ops.reference_optim import reference_update
from embcore.ops.update import update

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# the documented constants: largest finite value, mantissa bits, smallest normal, spacing below
LIMITS = {torch.float8_e4m3fn: (448.0, 3, 2.0**-6, 2.0**-9),
          torch.float8_e5m2: (57344.0, 2, 2.0**-14, 2.0**-16)}


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def oracle_scale(row: list[float], dtype: torch.dtype) -> float:
    """max |x| over the finite values / max finite; 1 when that is 0."""
    top = LIMITS[dtype][0]
    a = max((abs(v) for v in row if math.isfinite(v)), default=0.0)
    s = _f32(_f32(a) / top)
    return s if s > 0 else 1.0


def oracle_round(q: float, u: int, dtype: torch.dtype) -> float:
    """float32 ``q`` (within range) rounded stochastically with the uint32 ``u``: the documented
    rule in Python ints (normal results) and floats (subnormal ones)."""
    top, mant, normal, spacing = LIMITS[dtype]
    if math.isnan(q):
        return q
    if math.isinf(q):
        return q if dtype == torch.float8_e5m2 else math.nan
    drop = 23 - mant
    a = _bits(abs(q)) & 0x7FFFFFFF
    if abs(q) >= normal:
        mag = _from_bits(((a + (u >> (32 - drop))) >> drop) << drop)
    else:
        s = _f32(abs(q) + _f32((u >> 8) * 2.0**-24 * spacing))
        mag = math.floor(s / spacing) * spacing
    mag = min(mag, top)
    return -mag if q < 0 else mag


def oracle_quantize(x: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(U, D) float32 -> (U, D) float32 values ``code * scale`` by the oracle."""
    top = LIMITS[dtype][0]
    out = []
    for row, ub in zip(x.tolist(), bits.tolist()):
        s = oracle_scale(row, dtype)
        codes = []
        for v, u in zip(row, ub):
            q = _f32(v / s) if math.isfinite(v) else v
            q = max(-top, min(top, q)) if math.isfinite(q) else q
            codes.append(oracle_round(q, u, dtype))
        out.append([c * s for c in codes])
    return torch.tensor(out, dtype=torch.float32)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | nan).all())


_EDGES = [0.0, -0.0, 1.0, -1.0, 447.9, 448.0, 57343.0, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-16,
          1e-40, 3e38, -3e38, 1e-3, math.inf, -math.inf, math.nan]
_VALUES = st.one_of(st.sampled_from(_EDGES), st.floats(width=32),
                    st.floats(-1.0, 1.0, width=32))


# ------------------------------------------------------------------------------ the rounding
@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(FP8), st.lists(_VALUES, min_size=1, max_size=6), st.integers(1, 3),
       st.integers(0, 2**31 - 1))
def test_quantize_is_the_documented_rule(dtype, values, n, seed):
    """Codes and scales, stochastically (bits drawn at random) and to nearest (torch's own
    conversion of the clamped quotient), against the oracle."""
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor([values] * n, dtype=torch.float32) * (torch.rand(n, 1, generator=g) + 0.5)
    bits = torch.randint(0, 2**32, x.shape, generator=g)
    codes, scales = rounding.quantize(x, dtype, bits)
    assert codes.dtype == dtype and scales.dtype == torch.float32 and scales.shape == (n, 1)
    assert [float(s) for s in scales[:, 0]] == [oracle_scale(r, dtype) for r in x.tolist()]
    assert same_values(rounding.widen(codes, scales), oracle_quantize(x, bits, dtype))
    near, s2 = rounding.quantize(x, dtype)
    assert torch.equal(s2, scales)
    top = LIMITS[dtype][0]
    q = (x / scales).clamp(-top, top)
    finite = torch.isfinite(x)
    assert same_values(near.float()[finite], q.to(dtype).float()[finite])


@pytest.mark.parametrize("dtype", FP8)
def test_a_row_never_overflows(dtype):
    """Rows of every magnitude (float32's largest included) quantize to finite codes within the
    dtype's range, each value within one code spacing of its own (relative to the row's max)."""
    g = torch.Generator().manual_seed(1)
    mags = torch.tensor([1e-30, 1e-3, 1.0, 1e4, 1e30, 3.4e38])
    x = (torch.rand(6, 64, generator=g) * 2 - 1) * mags[:, None]  # (U, D) finite, |x| <= mag
    x[:, 0] = mags * torch.sign(x[:, 0])  # (the largest of each row, exactly its magnitude)
    for bits in (None, torch.randint(0, 2**32, x.shape, generator=g)):
        codes, scales = rounding.quantize(x, dtype, bits)
        assert bool(torch.isfinite(codes.float()).all()) and bool(torch.isfinite(scales).all())
        assert float(codes.float().abs().max()) <= LIMITS[dtype][0]
        err = (rounding.widen(codes, scales) - x).abs().amax(1) / x.abs().amax(1)
        assert bool((err <= 2.0 ** -LIMITS[dtype][1]).all()), err


@pytest.mark.parametrize("dtype", FP8)
def test_zeros_and_non_finite_rows(dtype):
    """A row of zeros keeps scale 1; NaN stays NaN; an infinity stays one in e5m2 and is NaN in
    e4m3fn; the finite values of such a row set its scale."""
    x = torch.tensor([[0.0, -0.0, 0.0], [math.nan, 2.0, -1.0], [math.inf, -4.0, 1.0]])
    codes, scales = rounding.quantize(x, dtype)  # (to nearest: the largest is max_finite)
    top = LIMITS[dtype][0]
    assert scales[:, 0].tolist() == [1.0, _f32(2.0 / top), _f32(4.0 / top)]
    v = rounding.widen(codes, scales)
    assert v[0].tolist() == [0.0, 0.0, 0.0] and math.isnan(v[1, 0]) and v[1, 1] == 2.0
    assert v[2, 1] == -4.0
    if dtype == torch.float8_e5m2:
        assert v[2, 0] == math.inf
    else:
        assert math.isnan(v[2, 0])


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("at", ["normal", "subnormal"])
def test_stochastic_rounding_is_unbiased(dtype, at):
    """E[round(q)] = q between two neighbours, normal and subnormal, with the row keys' bits."""
    _, mant, _, spacing = LIMITS[dtype]
    lo, ulp = (1.0, 2.0**-mant) if at == "normal" else (3 * spacing, spacing)
    n = 200_000
    keys = rounding.row_keys(torch.arange(n), rounding.step_key(5))
    bits = rounding.column_bits(keys, 1)[:, 0]
    for frac in (0.03, 0.25, 0.5, 0.9):
        q = torch.full((n,), lo + frac * ulp)
        r = rounding.round_stochastic(q, bits, dtype).float()
        assert bool(((r == lo) | (r == lo + ulp)).all())
        p = float(((r - lo) / ulp).mean())
        assert abs(p - frac) < 5 * (frac * (1 - frac) / n) ** 0.5 + 1e-4, (frac, p)


# ------------------------------------------------------------------------------- the update
@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(FP8), st.sampled_from(["sgd", "adagrad", "rowwise", "adam"]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_the_update_is_the_float32_rule_quantized(dtype, kind, stochastic, seed):
    """A row is widened (code * scale), updated by the optimizer's float32 rule (the oracle of
    ops/reference_optim.py), and quantized with the rows' bits: the new codes and scales."""
    gen = torch.Generator().manual_seed(seed)
    opt = {"sgd": ec.SGD, "adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad,
           "adam": ec.Adam}[kind](learning_rate=0.3)
    n, d = 32, 8
    codes, scales = rounding.quantize(torch.randn(n, d, generator=gen), dtype)
    slots = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen) + 0.1
             for s in opt.slots}
    rows = torch.randperm(n, generator=gen)[:20]
    grad = torch.randn(20, d, generator=gen)
    seg = rounding.shard_segments([("t", 0, torch.arange(n))], 3, n)
    r = rounding.Rounding(stochastic, seg).at(11)
    new_w, new_slots = reference_update(opt, rounding.widen(codes[rows], scales[rows]), grad,
                                        {k: v[rows] for k, v in slots.items()}, lr=0.3, step=0)
    new = torch.tensor(new_w, dtype=torch.float32)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[rows] = False
    before = rounding.widen(codes, scales)
    table = codes.clone()
    update(table, {**slots, "scales": scales}, rows, grad, opt, 0.3, 0, round_to=r)
    got = rounding.widen(table, scales)
    assert torch.equal(got[untouched], before[untouched])
    bits = (rounding.column_bits(r.keys32(rows), d) if stochastic else None)
    # the float32 rule computed in another order may differ in its last bits: compare the
    # values against the oracle quantized, within one code spacing of the row's scale
    want_codes, want_scales = rounding.quantize(new, dtype, bits)
    torch.testing.assert_close(scales[rows], want_scales, rtol=1e-5, atol=0)
    step = want_scales * 2.0 ** -LIMITS[dtype][1] * LIMITS[dtype][0]
    assert bool(((got[rows] - rounding.widen(want_codes, want_scales)).abs()
                 <= step * 1.01).all())
    for k, v in new_slots.items():
        torch.testing.assert_close(slots[k][rows], torch.tensor(v, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- the engine
def _train(dtype, steps=4, threads=None, two_tables=True, fast=True, stochastic=True, seed=0,
           opt=None, dynamic=False):
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
            emb = ec.Embedding(feats, opt or ec.Adagrad(learning_rate=0.25))
            gens = {k: torch.Generator().manual_seed(seed + ord(k)) for k in tables}
            for _ in range(steps):
                emb.enqueue({k: torch.randint(0, t.vocabulary_size, (64,), generator=gens[k])
                             * (1000003 if dynamic else 1) for k, t in tables.items()})
                acts = emb.dequeue()
                emb.apply_gradients({k: torch.randn(a.shape, generator=gens[k])
                                     for k, a in acts.items()})
            return {k: v.clone() for k, v in emb.state_dict().items()}, emb
    finally:
        torch.set_num_threads(old)


def _same_state(a, b, keys=None):
    for k in keys or a:
        if isinstance(a[k], torch.Tensor) and a[k].is_floating_point():
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1 else a[k],
                               b[k].view(torch.uint8) if b[k].element_size() == 1 else b[k]), k


@pytest.mark.parametrize("dtype", FP8)
def test_the_engine_trains_8_bit_rows_and_reads_them_with_their_scales(dtype):
    ref, emb = _train(dtype)
    w, s = ref["b/parameters"], ref["b/scales"]
    assert w.dtype == dtype and s.dtype == torch.float32 and s.shape == (50, 1)
    assert ref["b/accumulators"].dtype == torch.float32
    ids = torch.tensor([0, 3, 49, 3])
    acts = emb.lookup({"a": torch.tensor([1, 2, 3, 4]), "b": ids})
    assert acts["b"].dtype == torch.float32
    assert torch.equal(acts["b"], w[ids].float() * s[ids])
    initial, _ = _train(dtype, steps=0)
    assert not torch.equal(initial["b/scales"], s)  # the updates moved the scales


@pytest.mark.parametrize("dtype", FP8)
def test_the_same_bits_whatever_the_threads_the_stacking_and_the_path(dtype):
    ref, emb = _train(dtype)
    assert emb.plan.physical[0].tables == ("a", "b")  # stacked
    _same_state(ref, _train(dtype, threads=1)[0])
    _same_state(ref, _train(dtype, threads=2)[0])
    alone, _ = _train(dtype, two_tables=False)  # b's rows and keys: the seed and its name
    _same_state(ref, alone, ["b/parameters", "b/scales", "b/accumulators"])
    # kernels on and off: the fused kernel's float32 rule may differ from the optimizers' torch
    # math in a result's last bit (as for float32 and 16-bit rows); on dyadic SGD steps, the
    # same bits (the widening, the scales and the rounding: the same rules)
    sgd = ec.SGD(learning_rate=0.125)
    _same_state(_train(dtype, opt=sgd)[0], _train(dtype, opt=sgd, fast=False)[0])
    nearest, _ = _train(dtype, stochastic=False)
    assert not torch.equal(nearest["b/scales"], ref["b/scales"]) or not torch.equal(
        nearest["b/parameters"].float(), ref["b/parameters"].float())


@pytest.mark.parametrize("dtype", FP8)
def test_updates_far_below_a_code_step_train_stochastically_and_stall_to_nearest(dtype):
    """A row of ones and one entry 2 (its scale fixed by the 2): each step moves the ones by
    1/16 of their code spacing; to nearest loses every step, stochastically the mean follows."""
    mant = LIMITS[dtype][1]
    steps, n, d = 100, 128, 16
    means = {}
    for stochastic in (True, False):
        init = torch.ones(n, d)
        init[:, 0] = 2.0
        t = ec.TableConfig(vocabulary_size=n, dim=d, dtype=dtype, initializer=init,
                           stochastic_rounding=stochastic, name="t")
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=1.0))
        g = torch.full((n, d), -(2.0**-mant) / 16)
        g[:, 0] = 0.0
        for _ in range(steps):
            emb.enqueue({"f": torch.arange(n)})
            emb.dequeue()
            emb.apply_gradients({"f": g})
        sd = emb.state_dict()
        v = sd["t/parameters"].float() * sd["t/scales"]
        means[stochastic] = float(v[:, 1:].mean())
    want = 1.0 + steps * 2.0**-mant / 16
    assert abs(means[True] - want) < 0.05 * 2.0**-mant * steps / 16 + 2.0**-mant / 8, means
    assert means[False] == 1.0


SHARDED = {"a": "row_div", "b": "row_mod", "d": "table", "e": "replicated"}
SIZES = {"a": 37, "b": 23, "d": 19, "e": 11}


def _sharded_engine(dtype, **kw):
    torch.manual_seed(7)
    tables = {n: ec.TableConfig(vocabulary_size=v, dim=8, dtype=dtype, name=n)
              for n, v in SIZES.items()}
    return ec.Embedding({n: ec.FeatureConfig(table=t) for n, t in tables.items()},
                        ec.SGD(learning_rate=0.125), **kw)


def _sharded_steps(step, world):
    """Per rank: its batch and its dyadic gradients (sums exact in any order)."""
    g = torch.Generator().manual_seed(100 + step)
    return [({n: torch.randint(0, v, (4,), generator=g) for n, v in SIZES.items()},
             {n: torch.randint(-64, 65, (4, 8), generator=g).float() / 64 for n in SIZES})
            for _ in range(world)]


def _sharded_worker(rank, world, init, dtype, steps):
    ref = _sharded_engine(dtype)
    for s in range(steps):
        per_rank = _sharded_steps(s, world)
        ref.enqueue({n: torch.cat([b[n] for b, _ in per_rank]) for n in SIZES})
        ref.dequeue()
        ref.apply_gradients({n: torch.cat([g[n] for _, g in per_rank]) for n in SIZES})
    every = {n: torch.arange(v) for n, v in SIZES.items()}
    want = ref.lookup(every)  # every row's value, code * scale
    init()
    emb = _sharded_engine(dtype, sharding=SHARDED, timeout=60)
    for s in range(steps):
        batch, grads = _sharded_steps(s, world)[rank]
        emb.enqueue(batch)
        acts = emb.dequeue()
        emb.apply_gradients(grads)
    got = emb.lookup(every)  # (the rows fetched from their owners, widened there)
    assert acts is not None and emb.state_dict()["a/scales"] is not None
    whole = {t.name: v for t, v in emb.embedding_tables.items()}  # (gathered: the codes)
    assert all(whole[n].dtype == dtype and whole[n].shape == (v, 8) for n, v in SIZES.items())
    for name in SIZES:
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], want[name]), (name, SHARDED[name])


@pytest.mark.parametrize("dtype", FP8)
def test_sharded_8_bit_tables_round_as_one_process_does(dtype):
    """Every row strategy, W = 2 against W = 1 on dyadic SGD steps: the same codes and scales
    (the rows travel widened with their scales; the owner quantizes with the rows' bits)."""
    from distributed import run_on
    run_on(2, _sharded_worker, dtype, 3)


def _refused(rank, world, init, dtype):
    init()
    t = ec.TableConfig(vocabulary_size=10, dim=4, dtype=dtype, name="c")
    with pytest.raises(ValueError, match=r"table 'c'.*column split over several processes.*"
                                         r"row strategy"):
        ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                     sharding="column", timeout=60)


@pytest.mark.parametrize("dtype", FP8)
def test_what_8_bit_tables_do_not_take_yet_is_refused_by_name(dtype):
    """The slow tier and a column split over processes: a ValueError naming the table, the
    dtype and the fix, before anything is built."""
    from distributed import run_on
    mk = lambda **kw: ec.TableConfig(vocabulary_size=5000, dim=64, dtype=dtype,  # noqa: E731
                                     name="t", **kw)
    kind = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=f"table 't': {kind} rows do not take the slow tier"):
        ec.Embedding({"f": ec.FeatureConfig(table=mk())}, ec.SGD(learning_rate=0.1),
                     memory_budget=200_000)
    run_on(2, _refused, dtype)


def test_checkpoints_keep_codes_and_scales_and_convert_on_load(tmp_path):
    """Rows are saved as codes plus their scales; a load into the same dtype restores both (the
    scales with ``slots=False`` too: they are part of the rows); into a wider table the values
    ``code * scale`` (exact in float32), narrowed as usual into a 16-bit one; any rows into an
    8-bit table quantized to nearest."""
    e4, emb = _train(torch.float8_e4m3fn, steps=2)
    ec.save(tmp_path / "c", emb)
    values = e4["b/parameters"].float() * e4["b/scales"]
    _, same = _train(torch.float8_e4m3fn, steps=0, seed=5)
    ec.load(tmp_path / "c", same)
    _same_state(e4, same.state_dict())
    _, fresh = _train(torch.float8_e4m3fn, steps=0, seed=5)
    ec.load(tmp_path / "c", fresh, slots=False)
    _same_state(e4, fresh.state_dict(), ["b/parameters", "b/scales"])
    _, wide = _train(torch.float32, steps=0, seed=5)
    ec.load(tmp_path / "c", wide)
    got = wide.state_dict()
    assert "b/scales" not in got and torch.equal(got["b/parameters"], values)
    assert torch.equal(got["b/accumulators"], e4["b/accumulators"])
    _, half = _train(torch.float16, steps=0, seed=5)
    ec.load(tmp_path / "c", half)
    assert torch.equal(half.state_dict()["b/parameters"], values.half())
    _, e5 = _train(torch.float8_e5m2, steps=0, seed=5)
    ec.load(tmp_path / "c", e5)
    codes, scales = rounding.quantize(values, torch.float8_e5m2)
    _same_state({"b/parameters": codes, "b/scales": scales}, e5.state_dict(),
                ["b/parameters", "b/scales"])
    ec.save(tmp_path / "w", wide)  # float32 rows into an 8-bit table
    _, back = _train(torch.float8_e4m3fn, steps=0, seed=5)
    ec.load(tmp_path / "w", back)
    codes, scales = rounding.quantize(values, torch.float8_e4m3fn)
    _same_state({"b/parameters": codes, "b/scales": scales}, back.state_dict(),
                ["b/parameters", "b/scales"])


@pytest.mark.parametrize("dtype", FP8)
def test_8_bit_rows_serve_their_values_and_quantize(dtype):
    """``for_serving()`` serves the rows' values (code * scale, float32), or int8 / fp16 codes
    quantized from them; plain nn.Parameters are refused by name."""
    t = ec.TableConfig(vocabulary_size=50, dim=8, dtype=dtype, name="t")
    layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "adagrad")
    ids = torch.tensor([0, 3, 49, 3])
    for _ in range(2):
        out = layer({"f": torch.arange(20)})["f"]
        out.sum().backward()
    sd = layer.engine.state_dict()
    values = sd["t/parameters"].float() * sd["t/scales"]  # (50, 8)
    served = layer.for_serving()
    assert torch.equal(served({"f": ids})["f"], values[ids])
    int8 = layer.for_serving(quantize="int8")({"f": ids})["f"]
    span = (values.amax(1) - values.amin(1)).max()
    assert (int8 - values[ids]).abs().max() <= span / 255 + 1e-6
    assert torch.equal(layer.for_serving(quantize="fp16")({"f": ids})["f"],
                       values[ids].half().float())
    codes = layer.embedding_tables[t]  # (the codes alone: refused where values are read)
    with pytest.raises(ValueError, match=r"table 't': float8_\w+ rows are codes.*for_serving"):
        ec.serving_embedding_lookup({"f": ids}, None, {t: codes}, layer.feature_config)
    with pytest.raises(ValueError, match=r"table 't': float8_\w+ rows are codes"):
        ec.quantize_table(codes, "int8", name="t")
    with pytest.raises(ValueError, match=r"tables \['t'\] have 8-bit rows.*pass an optimizer"):
        ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, optimizer=None)


def _fp8_layer(dtype, seed=0):
    torch.manual_seed(seed)
    tables = {"a": ec.TableConfig(vocabulary_size=40, dim=8, dtype=dtype, name="a"),
              "b": ec.TableConfig(vocabulary_size=32, dim=8, dtype=dtype, name="b",
                                  dynamic=ec.DynamicVocabulary()),
              "c": ec.TableConfig(vocabulary_size=20, dim=8, name="c")}
    return ec.EmbeddingLayer({k: ec.FeatureConfig(table=t) for k, t in tables.items()},
                             ec.Adagrad(learning_rate=0.25))


def _fp8_steps(layer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        out = layer({"a": torch.randint(0, 40, (16,), generator=g),
                     "b": torch.randint(0, 24, (16,), generator=g) * 1000003,
                     "c": torch.randint(0, 20, (16,), generator=g)})
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in out.values()).backward()


@pytest.mark.parametrize("dtype", FP8)
def test_a_publish_of_8_bit_rows_serves_what_for_serving_serves(dtype, tmp_path):
    """A publish carries an 8-bit table's codes with their scales: a follower (from the snapshot,
    refreshed by deltas, or loaded anew) serves the values ``code * scale`` exactly as
    ``for_serving()`` does; ``ec.load`` of the directory resumes codes and scales bit for bit
    (the scales with ``slots=False`` too), and into a table of another dtype is refused."""
    layer = _fp8_layer(dtype)
    _fp8_steps(layer, 2, 1)
    d = tmp_path / "pub"
    assert ec.publish(d, layer)["kind"] == "snapshot"
    follower = ec.load_published(d)
    ask = {"a": torch.arange(40), "b": torch.arange(30) * 1000003, "c": torch.arange(20)}
    want = first = layer.for_serving()(ask)
    got = follower(ask)
    for k in ask:
        assert torch.equal(got[k], want[k]), k
    _fp8_steps(layer, 3, 2)
    info = ec.publish(d, layer, slots=True)
    assert info["kind"] == "snapshot"  # (a change of slots)
    _fp8_steps(layer, 2, 3)
    info = ec.publish(d, layer, slots=True)
    assert info["kind"] == "delta" and info["rows"]["a"] > 0
    assert follower.refresh() == 2
    want = layer.for_serving()(ask)
    for served in (follower, ec.load_published(d)):
        got = served(ask)
        for k in ask:
            assert torch.equal(got[k], want[k]), k
    assert not torch.equal(want["a"], first["a"])  # (the deltas changed what is served)
    sd = layer.engine.state_dict()
    back = _fp8_layer(dtype, seed=9)
    ec.load(d, back)
    _same_state(sd, back.engine.state_dict(),
                ["a/parameters", "a/scales", "a/accumulators", "b/parameters", "b/scales",
                 "c/parameters"])
    rows = _fp8_layer(dtype, seed=9)
    ec.load(d, rows, slots=False)
    _same_state(sd, rows.engine.state_dict(), ["a/parameters", "a/scales", "b/scales"])
    wide = _fp8_layer(torch.float32, seed=9)
    before = wide.engine.state_dict()
    with pytest.raises(ValueError, match=r"table 'a' has float8_\w+ rows in .* but float32 rows"):
        ec.load(d, wide)
    _same_state(before, wide.engine.state_dict())


@pytest.mark.parametrize("dtype", FP8)
def test_the_spec_names_8_bit_dtypes_and_tables_stack_by_dtype_and_rounding(dtype):
    name = str(dtype).removeprefix("torch.")
    t = ec.TableConfig(vocabulary_size=10, dim=4, dtype=dtype, stochastic_rounding=False,
                       name="t")
    spec = ec.EmbeddingSpec({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    d = spec.to_dict()
    assert d["tables"]["t"]["dtype"] == name
    cfg = ec.EmbeddingSpec.from_dict(d).feature_config["f"].table
    assert cfg.dtype == dtype and cfg.stochastic_rounding is False
    mk = lambda n, dt, sr: ec.TableConfig(vocabulary_size=10, dim=4, dtype=dt,  # noqa: E731
                                          stochastic_rounding=sr, name=n)
    emb = ec.Embedding({"a": ec.FeatureConfig(table=mk("a", dtype, True)),
                        "b": ec.FeatureConfig(table=mk("b", dtype, False)),
                        "c": ec.FeatureConfig(table=mk("c", dtype, True)),
                        "d": ec.FeatureConfig(table=mk("d", torch.float16, True))},
                       ec.SGD(learning_rate=0.1))
    assert sorted(p.tables for p in emb.plan.physical) == [("a", "c"), ("b",), ("d",)]


@pytest.mark.parametrize("dtype", FP8)
def test_dynamic_8_bit_tables_admit_rows_with_scales_and_round_the_same_everywhere(dtype):
    """Raw ids: a new row's initial values quantized to nearest with its scale; updates with
    the identity of the raw id, so stacked or alone, any threads, either path: the same bits;
    a checkpoint restores codes, scales and the map."""
    ref, emb = _train(dtype, dynamic=True)
    assert emb.plan.physical[0].tables == ("a", "b")  # stacked
    ids, rows = emb.vocabulary("b")
    assert ids.numel() > 0
    sd = emb.state_dict()
    values = sd["b/parameters"].float() * sd["b/scales"]
    got = emb.lookup({"a": torch.tensor([0]), "b": ids})["b"]
    assert torch.equal(got, values[rows])
    alone, _ = _train(dtype, dynamic=True, two_tables=False)
    _same_state(ref, alone, ["b/parameters", "b/scales", "b/accumulators"])
    _same_state(ref, _train(dtype, dynamic=True, threads=1)[0])
    sgd = ec.SGD(learning_rate=0.125)  # kernels on and off: on dyadic SGD steps, the same bits
    _same_state(_train(dtype, opt=sgd, dynamic=True)[0],
                _train(dtype, opt=sgd, dynamic=True, fast=False)[0])
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        ec.save(f"{d}/c", emb)
        _, back = _train(dtype, dynamic=True, steps=0, seed=5)
        ec.load(f"{d}/c", back)
        assert torch.equal(back.lookup({"a": torch.tensor([0]), "b": ids})["b"], got)


def _dynamic_worker(rank, world, init, dtype, steps):
    def engine(**kw):
        torch.manual_seed(7)
        t = ec.TableConfig(vocabulary_size=64, dim=8, dtype=dtype, name="f",
                           dynamic=ec.DynamicVocabulary())
        return ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.125), **kw)

    def batches(step):
        g = torch.Generator().manual_seed(100 + step)
        return [(torch.randint(0, 64, (4,), generator=g) * 7919,
                 torch.randint(-64, 65, (4, 8), generator=g).float() / 64) for _ in range(world)]

    ref = engine()
    for s in range(steps):
        per_rank = batches(s)
        ref.enqueue({"f": torch.cat([b for b, _ in per_rank])})
        ref.dequeue()
        ref.apply_gradients({"f": torch.cat([g for _, g in per_rank])})
    seen = torch.cat([b for s in range(steps) for b, _ in batches(s)]).unique()
    want = ref.lookup({"f": seen})["f"]
    init()
    emb = engine(sharding={"f": "hash"}, timeout=60)
    for s in range(steps):
        ids, g = batches(s)[rank]
        emb.enqueue({"f": ids})
        emb.dequeue()
        emb.apply_gradients({"f": g})
    assert torch.equal(emb.lookup({"f": seen})["f"], want)


@pytest.mark.parametrize("dtype", FP8)
def test_a_hashed_8_bit_table_over_two_processes_rounds_as_one_process_does(dtype):
    from distributed import run_on
    run_on(2, _dynamic_worker, dtype, 3)
