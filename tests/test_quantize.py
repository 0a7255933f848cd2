"""Quantized serving tables (embcore/quantize.py, ``for_serving(quantize=...)``): the int8
row-wise error bound, fp16 as a cast, lookups equal to serving the dequantized table bit for bit,
torch.export round trips, the bytes held, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from checks import fma32
from hypothesis import example, given, settings
from hypothesis import strategies as st
from profiles import examples
from strategies import cases

import embcore as ec
from embcore.ops.reference import reference_bags
from embcore.serving.quantize import dequantize_int8_rowwise, quantize_int8_rowwise

F32_MAX = torch.finfo(torch.float32).max


# ------------------------------------------------------------------------- the format itself
def int8_tolerance(table: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(N, 1) the bound on |x - deq(q(x))|: half a step, plus float32 rounding of the
    dequantization (a few ulps of the row's largest magnitude) and of a subnormal scale."""
    biggest = table.abs().amax(dim=1, keepdim=True).double()  # (N, 1)
    return scale.double()[:, None] / 2 + 2.0 ** -21 * biggest + 1e-40


magnitudes = st.sampled_from([2.0 ** -100, 2.0 ** -10, 1.0, 2.0 ** 10, 2.0 ** 66, 2.0 ** 126])


@st.composite
def tables(draw) -> torch.Tensor:
    """(N, D) float32 rows of random magnitudes, signs and ranges, some constant."""
    n, d = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    rows = []
    for _ in range(n):
        m = draw(magnitudes)
        if draw(st.integers(0, 4)) == 0:  # a constant row (zeros among them)
            rows.append([draw(st.sampled_from([0.0, -m, m]))] * d)
            continue
        rows.append([draw(st.floats(-m, m, width=32, allow_subnormal=True)) for _ in range(d)])
    return torch.tensor(rows, dtype=torch.float32)


@settings(max_examples=examples(300), deadline=None)
@given(tables())
@example(torch.tensor([[0.0, 0.0], [0.0, 3.565e-41]]))  # a subnormal step
def test_int8_error_is_at_most_half_a_step_per_entry(table):
    q, scale, bias = quantize_int8_rowwise(table)
    assert q.dtype == torch.uint8 and scale.dtype == bias.dtype == torch.float32
    assert torch.equal(bias, table.amin(dim=1))  # the row minimum, exactly
    back = dequantize_int8_rowwise(q, scale, bias)
    assert back.dtype == torch.float32 and bool(torch.isfinite(back).all())
    err = (table.double() - back.double()).abs()  # (N, D)
    assert bool((err <= int8_tolerance(table, scale)).all()), (err, scale)
    constant = table.amax(dim=1) == table.amin(dim=1)  # (N,) come back exactly
    assert torch.equal(back[constant], table[constant]) and bool((scale[constant] == 0).all())
    # the extremes are codes 0 and 255, unless the step is 0 (a constant row, or a range of a
    # few subnormals whose 255th part rounds to 0) or itself subnormal: then the step holds few
    # bits and max / step may round to 254 (hypothesis found [0, 3.565e-41]: step 100 * 2^-149,
    # max 254.4 steps), which the error bound above still covers
    assert bool((q.amin(dim=1) == 0).all())
    normal = scale >= torch.finfo(torch.float32).tiny
    assert bool((q.amax(dim=1)[normal] == 255).all())


def test_int8_huge_range_and_negative_rows():
    table = torch.tensor([[-1e38, 1e38, 0.0, 3e37], [-5.0, -4.0, -4.5, -4.25],
                          [F32_MAX / 2, -F32_MAX / 2, 1.0, 0.0]])
    q, scale, bias = quantize_int8_rowwise(table)
    back = dequantize_int8_rowwise(q, scale, bias)
    assert bool(torch.isfinite(back).all())
    assert bool(((table.double() - back.double()).abs() <= int8_tolerance(table, scale)).all())
    assert torch.equal(q[1], torch.tensor([0, 255, 127, 191], dtype=torch.uint8))  # 127.49..: 127


