"""Dynamic tables (raw ids, docs/semantics.md section 9) in the engine: against the readable
reference vocabulary and a per-id model written out here, every input kind, the layer, pipelining,
and W = 2 / 4 against W = 1."""

from __future__ import annotations

import functools
import math

import oracles
import pytest
import torch
from distributed import run_on
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import requires_native
from profiles import examples

import embcore as ec
from embcore.numerics.hashing import owner, splitmix64, splitmix64_int, uniform
from embcore.ops.backend import FUSED_CPU, choose
from embcore.state.vocab.vocabulary import vocab_map
from embcore.state.vocab.reference import ReferenceVocabulary
from embcore.state.vocab.vocabulary import initial_values, initialize_rows, inverse_normal, table_seed

BIG = [-(2**63), -1, 0, 3, 2**40 + 7, 2**63 - 1]


def _engine(capacity=4, dim=3, optimizer=None, combiner="sum", features=("f",), seed=0,
            **dynamic):
    torch.manual_seed(seed)
    t = ec.TableConfig(vocabulary_size=capacity, dim=dim, combiner=combiner, name="t",
                       dynamic=ec.DynamicVocabulary(**dynamic))
    cfg = {f: ec.FeatureConfig(table=t, name=f) for f in features}
    return ec.Embedding(cfg, optimizer or ec.SGD(learning_rate=0.5)), t


# ------------------------------------------------------------------------------ hashing
def test_splitmix64_matches_python_integers():
    xs = torch.tensor(BIG + list(range(-50, 50)), dtype=torch.int64)
    got = splitmix64(xs).tolist()
    for x, h in zip(xs.tolist(), got):
        assert h % 2**64 == splitmix64_int(x % 2**64)
    assert splitmix64_int(0) == 0xE220A8397B1DCDAF  # SplitMix64's first output for seed 0


def test_owner_is_the_unsigned_hash_modulo_w():
    xs = torch.tensor(BIG + list(range(200)), dtype=torch.int64)
    for w in (1, 2, 3, 4, 7):
        want = [splitmix64_int(x % 2**64) % w for x in xs.tolist()]
        assert owner(xs, w).tolist() == want


def test_uniform_and_initial_values_depend_on_the_id_and_seed_only():
    ids = torch.tensor([5, -3, 2**62], dtype=torch.int64)
    u = uniform(7, ids, 4)
    assert u.shape == (3, 4) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(uniform(7, ids[[2, 0]], 4), u[[2, 0]])
    assert not torch.equal(uniform(8, ids, 4), u)
    t = ec.TableConfig(vocabulary_size=4, dim=64, dynamic=ec.DynamicVocabulary())
    v = initial_values(t, "t", 11, torch.arange(2000))
    std = 1 / math.sqrt(64)
    assert v.abs().max() <= 2 * std and abs(v.std().item() - 0.88 * std) < 0.05 * std


@requires_native
def test_initial_values_are_the_same_with_the_kernels_and_without():
    t = ec.TableConfig(vocabulary_size=4, dim=33, dynamic=ec.DynamicVocabulary())
    ids = torch.cat([torch.tensor(BIG), torch.randint(-(2**63), 2**63 - 1, (3000,),
                                                      generator=torch.Generator().manual_seed(3))])
    rows = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(4))
    for seed in (0, 11, -5, 2**63 - 1, 2**64 - 1):
        want = initial_values(t, "t", seed, ids)  # torch ops
        for columns in ((0, 33), (5, 20)):
            got = torch.zeros(ids.numel(), columns[1] - columns[0])
            initialize_rows(t, "t", seed, ids, rows, got, columns, FUSED_CPU)  # the kernels
            assert torch.equal(got[rows], want[:, columns[0]:columns[1]])
    # the approximation of the inverse normal CDF against torch's ndtri
    p = torch.linspace(1e-6, 1 - 1e-6, 100_001, dtype=torch.float64)
    torch.testing.assert_close(inverse_normal(p), torch.special.ndtri(p), rtol=2e-9, atol=1e-12)


# ------------------------------------------------------------------------------ configs
def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="eviction"):
        ec.DynamicVocabulary(eviction="fifo")
    with pytest.raises(ValueError, match="admit_after"):
        ec.DynamicVocabulary(admit_after=0)
    with pytest.raises(TypeError, match="ttl_steps"):
        ec.DynamicVocabulary(ttl_steps=1.5)
    with pytest.raises(TypeError, match="dynamic"):
        ec.TableConfig(vocabulary_size=4, dim=2, dynamic="lru")
    with pytest.raises(ValueError, match="initializer tensor"):
        ec.TableConfig(vocabulary_size=4, dim=2, initializer=torch.zeros(4, 2),
                       dynamic=ec.DynamicVocabulary())
    t = ec.TableConfig(vocabulary_size=4, dim=2, name="t", dynamic=ec.DynamicVocabulary())
    with pytest.raises(ValueError, match="dynamic.*'column'"):
        ec.Embedding({"f": ec.FeatureConfig(table=t)}, sharding="column")
    s = ec.TableConfig(vocabulary_size=4, dim=2, name="s")
    with pytest.raises(ValueError, match="not dynamic.*'hash'"):
        ec.Embedding({"f": ec.FeatureConfig(table=s)}, sharding="hash")



