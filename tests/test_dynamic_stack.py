"""Stacked dynamic tables: dynamic tables of one dim, dtype and optimizer share one physical table
(W = 1), each keeping its own map; everything they do equals the same tables alone, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from distributed import run_on
from hypothesis import strategies as st
from profiles import examples

import embcore as ec


def _configs(caps, dim=4, **dyn):
    return [ec.TableConfig(vocabulary_size=c, dim=dim, name=f"t{k}", combiner=comb,
                           dynamic=ec.DynamicVocabulary(**dyn))
            for k, (c, comb) in enumerate(caps)]


def _stacked(cfgs, shared, optimizer, **kw):
    """One engine holding every table (they stack); ``shared``: tables read by a second
    feature ``g<k>``."""
    torch.manual_seed(0)
    fc = {f"f{k}": ec.FeatureConfig(table=c) for k, c in enumerate(cfgs)}
    fc.update({f"g{k}": ec.FeatureConfig(table=cfgs[k]) for k in shared})
    return ec.Embedding(fc, optimizer(), **kw)


def _alone(cfgs, shared, optimizer, **kw):
    """One engine per table (each its own physical table), built under the same seed."""
    out = []
    for k, c in enumerate(cfgs):
        torch.manual_seed(0)
        fc = {f"f{k}": ec.FeatureConfig(table=c)}
        if k in shared:
            fc[f"g{k}"] = ec.FeatureConfig(table=c)
        out.append(ec.Embedding(fc, optimizer(), **kw))
    return out


def _split(batch, k):
    return {n: v for n, v in batch.items() if n[1:] == str(k)}


class Pair:
    """The stacked engine and the engines alone, stepped alike."""

    def __init__(self, cfgs, shared=(), optimizer=lambda: ec.Adagrad(learning_rate=0.1),
                 stacked_kw=None, **kw):
        self.cfgs = cfgs
        self.stacked = _stacked(cfgs, shared, optimizer, **(stacked_kw or kw))
        self.alone = _alone(cfgs, shared, optimizer, **kw)
        physical = self.stacked._ready().store.plan.physical
        assert len(physical) == 1 and len(physical[0].tables) == len(cfgs)

    def train(self, batch, grad_seed):
        assert self.train_or_refuse(batch, grad_seed), "the step was refused"

    def train_or_refuse(self, batch, grad_seed):
        """Steps both alike and returns True; or, when the stacked engine refuses the step
        (a ValueError: more new ids than a table can place), checks that it changed nothing
        (its state still equals the engines alone, not stepped yet), that the engines alone
        refuse it too, the first refusing table with the same error, and returns False (the
        engines alone that took their part are a step ahead then: stop stepping)."""
        try:
            self.stacked.enqueue(batch)
            got = self.stacked.dequeue()
        except ValueError as refused:
            self.assert_same_state()
            refusals = []
            for k, e in enumerate(self.alone):
                part = _split(batch, k)
                if part:
                    try:
                        e.enqueue(part)
                        e.dequeue()
                    except ValueError as alone_refused:
                        refusals.append(alone_refused)
            assert refusals, f"only the stacked engine refused the step: {refused}"
            assert type(refusals[0]) is type(refused) and str(refusals[0]) == str(refused)
            return False
        want = {}
        for k, e in enumerate(self.alone):
            part = _split(batch, k)
            if part:
                e.enqueue(part)
                want.update(e.dequeue())
        assert sorted(got) == sorted(want)
        for n in got:
            assert torch.equal(got[n], want[n]), n
        g = torch.Generator().manual_seed(grad_seed)
        grads = {n: torch.randn(got[n].shape, generator=g) for n in sorted(got)}
        self.stacked.apply_gradients(grads)
        for k, e in enumerate(self.alone):
            part = {n: grads[n] for n in _split(batch, k)}
            if part:
                e.apply_gradients(part)
        return True

    def lookup(self, batch):
        got = self.stacked.lookup(batch)
        for k, e in enumerate(self.alone):
            part = _split(batch, k)
            if part:
                want = e.lookup(part)
                for n in want:
                    assert torch.equal(got[n], want[n]), n

    def assert_same_state(self):
        sd = self.stacked.state_dict()
        for k, e in enumerate(self.alone):
            for key, v in e.state_dict().items():
                if key == "step":
                    continue
                assert torch.equal(sd[key], v), key
            ids, rows = self.stacked.vocabulary(self.cfgs[k])
            ids_a, rows_a = e.vocabulary(self.cfgs[k])
            assert torch.equal(ids, ids_a) and torch.equal(rows, rows_a)
            assert torch.equal(self.stacked.embedding_tables[self.cfgs[k]],
                               e.embedding_tables[self.cfgs[k]])


def _batch(g, n, pool, batch=6, bags=None, empty=()):
    """Every table's feature ``f<k>``: (batch, 2) raw ids (``bags`` None), else jagged bags of
    2 ids (False) or 0-2 ids (True); tables in ``empty``: every bag empty (their maps step over
    no ids)."""
    out = {}
    for k in range(n):
        ids = torch.randint(-pool, pool, (batch, 2), generator=g) * (2**40 + 7)
        if bags is None:
            out[f"f{k}"] = ids
            continue
        lengths = torch.randint(0, 3, (batch,), generator=g) if bags else \
            torch.full((batch,), 2)
        lengths *= int(k not in empty)
        out[f"f{k}"] = torch.nested.nested_tensor_from_jagged(
            ids.flatten()[:int(lengths.sum())],
            torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]))
    return out


def test_stacked_equals_alone():
    """Activations, evaluation lookups, tables, maps and slots: the same bits stacked or alone
    (capacities small enough to evict, batches where some tables have no ids). A step the
    stacked engine refuses (more new ids than a small table holds) the engines alone refuse
    too, with the same error; most examples train before any refusal (they compare values)."""
    trained = []  # per example: the steps trained (and compared) before a refusal
    _stacked_equals_alone(trained)
    assert sum(t > 0 for t in trained) > len(trained) / 2, trained


@settings(max_examples=examples(25), deadline=None)
@given(data=st.data(), n=st.integers(2, 4), eviction=st.sampled_from(["lru", "lfu"]),
       admit_after=st.integers(1, 2), ttl=st.sampled_from([None, 1, 3]),
       shared=st.booleans(), bags=st.booleans())
def _stacked_equals_alone(trained, data, n, eviction, admit_after, ttl, shared, bags):
    # capacities of 7 to 14 rows for up to 10 distinct ids a step (pool=5): most steps fit,
    # and most tables evict; a table of 7 to 9 rows refuses some steps
    caps = [(data.draw(st.integers(7, 14)), data.draw(st.sampled_from(["sum", "mean"])))
            for _ in range(n)]
    pair = Pair(_configs(caps, eviction=eviction, admit_after=admit_after, ttl_steps=ttl),
                shared=(0,) if shared else ())
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    steps = 0
    for step in range(5):
        empty = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
        batch = _batch(g, n, pool=5, bags=bags, empty=empty)
        if shared:
            batch["g0"] = torch.randint(-5, 5, (6,), generator=g) * (2**40 + 7)
        if not pair.train_or_refuse(batch, step):  # both refused, alike
            break
        steps += 1
        pair.lookup(_batch(g, n, pool=6, bags=bags) | ({"g0": batch["g0"]} if shared else {}))
    else:
        pair.assert_same_state()
    trained.append(steps)


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_a_stack_beyond_memory_equals_the_tables_alone_in_memory(tmp_path, eviction):
    """Offloaded (a budget: rows and slots in the slow tier behind a cache, maps in memory),
    the stacked tables still equal the tables alone and in memory, bit for bit."""
    cfgs = _configs([(30, "sum"), (24, "mean"), (40, "sum")], dim=16, eviction=eviction,
                    admit_after=2, ttl_steps=4)  # rows and slots: 12 KB, maps: at most 6 KB
    pair = Pair(cfgs, shared=(1,), stacked_kw={"memory_budget": 12000,
                                               "offload_dir": tmp_path / "slow"})
    store = pair.stacked._ready().store
    assert store.plan.physical[0].offloaded
    g = torch.Generator().manual_seed(11)
    for step in range(8):
        batch = _batch(g, 3, pool=9, bags=True)
        batch["g1"] = torch.randint(-9, 9, (6,), generator=g) * (2**40 + 7)
        pair.train(batch, step)
        pair.lookup(_batch(g, 3, pool=10, bags=True) | {"g1": batch["g1"]})
    assert store.cache_stats()  # (the cache was used)
    pair.assert_same_state()


def test_an_overflowing_member_changes_no_map():
    """A stacked batch whose ids one member cannot place: a ValueError naming that table, and
    no member's map, row or slot changes."""
    cfgs = _configs([(8, "sum"), (3, "sum"), (8, "sum")])
    emb = _stacked(cfgs, (), lambda: ec.Adagrad(learning_rate=0.1))
    g = torch.Generator().manual_seed(0)
    emb.enqueue(_batch(g, 3, pool=1, batch=4))  # two ids a table
    emb.apply_gradients({k: torch.ones_like(v) for k, v in emb.dequeue().items()})
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    bad = _batch(g, 3, pool=1, batch=4)
    bad["f1"] = torch.arange(8).reshape(4, 2) * 1000 + 10**12  # 8 new ids for 3 rows
    with pytest.raises(ValueError, match="'t1'.*admits 8 new ids"):
        emb.enqueue(bad)
        emb.dequeue()
    after = emb.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_checkpoints_of_stacked_tables_load_alone_and_back(tmp_path):
    """A checkpoint holds each table under its own name: the stacked engine's loads into the
    tables alone and into another stacked engine, and training goes on alike."""
    cfgs = _configs([(16, "sum"), (13, "mean")], admit_after=2)
    pair = Pair(cfgs)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        pair.train(_batch(g, 2, pool=6), step)
    ec.save(tmp_path / "c", pair.stacked)
    other = Pair(cfgs)
    ec.load(tmp_path / "c", other.stacked)
    for e in other.alone:
        ec.load(tmp_path / "c", e, strict=False)
    other.assert_same_state()
    for step in range(4, 7):
        batch = _batch(g, 2, pool=6)
        pair.train(batch, step)
        other.train(batch, step)
    pair.assert_same_state()
    for k in range(2):
        assert torch.equal(pair.stacked.embedding_tables[cfgs[k]],
                           other.stacked.embedding_tables[cfgs[k]])


