"""16-bit rows that overflow say so (docs/semantics.md section 14).

An update whose float32 result of a row is finite but rounds to an infinity in the row's dtype
leaves that row and its slots as they were, on the fused kernel and the torch path alike, and is
reported: a RuntimeWarning under ``skip_nonfinite_gradients``, else an OverflowError once the step
is counted, both naming the table and the rows. A narrowing load refuses values beyond the
table's range unless ``saturate=True``; fp16 serving names the value it refuses.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from switches import kernels

import embcore as ec
from embcore.kernels import cpu
from embcore.numerics import rounding
from embcore.ops.update import update

# per dtype: a finite row value near the top of its range, and a step that carries it past it
# whichever way it rounds (float32 keeps the result finite: only the rounding to the row's dtype
# overflows; bfloat16: to float32's largest value, which rounds up but for 1 in 2**16 of the
# random bits)
_BF16_TOP = float(torch.finfo(torch.bfloat16).max)
EDGE = {torch.float16: (65000.0, 1000.0),
        torch.bfloat16: (_BF16_TOP, float(torch.finfo(torch.float32).max) - _BF16_TOP)}
PATHS = [pytest.param(True, id="kernel", marks=pytest.mark.skipif(
    not cpu.available(), reason=f"fused kernels unavailable: {cpu.error()}")),
    pytest.param(False, id="torch")]


# (width, column of the overflowing value): scalar columns only; the first lane of the kernel's
# first 16-wide SIMD block (AVX-512); a lane of the second block; the scalar tail after two
# blocks. The SIMD paths find an overflow as they round, the scalar columns after.
WIDTHS = [(2, 0), (16, 0), (40, 17), (40, 37)]


def _engine(dtype, stochastic, optimizer, big, dim=2, col=0):
    init = torch.ones(4, dim)
    init[1, col], init[2], init[3] = big, 2.0, 0.0
    t = ec.TableConfig(vocabulary_size=4, dim=dim, name="t", dtype=dtype,
                       stochastic_rounding=stochastic, initializer=init)
    return t, ec.Embedding(ec.FeatureConfig(table=t), optimizer)


def _step(emb, push, col=0):
    """One step on rows 0 and 1; row 1's gradient ``-push`` in column ``col``, the rest 1."""
    emb.enqueue(torch.tensor([0, 1]))
    grad = torch.ones_like(emb.dequeue())
    grad[1, col] = -push
    emb.apply_gradients(grad)