def test_a_raw_id_in_a_static_table_points_to_dynamic_tables():
    """An id beyond 32 bits (a hash, a 64-bit key) in a static table: the range error names
    the table and its dynamic= option, wherever it is fed (the engine's dense and jagged ids,
    the layer); nothing is trained. An id just past the end gets the plain range error."""
    t = ec.TableConfig(vocabulary_size=100, dim=4, name="users")
    emb = ec.Embedding({"user": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    layer = ec.EmbeddingLayer({"user": ec.FeatureConfig(table=t)}, "sgd")
    before = emb.embedding_tables["users"].clone()
    hint = (r"has id (-?1099511627776|4294967296) but table 'users' has vocabulary_size 100; "
            r"ids must be in \[0, 100\) \(.* looks like a raw id.*table 'users' with "
            r"dynamic=ec\.DynamicVocabulary\(\).*section 9\)")
    jagged = torch.nested.nested_tensor_from_jagged(torch.tensor([3, 2**40]),
                                                    torch.tensor([0, 1, 2]))
    for ids in (torch.tensor([2**40]), torch.tensor([1, -2**40]), torch.tensor([2**32]),
                jagged):
        with pytest.raises(ValueError, match=hint):
            emb.enqueue({"user": ids})
            emb.dequeue()
        with pytest.raises(ValueError, match=hint):
            layer({"user": ids})
    assert torch.equal(emb.embedding_tables["users"], before)
    for near in (100, -1):
        with pytest.raises(ValueError, match=rf"has id {near} but .*\[0, 100\)$"):
            emb.enqueue({"user": torch.tensor([near])})
            emb.dequeue()


# ------------------------------------------------------------------------------ the engine
class PerIdModel:
    """The oracle of a dynamic table with a sum combiner and SGD: the reference vocabulary says
    which ids are resident; each resident id has its own vector, made at admission by the
    documented truncated normal of its (seed, id) (tests/oracles.py, not ``initial_values``); a
    gradient moves the vectors of the ids resident after the step."""

    def __init__(self, table, seed, lr, **dynamic):
        self.vocab = ReferenceVocabulary(capacity=table.vocabulary_size, **dynamic)
        self.table, self.seed, self.lr = table, seed, lr
        self.vectors: dict[int, torch.Tensor] = {}

    def step(self, bags: list[list[int]], grad: torch.Tensor | None) -> torch.Tensor:
        flat = [i for b in bags for i in b]
        rows = dict(zip(flat, self.vocab.lookup(flat, training=grad is not None)))
        v = self.vocab
        for i in v.rows:  # admitted now (first use, this step): an evicted id starts over
            if grad is not None and v.frequency[i] == 1 and v.last_use[i] == v.step:
                self.vectors[i] = torch.from_numpy(oracles.truncated_normal_initial_values(
                    self.seed, [i], self.table.dim)[0])
        for i in set(self.vectors) - set(v.rows):
            del self.vectors[i]
        out = torch.stack([sum((self.vectors[i] for i in b if rows[i] is not None),
                               torch.zeros(self.table.dim)) for b in bags])
        if grad is not None:
            for b, g in zip(bags, grad):
                for i in b:
                    if rows[i] is not None:
                        self.vectors[i] = self.vectors[i] - self.lr * g
        return out


@settings(max_examples=examples(25), deadline=None)
@given(data=st.data(), capacity=st.integers(1, 5), eviction=st.sampled_from(["lru", "lfu"]),
       admit_after=st.integers(1, 2), ttl=st.sampled_from([None, 1, 2]))
def test_engine_matches_the_per_id_model(data, capacity, eviction, admit_after, ttl):
    dyn = dict(eviction=eviction, admit_after=admit_after, ttl_steps=ttl)
    emb, t = _engine(capacity, **dyn)
    model = PerIdModel(t, table_seed(emb._seed, "t"), 0.5, **dyn)
    pool = st.sampled_from(BIG + [10, 11, 12])
    for _ in range(data.draw(st.integers(1, 6))):
        bags = data.draw(st.lists(st.lists(pool, min_size=1, max_size=3), min_size=2,
                                  max_size=2))
        training = data.draw(st.booleans())
        ids = torch.nested.nested_tensor([torch.tensor(b) for b in bags],
                                         layout=torch.jagged)
        grad = torch.randn(2, 3)
        try:
            want = model.step(bags, grad if training else None)
        except ValueError:
            before = {k: v.clone() for k, v in emb.state_dict().items()}
            vocab = emb.vocabulary(t)
            with pytest.raises(ValueError, match="'t'"):
                emb.enqueue({"f": ids}, training=True)
                emb.dequeue()
            assert all(torch.equal(before[k], v) for k, v in emb.state_dict().items())
            assert all(torch.equal(a, b) for a, b in zip(vocab, emb.vocabulary(t)))
            continue  # (the refused batch was consumed: the engine takes the next one)
        if training:
            emb.enqueue({"f": ids})
            got = emb.dequeue()["f"]
            emb.apply_gradients({"f": grad})
        else:
            got = emb.lookup({"f": ids})["f"]
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
        ids_r, rows_r = model.vocab.resident()
        ids_e, rows_e = emb.vocabulary(t)
        assert ids_e.tolist() == ids_r and rows_e.tolist() == rows_r


def test_evaluation_admits_nothing_and_looks_up_zeros():
    emb, t = _engine()
    assert emb.lookup({"f": torch.tensor([5, 6])})["f"].abs().sum() == 0
    assert emb.vocabulary(t)[0].numel() == 0
    emb.enqueue({"f": torch.tensor([5, 6])}, training=False)
    assert emb.dequeue()["f"].abs().sum() == 0 and emb.vocabulary(t)[0].numel() == 0


def test_overflow_is_a_value_error_and_changes_nothing():
    emb, t = _engine(capacity=2)
    emb.enqueue({"f": torch.tensor([1, 2, 3])})
    with pytest.raises(ValueError, match=r"'t'.*3"):
        emb.dequeue()
    assert emb.vocabulary(t)[0].numel() == 0
    emb.enqueue({"f": torch.tensor([1, 2, 2])})  # the engine goes on
    a = emb.dequeue()["f"]
    emb.apply_gradients({"f": torch.zeros_like(a)})
    assert emb.vocabulary(t)[0].tolist() == [1, 2]


def test_slots_restart_for_a_new_row_and_initial_values_do_not_depend_on_history():
    emb, t = _engine(capacity=1, optimizer=ec.Adagrad(learning_rate=0.1))
    for ids in ([7], [8], [7]):  # 7 evicted by 8, then 8 by 7
        emb.enqueue({"f": torch.tensor(ids)})
        a = emb.dequeue()["f"]
        emb.apply_gradients({"f": torch.ones_like(a)})
    acc = emb.state_dict()["t/accumulators"]
    torch.testing.assert_close(acc, torch.full_like(acc, 0.1 + 1.0))  # fresh + one step
    other, _ = _engine(capacity=1, optimizer=ec.Adagrad(learning_rate=0.1))
    first = other.lookup({"f": torch.tensor([7])})["f"]  # not resident: zeros
    assert first.abs().sum() == 0
    other.enqueue({"f": torch.tensor([7])})
    fresh = other.dequeue()["f"].detach()
    seed = table_seed(other._seed, "t")
    assert torch.equal(fresh, initial_values(t, "t", seed, torch.tensor([7])))


@pytest.mark.parametrize("kind", ["dense", "jagged", "sparse", "pair", "sequence"])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_every_input_kind_reads_the_resident_rows(kind, combiner):
    torch.manual_seed(1)
    t = ec.TableConfig(vocabulary_size=16, dim=4, combiner=combiner, name="t",
                       dynamic=ec.DynamicVocabulary())
    seq = 3 if kind == "sequence" else 0
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t, max_sequence_length=seq)},
                       ec.Adagrad(learning_rate=0.1))
    bags = [[2**50, -9], [4], [-9, -9, 77]]
    values = torch.tensor([i for b in bags for i in b])
    offsets = torch.tensor([0, 2, 3, 6])
    weights = torch.tensor([0.5, 2.0, 1.0, 1.0, 3.0, 1.0])
    if kind == "dense":
        ids, w = torch.tensor([[2**50], [4], [-9]]), None
        bags = [[2**50], [4], [-9]]
    elif kind in ("jagged", "sequence"):
        ids = torch.nested.nested_tensor_from_jagged(values, offsets)
        w = None if kind == "sequence" else torch.nested.nested_tensor_from_jagged(weights,
                                                                                  offsets)
    elif kind == "pair":
        ids, w = (values, offsets), (weights, offsets)
    else:
        idx = torch.tensor([[0, 0, 1, 2, 2, 2], [0, 1, 0, 0, 1, 2]])
        ids = torch.sparse_coo_tensor(idx, values, (3, 3))
        w = torch.sparse_coo_tensor(idx, weights, (3, 3))
    emb.enqueue({"f": ids}, {"f": w} if w is not None else None)
    a = emb.dequeue()["f"]
    emb.apply_gradients({"f": torch.randn_like(a)})
    got = emb.lookup({"f": ids}, {"f": w} if w is not None else None)["f"]
    # the same batch on a static table holding the resident rows at the ids' row numbers
    vid, vrow = emb.vocabulary(t)
    rowmap = dict(zip(vid.tolist(), vrow.tolist()))
    static = ec.TableConfig(vocabulary_size=16, dim=4, combiner=combiner, name="s",
                            initializer=emb.embedding_tables[t].clone())
    ref = ec.Embedding({"f": ec.FeatureConfig(table=static, max_sequence_length=seq)})
    mapped = _map_ids(ids, rowmap)
    want = ref.lookup({"f": mapped}, {"f": w} if w is not None else None)["f"]
    torch.testing.assert_close(got, want)
    assert set(vid.tolist()) == {i for b in bags for i in b}


