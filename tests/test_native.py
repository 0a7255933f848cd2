"""The fused CPU kernels (kernels/cpu/, kernels/cpu/csrc/) against torch and the references.

Every wrapper is checked on random inputs against an independent computation: ``dedup`` against
torch's stable sort, ``lookup`` against ``embedding_bag`` / indexing, ``sparse_update`` against
``reference_optim.reference_update`` (with the row gradients summed here in float64), ``minmax``
and ``combiner_scales`` against torch and the torch-ops twin in ``ops/bags.py``. The
engine is then trained with the kernels on and off and must give the same tables and slots.
Everything but the switched-off test is skipped when the kernels cannot be built.

The ctypes boundary: every wrapper refuses a tensor of the wrong dtype, layout, device or length
with an error naming the kernel and the argument (before the kernel runs), the Python
declarations of the kernels' arguments agree with the C definitions in csrc/, the ABI version has
one source (cpu.ABI_VERSION, passed to the compiler) and the build key covers every source.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from checks import check_fresh_run, check_rows_updated, fma_bag_sums
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import requires_native
from profiles import examples
from strategies import common_options, jagged, rounded
from switches import kernels

import embcore as ec
from embcore.ops import bags as bags_ops
from embcore.kernels.cpu import args as kernel_args
from embcore.kernels import cpu
from embcore.ops.reference import reference_lookup, reference_row_gradients
from embcore.ops.update import _hyper

TOL = {"rtol": 1e-5, "atol": 1e-6}  # float32 kernels vs float64 references
RULES = {"sgd": cpu.SGD, "adagrad": cpu.ADAGRAD, "rowwise": cpu.ROWWISE_ADAGRAD}
NATIVE_FUNCS = ("dedup", "concat_dedup", "lookup", "sparse_update", "minmax", "combiner_scales",
                "bag_of", "offsets_error", "first_unordered")
# the kernels bound to one table (the rows objects'), counted as the function they call
NATIVE_BOUND = {"lookup": cpu.TableLookup, "sparse_update": cpu.SparseUpdate}


def hyper_at(opt, lr, step):
    """The kernel's hyper-parameters of ``opt`` at ``step``, as ``ops.update.update`` forms them."""
    return _hyper(opt, lr, gradient_multiplier=opt.current_gradient_multiplier(step))




@contextlib.contextmanager
def spy_native(forbid: bool = False):
    """Counts calls of the native wrappers (or makes them fail, ``forbid``); restores them."""
    calls: Counter[str] = Counter()
    saved = {name: getattr(cpu, name) for name in NATIVE_FUNCS}
    bound = {name: cls.__call__ for name, cls in NATIVE_BOUND.items()}

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            if forbid:
                raise AssertionError(f"native.{name} called while the kernels are disabled")
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    try:
        for name, fn in saved.items():
            setattr(cpu, name, wrap(name, fn))
        for name, fn in bound.items():
            NATIVE_BOUND[name].__call__ = wrap(name, fn)
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(cpu, name, fn)
        for name, fn in bound.items():
            NATIVE_BOUND[name].__call__ = fn


def torch_dedup(ids: torch.Tensor):
    """(unique, order, unique_offsets) by torch's stable sort + unique_consecutive."""
    sorted_ids, order = torch.sort(ids, stable=True)
    unique, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(counts, 0)
    return unique, order, offsets


def random_offsets(gen: torch.Generator, rows: int, max_len: int) -> torch.Tensor:
    """(rows + 1,) int64 bag boundaries, lengths in [0, max_len] (empty bags included)."""
    lengths = torch.randint(0, max_len + 1, (rows,), generator=gen)
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets


# ------------------------------------------------------------------------------- switched off
def test_disabled_kernels_are_not_used_and_the_engine_trains_the_same():
    """Not skipped without the kernels: the torch-ops path alone must train correctly."""
    initial = cpu.set_enabled(True)
    cpu.set_enabled(initial)
    results = {}
    for enabled in (False, True):
        with kernels(enabled):
            if not enabled:
                assert not cpu.usable(torch.zeros(1))
                assert not cpu.available()
                assert cpu.set_enabled(False) is False  # returns the previous setting
            with spy_native(forbid=not enabled):
                torch.manual_seed(3)
                t = ec.TableConfig(vocabulary_size=12, dim=3, combiner="mean", name="t")
                fc = {"d": ec.FeatureConfig(table=t), "j": ec.FeatureConfig(table=t)}
                emb = ec.Embedding(fc, ec.SGD(learning_rate=1.0))
                before = emb.embedding_tables[t].clone()
                ids = {"d": torch.tensor([1, 5, 1]),
                       "j": jagged([[5, 7, 5], [], [2]], torch.int64)}
                w = {"d": None, "j": jagged([[0.5, 2.0, -1.0], [], [3.0]], torch.float32)}
                emb.enqueue(ids, w)
                acts = emb.dequeue()
                gen = torch.Generator().manual_seed(0)
                grads = {k: torch.randn(a.shape, generator=gen) for k, a in acts.items()}
                emb.apply_gradients(grads)
                results[enabled] = ({k: a.detach().clone() for k, a in acts.items()},
                                    emb.embedding_tables[t].clone())
        if not enabled:  # the torch-ops path against the loops of ops/reference.py
            expected = before.double()
            for k, f in fc.items():
                torch.testing.assert_close(acts[k].double(),
                                           reference_lookup(before, f, ids[k], w[k]), **TOL)
                for row, g in reference_row_gradients(f, ids[k], w[k], grads[k]).items():
                    expected[row] -= torch.tensor(g, dtype=torch.float64)
            torch.testing.assert_close(emb.embedding_tables[t].double(), expected, **TOL)
            assert not torch.equal(emb.embedding_tables[t], before)
    for k in results[False][0]:
        torch.testing.assert_close(results[True][0][k], results[False][0][k], **TOL)
    torch.testing.assert_close(results[True][1], results[False][1], **TOL)
    assert cpu.set_enabled(initial) == initial  # the setting was restored


# ------------------------------------------------------------------------------------- dedup
@st.composite
def dedup_inputs(draw):
    num_rows = draw(st.sampled_from([1, 2, 3, 64, 4096, 4097, 2**13 + 1, 2**24, 2**30]))
    n = draw(st.one_of(st.sampled_from([0, 1, 2]), st.integers(3, 64), st.integers(65, 400),
                       st.sampled_from([4096, 5000, 9000])))
    distinct = draw(st.integers(1, 50))
    seed = draw(st.integers(0, 2**31 - 1))
    return num_rows, n, distinct, seed


@requires_native
@settings(max_examples=examples(80), deadline=None)
@given(dedup_inputs())
def test_dedup_equals_stable_sort(case):
    num_rows, n, distinct, seed = case
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, num_rows, (distinct,), generator=gen)
    pool[0] = num_rows - 1  # the highest id: every radix digit set
    ids = pool[torch.randint(0, distinct, (n,), generator=gen)]  # many duplicates
    unique, order, offsets = cpu.dedup(ids, num_rows)
    want_unique, want_order, want_offsets = torch_dedup(ids)
    assert unique.dtype == order.dtype == offsets.dtype == torch.int64
    assert torch.equal(unique, want_unique)
    assert torch.equal(order, want_order)  # stable: ties in position order
    assert torch.equal(offsets, want_offsets)


@requires_native
def test_dedup_all_distinct_and_all_equal():
    gen = torch.Generator().manual_seed(1)
    for n, num_rows in [(5000, 2**30), (70, 2**30), (9000, 5000), (64, 64)]:
        ids = torch.randperm(n, generator=gen) * max(num_rows // n, 1) % num_rows
        for case in (ids, torch.full((n,), num_rows - 1, dtype=torch.int64)):
            got, want = cpu.dedup(case, num_rows), torch_dedup(case)
            for g, w in zip(got, want):
                assert torch.equal(g, w)


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 70), min_size=1, max_size=6),
       st.sampled_from([torch.float32, torch.int64]), st.booleans(), st.integers(0, 2**31))
def test_concat_equals_torch_cat(lengths, dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(-1000, 1000, (2 * n if strided else n,), generator=gen).to(dtype)
             for n in lengths]
    if strided:  # every other element: not contiguous, so torch.cat's path
        parts = [p[::2] for p in parts]
    got = cpu.concat(parts)
    assert got.dtype == dtype and torch.equal(got, torch.cat(parts))
    mixed = parts + [torch.ones(3, dtype=torch.float64)]  # dtypes differ: torch.cat's promotion
    assert torch.equal(cpu.concat(mixed), torch.cat(mixed))


# ------------------------------------------------------------------------------------ lookup
# the widths of every column path of the kernel: blocks of 128 to 8 columns, whole rows (no
# block divides D), and SIMD tails; most are not multiples of 8 or 16
LOOKUP_DIMS = st.one_of(st.sampled_from([1, 3, 5, 8, 24, 40, 100, 130, 192, 256]),
                        st.integers(1, 140))


@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 40), LOOKUP_DIMS, st.integers(0, 30),
       st.integers(0, 6), st.booleans(), st.integers(0, 2**31 - 1))
