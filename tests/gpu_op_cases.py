"""The GPU kernels as torch operators (kernels/gpu/ops.py): fake implementations, ``opcheck``
and tracing by ``torch.compile``.

As tests/triton_cases.py: on a CUDA GPU the kernels run compiled; without one, in Triton's
interpreter on CPU tensors (this file sets ``TRITON_INTERPRET=1`` before triton is imported;
tests/test_gpu_ops.py runs it in a fresh interpreter).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from torch._subclasses import FakeTensorMode  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402
from embcore.kernels.hyper import Hyper  # noqa: E402
from embcore.ops.backend import TRITON  # noqa: E402
from embcore.ops.bags import Bags, dedup  # noqa: E402
from embcore.state.vocab.device_hash import DeviceHash  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
if not gpu.available():
    pytest.skip(f"triton does not load: {gpu.error()}", allow_module_level=True)
if not CUDA and not gpu.interpreted():
    pytest.skip("no CUDA GPU, and triton was imported before TRITON_INTERPRET=1 was set: run "
                "this file alone", allow_module_level=True)

OPS = gpu.operators()
NAMES = ["lookup", "row_gradients", "sparse_update", "move_rows", "hash_find", "hash_insert",
         "hash_delete", "init_rows", "id_bounds", "concat_shift", "concat_offsets",
         "jagged_offsets", "bag_index", "dedup_runs", "concat_bags"]


def _t(*args, **kwargs):
    return torch.tensor(*args, **kwargs, device=DEVICE)


def test_every_kernel_entry_point_is_an_operator_of_the_embcore_namespace():
    assert sorted(OPS) == sorted(NAMES)
    for name in NAMES:
        packet = getattr(torch.ops.embcore, name)
        assert OPS[name]._opoverload is packet.default
        schema = packet.default._schema
        assert str(schema.name) == f"embcore::{name}"
    written = {name: sorted(a.name for a in getattr(torch.ops.embcore, name).default._schema
                            .arguments if a.alias_info is not None and a.alias_info.is_write)
               for name in NAMES}
    assert written == {"lookup": [], "row_gradients": [], "hash_find": [],
                       "sparse_update": ["row_scales", "slot1", "slot2", "table"],
                       "move_rows": ["dst"], "hash_insert": ["maps"], "hash_delete": ["maps"],
                       "init_rows": ["out"],
                       "id_bounds": [], "concat_shift": [], "concat_offsets": [],
                       "jagged_offsets": [], "bag_index": [], "dedup_runs": [],
                       "concat_bags": []}


# -- (a) fake implementations: shapes and dtypes from the inputs', nothing run ------------------

def test_fake_tensors_give_each_operator_its_output_shapes_and_dtypes():
    with FakeTensorMode():
        table = torch.empty(100, 7, dtype=torch.bfloat16, device=DEVICE)
        ids = torch.empty(30, dtype=torch.int64, device=DEVICE)
        offsets = torch.empty(9, dtype=torch.int64, device=DEVICE)
        scales = torch.empty(30, dtype=torch.float32, device=DEVICE)
        out = torch.ops.embcore.lookup(table, ids, offsets, scales, 8)
        assert out.shape == (8, 7) and out.dtype == torch.float32 and out.device == DEVICE
        out = torch.ops.embcore.lookup(table, ids, None, None, 30)
        assert out.shape == (30, 7) and out.dtype == torch.float32

        grad = torch.empty(8, 7, dtype=torch.float32, device=DEVICE)
        uoff = torch.empty(12, dtype=torch.int64, device=DEVICE)  # 11 distinct rows
        order = torch.empty(30, dtype=torch.int64, device=DEVICE)
        g = torch.ops.embcore.row_gradients(grad, uoff, order, ids, scales)
        assert g.shape == (11, 7) and g.dtype == torch.float32

        slot = torch.empty(100, 7, device=DEVICE)
        rows = torch.empty(11, dtype=torch.int64, device=DEVICE)
        inf = float("inf")
        assert torch.ops.embcore.sparse_update(
            table, slot, None, rows, g, None, None, None, None, None, None, 0, 0,
            0.1, 1.0, -inf, inf, 0.0, -inf, inf, 2, [], False, False) is None

        keys = torch.empty(13, dtype=torch.int64, device=DEVICE)
        maps = torch.empty(1, 3, dtype=torch.int64, device=DEVICE)
        found = torch.ops.embcore.hash_find(keys, maps, None, False)
        assert found.shape == (13,) and found.dtype == torch.int64
        take = torch.empty(13, dtype=torch.bool, device=DEVICE)
        assert torch.ops.embcore.hash_insert(keys, keys, take, maps, None, False) is None
        assert torch.ops.embcore.hash_delete(keys, keys, take, maps, None, False) is None
        assert torch.ops.embcore.move_rows(slot, rows, slot, rows, take[:11]) is None


def test_the_public_wrappers_trace_under_fake_tensors():
    """``gpu.lookup`` / ``gpu.row_gradients`` / ``gpu.sparse_update`` (the call sites' names)
    under FakeTensorMode: shapes only, no kernel runs (fake tensors have no data)."""
    opt = ec.Adam(learning_rate=0.1)
    with FakeTensorMode():
        table = torch.empty(50, 4, device=DEVICE)
        slots = {s.name: torch.empty(50, 4, device=DEVICE) for s in opt.slots}
        out = gpu.lookup(table, torch.empty(6, dtype=torch.int64, device=DEVICE),
                         torch.empty(4, dtype=torch.int64, device=DEVICE), None, 3)
        assert out.shape == (3, 4)
        g = gpu.row_gradients(out, torch.empty(5, dtype=torch.int64, device=DEVICE),
                              torch.empty(6, dtype=torch.int64, device=DEVICE),
                              torch.empty(6, dtype=torch.int64, device=DEVICE), None)
        assert g.shape == (4, 4)
        gpu.sparse_update(opt, table, slots, torch.empty(4, dtype=torch.int64, device=DEVICE),
                          Hyper(0.1), g)


def test_a_tracer_records_the_operators_and_eager_calls_give_the_same_values():
    """make_fx on real tensors records ``embcore::lookup`` (the wrappers launch directly, past
    the dispatcher, only where no tracer can see the call) and its values are the eager call's."""
    from torch.fx.experimental.proxy_tensor import make_fx
    table, ids = torch.randn(9, 4, device=DEVICE), _t([8, 0, 8])

    def f(table, ids):
        return gpu.lookup(table, ids, None, None, 3)

    gm = make_fx(f)(table, ids)
    assert [str(n.target) for n in gm.graph.nodes if n.op == "call_function"] == [
        "embcore.lookup.default"]
    torch.testing.assert_close(gm(table, ids), f(table, ids), rtol=0, atol=0)
    torch.testing.assert_close(f(table, ids), table[ids], rtol=0, atol=0)


# -- (b) opcheck: schema, fake vs real, autograd registration, AOT dispatch ---------------------

def _lookup_args():
    torch.manual_seed(0)
    table = torch.randn(20, 5, device=DEVICE)
    ids = _t([3, 1, 3, 19, 0, 7])
    return [(table, ids, None, None, 6),
            (table, ids, _t([0, 2, 2, 6]), None, 3),
            (table.half(), ids, _t([0, 2, 2, 6]), torch.rand(6, device=DEVICE), 3)]


@pytest.mark.parametrize("case", range(3))
def test_opcheck_lookup(case):
    args = _lookup_args()[case]
    torch.library.opcheck(torch.ops.embcore.lookup.default, args)
    table, ids, offsets, scales, _ = args
    want = (table.float()[ids] if offsets is None else F.embedding_bag(
        ids, table.float(), offsets, mode="sum", per_sample_weights=scales,
        include_last_offset=True))  # (R, D)
    torch.testing.assert_close(torch.ops.embcore.lookup(*args), want)


def _occurrences():
    ids = _t([4, 2, 4, 9, 2, 4])
    bags = Bags(ids, _t([0, 2, 3, 6]), torch.rand(6, device=DEVICE))
    return bags, dedup(bags.ids)


def test_opcheck_row_gradients():
    bags, d = _occurrences()
    grad = torch.randn(bags.num_rows, 3, device=DEVICE)
    args = (grad, d.unique_offsets, d.order, bags.bag_of(TRITON), bags.scales)
    torch.library.opcheck(torch.ops.embcore.row_gradients.default, args)
    want = torch.zeros(d.unique.numel(), 3, device=DEVICE)
    inverse = torch.searchsorted(d.unique, bags.ids)
    want.index_add_(0, inverse, bags.scales[:, None] * grad[bags.bag_of(TRITON)])
    torch.testing.assert_close(torch.ops.embcore.row_gradients(*args), want)


@pytest.mark.parametrize("opt", [ec.SGD(learning_rate=0.1), ec.Adagrad(learning_rate=0.1),
                                 ec.Adam(learning_rate=0.1)], ids=lambda o: type(o).__name__)
def test_opcheck_sparse_update(opt):
    bags, d = _occurrences()
    torch.manual_seed(1)
    table = torch.randn(10, 3, device=DEVICE)
    slots = opt.init_slots(10, 3, device=DEVICE)
    names = [s.name for s in opt.slots]
    rule, h, f1, f2 = gpu.update_rule(opt)
    inf = float("inf")
    grad = torch.randn(bags.num_rows, 3, device=DEVICE)
    args = (table, slots[names[0]] if names else None, slots[names[1]] if len(names) > 1
            else None, d.unique, grad, d.unique_offsets, d.order, bags.bag_of(TRITON),
            bags.scales, None, None, 0, 0, 0.1, 1.0, -inf, inf, 0.0, -inf, inf, rule, list(h),
            f1, f2)
    torch.library.opcheck(torch.ops.embcore.sparse_update.default, args)
    # the operator's answer is the wrapper's (opcheck ran on copies)
    t0 = table.clone()
    t1, s1 = table.clone(), {k: v.clone() for k, v in slots.items()}
    torch.ops.embcore.sparse_update(*args)
    gpu.sparse_update(opt, t1, s1, d.unique, Hyper(0.1), grad, d.unique_offsets, d.order,
                      bags.bag_of(TRITON), bags.scales)
    assert not torch.equal(table, t0)
    torch.testing.assert_close(table, t1, rtol=0, atol=0)
    for k in slots:
        torch.testing.assert_close(slots[k], s1[k], rtol=0, atol=0)


def test_opcheck_move_rows():
    src = torch.randn(6, 4, device=DEVICE).to(torch.bfloat16)
    dst = torch.zeros(5, 4, dtype=torch.bfloat16, device=DEVICE)
    src_idx, dst_idx = _t([5, 0, 2]), _t([1, 4, 0])
    take = _t([True, False, True])
    torch.library.opcheck(torch.ops.embcore.move_rows.default, (src, src_idx, dst, dst_idx, take))
    torch.ops.embcore.move_rows(src, src_idx, dst, dst_idx, take)  # (opcheck runs on copies)
    assert torch.equal(dst[1], src[5]) and torch.equal(dst[0], src[2])
    assert torch.equal(dst[4], torch.zeros(4, dtype=torch.bfloat16, device=DEVICE))


def test_opcheck_init_rows():
    from embcore.numerics.normal import KERNEL
    from embcore.state.vocab.vocabulary import initial_values
    ids, rows, take = _t([5, -3, 2**62]), _t([2, 0, 3]), _t([True, False, True])
    out = torch.zeros(4, 6, device=DEVICE)
    k = torch.tensor(KERNEL + (6 ** 0.5,), dtype=torch.float64, device=DEVICE)
    torch.library.opcheck(torch.ops.embcore.init_rows.default, (ids, rows, take, out, 0, 11, k))
    torch.ops.embcore.init_rows(ids, rows, take, out, 0, 11, k)  # (opcheck runs on copies)
    t = ec.TableConfig(vocabulary_size=4, dim=6, dynamic=ec.DynamicVocabulary())
    want = initial_values(t, "t", 11, ids.cpu()).to(DEVICE)
    assert torch.equal(out[2], want[0]) and torch.equal(out[3], want[2])
    assert not out[0].any() and not out[1].any()


def test_opcheck_the_batch_operators():
    parts = [_t([4, 0, 9]), _t([7]), _t([2, 2, 11, 3])]
    flags = [_t(0), _t(False)]
    offsets = _t([0, 2, 2, 5])
    torch.library.opcheck(torch.ops.embcore.id_bounds.default, (parts, [10, 8, 12], flags))
    torch.library.opcheck(torch.ops.embcore.concat_shift.default, (parts, [0, 10, 18]))
    torch.library.opcheck(torch.ops.embcore.concat_offsets.default, ([offsets, offsets], [0, 5], 10))
    torch.library.opcheck(torch.ops.embcore.jagged_offsets.default, (offsets, 5, True))
    torch.library.opcheck(torch.ops.embcore.bag_index.default, (offsets, 5))
    torch.library.opcheck(torch.ops.embcore.dedup_runs.default, (_t([0, 0, 3, 5, 5, 5]),))
    scales = [_t([0.5, 0.5, 1.0, 1.0, 1.0]), _t([1.0])]
    for bags in (True, False):
        torch.library.opcheck(torch.ops.embcore.concat_bags.default,
                              ([_t([4, 0, 9, 7, 2]), _t([3])],
                               [0, 10], [offsets, _t([0, 1])], scales, bags))
    ids, off, sc, bag = torch.ops.embcore.concat_bags([_t([4, 0, 9, 7, 2]), _t([3])], [0, 10],
                                                      [offsets, _t([0, 0, 1])], scales, True)
    assert ids.tolist() == [4, 0, 9, 7, 2, 13] and off.tolist() == [0, 2, 2, 5, 5, 6]
    assert sc.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 1.0] and bag.tolist() == [0, 0, 2, 2, 2, 4]
    report, verdict = torch.ops.embcore.id_bounds(parts, [10, 8, 12], flags)
    assert report.tolist() == [0, 0, 0, 9, 7, 7, 2, 11] and int(verdict) == 0
    assert int(torch.ops.embcore.id_bounds(parts, [10, 7, 12], [])[1]) == 1  # (7 >= 7)
    assert int(torch.ops.embcore.id_bounds(parts, [10, 8, 12], [_t(0), _t(True)])[1]) == 1
    assert torch.ops.embcore.concat_offsets([offsets, offsets], [0, 5], 10).tolist() == [
        0, 2, 2, 5, 7, 7, 10]
    safe, bad, means = torch.ops.embcore.jagged_offsets(_t([0, 2, 1, 5]), 5, True)
    assert safe.tolist() == [0, 2, 2, 5] and int(bad) == 1
    assert torch.equal(means, torch.tensor([0.5, 0.5] + [1 / 3] * 3, device=DEVICE))
    assert torch.ops.embcore.bag_index(offsets, 5).tolist() == [0, 0, 2, 2, 2]
    assert torch.ops.embcore.concat_shift(parts, [0, 10, 18]).tolist() == [
        4, 0, 9, 17, 20, 20, 29, 21]
    unique, uoff = torch.ops.embcore.dedup_runs(_t([0, 0, 3, 5, 5, 5]))
    assert unique.tolist() == [0, 3, 5, 5, 5, 5] and uoff.tolist() == [0, 2, 3, 6, 6, 6, 6]
    with pytest.raises(TypeError, match="1-d int64"):
        torch.ops.embcore.concat_shift([_t([1.0])], [0])
    with FakeTensorMode():
        fake = [torch.empty(n, dtype=torch.int64, device=DEVICE) for n in (3, 5)]
        r, v = torch.ops.embcore.id_bounds(fake, [4, 4], [])
        assert r.shape == (4,) and v.shape == ()
        assert torch.ops.embcore.concat_shift(fake, [0, 4]).shape == (8,)
        u, o = torch.ops.embcore.dedup_runs(fake[1])
        assert u.shape == (5,) and o.shape == (6,)
        f_scales = [torch.empty(n, device=DEVICE) for n in (3, 5)]
        got = torch.ops.embcore.concat_bags(fake, [0, 4], [fake[0], fake[1]], f_scales, True)
        assert [tuple(t.shape) for t in got] == [(8,), (7,), (8,), (8,)]
        assert [t.dtype for t in got] == [torch.int64, torch.int64, torch.float32, torch.int64]


