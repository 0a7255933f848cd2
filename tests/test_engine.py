"""The engine: protocol, errors (nothing changed by a rejected call), shapes, and a comparison with
a plain torch model doing the same math over several steps."""

from __future__ import annotations

import warnings

import pytest
import torch

import embcore as ec


def two_tables(optimizer=None, **kw):
    torch.manual_seed(0)
    users = ec.TableConfig(vocabulary_size=20, dim=4, combiner="sum", name="users")
    items = ec.TableConfig(vocabulary_size=30, dim=4, combiner="mean", name="items")
    fc = {"user": ec.FeatureConfig(table=users), "item": ec.FeatureConfig(table=items),
          "history": ec.FeatureConfig(table=items, max_sequence_length=3)}
    return ec.Embedding(fc, optimizer or ec.Adagrad(learning_rate=0.1), **kw), fc


def batch(b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, 30, (b, 5), generator=g)
    return {"user": torch.randint(0, 20, (b,), generator=g),
            "item": torch.nested.nested_tensor_from_jagged(torch.randint(0, 30, (2 * b,), generator=g),
                                                           torch.arange(b + 1) * 2),
            "history": hist}


def snapshot(emb):
    return {k: v.clone() for k, v in emb.state_dict().items()}


def assert_unchanged(emb, before):
    for k, v in emb.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_stacking_one_physical_table_for_equal_dims():
    emb, _ = two_tables()
    assert len(emb.plan.physical) == 1
    assert {t.name for t in emb.plan.tables} == {"users", "items"}
    other = ec.TableConfig(vocabulary_size=5, dim=8, name="wide")
    emb2 = ec.Embedding({"a": ec.FeatureConfig(table=other), "b": ec.FeatureConfig(
        table=ec.TableConfig(vocabulary_size=5, dim=4, name="narrow"))}, ec.SGD())
    assert len(emb2.plan.physical) == 2
    assert "wide" in str(emb2.plan)


def test_automatic_table_names_in_first_use_order():
    a = ec.TableConfig(vocabulary_size=3, dim=2)
    b = ec.TableConfig(vocabulary_size=3, dim=2)
    emb = ec.Embedding([ec.FeatureConfig(table=b), ec.FeatureConfig(table=a)])
    assert sorted(emb.state_dict()) == ["step", "table_0/parameters", "table_1/parameters"]
    assert emb.table_names() == {b: "table_0", a: "table_1"}
    with pytest.raises(ValueError, match="named 'x'"):
        ec.Embedding([ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=3, dim=2, name="x")),
                      ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=3, dim=2, name="x"))])


def test_same_seed_same_tables_and_initializer_options():
    t = ec.TableConfig(vocabulary_size=70000, dim=3, name="big")
    torch.manual_seed(5)
    a = ec.Embedding(ec.FeatureConfig(table=t)).embedding_tables[t]
    torch.manual_seed(5)
    b = ec.Embedding(ec.FeatureConfig(table=t)).embedding_tables[t]
    assert torch.equal(a, b)
    std = 1 / 3 ** 0.5
    assert a.abs().max() <= 2 * std + 1e-6 and abs(a.std().item() - 0.88 * std) < 0.02
    from embcore.config.tables import initial_rows
    rows = torch.tensor([3, 65535, 65536, 69999])  # any subset gives the same rows
    assert torch.equal(initial_rows(t, "big", 123, rows),
                       initial_rows(t, "big", 123, torch.arange(70000))[rows])
    pre = torch.arange(12.).view(4, 3)
    t2 = ec.TableConfig(vocabulary_size=4, dim=3, initializer=pre)
    assert torch.equal(ec.Embedding(ec.FeatureConfig(table=t2)).embedding_tables[t2], pre)
    t3 = ec.TableConfig(vocabulary_size=4, dim=3, initializer=torch.nn.init.ones_)
    assert torch.equal(ec.Embedding(ec.FeatureConfig(table=t3)).embedding_tables[t3],
                       torch.ones(4, 3))