def test_lookup_equals_embedding_bag(n, d, rows, max_len, scaled, seed):
    """Bit for bit: each bag's columns summed in order, each step one fused multiply-add (the
    plain loop of ``fma_bag_sums``), as torch's ``embedding_bag`` does, for every width."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(n, d, generator=gen)
    offsets = random_offsets(gen, rows, max_len)
    nnz = int(offsets[-1])
    ids = torch.randint(0, n, (nnz,), generator=gen)
    scales = torch.randn(nnz, generator=gen) if scaled else None
    out = torch.full((rows, d), float("nan"))
    got = cpu.lookup(table, ids, offsets, scales, out)
    assert got is out
    want = F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=scales,
                           include_last_offset=True)
    assert torch.equal(got, fma_bag_sums(table, ids, offsets, scales))
    assert torch.equal(got, want)
    empty = offsets[1:] == offsets[:-1]
    assert torch.equal(got[empty], torch.zeros(int(empty.sum()), d))
    # offsets None: one id per output row, scale 1, an exact copy
    unit = torch.full((nnz, d), float("nan"))
    assert torch.equal(cpu.lookup(table, ids, None, None, unit), table[ids])


@requires_native
@pytest.mark.parametrize("scaled", [False, True])
def test_lookup_large_batch_threaded(scaled):
    """nnz * D above the kernel's serial threshold: the rows split over threads by cost."""
    gen = torch.Generator().manual_seed(7)
    table = torch.randn(3000, 32, generator=gen)
    offsets = random_offsets(gen, 700, 12)
    nnz = int(offsets[-1])
    ids = torch.randint(0, 3000, (nnz,), generator=gen)
    scales = torch.randn(nnz, generator=gen) if scaled else None
    got = cpu.lookup(table, ids, offsets, scales, torch.full((700, 32), float("nan")))
    want = F.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=scales,
                           include_last_offset=True)
    assert torch.equal(got, want)
    assert torch.equal(cpu.lookup(table, ids, None, None, torch.empty(nnz, 32)), table[ids])


COMBINE_DIMS = (1, 3, 8, 24, 40, 100)


@requires_native
def test_training_serving_and_export_give_the_same_bits_at_every_width():
    """Weighted sum, mean and sqrtn bags at widths that are not multiples of 16 (8, 24, 40: the
    kernel's 8-column blocks; 1, 3, 100: whole rows): the training forward (the fused lookup),
    the serving module, its exported program (torch ops: ``embedding_bag``) and the kernels
    switched off give the same bits, those of the plain fused multiply-add loop
    (docs/semantics.md section 12)."""
    tables = {f"{c}{d}": ec.TableConfig(vocabulary_size=30, dim=d, combiner=c, name=f"{c}{d}")
              for c in ("sum", "mean", "sqrtn") for d in COMBINE_DIMS}
    fc = {k: ec.FeatureConfig(table=t) for k, t in tables.items()}
    torch.manual_seed(0)
    layer = ec.EmbeddingLayer(fc, ec.SGD(learning_rate=0.1))
    gen = torch.Generator().manual_seed(1)
    offsets = random_offsets(gen, 16, 9)
    n = int(offsets[-1])
    x = {k: (torch.randint(0, 30, (n,), generator=gen), offsets) for k in fc}
    w = {k: (torch.rand(n, generator=gen) * 3 + 0.1, offsets) for k in fc}
    answers = {"training": {k: v.detach() for k, v in layer(x, w).items()}}
    served = layer.for_serving()
    with torch.no_grad():
        answers["serving"] = served(x, w)
        answers["exported"] = served.export(x, w).module()(x, w)
        with kernels(False):
            answers["kernels off"] = served(x, w)
    for k, t in tables.items():
        with kernels(False):  # the torch-ops scales (equal to the kernel's: tested below)
            scales = bags_ops.combiner_scales(offsets, w[k][0], t.combiner, n)
        want = fma_bag_sums(layer.embedding_tables[t].detach(), x[k][0], offsets, scales)
        for path, got in answers.items():
            assert torch.equal(got[k], want), (path, k)


@requires_native
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 builds")
def test_a_build_without_fma_instructions_looks_up_the_same_bits(tmp_path):
    """The kernels built for plain x86-64 (no FMA instructions: a multiply and an add unless
    the source asks for the fused operation) pass the lookup's bit-for-bit tests above."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(ec.__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "EMBCORE_NATIVE_ARCH": "x86-64", "XDG_CACHE_HOME": str(tmp_path),
           "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
         "no:warnings", "-o", "addopts=", __file__, "-k",
         "lookup_equals_embedding_bag or lookup_large_batch or same_bits_at_every_width"],
        env=env, capture_output=True, text=True, timeout=900, cwd=os.path.dirname(__file__))
    check_fresh_run(proc)
    assert "4 passed" in proc.stdout, proc.stdout[-3000:]


# ----------------------------------------------------------------------------- sparse update
@st.composite
def optimizers(draw):
    """(kind, optimizer, lr, step): a rule of the fused kernel with random common options
    (strategies.common_options; hyper-parameters rounded to 3 decimals)."""
    kind = draw(st.sampled_from(sorted(RULES)))
    lr = rounded(draw, 0.01, 1.0)
    step = draw(st.integers(0, 5))
    kw = common_options(draw)
    if kind == "sgd":
        opt = ec.SGD(learning_rate=lr, **kw)
    else:
        init = draw(st.sampled_from([0.0, 0.0, 0.1, 1.0]))
        cls = ec.Adagrad if kind == "adagrad" else ec.RowwiseAdagrad
        opt = cls(learning_rate=lr, initial_accumulator_value=init, **kw)
    return kind, opt, lr, step


def make_state(kind, opt, n, d, gen):
    """A random table and accumulators: the optimizer's initial value, grown on some rows."""
    table = torch.randn(n, d, generator=gen)
    if kind == "sgd":
        return table, None
    acc = torch.full((n, 1 if kind == "rowwise" else d), float(opt.initial_accumulator_value))
    grown = torch.rand(n, generator=gen) < 0.5
    acc[grown] += torch.rand(int(grown.sum()), acc.shape[1], generator=gen)
    return table, acc


def check_update(kind, opt, lr, step, table, acc, rows, row_grads, new_table, new_acc):
    """``new_*`` equal ``reference_update`` on ``rows``; every other row is bit-identical."""
    slots, new_slots = ({}, {}) if acc is None else ({"accumulators": acc},
                                                     {"accumulators": new_acc})
    check_rows_updated(opt, lr, step, table, slots, rows, row_grads, new_table, new_slots, TOL)


@requires_native
@settings(max_examples=examples(80), deadline=None)
@given(optimizers(), st.integers(1, 30), st.sampled_from([1, 2, 5, 16]), st.data())
def test_sparse_update_direct_equals_reference(opt_case, n, d, data):
    kind, opt, lr, step = opt_case
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    table, acc = make_state(kind, opt, n, d, gen)
    u = data.draw(st.integers(0, n))
    rows = torch.randperm(n, generator=gen)[:u]
    grads = torch.randn(u, d, generator=gen)
    grads[torch.rand(u, generator=gen) < 0.3] = 0.0  # zero rows: 0 / 0 with a zero accumulator
    new_table, new_acc = table.clone(), None if acc is None else acc.clone()
    cpu.sparse_update(RULES[kind], new_table, new_acc, rows, hyper_at(opt, lr, step),
                         [grads])
    check_update(kind, opt, lr, step, table, acc, rows, grads, new_table, new_acc)


def occurrence_case(gen, n, d, nnz, slice_rows, unit, scaled, strided=False):
    """Output gradients split in slices, occurrences with ids, bags and scales, and the reference
    row gradients (float64 sums of scale * grad_out[bag] per unique row). ``strided``: each slice
    is a column slice of a wider tensor (row stride > D)."""
    rows_out = nnz if unit else sum(slice_rows)
    if unit:  # occurrence k is output row k: one slice, or the nnz rows split at random points
        cuts = sorted(torch.randint(0, nnz + 1, (len(slice_rows) - 1,), generator=gen).tolist())
        slice_rows = [b - a for a, b in zip([0] + cuts, cuts + [nnz])]
    starts = [0]
    for r in slice_rows:
        starts.append(starts[-1] + r)
    assert starts[-1] == rows_out
    grad_out = torch.randn(rows_out, d, generator=gen)
    grad_out[torch.rand(rows_out, generator=gen) < 0.2] = 0.0
    parts = [grad_out[a:b].clone() for a, b in zip(starts[:-1], starts[1:])]
    if strided:  # column slices of wider tensors (torch.cat's backward): read with their strides
        sliced = []
        for p in parts:
            pad = int(torch.randint(1, 9, (), generator=gen))
            off = int(torch.randint(0, pad + 1, (), generator=gen))
            wide = torch.randn(p.shape[0], d + pad, generator=gen)
            wide[:, off:off + d] = p
            sliced.append(wide[:, off:off + d])
        parts = sliced
    ids = torch.randint(0, n, (nnz,), generator=gen)
    bags = None if unit else torch.randint(0, max(rows_out, 1), (nnz,), generator=gen)
    scales = None
    if scaled:
        scales = torch.randn(nnz, generator=gen)
        scales[torch.rand(nnz, generator=gen) < 0.2] = 0.0
    unique, order, unique_offsets = torch_dedup(ids)
    bag = torch.arange(nnz) if bags is None else bags
    scale = torch.ones(nnz, dtype=torch.float64) if scales is None else scales.double()
    summed = torch.zeros(n, d, dtype=torch.float64)
    summed.index_add_(0, ids, scale[:, None] * grad_out.double()[bag])
    return dict(parts=parts, starts=starts, unique=unique, order=order,
                unique_offsets=unique_offsets, bags=bags, scales=scales,
                row_grads=summed[unique])