def test_serving_a_stack_looks_up_each_table_by_its_own_map():
    cfgs = _configs([(12, "sum"), (9, "sum")])
    pair = Pair(cfgs)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        pair.train(_batch(g, 2, pool=4), step)
    probe = _batch(g, 2, pool=5)
    emb = pair.stacked
    tables = {c: (emb.embedding_tables[c], *emb.vocabulary(c)) for c in cfgs}
    fc = {f"f{k}": ec.FeatureConfig(table=c) for k, c in enumerate(cfgs)}
    got = ec.serving_embedding_lookup(probe, None, tables, fc)
    for k, e in enumerate(pair.alone):
        assert torch.equal(got[f"f{k}"], e.lookup(_split(probe, k))[f"f{k}"])
    torch.manual_seed(0)
    layer = ec.EmbeddingLayer(fc, ec.Adagrad(learning_rate=0.1))
    layer(_batch(g, 2, pool=4))["f1"].sum().backward()
    assert len(layer.engine._ready().store.plan.physical) == 1
    want = layer.engine.lookup(probe)
    served = layer.for_serving()(probe)
    assert all(torch.equal(served[n], want[n]) for n in want)


def test_what_stacks():
    """Dynamic tables stack with each other (one dim, dtype, optimizer), never with tables whose
    ids are rows, and stand alone with W > 1 (there: tests/test_dynamic.py's sharded tests)."""
    dyn = _configs([(5, "sum"), (6, "sum")])
    static = ec.TableConfig(vocabulary_size=5, dim=4, name="s")
    wide = ec.TableConfig(vocabulary_size=5, dim=8, name="w", dynamic=ec.DynamicVocabulary())
    fc = {"a": ec.FeatureConfig(table=dyn[0]), "b": ec.FeatureConfig(table=dyn[1]),
          "c": ec.FeatureConfig(table=static), "d": ec.FeatureConfig(table=wide)}
    emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.1))
    groups = sorted(p.tables for p in emb._ready().store.plan.physical)
    assert groups == [("s",), ("t0", "t1"), ("w",)]