class PlainModel(torch.nn.Module):
    """The same math with plain torch: nn.Parameter tables, explicit lookups, manual Adagrad."""

    def __init__(self, emb):
        super().__init__()
        self.tables = {t.name: v.detach().clone() for t, v in emb.embedding_tables.items()}
        self.acc = {n: torch.full_like(v, 0.1) for n, v in self.tables.items()}

    def step(self, feats, lr=0.1):
        tabs = {n: v.clone().requires_grad_() for n, v in self.tables.items()}
        u = tabs["users"][feats["user"]]
        item = feats["item"]
        vals, offs = item.values(), item.offsets()
        bag = torch.repeat_interleave(torch.arange(len(offs) - 1), offs.diff())
        cnt = offs.diff().clamp(min=1).float()[:, None]
        it = torch.zeros(len(offs) - 1, 4).index_add(0, bag, tabs["items"][vals]) / cnt
        h = tabs["items"][feats["history"][:, :3]]
        loss = (u * it).sum() + (h ** 2).sum() + (u ** 2).sum()
        loss.backward()
        for n, p in tabs.items():
            g = p.grad
            touched = g.abs().sum(1) > 0
            self.acc[n][touched] += g[touched] ** 2
            self.tables[n][touched] -= lr * g[touched] / self.acc[n][touched].sqrt()
        return {"user": u.detach(), "item": it.detach(), "history": h.detach()}


def test_engine_matches_plain_torch_model_over_steps():
    emb, _ = two_tables()
    plain = PlainModel(emb)
    for step in range(5):
        feats = batch(seed=step)
        emb.enqueue(feats)
        acts = emb.dequeue()
        want = plain.step(feats)
        for k in acts:
            torch.testing.assert_close(acts[k], want[k], rtol=1e-5, atol=1e-6)
        loss = (acts["user"] * acts["item"]).sum() + (acts["history"] ** 2).sum() + \
            (acts["user"] ** 2).sum()
        loss.backward()
        emb.apply_gradients({k: a.grad for k, a in acts.items()})
    for t, v in emb.embedding_tables.items():
        torch.testing.assert_close(v, plain.tables[t.name], rtol=1e-5, atol=1e-6)
    assert emb.step == 5


def test_protocol_errors_change_nothing():
    emb, fc = two_tables()
    with pytest.raises(RuntimeError, match="nothing enqueued"):
        emb.dequeue()
    with pytest.raises(RuntimeError, match="without a training batch"):
        emb.apply_gradients({"user": None, "item": None, "history": None})
    before = snapshot(emb)
    emb.enqueue(batch())
    with pytest.raises(RuntimeError, match="before dequeue"):
        emb.enqueue(batch())
    acts = emb.dequeue()
    good = {k: torch.ones_like(v) for k, v in acts.items()}
    with pytest.raises(ValueError, match="'user' has shape \\[3, 4\\], expected \\[4, 4\\]"):
        emb.apply_gradients({**good, "user": torch.ones(3, 4)})
    with pytest.raises(ValueError, match="missing \\['history'\\]"):
        emb.apply_gradients({"user": good["user"], "item": good["item"]})
    assert_unchanged(emb, before)
    emb.enqueue(batch(seed=1))
    with pytest.raises(RuntimeError, match="before apply_gradients"):
        emb.dequeue()
    emb.apply_gradients(good)
    with pytest.raises(RuntimeError, match="twice"):
        emb.apply_gradients(good)
    emb.dequeue()
    emb.apply_gradients(good)
    emb.enqueue(batch(), training=False)
    emb.dequeue()
    with pytest.raises(RuntimeError, match="training=False"):
        emb.apply_gradients(good)


def test_bad_inputs_name_the_feature_and_change_nothing():
    emb, _ = two_tables()
    before = snapshot(emb)
    bad = batch()
    bad["user"] = torch.tensor([1, 2, 20, 3])
    with pytest.raises(ValueError, match="feature 'user' has id 20 but table 'users' has "
                                         "vocabulary_size 20"):
        emb.enqueue(bad)
    with pytest.raises(ValueError, match="feature 'user' has id -1"):
        emb.enqueue({**batch(), "user": torch.tensor([-1, 0, 0, 0])})
    with pytest.raises(TypeError, match="int32 or int64"):
        emb.enqueue({**batch(), "user": torch.tensor([1.0, 2.0, 0.0, 0.0])})
    w = torch.nested.nested_tensor_from_jagged(torch.tensor([1.0] * 7 + [float("nan")]),
                                               torch.arange(5) * 2)
    with pytest.raises(ValueError, match="feature 'item' has a non-finite weight"):
        emb.enqueue(batch(), {"user": None, "item": w, "history": None})
    with pytest.raises(ValueError, match="weights were given for a dense input"):
        emb.enqueue(batch(), {"user": torch.ones(4), "item": None, "history": None})
    with pytest.raises(ValueError, match="sequence feature"):
        emb.enqueue(batch(), {"user": None, "item": None, "history": w})
    with pytest.raises(ValueError, match="keys differ"):
        emb.enqueue({"user": batch()["user"]})
    with pytest.raises(RuntimeError, match="nothing enqueued"):
        emb.dequeue()
    assert_unchanged(emb, before)