@requires_native
@settings(max_examples=examples(80), deadline=None)
@given(optimizers(), st.integers(1, 25), st.sampled_from([1, 3, 8]), st.integers(0, 60),
       st.lists(st.integers(0, 6), min_size=1, max_size=4), st.booleans(), st.booleans(),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_sparse_update_from_occurrences_equals_reference(opt_case, n, d, nnz, slice_rows, unit,
                                                         scaled, strided, seed):
    kind, opt, lr, step = opt_case
    if not unit and sum(slice_rows) == 0:
        nnz = 0  # no output rows: no occurrences
    gen = torch.Generator().manual_seed(seed)
    table, acc = make_state(kind, opt, n, d, gen)
    c = occurrence_case(gen, n, d, nnz, slice_rows, unit, scaled, strided)
    new_table, new_acc = table.clone(), None if acc is None else acc.clone()
    cpu.sparse_update(RULES[kind], new_table, new_acc, c["unique"], hyper_at(opt, lr, step),
                         c["parts"], c["starts"], c["unique_offsets"], c["order"], c["bags"],
                         c["scales"])
    check_update(kind, opt, lr, step, table, acc, c["unique"], c["row_grads"], new_table, new_acc)


@requires_native
@pytest.mark.parametrize("kind", sorted(RULES))
@pytest.mark.parametrize("mode", ["direct", "occurrences"])
def test_sparse_update_large_threaded(kind, mode):
    """Enough rows for the kernel to split the update over threads by occurrence counts."""
    kw = dict(learning_rate=0.3, clipvalue=(-0.5, None), weight_decay_factor=0.05,
              multiply_weight_decay_factor_by_learning_rate=True, clip_weight_max=1.5,
              gradient_multiplier=lambda s: 0.5 + s)
    opt = {"sgd": ec.SGD, "adagrad": ec.Adagrad, "rowwise": ec.RowwiseAdagrad}[kind](**kw)
    gen = torch.Generator().manual_seed(11)
    n, d = 2500, 8
    table, acc = make_state(kind, opt, n, d, gen)
    new_table, new_acc = table.clone(), None if acc is None else acc.clone()
    hyper = hyper_at(opt, 0.3, 2)
    if mode == "direct":
        rows = torch.randperm(n, generator=gen)[:1500]
        grads = torch.randn(1500, d, generator=gen)
        cpu.sparse_update(RULES[kind], new_table, new_acc, rows, hyper, [grads])
    else:
        c = occurrence_case(gen, n, d, 4000, [900, 0, 1100, 500], unit=False, scaled=True,
                            strided=True)
        rows, grads = c["unique"], c["row_grads"]
        assert rows.numel() > 1000
        cpu.sparse_update(RULES[kind], new_table, new_acc, rows, hyper, c["parts"],
                             c["starts"], c["unique_offsets"], c["order"], c["bags"], c["scales"])
    check_update(kind, opt, 0.3, 2, table, acc, rows, grads, new_table, new_acc)


def threaded_case(seed: int = 5) -> tuple:
    """A sparse update, a lookup and a dedup each large enough to be cut into many chunks."""
    gen = torch.Generator().manual_seed(seed)
    opt = ec.Adagrad(learning_rate=0.2)
    table, acc = make_state("adagrad", opt, 2500, 8, gen)
    c = occurrence_case(gen, 2500, 8, 5000, [3000, 2000], unit=False, scaled=True)
    offsets = random_offsets(gen, 3000, 10)
    ids = torch.randint(0, 2500, (int(offsets[-1]),), generator=gen)
    return opt, table, acc, c, offsets, ids


def run_threaded_case(case: tuple) -> tuple:
    opt, table, acc, c, offsets, ids = case
    t, a = table.clone(), acc.clone()
    cpu.sparse_update(cpu.ADAGRAD, t, a, c["unique"], hyper_at(opt, 0.2, 0), c["parts"],
                         c["starts"], c["unique_offsets"], c["order"], c["bags"], c["scales"])
    out = cpu.lookup(table, ids, offsets, None, torch.empty(len(offsets) - 1, 8))
    return (t, a, out, *cpu.dedup(ids, 2500))


def same(xs: tuple, ys: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(xs, ys, strict=True))


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@requires_native
def test_results_do_not_depend_on_the_thread_count():
    """Each output comes from one chunk in a fixed order: 1 to 4 threads (more than this
    machine's cores too) give the same bits."""
    case = threaded_case()
    results = []
    for nt in (1, 2, 3, 4):
        with torch_threads(nt):
            results.append(run_threaded_case(case))
    assert all(same(results[0], r) for r in results[1:])
    assert not torch.equal(results[0][0], case[1])  # the update changed the table


@requires_native
def test_kernels_called_from_several_threads_at_once():
    """Python threads calling threaded kernels together (ctypes releases the GIL): one runs on
    the pool, the others run on their own thread; every result is the serial one."""
    import threading
    case = threaded_case(6)
    with torch_threads(1):
        expected = run_threaded_case(case)
    results: list = [None] * 6
    errors: list = []

    def work(i: int) -> None:
        try:
            for _ in range(5):
                results[i] = run_threaded_case(case)
                assert same(results[i], expected)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    with torch_threads(2):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a kernel call hung"
    assert not errors, errors
    assert all(same(r, expected) for r in results)


@requires_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_threaded_kernels():
    """The pool's helper threads do not survive fork(): a child (a DataLoader worker, say) must
    neither wait for them nor find the pool locked, and gets the same results."""
    import pickle
    import select
    import warnings
    case = threaded_case(7)
    with torch_threads(2):
        expected = run_threaded_case(case)  # the parent's pool is running
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
            pid = os.fork()
        if pid == 0:  # the child: report and leave without running the parent's cleanup
            code = 1
            try:
                ok = same(run_threaded_case(case), expected)
                os.write(w, pickle.dumps(ok))
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        ready, _, _ = select.select([r], [], [], 120)
        if not ready:
            os.kill(pid, 9)
        data = os.read(r, 100) if ready else b""
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert ready, "the forked child's kernels hung"
    assert status == 0 and pickle.loads(data) is True


@requires_native
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_the_openmp_build_gives_the_same_bits(tmp_path):
    """Built with EMBCORE_NATIVE_POOL=omp, the parallel loops are OpenMP regions on torch's own
    runtime: the library links it, and the thread-count, several-callers and fork tests above
    pass on that build too."""
    import subprocess
    import sys
    env = {**os.environ, "EMBCORE_NATIVE_POOL": "omp", "XDG_CACHE_HOME": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "import embcore.kernels.cpu.library as L; assert L.available(); "
         "print(sorted({ln.split()[-1].rsplit('/', 1)[-1] for ln in open('/proc/self/maps') "
         "if 'gomp' in ln}), '-DEC_POOL_OMP' in L.DEFINES)"],
        env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0 and probe.stdout.split()[-1] == "True", probe.stderr[-2000:]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
         "-o", "addopts=", __file__, "-k",
         "depend_on_the_thread_count or several_threads_at_once or forked_child"],
        env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0 and "3 passed" in proc.stdout, tail