def _sharded_stack_body(rank, world, init, strategy):
    """W processes (each a share of every batch) equal one process: stacked tables whose ids
    travel to their owners in one exchange, by member (no eviction: capacities hold every id)."""
    g = torch.Generator().manual_seed(7)
    stream = [_batch(g, 3, pool=20, batch=8, bags=True) for _ in range(4)]
    grads = [{f"f{k}": torch.randn(8, 4, generator=g) for k in range(3)} for _ in range(4)]
    cfgs = _configs([(96, "sum"), (80, "mean"), (120, "sum")], admit_after=2)

    def run(emb, share, world_):
        acts = []
        for batch, grad in zip(stream, grads):
            b = 8 // world_
            part = {n: v[share * b:(share + 1) * b] if not v.is_nested else
                    torch.nested.nested_tensor_from_jagged(
                        v.values()[v.offsets()[share * b]:v.offsets()[(share + 1) * b]],
                        v.offsets()[share * b:(share + 1) * b + 1] - v.offsets()[share * b])
                    for n, v in batch.items()}
            emb.enqueue(part)
            got = emb.dequeue()
            acts.append(torch.cat([got[f"f{k}"] for k in range(3)], 1))
            emb.apply_gradients({n: v[share * b:(share + 1) * b] for n, v in grad.items()})
        return torch.cat(acts)

    one = _stacked(cfgs, (), lambda: ec.Adagrad(learning_rate=0.1))
    want = run(one, 0, 1)
    init()
    emb = _stacked(cfgs, (), lambda: ec.Adagrad(learning_rate=0.1), sharding=strategy,
                   timeout=30)
    plan = emb._ready().store.plan
    if strategy == "hash":  # ("table": the tables of one owner stack)
        assert len(plan.physical) == 1 and len(plan.physical[0].tables) == 3
    got = run(emb, rank, world)
    b = 8 // world
    share = torch.cat([want[i * 8 + rank * b:i * 8 + (rank + 1) * b] for i in range(4)])
    torch.testing.assert_close(got, share, rtol=1e-5, atol=1e-6)
    for c in cfgs:
        ids = emb.whole_vocabulary(c)[0]
        assert torch.equal(ids, one.vocabulary(c)[0]), c.name


@pytest.mark.parametrize("world,strategy", [(2, "hash"), (2, "table")])
@pytest.mark.slow
def test_a_sharded_stack_equals_one_process(world, strategy):
    run_on(world, _sharded_stack_body, strategy)