def test_shape_fixed_by_first_enqueue_build_and_output_shape():
    emb, _ = two_tables()
    emb.enqueue(batch(4))
    emb.dequeue()
    emb.apply_gradients({"user": None, "item": None, "history": None})
    with pytest.raises(ValueError, match="feature 'user': this batch gives activations of leading "
                                         "shape \\[3\\], but the shape was fixed at \\[4\\]"):
        emb.enqueue(batch(3))
    assert emb.lookup(batch(3))["user"].shape == (3, 4)  # lookup takes any batch size
    emb2, _ = two_tables()
    emb2.build(per_replica_batch_size=2)
    with pytest.raises(ValueError, match="fixed at \\[2\\]"):
        emb2.enqueue(batch(4))
    emb3, _ = two_tables()
    emb3.build(per_replica_input_shapes={"user": [4, 1], "item": [4, 2], "history": [4, 5]})
    emb3.enqueue(batch(4))
    assert emb3.dequeue()["history"].shape == (4, 3, 4)
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    emb4 = ec.Embedding({"f": ec.FeatureConfig(table=t, output_shape=[2, 3])})
    assert emb4.lookup({"f": torch.arange(6)})["f"].shape == (2, 3, 2)
    with pytest.raises(ValueError, match="output_shape=\\[2, 3\\] holds 6 rows"):
        emb4.lookup({"f": torch.arange(5)})


def test_build_input_shape_is_read_by_the_kind_of_input():
    """A [B, L] input shape is the input's own shape: dense ids give [B, L, D], bags [B, D]."""
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")

    def built(shape):
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, optimizer=ec.SGD(learning_rate=0.1))
        emb.build(per_replica_input_shapes={"f": shape})
        return emb

    dense = torch.arange(12).reshape(4, 3) % 10
    jagged = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3]),
                                         torch.tensor([4, 5, 6]), torch.tensor([7])],
                                        layout=torch.jagged)
    sparse = dense.to_sparse()
    for ids, want in ((dense, (4, 3, 2)), (jagged, (4, 2)), (sparse, (4, 2))):
        emb = built([4, 3])
        emb.enqueue({"f": ids})
        assert emb.dequeue()["f"].shape == want
        emb.apply_gradients({"f": None})
    emb = built([4, 3])
    with pytest.raises(ValueError, match="fixed at \\[4, 3\\]"):
        emb.enqueue({"f": dense[:, :2]})
    assert built([4, 3]).lookup({"f": dense[:2]})["f"].shape == (2, 3, 2)  # lookup: any shape
    emb = built([4, 1])
    emb.enqueue({"f": dense[:, :1]})
    assert emb.dequeue()["f"].shape == (4, 2)
    emb = built([4])
    emb.enqueue({"f": dense[:, 0]})
    assert emb.dequeue()["f"].shape == (4, 2)
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, optimizer=ec.SGD(learning_rate=0.1))
    emb.enqueue({"f": jagged})
    emb.dequeue()
    emb.apply_gradients({"f": None})
    emb.build(per_replica_input_shapes={"f": [4, 3]})  # agrees with the bags already seen
    with pytest.raises(ValueError, match="build\\(\\) shape \\[5, 3\\] conflicts"):
        emb.build(per_replica_input_shapes={"f": [5, 3]})


def test_none_gradient_warns_only_where_zero_moves_rows():
    for opt, warns in [(ec.SGD(learning_rate=0.1), False), (ec.Adam(learning_rate=0.1), True)]:
        emb, _ = two_tables(opt)
        emb.enqueue(batch())
        acts = emb.dequeue()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            emb.apply_gradients({"user": torch.ones_like(acts["user"]), "item": None,
                                 "history": None})
        assert any("None gradient" in str(r.message) for r in rec) == warns