def test_an_unknown_pool_is_refused():
    import subprocess
    import sys
    env = {**os.environ, "EMBCORE_NATIVE_POOL": "tbb"}
    proc = subprocess.run([sys.executable, "-c", "import embcore.kernels.cpu.library"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "EMBCORE_NATIVE_POOL='tbb'" in proc.stderr


# ------------------------------------------------------------------ Hyper (the kernels' EcHyper)
HYPER_FIELDS = ["learning_rate", "gradient_multiplier", "clip_min", "clip_max", "weight_decay",
                "weight_min", "weight_max"]
INF = float("inf")


def test_hyper_by_name_with_option_off_defaults():
    h = cpu.Hyper(learning_rate=0.25)
    assert [name for name, _ in cpu.Hyper._fields_] == HYPER_FIELDS
    assert h.as_dict() == dict(learning_rate=0.25, gradient_multiplier=1.0, clip_min=-INF,
                               clip_max=INF, weight_decay=0.0, weight_min=-INF, weight_max=INF)
    h = cpu.Hyper(learning_rate=0.5, clip_max=2, weight_decay=0.125)
    assert (h.learning_rate, h.clip_max, h.weight_decay, h.clip_min) == (0.5, 2.0, 0.125, -INF)
    assert h == cpu.Hyper(0.5, clip_max=2.0, weight_decay=0.125) != cpu.Hyper(0.5)
    with pytest.raises(TypeError):
        cpu.Hyper()  # the learning rate has no default
    with pytest.raises(TypeError):
        cpu.Hyper(0.1, 1.0)  # the options are keyword-only
    with pytest.raises(TypeError):
        cpu.Hyper(0.1, clip_lo=0.0)  # no such field


def test_hyper_from_the_optimizer_by_name():
    opt = ec.SGD(learning_rate=0.3, clipvalue=(-0.5, None), weight_decay_factor=0.1,
                 multiply_weight_decay_factor_by_learning_rate=True, clip_weight_max=1.5,
                 gradient_multiplier=lambda s: 0.5 + s)
    want = cpu.Hyper(learning_rate=0.2, gradient_multiplier=2.5, clip_min=-0.5, clip_max=INF,
                        weight_decay=0.1 * 0.2, weight_min=-INF, weight_max=1.5)
    assert hyper_at(opt, 0.2, 2) == want
    # the multiplier is taken as given (evaluated once by the engine), not called again
    assert _hyper(opt, 0.2, gradient_multiplier=2.5) == want
    assert _hyper(opt, 0.2, gradient_multiplier=0.75).gradient_multiplier == 0.75
    assert _hyper(ec.Adagrad(learning_rate=0.1), 0.1, gradient_multiplier=None) == \
        cpu.Hyper(learning_rate=0.1)


@requires_native
def test_hyper_layout_agrees_with_the_kernels():
    """Same size and field names in order, and every field round-trips by name (C++ reads it at
    ``offsetof(EcHyper, name)``); ``_load`` runs the same check."""
    lib = cpu.library._load()
    assert kernel_args.hyper_layout_errors(lib) == []
    assert lib.ec_hyper_size() == ctypes.sizeof(cpu.Hyper) == 8 * len(HYPER_FIELDS)
    names = [lib.ec_hyper_field_name(i).decode() for i in range(len(HYPER_FIELDS))]
    assert names == HYPER_FIELDS and lib.ec_hyper_field_name(len(HYPER_FIELDS)) is None
    values = dict(zip(HYPER_FIELDS, [0.125, 3.0, -INF, 7.5, 1e-300, -2.0, INF]))
    h = cpu.Hyper(**values)
    for i, name in enumerate(names):
        assert lib.ec_hyper_field(h, i) == values[name] == getattr(h, name), name


@requires_native
def test_hyper_layout_check_reports_mismatches():
    lib = cpu.library._load()

    def struct(names, ctype=ctypes.c_double):
        return type("S", (ctypes.Structure,), {"_fields_": [(n, ctype) for n in names]})

    swapped = HYPER_FIELDS[:]
    swapped[1], swapped[2] = swapped[2], swapped[1]
    errors = kernel_args.hyper_layout_errors(lib, struct(swapped))
    assert any("fields" in e for e in errors)
    assert any("'gradient_multiplier' does not round-trip" in e for e in errors)
    assert kernel_args.hyper_layout_errors(lib, struct(["lr"] + HYPER_FIELDS[1:]))
    assert "size" in kernel_args.hyper_layout_errors(lib, struct(HYPER_FIELDS[:-1]))[0]
    assert kernel_args.hyper_layout_errors(lib, struct(HYPER_FIELDS + ["x"] * 7, ctypes.c_float))


@requires_native
def test_load_refuses_a_library_whose_hyper_disagrees(monkeypatch):
    """A layout mismatch at load is a stale / broken library: warned, and the torch ops used."""
    monkeypatch.setattr(cpu.library, "_tried", False)
    monkeypatch.setattr(cpu.library, "_lib", None)
    monkeypatch.setattr(cpu.library, "_error", None)
    monkeypatch.setattr(cpu.library, "hyper_layout_errors", lambda lib: ["field 'x' differs"])
    with pytest.warns(RuntimeWarning, match="EcHyper disagree: field 'x' differs"):
        assert cpu.library._load() is None
    assert not cpu.usable(torch.zeros(1))


@requires_native
def test_sparse_update_reads_each_hyper_field_by_name():
    """SGD on one row w = 1 with gradient 1: each option changes the step as its name says."""
    cases = [
        (dict(), 0.9),                                # w - lr * g
        (dict(gradient_multiplier=2.0), 0.8),         # g * 2
        (dict(clip_max=0.5), 0.95),                   # g clipped to 0.5
        (dict(clip_min=1.5), 0.85),                   # g clipped up to 1.5
        (dict(weight_decay=0.25), 0.65),              # 0.9 - 0.25 * 1
        (dict(weight_max=0.5), 0.5),                  # w clipped down
        (dict(weight_min=0.95), 0.95),                # w clipped up
    ]
    for options, want in cases:
        table = torch.ones(3, 4)
        cpu.sparse_update(cpu.SGD, table, None, torch.tensor([1]),
                             cpu.Hyper(learning_rate=0.1, **options), [torch.ones(1, 4)])
        torch.testing.assert_close(table[1], torch.full((4,), want), msg=str(options))
        assert torch.equal(table[[0, 2]], torch.ones(2, 4))
    with pytest.raises(TypeError, match="kernels.Hyper"):
        cpu.sparse_update(cpu.SGD, table, None, torch.tensor([1]),
                             (0.1, 1.0, -INF, INF, 0.0, -INF, INF), [torch.ones(1, 4)])
    hyper = cpu.Hyper(learning_rate=0.1)
    with pytest.raises(ValueError, match="unit column stride"):  # the kernel reads rows as runs
        cpu.sparse_update(cpu.SGD, table, None, torch.tensor([1]), hyper,
                             [torch.ones(4, 2).t()], [0, 2], torch.tensor([0, 2]),
                             torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="must be contiguous"):
        cpu.sparse_update(cpu.SGD, table, None, torch.tensor([0, 1]), hyper,
                             [torch.ones(2, 8)[:, :4]])


# ----------------------------------------------------------------------- minmax, combiner scales
@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(-2**62, 2**62), min_size=1, max_size=200))
def test_minmax_equals_torch(values):
    ids = torch.tensor(values, dtype=torch.int64)
    assert cpu.minmax(ids) == (min(values), max(values))
    big = ids.repeat(50)  # longer than any vector width
    assert cpu.minmax(big) == (min(values), max(values))


@st.composite
def bag_weights(draw):
    """Bag lengths (some empty) and per-bag weights: none, random, or summing to exactly zero."""
    lengths = draw(st.lists(st.integers(0, 6), min_size=0, max_size=12))
    w = st.floats(-3, 3, allow_nan=False, width=32)
    weights = []
    for length in lengths:
        kind = draw(st.sampled_from(["random", "random", "cancel", "zeros"]))
        if kind == "random":
            weights.append([draw(w) for _ in range(length)])
        elif kind == "zeros":
            weights.append([0.0] * length)
        else:  # pairs a, -a: every partial sum in order is exactly 0 (then the odd one out)
            bag = []
            for _ in range(length // 2):
                a = draw(w)
                bag += [a, -a]
            weights.append(bag + [0.0] * (length % 2))
    return lengths, weights


@requires_native
@settings(max_examples=examples(80), deadline=None)
@given(bag_weights(), st.sampled_from(["sum", "mean", "sqrtn"]), st.booleans())
def test_combiner_scales_equal_torch_path(case, combiner, weighted):
    lengths, weight_lists = case
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    nnz = int(offsets[-1])
    weights = (torch.tensor([x for b in weight_lists for x in b], dtype=torch.float32)
               if weighted else None)
    got = cpu.combiner_scales(offsets, weights, combiner, nnz)
    with kernels(False):
        want = bags_ops.combiner_scales(offsets, weights, combiner, nnz)
    assert got.dtype == torch.float32 and got.shape == (nnz,)
    assert torch.isfinite(got).all()
    # bitwise: an exported program (the torch path) gives the eager module's (the kernel's) bits
    assert torch.equal(got, want)
    if weighted and combiner != "sum":  # a zero denominator gives zero scales, not NaN
        for r, b in enumerate(weight_lists):
            denom = sum(b) if combiner == "mean" else sum(x * x for x in b)
            if b and denom == 0:
                assert torch.equal(got[offsets[r]:offsets[r + 1]], torch.zeros(len(b)))


@requires_native
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_combiner_scales_are_the_torch_paths_bits_on_random_weights(combiner):
    """Random weights in many bags (where a fused multiply-add in the kernel, or torch's float32
    sqrt, once changed the last bit): the kernel and the torch path agree bitwise, so exported
    programs give the eager module's activations."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 6, (2000,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    nnz = int(offsets[-1])
    weights = torch.rand(nnz, generator=g) + 0.1
    got = cpu.combiner_scales(offsets, weights, combiner, nnz)
    with kernels(False):
        want = bags_ops.combiner_scales(offsets, weights, combiner, nnz)
    assert torch.equal(got, want)


@requires_native
@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=5), st.integers(0, 2**31 - 1))
def test_concat_dedup_equals_shift_cat_and_sort(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 50
    parts = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    adds = [vocab * i for i in range(len(parts))]  # stacked tables, one block of rows each
    ids, unique, order, uoff = cpu.concat_dedup(parts, adds, vocab * len(parts))
    want_ids = torch.cat([p + a for p, a in zip(parts, adds)])
    assert torch.equal(ids, want_ids)
    w_unique, w_order, w_uoff = torch_dedup(want_ids)
    assert torch.equal(unique, w_unique) and torch.equal(order, w_order)
    assert torch.equal(uoff, w_uoff)


@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=3), min_size=1, max_size=5),
       st.integers(0, 2**31 - 1))
def test_dedup_raw_runs_equals_dedup_raw_of_each_run(runs, seed):
    """Stacked dynamic tables' raw ids: deduplicated run by run (the same id in two runs is
    two distinct ids) in one call, as ``dedup_raw`` of each run's concatenated parts, each run's
    positions and distinct indices shifted past the runs before it."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor([-(2**63), -1, 0, 7, 2**62, 2**63 - 1, 12345])
    parts = [pool[torch.randint(0, pool.numel(), (n,), generator=gen)] for r in runs for n in r]
    ids, unique, inverse, order, uoff, counts = cpu.dedup_raw_runs(parts, [len(r) for r in runs])
    assert torch.equal(ids, torch.cat(parts))
    at = u = k = 0
    for r, c in zip(runs, counts):
        run = torch.cat(parts[k:k + len(r)])
        k += len(r)
        w_unique, w_inverse, w_order, w_uoff = cpu.dedup_raw(run)
        assert c == w_unique.numel()
        assert torch.equal(unique[u:u + c], w_unique)
        assert torch.equal(inverse[at:at + run.numel()], w_inverse + u)
        assert torch.equal(order[at:at + run.numel()], w_order + at)
        assert torch.equal(uoff[u:u + c + 1], w_uoff + at)
        at, u = at + run.numel(), u + c
    assert unique.numel() == u and uoff.numel() == u + 1 and int(uoff[-1]) == ids.numel()