def _map_ids(ids, rowmap):
    f = lambda v: torch.tensor([rowmap[i] for i in v.tolist()], dtype=torch.int64)  # noqa: E731
    if isinstance(ids, tuple):
        return f(ids[0]), ids[1]
    if ids.is_nested:
        return torch.nested.nested_tensor_from_jagged(f(ids.values()), ids.offsets())
    if ids.is_sparse:
        c = ids.coalesce()
        return torch.sparse_coo_tensor(c.indices(), f(c.values()), c.shape)
    return f(ids.reshape(-1)).reshape(ids.shape)


def test_shared_table_features_see_one_map():
    emb, t = _engine(capacity=4, features=("a", "b"))
    emb.enqueue({"a": torch.tensor([10, 20]), "b": torch.tensor([20, 30])})
    out = emb.dequeue()
    torch.testing.assert_close(out["a"][1], out["b"][0])
    emb.apply_gradients({"a": None, "b": None})
    assert emb.vocabulary(t)[0].tolist() == [10, 20, 30]


def test_a_gradient_for_a_row_given_to_another_id_is_dropped():
    emb, t = _engine(capacity=1)
    layer_steps = []
    for ids in ([7], [8]):  # two forwards before any backward: 8 evicts 7
        layer_steps.append(emb.training_step({"f": torch.tensor(ids)}))
    before = emb.embedding_tables[t].clone()
    layer_steps[0].apply({"f": torch.ones(1, 3)})  # 7's row now holds 8: dropped
    assert torch.equal(emb.embedding_tables[t], before)
    layer_steps[1].apply({"f": torch.ones(1, 3)})
    torch.testing.assert_close(emb.embedding_tables[t], before - 0.5)