def test_table_optimizer_overrides_engine_optimizer_and_untrained_tables():
    frozen = ec.TableConfig(vocabulary_size=5, dim=2, name="frozen", optimizer=ec.SGD(learning_rate=0.0))
    t = ec.TableConfig(vocabulary_size=5, dim=2, name="t")
    emb = ec.Embedding({"a": ec.FeatureConfig(table=frozen), "b": ec.FeatureConfig(table=t)},
                       ec.SGD(learning_rate=1.0))
    before = {k: v.clone() for k, v in emb.embedding_tables.items()}
    emb.enqueue({"a": torch.tensor([1]), "b": torch.tensor([1])})
    emb.dequeue()
    emb.apply_gradients({"a": torch.ones(1, 2), "b": torch.ones(1, 2)})
    assert torch.equal(emb.embedding_tables[frozen], before[frozen])
    torch.testing.assert_close(emb.embedding_tables[t][1], before[t][1] - 1)
    no_opt = ec.Embedding({"b": ec.FeatureConfig(table=t)})
    with pytest.raises(ValueError, match="no optimizer"):
        no_opt.enqueue({"b": torch.tensor([1])})


def test_dense_adam_moves_untouched_rows_lazy_does_not():
    for lazy in (True, False):
        emb, _ = two_tables(ec.Adam(learning_rate=0.1, lazy_adam=lazy))
        for s in range(2):
            emb.enqueue(batch(seed=s))
            acts = emb.dequeue()
            emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
        before = snapshot(emb)["users/parameters"]
        emb.enqueue({**batch(seed=2), "user": torch.tensor([0, 0, 0, 0])})
        acts = emb.dequeue()
        emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
        after = emb.state_dict()["users/parameters"]
        moved = (after != before).any(1)
        assert bool(moved[1:].any()) == (not lazy)


def test_state_dict_round_trip():
    emb, _ = two_tables()
    emb.enqueue(batch())
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
    sd = snapshot(emb)
    assert set(sd) == {"users/parameters", "users/accumulators", "items/parameters",
                       "items/accumulators", "step"}
    other, _ = two_tables()
    other.load_state_dict(sd)
    assert_unchanged(other, sd)
    assert other.step == 1
    with pytest.raises(KeyError, match="missing keys"):
        other.load_state_dict({"users/parameters": sd["users/parameters"]})
    with pytest.raises(ValueError, match="'users/parameters': shape"):
        other.load_state_dict({**sd, "users/parameters": torch.zeros(3, 4)})
    other.load_state_dict({"users/parameters": torch.zeros(20, 4)}, strict=False)
    assert torch.equal(other.state_dict()["users/parameters"], torch.zeros(20, 4))


def test_use_gradient_accumulation_false_refused():
    with pytest.raises(ValueError, match="use_gradient_accumulation"):
        ec.Adagrad(learning_rate=0.1, use_gradient_accumulation=False)


def test_pipelined_lookup_is_one_step_stale_and_exact_mode_is_not():
    """Batch 2 is enqueued before batch 1's update: pipelined, it sees the old tables."""
    results = {}
    for pipelined in (False, True):
        emb, _ = two_tables(ec.SGD(learning_rate=1.0), pipeline_execution=pipelined)
        b1, b2 = batch(seed=1), {**batch(seed=2), "user": batch(seed=1)["user"]}
        before = emb.lookup(b2)
        emb.enqueue(b1)
        acts = emb.dequeue()
        emb.enqueue(b2)
        emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
        after = emb.lookup(b2)
        got = emb.dequeue()
        results[pipelined] = (got, before, after)
        emb.apply_gradients({k: torch.ones_like(v) for k, v in got.items()})
    got, before, after = results[True]
    assert torch.equal(got["user"], before["user"]) and not torch.equal(got["user"], after["user"])
    got, before, after = results[False]
    assert torch.equal(got["user"], after["user"])