@requires_native
def test_dedup_raw_runs_over_threads_equals_one_thread():
    """Runs large enough to go over the threads (an empty one among them) give one thread's
    result."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randint(-(2**40), 2**40, (n,), generator=gen) % m
             for n, m in [(20_000, 5_000), (0, 1), (7_000, 100), (30_000, 2**40), (9, 3)]]
    runs = [2, 1, 2]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.dedup_raw_runs(parts, runs)
        torch.set_num_threads(2)
        two = cpu.dedup_raw_runs(parts, runs)
    finally:
        torch.set_num_threads(old)
    assert one[5] == two[5] and sum(one[5]) == one[1].numel()
    for a, b in zip(one[:5], two[:5]):
        assert torch.equal(a, b)
    ids, unique, inverse, order, uoff, _ = two
    assert torch.equal(unique[inverse], ids)  # (each occurrence's distinct id)
    assert torch.equal(torch.sort(order).values, torch.arange(ids.numel()))
    assert torch.equal(inverse[order], torch.repeat_interleave(
        torch.arange(unique.numel()), uoff[1:] - uoff[:-1]))  # (occurrences grouped by id)


@requires_native
@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.sampled_from([1, 1, 2, 5])),
                min_size=1, max_size=4),
       st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.02, 0.3]))
def test_concat_dedup_limits_and_steps(shapes, seed, bad_rate):
    """``ConcatDedup`` reads each part every ``step`` elements (a column of a wider batch) and,
    with ``limits``, returns the first part holding an id outside ``[0, limit)`` (negative or
    too large, int64 extremes included); else the same as ``concat_dedup`` of contiguous
    copies without limits."""
    gen = torch.Generator().manual_seed(seed)
    parts, limits, steps = [], [], []
    for n, limit, step in shapes:
        p = torch.randint(0, limit, (n,), generator=gen)
        bad = torch.rand(n, generator=gen) < bad_rate
        wrong = torch.tensor([-1, limit, 2**63 - 1, -2**63, limit + 7])[
            torch.randint(0, 5, (n,), generator=gen)]
        ids = torch.where(bad, wrong, p)
        wide = torch.full((n, step), -5, dtype=torch.int64)  # the other columns: out of range
        wide[:, 0] = ids
        parts.append(wide[:, 0])  # stride `step`
        limits.append(limit)
        steps.append(step)
    adds = list(itertools.accumulate([0] + limits[:-1]))
    call = cpu.ConcatDedup([p.numel() for p in parts], adds, sum(limits), limits)
    got = call(parts, steps)
    first_bad = next((i for i, (p, lim) in enumerate(zip(parts, limits))
                      if bool(((p < 0) | (p >= lim)).any())), None)
    if first_bad is not None:
        assert got == first_bad
        return
    assert not isinstance(got, int)
    want = cpu.concat_dedup([p.contiguous() for p in parts], adds, sum(limits))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@requires_native
def test_bag_of_equals_repeat_interleave():
    gen = torch.Generator().manual_seed(2)
    for rows in (0, 1, 9, 300):
        offsets = random_offsets(gen, rows, 4)
        nnz = int(offsets[-1])
        want = torch.repeat_interleave(torch.arange(rows), offsets.diff(), output_size=nnz)
        assert torch.equal(cpu.bag_of(offsets, nnz), want)


# -------------------------------------------------------------------------------- the engine
def workload(seed: int):
    """Tables (two stacked of dim 4, one of dim 3), features sharing tables, and 3 batches."""
    a = ec.TableConfig(vocabulary_size=20, dim=4, combiner="mean", name="a")
    b = ec.TableConfig(vocabulary_size=15, dim=4, combiner="sqrtn", name="b")
    c = ec.TableConfig(vocabulary_size=9, dim=3, combiner="sum", name="c")
    fc = {"a_dense": ec.FeatureConfig(table=a), "a_bags": ec.FeatureConfig(table=a),
          "b_bags": ec.FeatureConfig(table=b), "b_grid": ec.FeatureConfig(table=b),
          "c_bags": ec.FeatureConfig(table=c), "c_seq": ec.FeatureConfig(table=c,
                                                                          max_sequence_length=3)}
    gen = torch.Generator().manual_seed(seed)

    def bags(vocab, weighted):
        lengths = torch.randint(0, 5, (4,), generator=gen).tolist()  # some bags empty
        rows = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]
        w = None
        if weighted:
            w = jagged([(torch.rand(k, generator=gen) * 2 - 0.5).tolist() for k in lengths],
                       torch.float32)
        return jagged(rows, torch.int64), w

    batches = []
    for _ in range(3):
        a_bags, a_w = bags(20, True)
        b_bags, b_w = bags(15, True)
        c_bags, _ = bags(9, False)
        ids = {"a_dense": torch.randint(0, 20, (4,), generator=gen), "a_bags": a_bags,
               "b_bags": b_bags, "b_grid": torch.randint(0, 15, (4, 2, 1), generator=gen),
               "c_bags": c_bags, "c_seq": torch.randint(0, 9, (4, 5), generator=gen)}
        weights = {"a_dense": None, "a_bags": a_w, "b_bags": b_w, "b_grid": None,
                   "c_bags": None, "c_seq": None}
        batches.append((ids, weights))
    return fc, batches


def train(fc, batches, optimizer, seed):
    torch.manual_seed(seed)
    emb = ec.Embedding(fc, optimizer)
    gen = torch.Generator().manual_seed(seed + 1)
    acts_seen = []
    for ids, weights in batches:
        emb.enqueue(ids, weights, training=True)
        acts = emb.dequeue()
        # gradients depend on the activations (a real loss) plus noise
        grads = {k: a.detach() * 0.5 + torch.randn(a.shape, generator=gen)
                 for k, a in acts.items()}
        emb.apply_gradients(grads)
        acts_seen.append({k: a.detach().clone() for k, a in acts.items()})
    return emb, acts_seen


ENGINE_OPTIMIZERS = {
    "adagrad": lambda: ec.Adagrad(learning_rate=0.2),
    "rowwise": lambda: ec.RowwiseAdagrad(learning_rate=0.3, initial_accumulator_value=0.0),
    "sgd": lambda: ec.SGD(learning_rate=0.4, clipvalue=0.6, weight_decay_factor=0.05,
                          clip_weight_min=-0.8),
}


@requires_native
@pytest.mark.parametrize("opt_name", sorted(ENGINE_OPTIMIZERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_engine_native_equals_torch_ops(opt_name, seed):
    fc, batches = workload(seed)
    with kernels(True), spy_native() as calls:
        emb_on, acts_on = train(fc, batches, ENGINE_OPTIMIZERS[opt_name](), seed)
    # the kernels really ran: dedup, lookup, the fused backward + update, combiner scales
    for name in ("concat_dedup", "lookup", "sparse_update", "combiner_scales", "minmax"):
        assert calls[name] > 0, name
    with kernels(False), spy_native(forbid=True):
        emb_off, acts_off = train(fc, batches, ENGINE_OPTIMIZERS[opt_name](), seed)
    assert len(emb_on.plan.physical) == 2  # a and b stacked, c alone
    for step, (on, off) in enumerate(zip(acts_on, acts_off)):
        for k in on:
            torch.testing.assert_close(on[k], off[k], **TOL, msg=f"step {step} {k}")
    s_on, s_off = emb_on.state_dict(), emb_off.state_dict()
    assert sorted(s_on) == sorted(s_off)
    assert int(s_on["step"]) == 3
    for k in s_on:
        torch.testing.assert_close(s_on[k], s_off[k], **TOL, msg=k)
    # and training moved the tables at all
    torch.manual_seed(seed)
    fresh = ec.Embedding(fc, ENGINE_OPTIMIZERS[opt_name]()).state_dict()
    for name in ("a", "b", "c"):
        assert not torch.equal(s_on[f"{name}/parameters"], fresh[f"{name}/parameters"]), name


# ---------------------------------------------------------------------------- OpenMP runtime
@requires_native
def test_one_openmp_runtime_in_the_process():
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this system")
    assert cpu.available()
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(paths) == 1, f"several OpenMP runtimes mapped: {sorted(paths)}"


@pytest.mark.slow
def test_command_line_builds_the_kernels():
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "embcore", "kernels"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == (0 if cpu.available() else 1), proc.stderr
    assert "RuntimeWarning" not in proc.stderr
    helped = subprocess.run([sys.executable, "-m", "embcore", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "kernels" in helped.stdout


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
       width=st.integers(1, 40), threads=st.sampled_from([1, 2]))
def test_copy_rows_equals_index_ops(data, dtype, width, threads):
    """The cache's row moves (cache.py): dst[dst_rows] = src[src_rows], in one pass, for any
    dtype and width, rows of a strided view too (a slot of shape (N, 1))."""
    n_src, n_dst = data.draw(st.integers(1, 60)), data.draw(st.integers(1, 60))
    k = data.draw(st.integers(0, min(n_src, n_dst)))
    src = torch.randn(n_src, width + 3).to(dtype)[:, :width]  # rows 3 entries apart
    dst = torch.randn(n_dst, width).to(dtype)
    src_rows = torch.tensor(data.draw(st.lists(st.integers(0, n_src - 1), min_size=k,
                                               max_size=k)), dtype=torch.int64)
    dst_rows = torch.randperm(n_dst)[:k]  # distinct targets
    want = dst.clone()
    want[dst_rows] = src[src_rows]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu.copy_rows(src, src_rows, dst, dst_rows)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(dst, want)


# ----------------------------------------------------------------------- the ctypes boundary
def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _nested(t: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor of ``t``'s values (its data pointer reads as 0)."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nested.nested_tensor_from_jagged(t, torch.tensor([0, t.numel()]))


def boundary_cases():
    """(call, exception, message): each passes one wrong argument to a wrapper; the message
    names the kernel and the argument and says what it must be."""
    i64 = torch.int64
    table, ids = torch.randn(10, 4), torch.tensor([1, 2, 3, 4])
    offsets, scales = torch.tensor([0, 1, 4]), torch.ones(4)

    def out(rows=2, d=4):
        return torch.full((rows, d), float("nan"))

    acc = torch.zeros(10, 4)
    rows, hyper = torch.tensor([1, 2]), cpu.Hyper(learning_rate=0.1)
    uoff, order = torch.tensor([0, 1, 2]), torch.tensor([0, 1])
    cache = {"where": torch.full((20,), -1, dtype=torch.int32),
             "owner": torch.full((4,), -1, dtype=i64), "stamp": torch.zeros(4, dtype=i64),
             "dirty": torch.zeros(4, dtype=torch.bool), "fresh": torch.zeros(4, dtype=torch.bool),
             "version": torch.zeros(4, dtype=torch.int32),
             "free": torch.arange(3, -1, -1), "n_free": 4, "clock": 1, "spare": 0,
             "bounds": torch.tensor([10]), "counts": torch.zeros(3, 2, dtype=i64)}
    vocab = {"slots": torch.full((8,), -1, dtype=i64), "row_key": torch.zeros(4, dtype=i64),
             "last_use": torch.zeros(4, dtype=i64)}

    def cache_step(**change):
        kw = dict(cache, **change)
        return lambda: cpu.cache_step(torch.tensor([3, 5]), **kw)

    def vocab_find(**change):
        kw = dict(vocab, **change)
        return lambda: cpu.vocab_find(kw["slots"], kw["row_key"], kw["last_use"], 0, ids)

    return {
        "lookup ids int32": (lambda: cpu.lookup(table, ids.int(), offsets, scales, out()),
                             TypeError, (r"ec_lookup: argument 'ids' must be torch.int64, got "
                                        r"torch.int32")),
        "lookup table not contiguous": (
            lambda: cpu.lookup(torch.randn(4, 10).t(), ids, offsets, scales, out()),
            ValueError, r"ec_lookup: argument 'table' must be contiguous, got shape \(10, 4\)"),
        "lookup table meta": (lambda: cpu.lookup(_meta(table), ids, offsets, scales, out()),
                              ValueError, r"argument 'table' must be on the CPU, got device meta"),
        "lookup ids nested": (lambda: cpu.lookup(table, _nested(ids), offsets, scales, out()),
                              ValueError, r"argument 'ids' must be a strided tensor"),
        "lookup offsets a list": (lambda: cpu.lookup(table, ids, [0, 1, 4], scales, out()),
                                  TypeError, (r"argument 'offsets' must be a torch.Tensor, got "
                                             r"list")),
        "lookup offsets short": (lambda: cpu.lookup(table, ids, offsets[:2], scales, out()),
                                 ValueError, r"argument 'offsets' must be of 3 elements, got 2"),
        "lookup scales short": (lambda: cpu.lookup(table, ids, offsets, scales[:3], out()),
                                ValueError, r"argument 'scales' must be of 4 elements, got 3"),
        "lookup out narrow": (lambda: cpu.lookup(table, ids, offsets, scales, out(2, 3)),
                              ValueError, r"argument 'out' must be of 8 elements, got 6"),
        "lookup ids short": (lambda: cpu.lookup(table, ids, None, None, out(5)),
                             ValueError, r"argument 'ids' must be of 5 elements, got 4"),
        "lookup out 1-D": (lambda: cpu.lookup(table, ids, None, None, torch.empty(4)),
                           ValueError, r"argument 'out' must be 2-D, got shape \(4,\)"),
        "sparse_update acc of another rule": (
            lambda: cpu.sparse_update(cpu.ROWWISE_ADAGRAD, table, acc, rows, hyper,
                                         [torch.ones(2, 4)]),
            ValueError, r"ec_sparse_update: argument 'acc' must be of 10 elements, got 40"),
        "sparse_update acc missing": (
            lambda: cpu.sparse_update(cpu.ADAGRAD, table, None, rows, hyper,
                                         [torch.ones(2, 4)]),
            ValueError, r"ec_sparse_update: rule 2 \(ADAGRAD\) needs the accumulators 'acc'"),
        "sparse_update unknown rule": (
            lambda: cpu.sparse_update(7, table, acc, rows, hyper, [torch.ones(2, 4)]),
            ValueError, r"rule 7 is none of SGD, ADAGRAD, ROWWISE_ADAGRAD"),
        "sparse_update summed gradient short": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper, [torch.ones(1, 4)]),
            ValueError, r"argument 'slices\[0\]' must be of 8 elements, got 4"),
        "sparse_update part narrow": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper,
                                         [torch.ones(2, 3)], [0, 2], uoff, order),
            ValueError, r"argument 'slices\[0\]' must be 4 columns wide"),
        "sparse_update part float64": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper,
                                         [torch.ones(1, 4), torch.ones(1, 4, dtype=torch.float64)],
                                         [0, 1, 2], uoff, order),
            TypeError, r"argument 'slices\[1\]' must be torch.float32, got torch.float64"),
        "sparse_update parts and starts disagree": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper,
                                         [torch.ones(1, 4), torch.ones(2, 4)], [0, 1, 2], uoff,
                                         order),
            ValueError, r"gradient part 1 must have starts\[2\] - starts\[1\] = 1 rows, got 2"),
        "sparse_update several parts without starts": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper,
                                         [torch.ones(1, 4), torch.ones(1, 4)], None, uoff, order),
            ValueError, r"2 gradient parts need their 'starts'"),
        "sparse_update order without offsets": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper,
                                         [torch.ones(2, 4)], None, None, order),
            ValueError, r"give both unique_offsets and order"),
        "sparse_update bags short": (
            lambda: cpu.sparse_update(cpu.SGD, table, None, rows, hyper,
                                         [torch.ones(2, 4)], [0, 2], uoff, order,
                                         torch.tensor([0])),
            ValueError, r"argument 'bags' must be of 2 elements, got 1"),
        "sparse_update table meta": (
            lambda: cpu.sparse_update(cpu.SGD, _meta(table), None, rows, hyper,
                                         [torch.ones(2, 4)]),
            ValueError, r"argument 'w' must be on the CPU, got device meta"),
        "minmax empty": (lambda: cpu.minmax(torch.zeros(0, dtype=i64)),
                         ValueError, r"ec_minmax: argument 'ids' must be non-empty"),
        "offsets_error empty": (lambda: cpu.offsets_error(torch.zeros(0, dtype=i64), 0),
                                ValueError, r"argument 'offsets' must be non-empty"),
        "offsets_error nnz a float": (lambda: cpu.offsets_error(offsets, 4.0),
                                      TypeError, r"ec_offsets_error: argument 'nnz' must be int64"),
        "first_unordered 1-D": (lambda: cpu.first_unordered(ids),
                                ValueError, r"argument 'idx' must be 2-D"),
        "combiner_scales weights short": (
            lambda: cpu.combiner_scales(offsets, torch.ones(3), "mean", 4),
            ValueError, r"ec_combiner_scales: argument 'weights' must be of 4 elements"),
        "combiner_scales unknown combiner": (
            lambda: cpu.combiner_scales(offsets, None, "max", 4),
            ValueError, r"combiner 'max' is none of \['mean', 'sqrtn', 'sum'\]"),
        "bag_of offsets int32": (lambda: cpu.bag_of(offsets.int(), 4),
                                 TypeError, r"ec_bag_of: argument 'offsets' must be torch.int64"),
        "expand offsets short": (lambda: cpu.expand(rows, order, uoff[:2]),
                                 ValueError, r"ec_expand: argument 'uoff' must be of 3 elements"),
        "concat_dedup part int32": (
            lambda: cpu.concat_dedup([ids, ids.int()], [0, 10], 20),
            TypeError, r"ec_concat_dedup: argument 'parts\[1\]' must be torch.int64"),
        "ConcatDedup part of another length": (
            lambda: cpu.ConcatDedup([4, 3], [0, 10], 20)([ids, ids]),
            ValueError, r"argument 'parts\[1\]' must be of 3 elements, got 4"),
        "ConcatDedup column of another step": (
            lambda: cpu.ConcatDedup([4], [0], 20)([torch.zeros(4, 3, dtype=i64)[:, 0]], [2]),
            ValueError, r"argument 'parts\[0\]' must be 4 int64 CPU elements 2 apart"),
        "ConcatDedup adds short": (lambda: cpu.ConcatDedup([4, 4], [0], 20),
                                   ValueError, r"ConcatDedup: 2 parts but 1 adds"),
        "dedup_raw ids meta": (lambda: cpu.dedup_raw(_meta(ids)),
                               ValueError, r"ec_dedup_raw: argument 'ids' must be on the CPU"),
        "copy_rows dst of another dtype": (
            lambda: cpu.copy_rows(table, rows, torch.zeros(5, 4, dtype=torch.float64), rows),
            TypeError, (r"ec_copy_rows: argument 'dst' must be torch.float32 \(as the rows it "
                       r"pairs with\)")),
        "copy_rows dst narrow": (
            lambda: cpu.copy_rows(table, rows, torch.zeros(5, 3), rows),
            ValueError, r"argument 'dst' must be 4 columns wide"),
        "copy_rows src columns apart": (
            lambda: cpu.copy_rows(torch.randn(4, 10).t(), rows, torch.zeros(5, 4), rows),
            ValueError, r"argument 'src' must be of unit column stride"),
        "copy_rows dst_rows short": (
            lambda: cpu.copy_rows(table, rows, torch.zeros(5, 4), rows[:1]),
            ValueError, r"argument 'dst_rows' must be of 2 elements, got 1"),
        "copy_rows_summed versions short": (
            lambda: cpu.copy_rows_summed(table, rows, None, None, rows,
                                            torch.zeros(2, dtype=torch.int32), True,
                                            versions=torch.zeros(1, dtype=torch.int32)),
            ValueError, r"ec_copy_rows_summed: argument 'versions' must be of 2 elements"),
        "copy_rows_summed versions int64": (
            lambda: cpu.copy_rows_summed(table, rows, None, None, rows,
                                            torch.zeros(2, dtype=torch.int32), True,
                                            versions=torch.zeros(2, dtype=i64)),
            TypeError, r"argument 'versions' must be torch.int32"),
        "will_need rows int32": (lambda: cpu.will_need(table, rows.int()),
                                 TypeError, r"ec_will_need: argument 'rows' must be torch.int64"),
        "cache_step where int64": (cache_step(where=torch.full((20,), -1, dtype=i64)),
                                   TypeError, (r"ec_cache_step: argument 'where' must be "
                                              r"torch.int32")),
        "cache_step dirty float": (cache_step(dirty=torch.zeros(4)),
                                   TypeError, (r"argument 'dirty' must be torch.uint8 or "
                                              r"torch.bool")),
        "cache_step stamp short": (cache_step(stamp=torch.zeros(3, dtype=i64)),
                                   ValueError, r"argument 'stamp' must be of 4 elements, got 3"),
        "cache_step version int64": (cache_step(version=torch.zeros(4, dtype=i64)),
                                     TypeError, r"argument 'version' must be torch.int32"),
        "cache_step version short": (cache_step(version=torch.zeros(3, dtype=torch.int32)),
                                     ValueError, r"argument 'version' must be of 4 elements"),
        "cache_step counts of other members": (cache_step(counts=torch.zeros(3, 3, dtype=i64)),
                                               ValueError, (r"argument 'counts' must be of 6 "
                                                           r"elements, got 9")),
        "cache_step n_free beyond the cache": (cache_step(n_free=5), ValueError,
                                               r"n_free must lie in \[0, 4\]"),
        "row_versions version int64": (
            lambda: cpu.row_versions(cache["where"], torch.zeros(4, dtype=i64), rows, True),
            TypeError, r"ec_row_versions: argument 'version' must be torch.int32"),
        "set_flags flags int64": (lambda: cpu.set_flags(torch.zeros(4, dtype=i64), rows, True),
                                  TypeError, r"ec_set_flags: argument 'flags' must be"),
        "vocab_find slots empty": (vocab_find(slots=torch.zeros(0, dtype=i64)), ValueError,
                                   r"ec_vocab_find: argument 'slots' must be non-empty"),
        "vocab_find last_use short": (vocab_find(last_use=torch.zeros(3, dtype=i64)),
                                      ValueError, r"argument 'last_use' must be of 4 elements"),
        "vocab_valid born float": (
            lambda: cpu.vocab_valid(rows, torch.zeros(4), 0),
            TypeError, r"ec_vocab_valid: argument 'born' must be torch.int32 or torch.int64"),
        "vocab_step freed short": (
            lambda: cpu.vocab_step(vocab["slots"], vocab["row_key"], vocab["last_use"],
                                      torch.zeros(4, dtype=i64), torch.zeros(4, dtype=i64), 4, 0,
                                      torch.zeros(0, dtype=i64), torch.zeros(0, dtype=i64),
                                      1, 0, False, 0, 3, torch.zeros(2, dtype=i64)),
            ValueError, r"ec_vocab_step: argument 'freed' must be of 3 elements, got 2"),
        "vocab_step born short": (
            lambda: cpu.vocab_step(vocab["slots"], vocab["row_key"], vocab["last_use"],
                                      torch.zeros(4, dtype=i64), torch.zeros(3, dtype=i64), 4, 0,
                                      torch.zeros(0, dtype=i64), torch.zeros(0, dtype=i64),
                                      1, 0, False, 0),
            ValueError, r"ec_vocab_step: argument 'born' must be of 4 elements, got 3"),
        "vocab_step steps of two dtypes": (
            lambda: cpu.vocab_step(vocab["slots"], vocab["row_key"], vocab["last_use"],
                                      torch.zeros(4, dtype=torch.int32),
                                      torch.zeros(4, dtype=i64), 4, 0,
                                      torch.zeros(0, dtype=i64), torch.zeros(0, dtype=i64),
                                      1, 0, False, 0),
            TypeError, r"ec_vocab_step: last_use, frequency and born must share one dtype"),
        "init_normal table narrow": (
            lambda: cpu.init_normal(0, ids, ids, (0, 5), 0.0, 1.0, 1.0, table),
            ValueError, r"ec_init_normal: columns \(0, 5\) need a table 5 wide"),
        "init_normal table float64": (
            lambda: cpu.init_normal(0, ids, ids, (0, 4), 0.0, 1.0, 1.0, table.double()),
            TypeError, r"argument 'table' must be torch.float32"),
        "vocab_index slots int16": (
            lambda: cpu.vocab_index(vocab["slots"].short(), vocab["row_key"],
                                       torch.full((4,), -1, dtype=torch.int32)),
            TypeError, r"ec_vocab_index: argument 'slots' must be torch.int32 or torch.int64"),
        "f32 scales as int64": (lambda: cpu.lookup(table, ids, offsets, ids, out()),
                                TypeError, (r"argument 'scales' must be torch.float32, got "
                                           r"torch.int64 \(expected a contiguous CPU float32 "
                                           r"tensor or None, read\)")),
    }


BOUNDARY_CASES = boundary_cases()


@requires_native
@pytest.mark.parametrize("case", sorted(BOUNDARY_CASES))
def test_a_wrong_argument_is_a_clear_error_before_the_kernel_runs(case):
    """Each wrapper checks every tensor it passes (dtype, layout, device, contiguity, length) and
    raises, naming the kernel and the argument, instead of handing C a pointer it would read
    past or misread (a meta or nested tensor's data pointer is 0)."""
    call, error, message = BOUNDARY_CASES[case]
    with pytest.raises(error, match=message):
        call()


@requires_native
def test_a_refused_call_writes_nothing():
    """The checks run before the kernel: a wrong argument leaves the outputs as they were."""
    table, ids, offsets = torch.randn(10, 4), torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 4])
    out = torch.full((2, 4), float("nan"))
    with pytest.raises(ValueError, match="'scales'"):
        cpu.lookup(table, ids, offsets, torch.ones(3), out)
    assert out.isnan().all()
    before = table.clone()
    with pytest.raises(ValueError, match="'acc'"):
        cpu.sparse_update(cpu.ADAGRAD, table, torch.zeros(10, 3), torch.tensor([1]),
                             cpu.Hyper(learning_rate=1.0), [torch.ones(1, 4)])
    assert torch.equal(table, before)
    # and the same calls with the right arguments do run
    cpu.lookup(table, ids, offsets, torch.ones(4), out)
    assert torch.equal(out, torch.stack([table[1], table[2:5].sum(0)]))