@pytest.mark.parametrize("native_on", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize(("dim", "col"), WIDTHS)
def test_an_overflowing_update_raises_naming_the_rows_and_leaves_them(native_on, dtype,
                                                                      stochastic, dim, col):
    big, push = EDGE[dtype]
    with kernels(native_on):
        t, emb = _engine(dtype, stochastic, ec.SGD(learning_rate=1.0), big, dim, col)
        before = emb.embedding_tables[t].clone()
        with pytest.raises(OverflowError, match=r"rows \[1\] of table 't' overflows "
                           + str(dtype).removeprefix("torch.")) as caught:
            _step(emb, push, col)
        assert "skip_nonfinite_gradients" in str(caught.value)
        w = emb.embedding_tables[t]
        assert torch.isfinite(w.float()).all()
        assert torch.equal(w[1], before[1])                     # left as it was
        assert torch.equal(w[0].float(), torch.zeros(dim))      # the other row updated
        assert emb.step == 1                                    # the step counted, consumed
        with pytest.raises(RuntimeError):
            emb.apply_gradients(torch.zeros(2, dim))


@pytest.mark.parametrize("native_on", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize(("dim", "col"), WIDTHS)
def test_under_skip_nonfinite_gradients_the_rows_are_skipped_with_a_warning(native_on, dtype,
                                                                            stochastic, dim,
                                                                            col):
    big, push = EDGE[dtype]
    with kernels(native_on):
        # a gradient of 1 on an accumulator of 3: a step of exactly lr / 2 = push
        t, emb = _engine(dtype, stochastic, ec.Adagrad(
            learning_rate=2 * push, initial_accumulator_value=3.0,
            skip_nonfinite_gradients=True), big, dim, col)
        acc = emb.state_dict()["t/accumulators"]
        before, acc_before = emb.embedding_tables[t].clone(), acc.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(emb, 1.0, col)
        said = [str(c.message) for c in caught if c.category is RuntimeWarning]
        assert len(said) == 1 and "rows [1] of table 't'" in said[0], said
        assert "skip_nonfinite_gradients=True" in said[0]
        acc = emb.state_dict()["t/accumulators"]
        assert torch.equal(emb.embedding_tables[t][1], before[1])  # the row and its slots
        assert torch.equal(acc[1], acc_before[1])
        assert not torch.equal(acc[0], acc_before[0])               # the other row trained
        assert emb.step == 1


@pytest.mark.parametrize("native_on", PATHS)
def test_rows_already_infinite_or_nan_gradients_are_not_overflow(native_on):
    """Only the rounding's overflow is reported: a float32 result that is itself infinite or
    NaN (a NaN gradient, an infinite row) is applied as on a float32 table."""
    with kernels(native_on):
        t, emb = _engine(torch.float16, False, ec.SGD(learning_rate=1.0), 1.0)
        emb.embedding_tables[t][2, 0] = float("inf")
        emb.enqueue(torch.tensor([0, 1, 2]))
        grad = torch.ones_like(emb.dequeue())
        grad[1, 0] = float("nan")
        emb.apply_gradients(grad)  # (no error)
        w = emb.embedding_tables[t].float()
        assert torch.isnan(w[1, 0]) and torch.isinf(w[2, 0]) and emb.step == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise"])
@pytest.mark.parametrize("d", [8, 16, 40])  # below, at and beyond the 16-wide SIMD blocks
def test_the_kernel_and_the_torch_path_leave_the_same_rows(dtype, stochastic, kind, d):
    if not cpu.available():
        pytest.skip(f"fused kernels unavailable: {cpu.error()}")
    gen = torch.Generator().manual_seed(7)
    top = float(torch.finfo(dtype).max)
    n = 64
    # rows near the top of the range (either sign), steps below 0.3 % of it: some cross it,
    # none leaves float32's range (bfloat16's top is float32's less 0.4 %)
    opt = {"sgd": ec.SGD, "adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad}[kind](
        learning_rate=top * {"sgd": 1e-3, "adagrad": 3e-3, "rowwise": 1.5e-3}[kind])
    sign = torch.where(torch.rand(n, d, generator=gen) < 0.5, -1.0, 1.0)
    start = (sign * top * (1 - 0.005 * torch.rand(n, d, generator=gen))).to(dtype)
    slots0 = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen) + 0.5
              for s in opt.slots}
    rows = torch.randperm(n, generator=gen)[:48]
    grad = torch.randn(48, d, generator=gen).clamp(-3, 3)
    r = rounding.Rounding(stochastic, rounding.shard_segments([("t", 0, torch.arange(n))], 3,
                                                              n)).at(5)
    got = {}
    for on in (True, False):
        table, slots = start.clone(), {k: v.clone() for k, v in slots0.items()}
        with kernels(on):
            left = update(table, slots, rows, grad, opt, opt.learning_rate, 0, round_to=r,
                          guard=True)
        got[on] = (table, slots, left)
    (t1, s1, l1), (t0, s0, l0) = got[True], got[False]
    assert l1 is not None and l0 is not None and l1.numel() > 0
    assert torch.equal(l1.sort().values, l0.sort().values)
    assert torch.isfinite(t1.float()).all() and torch.isfinite(t0.float()).all()
    assert torch.equal(t1[l1], start[l1])  # left as they were, with their slots
    for k in slots0:
        assert torch.equal(s1[k][l1], slots0[k][l1])
        assert torch.equal(s0[k][l0], slots0[k][l0])
    if kind == "sgd":  # (the same float32 arithmetic: the same bits)
        assert torch.equal(t1.view(torch.int16), t0.view(torch.int16))
    # without the guard the kernel writes the infinities, as before
    table = start.clone()
    with kernels(True):
        assert update(table, {k: v.clone() for k, v in slots0.items()}, rows, grad, opt,
                      opt.learning_rate, 0, round_to=r) is None
    assert not torch.isfinite(table.float()).all()


# ----------------------------------------------------------------------------- loading
def _saved(tmp_path, values):
    t = ec.TableConfig(vocabulary_size=3, dim=2, name="t")
    emb = ec.Embedding(ec.FeatureConfig(table=t), ec.Adagrad(learning_rate=0.1))
    emb.embedding_tables[t].copy_(values)
    ec.save(tmp_path / "ckpt", emb)
    narrow = ec.TableConfig(vocabulary_size=3, dim=2, name="t", dtype=torch.float16)
    return narrow, ec.Embedding(ec.FeatureConfig(table=narrow), ec.Adagrad(learning_rate=0.1))


def test_a_narrowing_load_refuses_values_beyond_the_range(tmp_path):
    values = torch.tensor([[1.0, 2.0], [1e5, -3.0], [65519.0, float("inf")]])
    narrow, emb = _saved(tmp_path, values)
    before = emb.embedding_tables[narrow].clone()
    with pytest.raises(ValueError, match=r"table 't' is float16 .* row\(s\) \(1\) hold values "
                                         r"beyond float16's range \(largest \|x\| 100000") as e:
        ec.load(tmp_path / "ckpt", emb)
    assert "saturate=True" in str(e.value)
    assert torch.equal(emb.embedding_tables[narrow], before)  # nothing loaded
    assert emb.step == 0


def test_a_narrowing_load_saturates_when_asked(tmp_path):
    values = torch.tensor([[1.0, 2.0], [1e5, -7e4], [65519.0, float("inf")]])
    narrow, emb = _saved(tmp_path, values)
    ec.load(tmp_path / "ckpt", emb, saturate=True)
    w = emb.embedding_tables[narrow].float()
    assert torch.equal(w, torch.tensor([[1.0, 2.0], [65504.0, -65504.0],
                                        [65504.0, float("inf")]]))  # inf stays inf