def test_a_third_pipelined_enqueue_names_the_two_pending_batches():
    """pipeline_execution=True holds two enqueued batches: a third enqueue says that two are
    pending and that dequeue() is the call due, and queues nothing; after a dequeue the next
    enqueue is taken, and the batches come out in order."""
    emb, _ = two_tables(pipeline_execution=True)
    fresh, _ = two_tables()  # the same tables: zero gradients leave them so
    emb.enqueue(batch(seed=0))
    emb.enqueue(batch(seed=1))
    with pytest.raises(RuntimeError, match=r"enqueue\(\) called while 2 batches are enqueued and "
                                           r"not yet dequeued, .*; call dequeue\(\)"):
        emb.enqueue(batch(seed=2))
    for seed in (0, 1, 2):
        acts = emb.dequeue()
        want = fresh.lookup(batch(seed=seed))
        for k in acts:
            torch.testing.assert_close(acts[k], want[k], rtol=0, atol=0)
        emb.apply_gradients({k: torch.zeros_like(v) for k, v in acts.items()})
        if seed == 0:
            emb.enqueue(batch(seed=2))
    with pytest.raises(RuntimeError, match="nothing enqueued"):
        emb.dequeue()
    assert emb.step == 3


def test_pipelined_training_matches_exact_when_not_overlapped():
    a, _ = two_tables(pipeline_execution=True)
    b, _ = two_tables(pipeline_execution=False)
    for s in range(3):
        for emb in (a, b):
            emb.enqueue(batch(seed=s))
            acts = emb.dequeue()
            emb.apply_gradients({k: v.detach() * 2 for k, v in acts.items()})
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


@pytest.mark.parametrize("pipelined", [False, True])
def test_threads_sharing_an_engine_never_lose_or_double_an_update(pipelined):
    """One thread runs the protocol while another keeps calling apply_gradients: calls are
    serialized, so each dequeued training batch is applied at most once, every apply that
    returned is counted in the step, and out-of-order calls raise RuntimeError, nothing else."""
    import threading

    from switches import kernels
    t = ec.TableConfig(vocabulary_size=8, dim=64, combiner="sum", name="t")
    with kernels(False):  # the torch-ops path, where updates were lost before
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.01),
                           pipeline_execution=pipelined)
        emb.embedding_tables[t].zero_()
        ids = {"f": torch.tensor([1, 2, 2] * 2000)}  # big enough for torch to drop the GIL
        grad = {"f": torch.ones(6000, 64)}
        counts = {"dequeued": 0, "a": 0, "b": 0}
        errors: list[BaseException] = []
        done = threading.Event()

        def trainer():
            for _ in range(100):
                try:
                    emb.enqueue(ids)
                    emb.dequeue()
                    counts["dequeued"] += 1
                    emb.apply_gradients(grad)
                    counts["a"] += 1
                except RuntimeError:
                    pass
                except Exception as e:  # noqa: BLE001 - anything else is a bug
                    errors.append(e)
            done.set()

        def applier():
            while not done.is_set():
                try:
                    emb.apply_gradients(grad)
                    counts["b"] += 1
                except RuntimeError:
                    pass
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        threads = [threading.Thread(target=trainer), threading.Thread(target=applier)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors[:3]
        n = emb.step
        assert n == counts["a"] + counts["b"] <= counts["dequeued"], (n, counts)
        table = emb.embedding_tables[t]
        torch.testing.assert_close(table[1], torch.full((64,), -0.01 * 2000 * n))
        torch.testing.assert_close(table[2], torch.full((64,), -0.02 * 2000 * n))


def test_load_state_dict_refuses_negative_accumulators_and_changes_nothing():
    t = ec.TableConfig(vocabulary_size=6, dim=2, name="t")
    for opt in (ec.Adagrad(learning_rate=0.1), ec.RowwiseAdagrad(learning_rate=0.1),
                ec.Adam(learning_rate=0.1), ec.FTRL(learning_rate=0.1)):
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, opt)
        before = {k: v.clone() for k, v in emb.state_dict().items()}
        key = "t/velocities" if isinstance(opt, ec.Adam) else "t/accumulators"
        bad = {k: v.clone() for k, v in before.items()}
        bad["t/parameters"] += 1.0
        bad[key][2] = -0.5
        with pytest.raises(ValueError, match=f"'{key}' holds negative values"):
            emb.load_state_dict(bad)
        assert all(torch.equal(v, before[k]) for k, v in emb.state_dict().items())
        emb.load_state_dict({k: v.abs() if k == key else v for k, v in bad.items()})


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_host_checks_must_be_a_bool(bad):
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    with pytest.raises(TypeError, match="host_checks must be True or False"):
        ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                     host_checks=bad)
    with pytest.raises(TypeError, match="host_checks must be True or False"):
        ec.EmbeddingLayer({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1),
                          host_checks=bad)