def test_a_layer_without_optimizer_refuses_dynamic_tables():
    t = ec.TableConfig(vocabulary_size=8, dim=4, name="t", dynamic=ec.DynamicVocabulary())
    with pytest.raises(ValueError, match=r"\['t'\] are dynamic"):
        ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, None)


def test_layer_and_pipelined_engine_train_dynamic_tables():
    torch.manual_seed(3)
    t = ec.TableConfig(vocabulary_size=8, dim=4, name="t", dynamic=ec.DynamicVocabulary())
    layer = ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, ec.Adagrad(learning_rate=0.1))
    x = torch.tensor([[2**40, 5], [5, -1]])
    out = layer({"f": x})["f"]
    first = out.detach().clone()
    out.sum().backward()
    again = layer({"f": x})["f"]
    assert (again.detach() - first).abs().min() > 0  # every resident row moved
    assert layer.engine.vocabulary(t)[0].tolist() == [-1, 5, 2**40]
    emb, _ = _engine(capacity=8, dim=4)
    piped = ec.Embedding({"f": ec.FeatureConfig(table=emb.feature_config["f"].table)},
                         ec.SGD(learning_rate=0.5), pipeline_execution=True)
    for step in range(3):
        for e in (emb, piped):
            e.enqueue({"f": torch.tensor([step, step + 1, 99])})
            a = e.dequeue()["f"]
            e.apply_gradients({"f": torch.ones_like(a)})
    assert torch.equal(emb.vocabulary(emb.feature_config["f"].table)[0],
                       piped.vocabulary(emb.feature_config["f"].table)[0])


# ------------------------------------------------------------------------------ W = 2 and 4
def _stream(steps=4, batch=8, pool=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(-pool, pool, (batch, 2), generator=g) * (2**40 + 3)
        out.append((ids, torch.randn(batch, 2, 4, generator=g)))
    return out


def _train(emb, stream, rank, world):
    acts = []
    for ids, grad in stream:
        b = ids.shape[0] // world
        emb.enqueue({"f": ids[rank * b:(rank + 1) * b]})
        a = emb.dequeue()["f"]
        acts.append(a.detach())
        emb.apply_gradients({"f": grad[rank * b:(rank + 1) * b]})
    return torch.cat(acts)


def _share(want, stream, rank, world):
    """This rank's rows of W = 1's activations ``want`` of ``stream`` (batches split by rank)."""
    n = stream[0][0].shape[0]
    b = n // world
    return torch.cat([want[i * n + rank * b: i * n + (rank + 1) * b]
                      for i in range(len(stream))])


def _sharded_body(rank, world, init, strategy):
    stream = _stream()
    torch.manual_seed(0)
    t1 = ec.TableConfig(vocabulary_size=256, dim=4, name="t", dynamic=ec.DynamicVocabulary())
    ref = ec.Embedding({"f": ec.FeatureConfig(table=t1)}, ec.Adagrad(learning_rate=0.1))
    want = _train(ref, stream, 0, 1)
    want_ids, _ = ref.vocabulary(t1)
    init()
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=256, dim=4, name="t", dynamic=ec.DynamicVocabulary())
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.Adagrad(learning_rate=0.1),
                       sharding=strategy)
    got = _train(emb, stream, rank, world)
    torch.testing.assert_close(got, _share(want, stream, rank, world), rtol=1e-5, atol=1e-6)
    ids, rows = emb.vocabulary(t)
    if strategy == "hash":
        assert bool((owner(ids, world) == rank).all())
        assert rows.numel() == 0 or int(rows.max()) < emb.plan.physical[0].row_counts[rank]
    everyone = torch.unique(torch.cat(emb.comm.all_to_all([ids] * world)))
    assert torch.equal(everyone, want_ids)
    whole = emb.embedding_tables[t]  # a collective
    assert whole.shape == (256, 4)


