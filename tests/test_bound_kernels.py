"""Kernels bound to one table (kernels/cpu/args.py ``Kernel.partial``; kernels/cpu ``SparseUpdate``
and ``TableLookup``; ops ``TableUpdate`` and ``TableCombine``) against the calls they stand for:
the same bits, the same errors, and a table whose storage is replaced bound again."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import requires_native
from profiles import examples
from strategies import any_optimizer, occurrences
from switches import kernels

import embcore as ec
from embcore.kernels import cpu
from embcore.ops.backend import TORCH_OPS
from embcore.ops.bags import Bags
from embcore.ops.combine import OutputGrads, TableCombine, combine
from embcore.ops.update import TableUpdate, _hyper, update

pytestmark = requires_native


def _table(gen, n, d, dtype):
    return torch.randn(n, d, generator=gen).to(dtype)


def _acc(gen, n, d, rowwise):
    return torch.rand(n, 1 if rowwise else d, generator=gen) + 0.1


# ------------------------------------------------------------------------------ Kernel.partial
def test_partial_checks_its_fixed_arguments_once_and_the_others_every_call():
    table = torch.zeros(4, 3)
    kernel = cpu.batch._LOOKUP
    with pytest.raises(TypeError, match="ec_lookup: argument 'table' must be"):
        kernel.partial(table=(table.double(), None))
    with pytest.raises(ValueError, match="ec_lookup: argument 'table' must be contiguous"):
        kernel.partial(table=(torch.zeros(3, 4).t(), None))
    with pytest.raises(TypeError, match=r"ec_lookup: no argument\(s\) \['tabel'\]"):
        kernel.partial(tabel=(table, None))
    call = kernel.partial(type=0, table=(table, None), row_scales=(None, 0), d=3)
    out = torch.empty(2, 3)
    with pytest.raises(TypeError, match="ec_lookup: argument 'ids' must be"):
        call((torch.tensor([0, 1], dtype=torch.int32), 2), (None, 3), (None, 2), 2, (out, 6), 1)
    with pytest.raises(TypeError):  # a fixed argument is keyword-only: not given again by place
        call((torch.tensor([0, 1]), 2), (None, 3), (None, 2), 2, (out, 6), 1, 0)


# ---------------------------------------------------------------------- SparseUpdate, lookup
@settings(max_examples=examples(60), deadline=None)
@given(st.sampled_from([cpu.SGD, cpu.ADAGRAD, cpu.ROWWISE_ADAGRAD]),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.integers(1, 12),
       st.sampled_from([1, 4, 9]), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_sparse_update_bound_equals_sparse_update(rule, dtype, n, d, unit, summed, seed):
    gen = torch.Generator().manual_seed(seed)
    table = _table(gen, n, d, dtype)
    acc = None if rule == cpu.SGD else _acc(gen, n, d, rule == cpu.ROWWISE_ADAGRAD)
    bound_table, bound_acc = table.clone(), None if acc is None else acc.clone()
    bound = cpu.SparseUpdate(rule, bound_table, bound_acc)
    hyper = cpu.Hyper(0.1, clip_min=-0.5, clip_max=0.5)
    for step in range(3):  # (the arrays are kept across calls: a layout, then another)
        grad, _, _ = occurrences(gen, n, d, int(torch.randint(0, 3 * n, (1,), generator=gen)),
                                 unit)
        dd = grad.dedup
        if summed:
            g = [torch.randn(dd.unique.numel(), d, generator=gen)]
            cpu.sparse_update(rule, table, acc, dd.unique, hyper, g)
            bound(dd.unique, hyper, g)
        else:
            bag = None if grad.bags.unit else grad.bags.bag_of(TORCH_OPS)
            cpu.sparse_update(rule, table, acc, dd.unique, hyper, grad.parts, grad.starts,
                                 dd.unique_offsets, dd.order, bag, grad.bags.scales)
            bound(dd.unique, hyper, grad.parts, list(grad.starts), dd.unique_offsets, dd.order,
                  bag, grad.bags.scales)
        assert torch.equal(bound_table, table)
        if acc is not None:
            assert torch.equal(bound_acc, acc)


def test_sparse_update_bound_checks_every_call_and_rebinds_a_replaced_storage():
    table, acc = torch.zeros(5, 3), torch.ones(5, 3)
    with pytest.raises(ValueError, match="needs the accumulators"):
        cpu.SparseUpdate(cpu.ADAGRAD, table, None)
    with pytest.raises(ValueError, match="rule 7 is none of"):
        cpu.SparseUpdate(7, table, acc)
    with pytest.raises(ValueError, match="ec_sparse_update: argument 'acc' must be of 15"):
        cpu.SparseUpdate(cpu.ADAGRAD, table, torch.ones(5, 1))
    bound = cpu.SparseUpdate(cpu.ADAGRAD, table, acc)
    hyper = cpu.Hyper(1.0)
    rows = torch.tensor([1, 3])
    with pytest.raises(TypeError, match="ec_sparse_update: argument 'slices"):
        bound(rows, hyper, [torch.ones(2, 3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"'slices\[0\]' must be 3 columns wide"):
        bound(rows, hyper, [torch.ones(2, 4)], [0, 2], torch.tensor([0, 1, 2]),
              torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="gradient part 0 must have starts"):
        bound(rows, hyper, [torch.ones(3, 3)], [0, 2], torch.tensor([0, 1, 2]),
              torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="give both unique_offsets and order"):
        bound(rows, hyper, [torch.ones(2, 3)], None, torch.tensor([0, 1, 2]))
    # the table's storage replaced (set_): bound again, the new storage written
    table.set_(torch.zeros(5, 3).untyped_storage(), 0, (5, 3), (3, 1))
    bound(rows, hyper, [torch.ones(2, 3)])
    assert table[1].ne(0).all() and table[3].ne(0).all() and table[0].eq(0).all()


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), st.integers(1, 12),
       st.sampled_from([1, 5]), st.booleans(), st.integers(0, 2**31 - 1))
def test_table_lookup_equals_lookup(dtype, n, d, unit, seed):
    gen = torch.Generator().manual_seed(seed)
    table = _table(gen, n, d, dtype)
    grad, _, _ = occurrences(gen, n, d, int(torch.randint(1, 3 * n, (1,), generator=gen)), unit)
    bags = grad.bags
    r = bags.num_rows
    want = cpu.lookup(table, bags.ids, bags.offsets, bags.scales, torch.empty(r, d))
    got = cpu.TableLookup(table)(bags.ids, bags.offsets, bags.scales, torch.empty(r, d))
    assert torch.equal(got, want)


# ---------------------------------------------------------------- TableUpdate, TableCombine
@settings(max_examples=examples(60), deadline=None)
@given(any_optimizer(), st.sampled_from([torch.float32, torch.bfloat16]), st.integers(1, 12),
       st.sampled_from([1, 4]), st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
def test_table_update_equals_update(opt_case, dtype, n, d, unit, switch, seed):
    """Every optimizer (the fused kernel's and the others'): the bound update equals ``update``
    on the same backend; the kernels switched off halfway (``switch``) change neither (the
    backend is chosen once, when the update is bound)."""
    opt, lr, step = opt_case
    gen = torch.Generator().manual_seed(seed)
    table = _table(gen, n, d, dtype)
    slots = {s.name: torch.rand(n, 1 if s.rowwise else d, generator=gen) + 0.1
             for s in opt.slots}
    bound_table, bound_slots = table.clone(), {k: v.clone() for k, v in slots.items()}
    bound = TableUpdate(bound_table, bound_slots, opt)
    for k in range(3):
        with kernels(not (switch and k == 1)):
            grad, _, _ = occurrences(gen, n, d, int(torch.randint(0, 3 * n, (1,),
                                                                  generator=gen)), unit)
            update(table, slots, grad.dedup.unique, grad, opt, lr, step + k,
                   backend=bound.backend)
            bound(grad.dedup.unique, grad, lr, step + k)
        assert torch.equal(bound_table, table)
        for name, v in slots.items():
            assert torch.equal(bound_slots[name], v), name


def test_table_update_keeps_a_schedules_hyper_parameters_bounded():
    table, acc = torch.zeros(4, 2), torch.full((4, 2), 0.1)
    opt = ec.Adagrad(learning_rate=0.1)
    bound = TableUpdate(table, {"accumulators": acc}, opt)
    rows, grad = torch.tensor([0, 2]), torch.ones(2, 2)
    for k in range(3 * TableUpdate._HYPERS_KEPT):  # a new rate every step
        bound(rows, grad, 0.1 + k / 100, k)
        assert len(bound._hypers) <= TableUpdate._HYPERS_KEPT
    assert bound._hypers[(0.1 + (k / 100), None)] == _hyper(opt, 0.1 + k / 100,
                                                           gradient_multiplier=None)


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from([torch.float32, torch.float16, torch.float64]), st.integers(1, 10),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_table_combine_equals_combine(dtype, n, unit, seed):
    gen = torch.Generator().manual_seed(seed)
    table = _table(gen, n, 3, dtype)
    grad, _, _ = occurrences(gen, n, 3, int(torch.randint(1, 3 * n, (1,), generator=gen)), unit)
    bags = grad.bags
    bound = TableCombine(table)
    assert torch.equal(bound(bags.ids, bags), combine(table, bags.ids, bags))
    with kernels(False):  # switched off: the bound kernel stays, the torch ops' bits all the same
        assert torch.equal(bound(bags.ids, bags), combine(table, bags.ids, bags))
    assert torch.equal(TableCombine(table, TORCH_OPS)(bags.ids, bags), bound(bags.ids, bags))


def test_table_combine_of_a_differentiable_table_stays_differentiable():
    table = torch.randn(5, 3, requires_grad=True)
    bags = Bags(torch.tensor([0, 4, 4]), None, None)
    out = TableCombine(table)(bags.ids, bags)
    assert out.requires_grad
    out.sum().backward()
    assert table.grad is not None and table.grad[4].eq(2).all() and table.grad[1].eq(0).all()


def test_kernel_partial_keeps_its_tensors_alive():
    """The bound addresses stay valid while the bound call lives, whatever the caller drops; a
    tensor passed inline (``ids`` here) lives until the kernel returns (its address was taken
    before the other arguments' checks: it segfaulted before the call kept what it was given)."""
    call = cpu.batch._LOOKUP.partial(type=0, table=(torch.arange(6.0).view(2, 3), None),
                                     row_scales=(None, 0), d=3)
    gc.collect()
    torch.full((2, 3), -1.0)  # (memory a freed table would give next)
    out = torch.empty(1, 3)
    call((torch.tensor([1]), 1), (None, 2), (None, 1), 1, (out, 3), 1)
    assert out.tolist() == [[3.0, 4.0, 5.0]]


def test_output_grads_is_what_the_update_reads():
    """``OutputGrads`` (a named tuple) by field, as ``update`` and the bound update read it."""
    gen = torch.Generator().manual_seed(0)
    grad, _, _ = occurrences(gen, 6, 2, 9, False)
    again = OutputGrads(*grad)
    assert (again.parts, again.starts, again.bags, again.dedup) == tuple(grad)
    assert again.parts is grad.parts and again.dedup is grad.dedup


# ------------------------------------------------------------- the packed calls (csrc/packed.h)
_PACKED = {"ec_concat_dedup", "ec_lookup", "ec_sparse_update"}


def test_the_hot_kernels_are_declared_packed_as_packed_h_exports_them():
    """The kernels declared ``packed`` are those csrc/packed.h exports as ``<name>_packed``, and
    the loaded library has each entry. Needs the library (requires_native)."""
    import re
    declared = {k.name for k in cpu.args.kernels() if k.packed}
    text = (cpu.CSRC / "packed.h").read_text()
    assert set(re.findall(r"^EC_PACKED\((ec_\w+)\)$", text, re.M)) == declared == _PACKED
    lib = cpu.library._load()
    for name in declared:
        assert getattr(lib, f"{name}_packed") is not None


def test_a_bound_call_of_a_packed_kernel_passes_one_argument(monkeypatch):
    """A bound hot kernel (``Kernel.partial``) calls ``<name>_packed`` with its arguments in
    slots, not the ctypes call of every argument: with the per-argument entry gone, the bound
    lookup, update and dedup still give the results of the unbound calls."""
    gen = torch.Generator().manual_seed(3)
    table, acc = torch.randn(6, 4, generator=gen), torch.rand(6, 4, generator=gen) + 0.1
    ids = torch.tensor([4, 1, 4, 0])
    want_out = cpu.lookup(table, ids, None, None, torch.empty(4, 4))
    grads = [torch.randn(4, 4, generator=gen)]
    t2, a2 = table.clone(), acc.clone()
    unique, order, uoff = cpu.dedup(ids, 6)
    hyper = cpu.Hyper(learning_rate=0.5)
    cpu.sparse_update(cpu.ADAGRAD, t2, a2, unique, hyper, grads, [0, 4], uoff, order)
    want_dedup = cpu.concat_dedup([ids[:2], ids[2:]], [0, 2], 8, [6, 6])
    for name in _PACKED:  # (each kernel's per-argument entry fails from here on)
        kernel = next(k for k in cpu.args.kernels() if k.name == name)
        monkeypatch.setattr(kernel, "_fn", None)
    out = cpu.TableLookup(table)(ids, None, None, torch.empty(4, 4))
    assert torch.equal(out, want_out)
    cpu.SparseUpdate(cpu.ADAGRAD, table, acc)(unique, hyper, grads, [0, 4], uoff, order)
    assert torch.equal(table, t2) and torch.equal(acc, a2)
    got = cpu.batch.ConcatDedup([2, 2], [0, 2], 8, [6, 6])([ids[:2], ids[2:]])
    assert all(torch.equal(a, b) for a, b in zip(got, want_dedup, strict=True))
    assert cpu.batch.ConcatDedup([2, 2], [0, 2], 8, [6, 6])([ids[:2], ids[2:] + 3]) == 1


def test_a_packed_bound_call_names_a_wrong_argument_and_changes_nothing():
    """An argument of the wrong type to a bound packed kernel is the TypeError of the unbound
    call, naming the kernel and the argument; the table is left as it was."""
    table = torch.randn(5, 3)
    acc = torch.ones(5, 3)
    before = table.clone()
    update = cpu.SparseUpdate(cpu.ADAGRAD, table, acc)
    rows, grads = torch.tensor([1, 2]), [torch.ones(2, 3)]
    with pytest.raises(TypeError, match="ec_sparse_update: argument 'hyper' must be"):
        update(rows, 0.5, grads)
    with pytest.raises(TypeError, match="ec_sparse_update: argument 'rows' must be"):
        update(rows.int(), cpu.Hyper(learning_rate=0.5), grads)
    call = cpu.batch._LOOKUP.partial(type=0, table=(table, None), row_scales=(None, 0), d=3)
    out = torch.zeros(2, 3)
    with pytest.raises(TypeError, match="ec_lookup: argument 'r_rows' must be int64: wrong "
                                        "type float"):
        call((rows, 2), (None, 3), (None, 2), 2.0, (out, 6), 1)
    with pytest.raises(TypeError, match="ec_lookup: argument 'nt' must be int: wrong type"):
        call((rows, 2), (None, 3), (None, 2), 2, (out, 6), None)
    assert torch.equal(table, before) and out.eq(0).all() and acc.eq(1).all()
    call((rows, 2), (None, 3), (None, 2), 2, (out, 6), 1)  # and the right call runs
    assert torch.equal(out, table[rows])


def test_a_bound_call_keeps_its_slots_per_thread():
    """Threads calling one bound kernel at once each write their own slots: every thread's
    lookups give its own rows."""
    import threading
    table = torch.arange(64 * 8, dtype=torch.float32).view(64, 8)
    call = cpu.batch._LOOKUP.partial(type=0, table=(table, None), row_scales=(None, 0), d=8)
    wrong = []

    def worker(k: int) -> None:
        ids = torch.full((16,), k, dtype=torch.int64)
        for _ in range(300):
            out = torch.empty(16, 8)
            call((ids, 16), (None, 17), (None, 16), 16, (out, 128), 1)
            if not torch.equal(out, table[ids]):
                wrong.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_a_one_off_dedup_binds_nothing_and_a_layout_binds_at_its_second_call(monkeypatch):
    """``dedup`` / ``concat_dedup`` (a new ``ConcatDedup`` each call) take the unbound call:
    binding compiles a function, which a one-off call would pay every time; a ``ConcatDedup``
    called again (a batch layout's, every step) binds, with the same results."""
    ids = torch.tensor([5, 1, 5, 3])
    bound = []
    partial = cpu.batch._CONCAT_DEDUP.partial
    monkeypatch.setattr(cpu.batch._CONCAT_DEDUP, "partial",
                        lambda **fixed: bound.append(1) or partial(**fixed))
    unique, order, uoff = cpu.dedup(ids, 8)
    assert unique.tolist() == [1, 3, 5] and uoff.tolist() == [0, 1, 2, 4] and not bound
    layout = cpu.batch.ConcatDedup([2, 2], [0, 8], 16, [8, 8])
    first = layout([ids[:2], ids[2:]])
    assert not bound
    again = layout([ids[:2], ids[2:]])
    assert len(bound) == 1 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    layout([ids[:2], ids[2:]])
    assert len(bound) == 1