def _c_functions() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The library's exported functions as the C source defines them: ``{name: (result type,
    [(parameter, type)])}``, types without spaces (``const float*`` -> ``constfloat*``)."""
    import re
    functions = {}
    for path in cpu.library._sources():
        text = re.sub(r"//[^\n]*", "", path.read_text())
        for m in re.finditer(r"((?:const\s+)?\w+\s*\*?)\s*\b(ec_\w+)\s*\(([^)]*)\)\s*\{", text):
            params = []
            for p in filter(None, (p.strip() for p in m[3].split(","))):
                typ, name = re.fullmatch(r"(.*?)(\w+)", p).groups()
                params.append((name, typ.replace(" ", "")))
            functions[m[2]] = (m[1].replace(" ", ""), params)
    return functions


def _c_types(kind) -> set[str]:
    """The C types a declared kind may stand for."""
    scalars = {id(kernel_args.INT64): "i64", id(kernel_args.INT): "int", id(kernel_args.DOUBLE): "double",
               id(kernel_args.STRING): "constchar*", id(kernel_args.HYPER): "constEcHyper*"}
    if id(kind) in scalars:
        return {scalars[id(kind)]}
    const = "" if getattr(kind, "writes", True) else "const"
    if isinstance(kind, kernel_args.TensorArg):
        if len(kind.dtypes) > 1 and (torch.float16 in kind.dtypes  # rows of several types
                                     or torch.int32 in kind.dtypes):  # a vocab map's int32/64
            return {f"{const}void*"}
        base = {torch.float32: "float", torch.int64: "i64", torch.int32: "int32_t",
                torch.uint8: "uint8_t", torch.int16: "uint16_t"}[kind.dtypes[0]]
        return {f"{const}{base}*"}
    if isinstance(kind, kernel_args.RowsArg):
        return {f"{const}char*"}
    if isinstance(kind, kernel_args.PartsArg):
        return {"consti64*const*"}
    if isinstance(kind, kernel_args.AllocatedArg):
        return {"i64*"}
    if isinstance(kind, kernel_args.ArrayArg):
        return {ctypes.c_int64: {"i64*", "consti64*"}, ctypes.c_double: {"constdouble*"},
                ctypes.c_void_p: {"constfloat*const*"}}[kind.ctype._type_]
    raise AssertionError(f"a kind without a C type: {kind!r}")


def test_every_kernel_is_declared_as_the_c_source_defines_it():
    """The Python declarations (kernel_args.kernels()) and the C definitions agree: the same
    functions, the same parameter names in the same order, each kind standing for its C type
    (a tensor read through a const pointer, written through a plain one). Needs no compiler."""
    c = _c_functions()
    declared = {k.name: k for k in kernel_args.kernels()}
    assert set(c) - set(declared) == {"ec_dedup"}  # (called by ec_concat_dedup only)
    results = {None: "void", kernel_args.INT64: "i64", kernel_args.INT: "int", kernel_args.DOUBLE: "double",
               kernel_args.STRING: "constchar*"}
    for name, kernel in declared.items():
        result, params = c[name]
        assert results[kernel.result] == result, name
        assert [arg for arg, _ in kernel.args] == [p for p, _ in params], name
        for (arg, kind), (_, typ) in zip(kernel.args, params, strict=True):
            assert typ in _c_types(kind), f"{name}: {arg} is {typ} in C, declared {kind!r}"
        assert name in kernel.source and repr(kernel).startswith(name + "(")


def test_no_assert_guards_in_native():
    """``python -O`` removes asserts: cpu.py and args.py guard with explicit raises
    only."""
    import ast
    from pathlib import Path
    for module in (cpu, kernel_args):
        tree = ast.parse(Path(module.__file__).read_text())
        assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)], (
            module.__name__)


@requires_native
def test_the_abi_version_has_one_source():
    """cpu.ABI_VERSION reaches the library through the build's -DEC_ABI_VERSION: the built
    library reports it, and no source file spells a version of its own."""
    lib = cpu.library._load()
    assert lib.ec_abi_version() == cpu.ABI_VERSION
    assert cpu.DEFINES[0] == f"-DEC_ABI_VERSION={cpu.ABI_VERSION}"
    assert not [d for d in cpu.DEFINES[1:] if not d.startswith("-DEC_RULE_")]  # (rules.py's)
    text = "\n".join(p.read_text() for p in cpu.library._sources())
    assert "return EC_ABI_VERSION;" in text
    assert "#define EC_ABI_VERSION" not in text
    assert "ec_abi_version() { return EC_ABI_VERSION; }" in cpu.SOURCE.read_text()


@pytest.mark.slow
def test_a_build_without_the_abi_version_fails():
    """The preprocessor alone (no compile): without -DEC_ABI_VERSION the translation unit stops
    at its #error; with it, ec_abi_version returns cpu.ABI_VERSION."""
    import subprocess
    try:
        cxx = cpu.library._compiler()
    except OSError:
        pytest.skip("no C++ compiler")
    cmd = [cxx, "-E", "-P", "-std=c++17", str(cpu.SOURCE)]
    bare = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert bare.returncode != 0 and "-DEC_ABI_VERSION" in bare.stderr
    defined = subprocess.run(cmd[:2] + list(cpu.DEFINES) + cmd[2:], check=False,
                             capture_output=True, text=True, timeout=120)
    assert defined.returncode == 0, defined.stderr[-2000:]
    assert f"int ec_abi_version() {{ return {cpu.ABI_VERSION}; }}" in defined.stdout