def test_fp16_is_a_plain_cast():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 7, generator=g) * torch.logspace(-6, 4, 50)[:, None]
    q = ec.quantize_table(table, "fp16")
    assert q.precision == "fp16" and q.scale is None and q.bias is None
    assert torch.equal(q.data, table.half())
    assert torch.equal(q.dequantize(), table.half().float())
    index = torch.tensor([3, 3, 49, 0])
    assert torch.equal(q.rows(index), table.half().float()[index])


def test_rows_dequantize_only_what_they_gather():
    table = torch.randn(1000, 16)
    q = ec.quantize_table(table, "int8")
    index = torch.tensor([5, 999, 5, 0])
    assert torch.equal(q.rows(index), q.dequantize()[index])
    z = q.with_zero_row()
    assert z.shape == (1001, 16) and torch.equal(z.rows(torch.tensor([1000])), torch.zeros(1, 16))
    assert torch.equal(ec.quantize_table(table, "fp16").with_zero_row().dequantize()[-1],
                       torch.zeros(16))


def test_bytes_are_a_quarter_and_a_half_of_float32():
    n, d = 1000, 64
    t = ec.TableConfig(vocabulary_size=n, dim=d, name="t")
    layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, "adagrad")
    fp32 = layer.for_serving().table_bytes()["t"]
    fp16 = layer.for_serving(quantize="fp16").table_bytes()["t"]
    int8 = layer.for_serving(quantize="int8").table_bytes()["t"]
    assert fp32 == 4 * n * d and fp16 == 2 * n * d and int8 == n * d + 8 * n
    assert int8 / fp32 == pytest.approx(0.25 + 2 / d)
    served = layer.for_serving(quantize="int8")
    buffers = sum(b.numel() * b.element_size() for b in served.buffers())
    assert buffers == int8  # nothing else is held (a static table has no map)
    assert {k: v.dtype for k, v in served.state_dict().items()} == {
        "t": torch.uint8, "t__scale": torch.float32, "t__bias": torch.float32}


# ------------------------------------------------------------------------- lookups
def _trained_layer(fc: dict, seed: int = 0) -> ec.EmbeddingLayer:
    """A layer whose tables hold random values with some constant rows."""
    torch.manual_seed(seed)
    layer = ec.EmbeddingLayer(fc, None)
    for table in layer.embedding_tables.values():
        with torch.no_grad():
            table.normal_().mul_(torch.logspace(-2, 1, table.shape[0])[:, None])
            table[::3] = table[::3, :1]  # every third row constant
    return layer


def _dequantized(q) -> np.ndarray:
    """(N, D) float32 rows of a quantized table as the format reads back, in numpy: fp16 widened;
    int8 ``q * scale + bias`` (a float32 product, then a float32 sum)."""
    if q.scale is None:
        return q.data.numpy().astype(np.float32)
    codes = q.data.numpy().astype(np.float32)
    return codes * q.scale.numpy()[:, None] + q.bias.numpy()[:, None]


def _oracle_lookup(feature: ec.FeatureConfig, ids, weights, rows: np.ndarray) -> torch.Tensor:
    """The activation by plain loops from the raw input (ops/reference.py's bags): float32
    combiner scales as section 2 states them (a bag's weights, or their squares, summed in
    order; sqrtn's root correctly rounded), each bag summed by fused multiply-adds in order
    (tests/checks.py's ``fma32``, as section 12 states)."""
    bags, shape, combine = reference_bags(feature, ids, weights)
    out = np.zeros((len(bags), rows.shape[1]), np.float32)
    for r, bag in enumerate(bags):
        w = [np.float32(x) for _, x in bag]
        scales = w
        if combine and feature.table.combiner != "sum":
            total = np.float32(0)
            for x in w:
                total = total + (x if feature.table.combiner == "mean" else x * x)
            if feature.table.combiner == "sqrtn":
                total = np.float32(math.sqrt(float(total)))
            scales = [x / total if total != 0 else np.float32(0) for x in w]
        for (i, _), s in zip(bag, scales):
            out[r] = fma32(np.full(rows.shape[1], s, np.float32), rows[i], out[r])
    return torch.from_numpy(out).reshape(*shape, rows.shape[1])