@pytest.mark.parametrize("world,strategy", [(2, "hash"), (4, "hash"), (2, "table"),
                                            (2, "replicated")])
@pytest.mark.slow
def test_sharded_dynamic_tables_equal_one_process(world, strategy):
    run_on(world, _sharded_body, strategy)


def _overflow_body(rank, world, init, strategy):
    init()
    torch.manual_seed(0)
    t = ec.TableConfig(vocabulary_size=8, dim=2, name="t", dynamic=ec.DynamicVocabulary())
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                       sharding=strategy, timeout=30)
    pool = torch.arange(1, 200)
    mine = pool[owner(pool, world) == 0][:12]  # ids process 0 owns (its shard holds 4 rows)
    ids = mine[:6] if rank == 0 else mine[6:]
    emb.enqueue({"f": ids})
    with pytest.raises(ValueError, match="admits|must admit"):
        emb.dequeue()  # every process raises at once (no collective times out)
    emb.enqueue({"f": torch.tensor([1, 1, 1, 2, 2, 2]) + 10 * rank})  # the engine goes on
    act = emb.dequeue()["f"]
    emb.apply_gradients({"f": torch.ones_like(act)})
    assert act.abs().sum() > 0


@pytest.mark.parametrize("strategy", ["hash", "table"])
@pytest.mark.slow
def test_an_overflow_on_one_process_raises_on_every_process(strategy):
    run_on(2, _overflow_body, strategy)


def _two_tables_overflow_body(rank, world, init, strategy):
    init()
    torch.manual_seed(0)
    big = ec.TableConfig(vocabulary_size=64, dim=2, name="big", dynamic=ec.DynamicVocabulary())
    small = ec.TableConfig(vocabulary_size=8, dim=2, name="small", dynamic=ec.DynamicVocabulary())
    emb = ec.Embedding({"a": ec.FeatureConfig(table=big), "b": ec.FeatureConfig(table=small)},
                       ec.SGD(learning_rate=0.1), sharding=strategy, timeout=30)
    pool = torch.arange(1, 200)
    mine = pool[owner(pool, world) == 0][:12]  # ids process 0 owns (its shard of small: 4 rows)
    ids = mine[:6] if rank == 0 else mine[6:]
    emb.enqueue({"a": torch.arange(6) + 100 * rank, "b": ids})
    with pytest.raises(ValueError, match="admit"):
        emb.dequeue()  # every process raises, before any map step
    for t in (big, small):
        assert emb.whole_vocabulary(t)[0].numel() == 0, t.name  # no map changed anywhere
    emb.enqueue({"a": torch.arange(6) + 100 * rank, "b": torch.tensor([1, 1, 2, 2, 3, 3])})
    acts = emb.dequeue()  # the engine goes on
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
    assert emb.whole_vocabulary(big)[0].numel() == 12


@pytest.mark.parametrize("strategy", ["hash", "replicated"])
def test_an_overflow_at_one_table_changes_no_map_on_any_process(strategy):
    run_on(2, _two_tables_overflow_body, strategy)


# ------------------------------------------------------------------------------ checkpoints
def _continue(emb, t, stream):
    out = [_train(emb, stream, 0, 1)]
    out.append(emb.lookup({"f": stream[0][0]})["f"])
    return out, emb.vocabulary(t)


