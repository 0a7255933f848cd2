"""Hypothesis strategies: random feature configs and batches of every input kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

import embcore as ec


@dataclass
class Case:
    """One feature with a batch: config, ids, weights (or None)."""

    feature: ec.FeatureConfig
    ids: torch.Tensor
    weights: torch.Tensor | None


def jagged(values: list[list[int]] | list[list[float]], dtype: torch.dtype) -> torch.Tensor:
    lengths = [len(r) for r in values]
    flat = [x for r in values for x in r]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(torch.tensor(flat, dtype=dtype), offsets)


def sparse(rows: list[list[int | None]], dtype: torch.dtype, width: int) -> torch.Tensor:
    """Rank-2 sparse tensor from rows with holes (None)."""
    idx = [(b, p) for b, r in enumerate(rows) for p, x in enumerate(r) if x is not None]
    vals = [rows[b][p] for b, p in idx]
    indices = torch.tensor(idx, dtype=torch.int64).reshape(-1, 2).T
    return torch.sparse_coo_tensor(indices, torch.tensor(vals, dtype=dtype),
                                   (len(rows), width)).coalesce()


@st.composite
def cases(draw, table: ec.TableConfig, allow_weights: bool = True) -> Case:
    """A feature of ``table`` with a random batch of a random kind."""
    n = table.vocabulary_size
    kind = draw(st.sampled_from(["dense1", "dense", "jagged", "sparse"]))
    seq = draw(st.sampled_from([0, 0, 1, 3]))
    feature = ec.FeatureConfig(table=table, max_sequence_length=seq)
    b = draw(st.integers(1, 4))
    idx_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    ident = st.integers(0, n - 1)
    if kind == "dense1":
        shape = draw(st.sampled_from([(b,), (b, 1)]))
        ids = torch.tensor(draw(st.lists(ident, min_size=b, max_size=b)), dtype=idx_dtype)
        return Case(feature, ids.reshape(shape), None)
    if kind == "dense":
        length = draw(st.integers(1, 4))
        flat = draw(st.lists(ident, min_size=b * length, max_size=b * length))
        return Case(feature, torch.tensor(flat, dtype=idx_dtype).reshape(b, length), None)
    weighted = allow_weights and seq == 0 and draw(st.booleans())
    wv = st.floats(-2, 2, allow_nan=False, width=32).filter(lambda x: abs(x) > 1e-3)
    if kind == "jagged":
        rows = draw(st.lists(st.lists(ident, max_size=5), min_size=b, max_size=b))
        ids = jagged(rows, idx_dtype)
        w = None
        if weighted:
            w = jagged([[draw(wv) for _ in r] for r in rows], torch.float32)
        return Case(feature, ids, w)
    width = draw(st.integers(1, 5))
    rows_s = draw(st.lists(st.lists(st.one_of(st.none(), ident), min_size=width, max_size=width),
                           min_size=b, max_size=b))
    ids = sparse(rows_s, idx_dtype, width)
    w = None
    if weighted:
        w_rows = [[None if x is None else draw(wv) for x in r] for r in rows_s]
        w = sparse(w_rows, torch.float32, width)
    return Case(feature, ids, w)


def rounded(draw, lo: float, hi: float) -> float:
    """A float in [lo, hi] rounded to 3 decimals (a bound like 1e-78 is 0 in float32, the
    kernels' precision, but not in the float64 references: not what the tests are about)."""
    return draw(st.floats(lo, hi).map(lambda x: round(x, 3)))


def common_options(draw) -> dict:
    """The options every optimizer takes, drawn at random: gradient multiplier, gradient
    clipping (scalar, one side or both), weight decay, weight clipping (each side or not)."""
    kw = {}
    if draw(st.booleans()):
        c = rounded(draw, 0.1, 3.0)
        kw["gradient_multiplier"] = lambda s, c=c: c * (s + 1) / 3
    clip = draw(st.sampled_from(["none", "scalar", "lo", "hi", "both"]))
    a, b = sorted([rounded(draw, -1.0, 1.0), rounded(draw, -1.0, 1.0)])
    if clip == "scalar":
        kw["clipvalue"] = rounded(draw, 0.05, 2.0)
    elif clip != "none":
        kw["clipvalue"] = {"lo": (a, None), "hi": (None, b), "both": (a, b)}[clip]
    if draw(st.booleans()):
        kw["weight_decay_factor"] = rounded(draw, 0.0, 0.5)
        kw["multiply_weight_decay_factor_by_learning_rate"] = draw(st.booleans())
    wmin, wmax = sorted([rounded(draw, -2.0, 0.5), rounded(draw, -0.5, 2.0)])
    if draw(st.booleans()):
        kw["clip_weight_min"] = wmin
    if draw(st.booleans()):
        kw["clip_weight_max"] = wmax
    return kw


@st.composite
def any_optimizer(draw, dense_adam: bool = True):
    """(optimizer, lr, step): every embcore optimizer (``dense_adam``: Adam(lazy_adam=False)
    too), its own hyper-parameters and the common options drawn at random (rounded to 3
    decimals)."""
    def num(lo, hi):
        return rounded(draw, lo, hi)

    lr = num(0.01, 1.0)
    kw = common_options(draw)
    kind = draw(st.sampled_from(["sgd", "adagrad", "rowwise", "momentum", "adam", "ftrl"]))
    init = draw(st.sampled_from([0.0, 0.1, 1.0]))
    if kind == "sgd":
        opt = ec.SGD(learning_rate=lr, **kw)
    elif kind in ("adagrad", "rowwise"):
        cls = ec.Adagrad if kind == "adagrad" else ec.RowwiseAdagrad
        opt = cls(learning_rate=lr, initial_accumulator_value=init, **kw)
    elif kind == "momentum":
        opt = ec.AdagradMomentum(learning_rate=lr, momentum=num(0.0, 0.99),
                                 use_nesterov=draw(st.booleans()), exponent=num(1.0, 4.0),
                                 beta2=draw(st.sampled_from([1.0, 0.9])), **kw)
    elif kind == "adam":
        opt = ec.Adam(learning_rate=lr, beta_1=num(0.0, 0.95), beta_2=num(0.5, 0.999),
                      lazy_adam=not dense_adam or draw(st.booleans()),
                      sum_inside_sqrt=draw(st.booleans()), **kw)
    else:
        zero = draw(st.booleans())
        opt = ec.FTRL(learning_rate=lr, learning_rate_power=draw(st.sampled_from([-0.5, -0.25,
                                                                                  0.0])),
                      l1_regularization_strength=num(0.0, 0.1),
                      l2_regularization_strength=num(0.0, 0.1), beta=num(0.0, 0.5),
                      initial_accumulator_value=0.0 if zero else max(init, 0.1),
                      allow_zero_accumulator=zero,
                      multiply_linear_by_learning_rate=draw(st.booleans()), **kw)
    return opt, lr, draw(st.integers(0, 5))


def dedup_oracle(ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Plain Python, sharing no code with ``embcore.ops.bags.dedup``: ``(unique, order,
    unique_offsets)``, the distinct ids ascending, the positions of the occurrences grouped by
    id (ascending positions within an id) and each id's first place in ``order``."""
    positions: dict[int, list[int]] = {}
    for i, v in enumerate(ids):
        positions.setdefault(v, []).append(i)
    unique = sorted(positions)
    order, offsets = [], [0]
    for v in unique:
        order += positions[v]
        offsets.append(len(order))
    return unique, order, offsets


def occurrences(gen, n, d, nnz, unit, scaled=True, device=None):
    """Output gradients of ``nnz`` occurrences of random rows (bags of them, some empty, unless
    ``unit``; per-id scales when ``scaled``) as ``OutputGrads`` in two parts on ``device``, the
    float64 summed gradient of each distinct row, and those rows (on the CPU).

    The ``OutputGrads`` carry ``embcore.ops.bags.dedup``'s grouping (what the engine passes);
    the rows and their sums returned are the plain-Python oracle's (``dedup_oracle`` and a
    loop over the occurrences), never computed with the code they check, and the dedup must
    equal the oracle's grouping."""
    from embcore.ops.bags import Bags, dedup
    from embcore.ops.combine import OutputGrads

    ids = torch.randint(0, n, (nnz,), generator=gen)
    if unit:
        bags = Bags(ids, None, None)
    else:
        r = max(1, nnz // 2)
        cuts = torch.sort(torch.randint(0, nnz + 1, (r - 1,), generator=gen)).values
        offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([nnz])])
        bags = Bags(ids, offsets, torch.randn(nnz, generator=gen) if scaled else None)
    rows_out = nnz if unit else r
    grad_out = torch.randn(rows_out, d, generator=gen)
    split = rows_out // 2

    # the oracle: each occurrence's bag from the offsets, its scale, summed in Python floats
    id_list = ids.tolist()
    bag_of = list(range(nnz)) if unit else [
        b for b in range(r) for _ in range(int(offsets[b + 1]) - int(offsets[b]))]
    scale = [1.0] * nnz if bags.scales is None else bags.scales.double().tolist()
    out = grad_out.double().tolist()
    unique, order, unique_offsets = dedup_oracle(id_list)
    sums = {v: [0.0] * d for v in unique}
    for i, v in enumerate(id_list):
        row = sums[v]
        for c in range(d):
            row[c] += scale[i] * out[bag_of[i]][c]
    want_rows = torch.tensor(unique, dtype=torch.int64)
    want_sums = torch.tensor([sums[v] for v in unique], dtype=torch.float64).reshape(-1, d)

    dd = dedup(ids)  # the grouping under test: the oracle's
    assert dd.unique.tolist() == unique and dd.order.tolist() == order \
        and dd.unique_offsets.tolist() == unique_offsets, "dedup differs from the oracle"

    def on(t):
        return None if t is None or device is None else t.to(device)

    if device is not None:
        bags = Bags(on(bags.ids), on(bags.offsets), on(bags.scales))
        dd_dev = type(dd)(on(dd.unique), on(dd.order), on(dd.unique_offsets))
    else:
        dd_dev = dd
    parts = [grad_out[:split].clone(), grad_out[split:].clone()]
    if device is not None:
        parts = [p.to(device) for p in parts]
    return OutputGrads(parts, [0, split, rows_out], bags, dd_dev), want_sums, want_rows