@pytest.mark.parametrize("precision", ["int8", "fp16"])
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_quantized_lookup_equals_serving_the_dequantized_table(precision, data):
    """For every combiner, input kind, weights and sequence features, at widths below, at and
    beyond the SIMD blocks: the quantized module's activations are, exactly, those of the
    table's codes read back and combined by plain loops (``_oracle_lookup``), as serving the
    table dequantized up front gives them."""
    combiner = data.draw(st.sampled_from(["sum", "mean", "sqrtn"]))
    t = ec.TableConfig(vocabulary_size=data.draw(st.integers(1, 12)), dim=data.draw(
        st.one_of(st.integers(1, 6), st.sampled_from([8, 17, 24, 40]))), combiner=combiner,
        name="t")
    case = data.draw(cases(t))
    fc = {"f": case.feature}
    layer = _trained_layer(fc, seed=data.draw(st.integers(0, 3)))
    table = layer.embedding_tables[t].detach()
    q = ec.quantize_table(table, precision)
    want = _oracle_lookup(case.feature, case.ids, case.weights, _dequantized(q))
    served = layer.for_serving(quantize=precision)
    got = served({"f": case.ids}, {"f": case.weights})["f"]
    assert got.dtype == torch.float32 and torch.equal(got, want)
    up_front = ec.serving_embedding_lookup({"f": case.ids}, {"f": case.weights},
                                           {t: q.dequantize()}, fc)["f"]
    plain = ec.serving_embedding_lookup({"f": case.ids}, {"f": case.weights}, {"t": q}, fc)["f"]
    assert torch.equal(up_front, want) and torch.equal(plain, want)


def test_a_mapping_quantizes_some_tables_and_names_errors():
    a = ec.TableConfig(vocabulary_size=10, dim=4, name="a")
    b = ec.TableConfig(vocabulary_size=10, dim=4, name="b", combiner="sum")
    c = ec.TableConfig(vocabulary_size=10, dim=4, name="c")
    fc = {"x": ec.FeatureConfig(table=a), "y": ec.FeatureConfig(table=b),
          "z": ec.FeatureConfig(table=c)}
    layer = _trained_layer(fc)
    served = layer.for_serving(quantize={"a": "int8", b: "fp16", "c": None})
    assert served.precisions == {"a": "int8", "b": "fp16", "c": None}
    assert [served.a.dtype, served.b.dtype, served.c.dtype] == [torch.uint8, torch.float16,
                                                                torch.float32]
    assert layer.for_serving(quantize={"b": "int8"}).precisions == {"a": None, "b": "int8",
                                                                    "c": None}
    ids = {"x": torch.tensor([1, 2]), "y": torch.tensor([[1, 2]]), "z": torch.tensor([3])}
    out = served(ids)
    assert all(v.dtype == torch.float32 for v in out.values())
    assert torch.equal(out["z"], layer(ids)["z"])  # unquantized: as trained
    with pytest.raises(ValueError, match=r"table 'a': quantize='int4' is not one of \[None, "
                                         r"'fp16', 'int8'\]"):
        layer.for_serving(quantize={"a": "int4"})
    with pytest.raises(ValueError, match="table 'a': quantize='float16'"):
        layer.for_serving(quantize="float16")
    with pytest.raises(ValueError, match=r"names table 'users', which is not served here; the "
                                         r"served tables are \['a', 'b', 'c'\]"):
        layer.for_serving(quantize={"users": "int8"})
    with pytest.raises(ValueError, match="not served"):  # served subset: 'a' is left out
        layer.for_serving({"y": fc["y"]}, quantize={"a": "int8"})
    with pytest.raises(TypeError, match="quantize must be None, 'fp16', 'int8' or a mapping"):
        layer.for_serving(quantize=8)