def test_state_dict_round_trip_continues_like_the_original(tmp_path):
    first, later = _stream(3, seed=1), _stream(3, seed=2)
    emb, t = _engine(capacity=20, dim=4, optimizer=ec.Adagrad(learning_rate=0.1),
                     ttl_steps=3, eviction="lfu")
    _train(emb, first, 0, 1)
    ec.save(tmp_path / "ckpt", emb)
    sd = {k: v.clone() for k, v in emb.state_dict().items()}
    assert sd["t/vocabulary/ids"].shape == (20, 1) and int(sd["t/vocabulary/step"]) == 3
    other, t2 = _engine(capacity=20, dim=4, optimizer=ec.Adagrad(learning_rate=0.1), seed=99,
                        ttl_steps=3, eviction="lfu")
    ec.load(tmp_path / "ckpt", other)
    assert all(torch.equal(sd[k], v) for k, v in other.state_dict().items())
    (a, va), (b, vb) = _continue(emb, t, later), _continue(other, t2, later)
    assert all(torch.equal(x, y) for x, y in zip(a + list(va), b + list(vb)))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_admission_counts_survive_a_checkpoint(tmp_path, eviction):
    """A resumed run counts exactly as an uninterrupted one: ids seen before the checkpoint
    keep their counts (and last steps seen) and are admitted at the same step."""
    first, later = _stream(4, pool=12, seed=3), _stream(4, pool=12, seed=4)
    make = functools.partial(_engine, capacity=24, dim=4, eviction=eviction, admit_after=3,
                             optimizer=ec.Adagrad(learning_rate=0.1))
    emb, t = make()
    _train(emb, first, 0, 1)
    pending = emb.state_dict()["t/vocabulary/pending"]
    assert pending.shape[0] > 0 and pending.shape[1] == 3
    assert bool((pending[1:, 0] > pending[:-1, 0]).all()) and int(pending[:, 1].max()) == 2
    ec.save(tmp_path / "ckpt", emb)
    other, t2 = make(seed=99)
    ec.load(tmp_path / "ckpt", other)
    sd, got = emb.state_dict(), other.state_dict()
    assert sorted(sd) == sorted(got) and all(torch.equal(sd[k], got[k]) for k in sd)
    (a, va), (b, vb) = _continue(emb, t, later), _continue(other, t2, later)
    assert all(torch.equal(x, y) for x, y in zip(a + list(va), b + list(vb)))
    # a state without counts (an older checkpoint) loads, counting afresh
    third, _ = make(seed=7)
    third.load_state_dict({k: v for k, v in sd.items() if not k.endswith("/pending")})
    assert third.state_dict()["t/vocabulary/pending"].shape == (0, 3)


def test_bad_admission_counts_are_refused_and_change_nothing():
    emb, t = _engine(capacity=8, dim=4, admit_after=4)
    _train(emb, _stream(2, pool=6), 0, 1)
    sd = {k: v.clone() for k, v in emb.state_dict().items()}
    assert sd["t/vocabulary/pending"].shape[0] > 0
    for bad_value, match in ((sd["t/vocabulary/pending"][:, :2], r"\[P, 3\]"),
                             (sd["t/vocabulary/pending"].float(), "integer"),
                             (sd["t/vocabulary/pending"] * torch.tensor([1, 1, 9]), "pending_seen"),
                             (sd["t/vocabulary/pending"] * torch.tensor([1, 0, 1]),
                              "pending_counts"),
                             (sd["t/vocabulary/pending"].flip(0), "pending_ids")):
        with pytest.raises(ValueError, match=match):
            emb.load_state_dict({**sd, "t/vocabulary/pending": bad_value})
        assert all(torch.equal(sd[k], v) for k, v in emb.state_dict().items())


def test_counts_beyond_a_smaller_shard_keep_the_latest_seen():
    m = vocab_map(1, choose("cpu"), admit_after=5)  # keeps max(4 * 1, 1024) = 1024 counted ids
    ids = torch.arange(1, 1101)
    seen = torch.arange(1100) % 7 + 1  # steps 1..7
    m.load_state_dict({"ids": ids[:0], "rows": ids[:0], "last_use": ids[:0],
                       "frequency": ids[:0], "pending_ids": ids,
                       "pending_counts": torch.ones(1100, dtype=torch.int64),
                       "pending_seen": seen, "step": torch.tensor(7)})
    kept = set(m.pending_ids.tolist())
    dropped = [i for i in ids.tolist() if i not in kept]
    assert len(kept) == 1024 and len(dropped) == 76
    # the 76 seen longest ago (step 1: ids 1, 8, 15, ... ; ties: the smaller ids) go
    assert dropped == [i for i in ids.tolist() if seen[i - 1] == 1][:76]


def test_static_and_dynamic_checkpoints_do_not_mix(tmp_path):
    emb, _ = _engine()
    ec.save(tmp_path / "dyn", emb)
    static = ec.Embedding({"f": ec.FeatureConfig(table=ec.TableConfig(
        vocabulary_size=4, dim=3, name="t"))}, ec.SGD(learning_rate=0.1))
    with pytest.raises(ValueError, match="dynamic.*static"):
        ec.load(tmp_path / "dyn", static)
    ec.save(tmp_path / "static", static)
    with pytest.raises(ValueError, match="static.*dynamic"):
        ec.load(tmp_path / "static", emb)


def test_a_bad_map_state_is_refused_and_changes_nothing():
    emb, t = _engine(capacity=4, dim=4)
    _train(emb, _stream(1, batch=1, pool=2), 0, 1)
    sd = {k: v.clone() for k, v in emb.state_dict().items()}
    bad = dict(sd)
    bad["t/vocabulary/ids"] = torch.zeros(4, 1, dtype=torch.int64)
    bad["t/vocabulary/last_use"] = torch.ones(4, 1, dtype=torch.int64)  # id 0 four times
    with pytest.raises(ValueError, match="'t'"):
        emb.load_state_dict(bad)
    assert all(torch.equal(sd[k], v) for k, v in emb.state_dict().items())


