"""Cases no other fast test covered, each found by a mutant that survived the non-slow suite:

- a write-back cache evicting exactly one updated row (a write-back skipping a lone evicted row
  went unseen: every other fast test evicts several rows at once);
- a dynamic table's rows that a step's map moved but its update left alone (a step skipped by
  ``skip_nonfinite_gradients``): they are written (new ids took them, with initial values and
  fresh slots), so the next publish carries them and a follower equals the trainer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from native_required import require_native
from switches import kernels
from test_publish import assert_follows

import embcore as ec
from embcore.state.tier.cache import CachedRows
from embcore.state.tier.files import slow_tensor

BUDGET = 2000  # bytes: a cache of 6 of the 64 rows of 16 floats (and their Adagrad slots)


# ---------------------------------------------------------------- a lone evicted row written back
@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "torch"])
def test_a_lone_evicted_updated_row_reaches_the_slow_tier(tmp_path, fused):
    """A full cache of 4 updated rows (no spare rows: 4 // SPARE_SHARE is 0) admits one new row:
    exactly one row leaves, written back whole (its value and its slot) to the slow-tier file,
    read back right from there, and cached again with that value."""
    if fused:
        require_native()
    n, dim = 10, 3
    slow = {"parameters": slow_tensor(tmp_path / "p.bin", (n, dim), torch.float32),
            "accumulators": slow_tensor(tmp_path / "a.bin", (n, dim), torch.float32)}
    slow["parameters"].copy_(torch.arange(n * dim, dtype=torch.float32).view(n, dim))
    slow["accumulators"].fill_(0.5)
    with kernels(fused):
        cache = CachedRows("t", slow, 4, torch.device("cpu"), [0, n], ["t"], mapped=True)
        held = torch.tensor([0, 1, 2, 3])
        at = cache.resolve(held)
        new_values = -1.0 - torch.arange(4 * dim, dtype=torch.float32).view(4, dim)
        cache.table[at] = new_values
        cache.slots["accumulators"][at] = 7.0 + torch.arange(4, dtype=torch.float32)[:, None]
        cache.touched(at)

        cache.resolve(torch.tensor([4]))  # the cache is full: one row leaves
        left = [r for r in held.tolist() if int(cache.index.where[r]) < 0]
        assert len(left) == 1 and cache.written_rows == 1
        row = left[0]
        want, want_slot = new_values[row], torch.full((dim,), 7.0 + row)
        assert torch.equal(slow["parameters"][row], want)  # in the file, not only the cache
        assert torch.equal(slow["accumulators"][row], want_slot)
        assert torch.equal(cache.read("parameters", torch.tensor([row]))[0], want)
        assert torch.equal(cache.read("accumulators", torch.tensor([row]))[0], want_slot)
        back = cache.resolve(torch.tensor([row]))  # read in again (another row leaves)
        assert torch.equal(cache.table[back[0]], want)
        assert torch.equal(cache.slots["accumulators"][back[0]], want_slot)
        cache.flush()  # the other rows too, whole
    for r in held.tolist():
        assert torch.equal(slow["parameters"][r], new_values[r]), r
        assert torch.equal(slow["accumulators"][r], torch.full((dim,), 7.0 + r)), r
    untouched = torch.arange(4, n)
    assert torch.equal(slow["parameters"][untouched],
                       torch.arange(n * dim, dtype=torch.float32).view(n, dim)[untouched])


def test_lone_evicted_rows_of_a_training_run_equal_the_run_in_memory(tmp_path):
    """Through an engine: a table in the slow tier whose cache holds a few rows, each step
    updating one new row, so that once the cache is full every step evicts one updated row
    alone; the activations, and at the end the whole table (read back from the slow tier),
    equal the same run in memory."""
    table = ec.TableConfig(vocabulary_size=64, dim=16, name="t")

    def engine(**kw):
        torch.manual_seed(0)
        return ec.Embedding({"f": ec.FeatureConfig(table=table)},
                            ec.Adagrad(learning_rate=0.1), **kw)

    memory = engine()
    offloaded = engine(memory_budget=BUDGET, offload_dir=tmp_path / "slow")
    (cached,) = offloaded._ready().store.caches()
    assert cached.capacity < 8, cached.capacity  # no spare rows evicted ahead
    lone = 0
    for step in range(cached.capacity + 4):  # rows 0, 1, 2, ...: one new row a step
        written = cached.written_rows
        acts = []
        for emb in (memory, offloaded):
            emb.enqueue({"f": torch.tensor([step])})
            acts.append(emb.dequeue()["f"])
            emb.apply_gradients({"f": torch.ones_like(acts[-1])})
        assert torch.equal(acts[0], acts[1]), step
        lone += cached.written_rows - written == 1
    assert lone >= 3, lone
    assert torch.equal(offloaded.embedding_tables[table], memory.embedding_tables[table])


# ------------------------------------------------------- a skipped step's new rows are published
def _dynamic_engine(**kw):
    torch.manual_seed(0)
    d = ec.TableConfig(vocabulary_size=24, dim=8, name="d",
                       dynamic=ec.DynamicVocabulary(ttl_steps=4))
    return ec.Embedding({"fd": ec.FeatureConfig(table=d)},
                        ec.Adagrad(learning_rate=0.1, skip_nonfinite_gradients=True), **kw)


@pytest.mark.parametrize("fused", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("store", ["memory", "offloaded"])
def test_a_skipped_steps_new_ids_are_published(tmp_path, store, fused):
    """Steps on a dynamic table with new ids each time, some of them skipped (a NaN gradient):
    a skipped step's map still admits its new ids (rows with initial values and fresh slots),
    so the delta after it carries those rows and ids, and the follower equals the trainer
    exactly after every refresh (tables, maps, lookups)."""
    if fused:
        require_native()
    kw = {"memory_budget": 2500, "offload_dir": tmp_path / "slow"} if store == "offloaded" \
        else {}
    pub = tmp_path / "pub"
    with kernels(fused):
        emb = _dynamic_engine(**kw)
        if store == "offloaded":
            assert any(p.offloaded for p in emb.plan.physical)
        ec.publish(pub, emb)
        served = ec.load_published(pub)
        skipped_new = 0
        for step in range(8):
            ids = torch.tensor([step * 3, step * 3 + 1, 7, step * 3 + 2]) * 1_000_003 - 5
            known = set(emb.vocabulary("d")[0].tolist())
            emb.enqueue({"fd": ids})
            act = emb.dequeue()
            grad = torch.full_like(act["fd"], 0.25)
            skip = step % 3 == 1
            if skip:
                grad[0, 0] = float("nan")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                emb.apply_gradients({"fd": grad})
            assert any("skip_nonfinite" in str(w.message) for w in caught) == skip
            if skip:
                skipped_new += len(set(ids.tolist()) - known)
            info = ec.publish(pub, emb, snapshot=False)
            assert info["kind"] == "delta"
            assert served.refresh() == 1
            assert_follows(served, emb)
            probe = {"fd": torch.cat([ids, torch.tensor([-5, 10**9])])}
            want, got = emb.lookup(probe), served(probe)
            assert torch.equal(got["fd"], want["fd"]), step
        assert skipped_new >= 6  # the skipped steps did admit new ids