def test_a_table_named_table_is_served():
    t = ec.TableConfig(vocabulary_size=5, dim=3, name="table")
    layer = _trained_layer({"f": ec.FeatureConfig(table=t)})
    served = layer.for_serving(quantize="int8")
    assert served.table.dtype == torch.uint8 and served.table_bytes() == {"table": 5 * 11}


def test_tables_the_formats_cannot_hold_are_refused_by_name():
    t = ec.TableConfig(vocabulary_size=4, dim=2, name="clicks")
    layer = _trained_layer({"f": ec.FeatureConfig(table=t)})
    with torch.no_grad():
        layer.embedding_tables[t][2, 1] = 1e5  # beyond fp16
    with pytest.raises(ValueError, match="table 'clicks': row 2 holds values beyond fp16"):
        layer.for_serving(quantize="fp16")
    layer.for_serving(quantize="int8")  # int8 holds it
    with torch.no_grad():
        layer.embedding_tables[t][1, 0] = math.nan
    with pytest.raises(ValueError, match="table 'clicks': row 1 holds NaN or inf"):
        layer.for_serving(quantize="int8")
    with pytest.raises(ValueError, match="row 0 spans"):
        ec.quantize_table(torch.tensor([[-F32_MAX, F32_MAX]]), "int8")
    with pytest.raises(ValueError, match=r"expected \(N, D\) floating-point rows"):
        ec.quantize_table(torch.zeros(3, dtype=torch.int64), "int8")


def _dynamic_layer() -> tuple[ec.EmbeddingLayer, dict]:
    torch.manual_seed(1)
    t = ec.TableConfig(vocabulary_size=16, dim=5, combiner="mean", name="t")
    raw = ec.TableConfig(vocabulary_size=8, dim=5, combiner="sqrtn", name="raw",
                         dynamic=ec.DynamicVocabulary())
    fc = {"dense": ec.FeatureConfig(table=t), "bag": ec.FeatureConfig(table=t),
          "seq": ec.FeatureConfig(table=t, max_sequence_length=3),
          "raw": ec.FeatureConfig(table=raw), "raw_dense": ec.FeatureConfig(table=raw)}
    layer = ec.EmbeddingLayer(fc, ec.Adagrad(learning_rate=0.5))
    seen = torch.tensor([2**60, -4, 9, 77, -(2**40)])
    layer({"dense": torch.tensor([1, 2]), "bag": (torch.tensor([3, 4, 5]), torch.tensor([0, 1, 3])),
           "seq": (torch.tensor([6, 7]), torch.tensor([0, 2])),
           "raw": (seen, torch.tensor([0, 2, 5])), "raw_dense": seen[:2]}
          )["raw"].sum().backward()
    return layer, fc