def _reshard_body(rank, world, init, root, save_world):
    first, later = _stream(3, seed=1), _stream(3, seed=2)

    def make(seed):
        torch.manual_seed(seed)  # (the loaded engines' own seeds differ from the checkpoint's)
        t = ec.TableConfig(vocabulary_size=256, dim=4, name="t",
                           dynamic=ec.DynamicVocabulary(admit_after=2))  # counts move too
        return ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.Adagrad(learning_rate=0.1),
                            sharding="hash"), t

    ref, t1 = make(5)
    _train(ref, first, 0, 1)
    if save_world == 1 and rank == 0:
        ec.save(f"{root}/w1", ref)
    want = _train(ref, later, 0, 1)
    init()
    emb, t = make(5)
    if save_world > 1:
        _train(emb, first, rank, world)
        ec.save(f"{root}/wn", emb)
        emb, t = make(50)
        init_path = f"{root}/wn"
    else:
        emb, t = make(50)
        init_path = f"{root}/w1"
    torch.distributed.barrier()
    ec.load(init_path, emb)
    got = _train(emb, later, rank, world)
    torch.testing.assert_close(got, _share(want, later, rank, world), rtol=1e-5, atol=1e-6)
    ids, _ = emb.vocabulary(t)
    assert bool((owner(ids, world) == rank).all())


@pytest.mark.parametrize("world,save_world", [(2, 1), (2, 2)])
@pytest.mark.slow
def test_checkpoints_restore_into_any_world_size(tmp_path, world, save_world):
    run_on(world, _reshard_body, str(tmp_path), save_world)


# ------------------------------------------------------------------------------ serving
def test_serving_lookup_and_exported_module_carry_the_map():
    torch.manual_seed(2)
    t = ec.TableConfig(vocabulary_size=8, dim=4, name="t", combiner="mean",
                       dynamic=ec.DynamicVocabulary())
    f = ec.FeatureConfig(table=t, name="f")
    layer = ec.EmbeddingLayer({"f": f}, ec.Adagrad(learning_rate=0.1))
    x = torch.tensor([[2**60, -4], [-4, 9]])
    layer({"f": x})["f"].sum().backward()
    probe = torch.tensor([[9, 12345], [-4, 2**60]])  # 12345 never seen: zeros
    want = layer.engine.lookup({"f": probe})["f"]
    tables = {t: (layer.engine.embedding_tables[t], *layer.engine.vocabulary(t))}
    torch.testing.assert_close(ec.serving_embedding_lookup({"f": probe}, None, tables,
                                                           {"f": f})["f"], want)
    with pytest.raises(TypeError, match="dynamic"):
        ec.serving_embedding_lookup({"f": probe}, None, {t: layer.engine.embedding_tables[t]},
                                    {"f": f})
    module = layer.for_serving()
    torch.testing.assert_close(module({"f": probe})["f"], want)
    exported = torch.export.export(module, ({"f": probe},))
    torch.testing.assert_close(exported.module()({"f": probe})["f"], want)
    values, offsets = torch.tensor([9, 12345, -4]), torch.tensor([0, 2, 3])
    pair = module({"f": (values, offsets)})["f"]
    torch.testing.assert_close(pair[1], want[1, 0])


NAMED = [
    (functools.partial(torch.nn.init.uniform_, a=-0.05, b=0.05),
     lambda v: v.min() >= -0.05 and v.max() <= 0.05 and abs(float(v.mean())) < 0.002),
    (functools.partial(torch.nn.init.normal_, mean=1.0, std=0.1),
     lambda v: abs(float(v.mean()) - 1) < 0.005 and abs(float(v.std()) - 0.1) < 0.005),
    (functools.partial(torch.nn.init.trunc_normal_, std=0.02, a=-0.04, b=0.04),
     lambda v: v.min() >= -0.04 and v.max() <= 0.04 and abs(float(v.std()) - 0.0176) < 0.001),
    (functools.partial(torch.nn.init.constant_, val=0.3), lambda v: bool((v == 0.3).all())),
    (functools.partial(torch.nn.init.ones_), lambda v: bool((v == 1).all())),
]