def test_opcheck_the_hash_index():
    owner = _t([40, -7, 12, 99, 5], dtype=torch.int64)
    keys, places = owner[:4].clone(), _t([0, 1, 2, 3])
    take = _t([True, True, False, True])
    gone = (_t([-7]), _t([1]), _t([True]))
    # opcheck runs each operator several times, on copies of ``maps`` (the same addresses):
    # an index of its own
    checked = DeviceHash(5, owner)
    for name, args in [("hash_insert", (keys, places, take)), ("hash_find", (keys,)),
                       ("hash_delete", gone)]:
        torch.library.opcheck(getattr(torch.ops.embcore, name).default,
                              (*args, checked.maps, None, checked.slot64))
    h = DeviceHash(5, owner)
    torch.ops.embcore.hash_insert(keys, places, take, h.maps, None, h.slot64)
    find = (_t([99, 12, 40, 1234, -7]), h.maps, None, h.slot64)
    assert torch.ops.embcore.hash_find(*find).tolist() == [3, -1, 0, -1, 1]
    torch.ops.embcore.hash_delete(*gone, h.maps, None, h.slot64)
    assert torch.ops.embcore.hash_find(*find).tolist() == [3, -1, 0, -1, -1]


# -- (c) one table's combine + update through torch.compile, no graph break ---------------------

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_one_tables_combine_and_update_compile_without_a_graph_break(backend):
    """Lookup, the summed row gradients and the Adagrad update of one table, traced whole by
    ``torch.compile(fullgraph=True)`` (a graph break is an error), against the same calls run
    eagerly. The deduplication stays outside (its sizes depend on the data)."""
    opt = ec.Adagrad(learning_rate=0.1)
    hyper = Hyper(0.1, clip_min=-0.5, clip_max=0.5)

    def step(table, acc, ids, offsets, grad_out, unique, unique_offsets, order, bag_of):
        out = gpu.lookup(table, ids, offsets, None, grad_out.shape[0])  # (R, D)
        g = gpu.row_gradients(grad_out * out, unique_offsets, order, bag_of, None)  # (U, D)
        gpu.sparse_update(opt, table, {"accumulators": acc}, unique, hyper, g)
        return out

    torch.manual_seed(2)
    ids, offsets = _t([3, 8, 3, 0, 5, 8, 8]), _t([0, 3, 3, 7])
    bags = Bags(ids, offsets, None)
    d = dedup(ids)
    grad_out = torch.randn(3, 6, device=DEVICE)
    table = torch.randn(10, 6, device=DEVICE)
    acc = opt.init_slots(10, 6, device=DEVICE)["accumulators"]
    args = (ids, offsets, grad_out, d.unique, d.unique_offsets, d.order, bags.bag_of(TRITON))
    t_eager, a_eager = table.clone(), acc.clone()
    out_eager = step(t_eager, a_eager, *args)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    out = compiled(table, acc, *args)
    torch.testing.assert_close(out, out_eager, rtol=0, atol=0)
    torch.testing.assert_close(table, t_eager, rtol=0, atol=0)
    torch.testing.assert_close(acc, a_eager, rtol=0, atol=0)
    assert not torch.equal(table, t_eager.new_zeros(table.shape))
    explained = torch._dynamo.explain(step)(table.clone(), acc.clone(), *args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes
           if n.op == "call_function"}
    assert {"embcore.lookup.default", "embcore.row_gradients.default",
            "embcore.sparse_update.default"} <= ops, ops


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