def _inputs(kind: str, g: torch.Generator, b: int) -> tuple[dict, dict]:
    """A batch of every feature in one input kind: (ids, weights)."""
    raw_pool = torch.tensor([2**60, -4, 9, 77, -(2**40), 12345, -1])  # the last two not resident

    def ids(n, high):
        return (torch.randint(0, high, (n,), generator=g) if high else
                raw_pool[torch.randint(0, len(raw_pool), (n,), generator=g)])
    if kind == "dense":
        x = {"dense": ids(b, 16), "bag": ids(b * 2, 16).view(b, 2),
             "seq": ids(b * 3, 16).view(b, 3), "raw": ids(b * 2, 0).view(b, 2),
             "raw_dense": ids(b, 0)}
        return x, None
    if kind == "jagged":
        lengths = torch.randint(0, 4, (b,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        n = int(offsets[-1])
        w = torch.rand(n, generator=g) + 0.1
        x = {"dense": ids(b, 16), "bag": (ids(n, 16), offsets), "seq": (ids(n, 16), offsets),
             "raw": (ids(n, 0), offsets), "raw_dense": ids(b, 0)}
        return x, {"dense": None, "bag": (w, offsets), "seq": None, "raw": (w, offsets),
                   "raw_dense": None}
    width, nnz = 4, b * 2

    def coo(high):
        lin = torch.randperm(b * width, generator=g)[:nnz]
        return torch.sparse_coo_tensor(torch.stack(torch.unravel_index(lin, (b, width))),
                                       ids(nnz, high), (b, width))
    x = {"dense": ids(b, 16), "bag": coo(16), "seq": coo(16), "raw": coo(0),
         "raw_dense": ids(b, 0)}
    w = torch.sparse_coo_tensor(x["bag"]._indices(), torch.rand(nnz, generator=g) + 0.1,
                                (b, width))
    return x, {"dense": None, "bag": w, "seq": None, "raw": None, "raw_dense": None}


@pytest.mark.parametrize("precision", ["int8", "fp16"])
def test_dynamic_tables_quantized_with_their_map(precision):
    layer, fc = _dynamic_layer()
    served = layer.for_serving(quantize=precision)
    assert {"raw", "raw__ids", "raw__rows"} <= set(dict(served.named_buffers()))
    raw = next(t for t in layer.embedding_tables if t.name == "raw")
    tables = {t: ec.quantize_table(v.detach(), precision).dequantize()
              for t, v in layer.embedding_tables.items()}
    tables[raw] = (tables[raw], *layer.engine.vocabulary(raw))
    g = torch.Generator().manual_seed(0)
    for kind in ("dense", "jagged", "sparse"):
        x, w = _inputs(kind, g, 5)
        want = ec.serving_embedding_lookup(x, w, tables, fc)
        got = served(x, w)
        for k in fc:
            assert torch.equal(got[k], want[k]), (kind, k)
    not_resident = served({**x, "raw_dense": torch.tensor([12345, -1])}, w)["raw_dense"]
    assert torch.equal(not_resident, torch.zeros(2, 5))


@pytest.mark.parametrize("kind", ["dense", "jagged", "sparse"])
def test_export_round_trip_is_bitwise_the_eager_module(kind, tmp_path):
    """torch.export (a dynamic batch), save and load: the program's outputs are bitwise the
    eager quantized module's, for other batch sizes and numbers of ids too, dynamic table
    included (its map travels in the program)."""
    layer, fc = _dynamic_layer()
    served = layer.for_serving(quantize={"t": "int8", "raw": "fp16"})
    g = torch.Generator().manual_seed(1)
    x, w = _inputs(kind, g, 4)
    batch = torch.export.Dim("batch")
    if kind == "jagged":  # (values, offsets) pairs: any number of ids, batch + 1 offsets
        dims = {k: ({0: torch.export.Dim(f"n_{k}")}, {0: batch + 1}) if isinstance(v, tuple)
                else {0: batch} for k, v in x.items()}
        w_dims = {k: None if v is None else dims[k] for k, v in w.items()}
    else:  # dense and sparse COO tensors: any batch size (sparse: any number of entries)
        dims = {k: {0: batch} for k in x}
        w_dims = None if w is None else {k: None if v is None else {0: batch}
                                         for k, v in w.items()}
    program = torch.export.export(served, (x, w), dynamic_shapes=(dims, w_dims))
    torch.export.save(program, tmp_path / "q.pt2")
    loaded = torch.export.load(tmp_path / "q.pt2").module()
    for b in (4, 7, 2):
        x, w = _inputs(kind, g, b)
        got, want = loaded(x, w), served(x, w)
        for k in fc:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), (b, k)