def test_load_state_dict_narrows_by_the_same_rule():
    """Embedding.load_state_dict refuses float32 rows beyond a float16 table's range as ec.load
    does (or saturates them when asked); the layer's load_state_dict (the engine's tables, or
    its own nn.Parameters with optimizer=None) and a serving module's refuse them in torch's
    words."""
    values = torch.tensor([[1.0, 2.0], [1e5, -7e4], [65519.0, float("inf")]])
    narrow = ec.TableConfig(vocabulary_size=3, dim=2, name="t", dtype=torch.float16)
    emb = ec.Embedding(ec.FeatureConfig(table=narrow), ec.Adagrad(learning_rate=0.1))
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    with pytest.raises(ValueError, match=r"load_state_dict: table 't' is float16 .* the "
                                         r"state_dict, and 1 row\(s\) \(1\) hold values beyond "
                                         r"float16's range \(largest \|x\| 100000.*saturate=True"):
        emb.load_state_dict({"t/parameters": values}, strict=False)
    for k, v in before.items():
        assert torch.equal(emb.state_dict()[k], v), k  # nothing loaded
    emb.load_state_dict({"t/parameters": values}, strict=False, saturate=True)
    assert torch.equal(emb.embedding_tables[narrow].float(), torch.tensor(
        [[1.0, 2.0], [65504.0, -65504.0], [65504.0, float("inf")]]))  # inf stays inf
    emb.load_state_dict({"t/parameters": torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6e4]])},
                        strict=False)  # within the range: rounded to nearest, as ec.load
    assert emb.embedding_tables[narrow][2, 1] == 6e4
    for optimizer in ("adagrad", None):  # the engine's tables; the layer's nn.Parameters
        layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=narrow)}, optimizer)
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        with pytest.raises(RuntimeError, match=r"table 't' is float16 .* row\(s\) \(1\) .*"
                                               r"Clamp them to \+-65504"):
            layer.load_state_dict({**state, "t/parameters": values})
        for k, v in state.items():
            assert torch.equal(layer.state_dict()[k], v), (optimizer, k)
    for quantize in (None, "fp16"):  # a serving module's float16 rows, or float16 codes
        served = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=narrow)},
                                   "adagrad").for_serving(quantize=quantize)
        state = {k: v.clone() for k, v in served.state_dict().items()}
        assert state["t"].dtype == torch.float16
        with pytest.raises(RuntimeError, match=r"load_state_dict \(t\): table 't' is float16 .*"
                                               r"row\(s\) \(1\) .*Clamp them to \+-65504"):
            served.load_state_dict({"t": values})
        assert torch.equal(served.state_dict()["t"], state["t"])  # nothing loaded
        served.load_state_dict({"t": values.clamp(-65504, 65504)})  # as the message says
        assert served.state_dict()["t"][1, 0] == 65504


def _published(tmp_path, values):
    """A float32 engine's rows published (with slots), and a float16 twin to resume into."""
    t = ec.TableConfig(vocabulary_size=3, dim=2, name="t")
    emb = ec.Embedding(ec.FeatureConfig(table=t), ec.Adagrad(learning_rate=0.1))
    emb.embedding_tables[t].copy_(values)
    ec.publish(tmp_path / "pub", emb, slots=True)
    narrow = ec.TableConfig(vocabulary_size=3, dim=2, name="t", dtype=torch.float16)
    return narrow, ec.Embedding(ec.FeatureConfig(table=narrow), ec.Adagrad(learning_rate=0.1))


def test_resuming_a_publish_directory_narrows_by_the_same_rule(tmp_path):
    values = torch.tensor([[1.0, 2.0], [1e5, -7e4], [65519.0, float("inf")]])
    narrow, emb = _published(tmp_path, values)
    before = emb.embedding_tables[narrow].clone()
    with pytest.raises(ValueError, match=r"table 't' is float16 .* published entries, and 1 "
                                         r"row\(s\) \(1\) hold values beyond float16's range"):
        ec.load(tmp_path / "pub", emb)
    assert torch.equal(emb.embedding_tables[narrow], before) and emb.step == 0
    ec.load(tmp_path / "pub", emb, saturate=True)
    assert torch.equal(emb.embedding_tables[narrow].float(), torch.tensor(
        [[1.0, 2.0], [65504.0, -65504.0], [65504.0, float("inf")]]))


def test_fp16_serving_names_the_refused_rows_value():
    table = torch.tensor([[1.0, 2.0], [7e4, 1.0], [1e30, float("nan")]])
    with pytest.raises(ValueError, match=r"row 1 .* 70000\)") as e:
        ec.quantize_table(table, "fp16", name="t")
    assert "1e+30" not in str(e.value) and "nan" not in str(e.value)