def test_the_build_key_covers_every_source_file_and_the_abi_version(tmp_path, monkeypatch):
    """A change to any header or to ABI_VERSION builds a new library (a new cache key)."""
    import shutil
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu.CSRC, csrc)
    sources = cpu.library._sources(csrc)
    assert {p.name for p in sources} >= {"kernels.cpp", "common.h", "pool.h", "dedup.h",
                                         "lookup.h", "update.h", "vocab.h", "cache_index.h"}
    key = cpu.library._build_key("c++", ["c++ 1"], csrc)
    assert cpu.library._build_key("c++", ["c++ 1"], csrc) == key
    seen = {key}
    for p in sources:
        text = p.read_text()
        p.write_text(text + "\n// changed\n")
        seen.add(cpu.library._build_key("c++", ["c++ 1"], csrc))
        p.write_text(text)
    assert len(seen) == len(sources) + 1  # every file moved the key
    monkeypatch.setattr(cpu.library, "DEFINES", ("-DEC_ABI_VERSION=999",))
    assert cpu.library._build_key("c++", ["c++ 1"], csrc) not in seen


def test_kernels_cpp_includes_every_header_and_the_package_ships_them():
    """One translation unit: kernels.cpp includes each header of csrc/ (so one compiler call
    builds them all); pyproject's package-data ships every source file (the kernels are
    compiled from the installed package)."""
    import fnmatch
    import re
    tomllib = pytest.importorskip("tomllib")
    headers = {p.name for p in cpu.library._sources() if p.suffix == ".h"}
    included = set(re.findall(r'#include "([\w.]+)"', cpu.SOURCE.read_text()))
    assert headers and included == headers
    pyproject = cpu.CSRC.parents[3] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("an installed package: no pyproject.toml beside it")
    globs = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["embcore"]
    for p in cpu.library._sources():
        relative = p.relative_to(cpu.CSRC.parents[2]).as_posix()
        assert any(fnmatch.fnmatch(relative, g) for g in globs), relative