@pytest.mark.parametrize("init, fits", NAMED, ids=[i.func.__name__ for i, _ in NAMED])
def test_named_initializers_make_a_batch_of_new_rows_at_once(init, fits):
    """A spec's named initializers are computed for all new ids of a step at once, from
    counter-based uniforms: each id's row depends on the seed and the id alone (any batch, any
    order), with the initializer's distribution; the engine admits ids with those rows."""
    t = ec.TableConfig(vocabulary_size=64, dim=16, name="t", initializer=init,
                       dynamic=ec.DynamicVocabulary())
    ids = torch.arange(20000) * 7919 - 10**9
    v = initial_values(t, "t", 5, ids)  # (20000, 16)
    assert v.dtype == torch.float32 and fits(v)
    assert torch.equal(initial_values(t, "t", 5, ids.flip(0)), v.flip(0))
    assert torch.equal(initial_values(t, "t", 5, ids[100:200]), v[100:200])
    import embcore.config.tables as tables
    calls = []
    real = tables._fill

    def counted(*a, **k):  # (the per-id path runs each initializer through _fill)
        calls.append(1)
        return real(*a, **k)

    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.0))
    batch = torch.tensor([3, -7, 2**62, 11])
    tables._fill = counted
    try:
        emb.enqueue({"f": batch})
        emb.apply_gradients({"f": torch.zeros_like(emb.dequeue()["f"])})
        initial_values(ec.TableConfig(vocabulary_size=8, dim=2, name="x",
                                      initializer=lambda w: w.fill_(1.0),
                                      dynamic=ec.DynamicVocabulary()), "x", 1, batch)
    finally:
        tables._fill = real
    assert len(calls) == 4  # the lambda's four ids, one at a time; the named one: none
    got = emb.lookup({"f": batch})["f"]
    want = initial_values(t, "t", table_seed(emb._seed, "t"), batch)
    assert torch.equal(got, want)


@pytest.mark.parametrize("style", ["torch", "tf"])
def test_a_callable_initializer_runs_once_per_id_and_leaves_the_generator(style):
    """Any other callable: one call per new id (never a second try), each id's values its own
    (a function of the seed and the id, whatever is admitted with it), torch's generator as it
    was; an initializer that leaves NaN is an error naming the table."""
    calls = []

    def torch_init(w):
        calls.append(tuple(w.shape))
        return torch.nn.init.normal_(w, std=0.01)

    def tf_init(shape, dtype):
        calls.append(tuple(shape))
        return torch.rand(shape, dtype=dtype)

    t = ec.TableConfig(vocabulary_size=8, dim=6, name="t",
                       initializer=torch_init if style == "torch" else tf_init,
                       dynamic=ec.DynamicVocabulary())
    ids = torch.tensor([5, -(2**63), 2**40, 17, 9])
    torch.manual_seed(3)
    before = torch.get_rng_state()
    v = initial_values(t, "t", 11, ids)
    assert torch.equal(torch.get_rng_state(), before)
    assert calls == [(1, 6)] * 5 and bool(torch.isfinite(v).all())
    assert torch.equal(initial_values(t, "t", 11, ids[[3, 0]]), v[[3, 0]])
    assert not torch.equal(initial_values(t, "t", 12, ids), v)
    bad = ec.TableConfig(vocabulary_size=8, dim=6, name="bad", initializer=lambda w: None,
                         dynamic=ec.DynamicVocabulary())
    with pytest.raises(ValueError, match="'bad'.*NaN"):
        initial_values(bad, "bad", 1, ids)


@pytest.mark.parametrize("native_maps", [True, False])
def test_an_overflow_at_one_table_changes_no_other_table(native_maps):
    """A batch whose second dynamic table cannot admit its ids changes neither table's map (nor
    the step); the engine goes on."""
    from switches import kernels
    with kernels(native_maps):
        torch.manual_seed(0)
        big = ec.TableConfig(vocabulary_size=100, dim=4, name="big", dynamic=ec.DynamicVocabulary())
        small = ec.TableConfig(vocabulary_size=3, dim=4, name="small",
                               dynamic=ec.DynamicVocabulary())
        emb = ec.Embedding({"a": ec.FeatureConfig(table=big), "b": ec.FeatureConfig(table=small)},
                           ec.SGD(learning_rate=0.1))
        emb.enqueue({"a": torch.tensor([5, 6, 7, 8]), "b": torch.tensor([1, 2, 3, 4])})
        with pytest.raises(ValueError, match="small"):
            emb.dequeue()
        assert emb.vocabulary(big)[0].numel() == 0 and emb.vocabulary(small)[0].numel() == 0
        assert emb.step == 0
        emb.enqueue({"a": torch.tensor([5, 6, 7, 8]), "b": torch.tensor([1, 2, 2, 1])})
        acts = emb.dequeue()
        emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
        assert emb.vocabulary(big)[0].tolist() == [5, 6, 7, 8]
        assert emb.vocabulary(small)[0].tolist() == [1, 2]


def test_a_map_bigger_than_the_gpu_is_refused_before_it_is_allocated(monkeypatch):
    """A raw-id map whose per-row state exceeds the GPU's memory is a ValueError naming the
    table, before anything is allocated (issue 54: a worker crashed trying, on CUDA; the CPU
    has had this check). The GPU's size is faked: no GPU is needed."""
    from types import SimpleNamespace

    from embcore.state.vocab import torch_map
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=2**34))
    tried = []
    with pytest.raises(ValueError, match=r"table 'raw'.*more than cuda's 17179869184 bytes"):
        with torch_map._allocating("table 'raw'", 2**40, torch.device("cuda")):
            tried.append(True)
    assert not tried
