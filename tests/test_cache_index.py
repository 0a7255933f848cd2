"""The cache's index (state/tier/index.py): the fused kernel equals the torch-ops twin step for
step, and both equal a plain-Python model of the policy the module's docstring states (LRU by
(stamp, cache row) among the rows a step does not use, spare rows freed ahead, a free stack)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_required import require_native
from profiles import examples

from embcore.kernels import cpu
from embcore.ops.backend import FUSED_CPU, TORCH_OPS
from embcore.state.tier.index import CacheIndex, Step

STATE = ("where", "owner", "stamp", "dirty", "fresh", "version")


class Model:
    """The policy in plain Python (the test's oracle)."""

    def __init__(self, rows, capacity, bounds):
        self.where = {}  # shard row -> cache row
        self.owner = [-1] * capacity
        self.stamp = [None] * capacity
        self.dirty = [False] * capacity
        self.fresh = [False] * capacity
        self.free = list(range(capacity - 1, -1, -1))  # the top is the end
        self.clock = 0
        self.bounds = bounds
        self.counts = [[0] * (len(bounds) + 1) for _ in range(3)]

    def step(self, rows, count, spare):
        self.clock += 1
        slots, misses = [], []
        for r in rows:
            member = sum(b <= r for b in self.bounds)
            s = self.where.get(r)
            if s is None:
                misses.append(r)
                slots.append(None)
                if count:
                    self.counts[1][member] += 1
                continue
            self.stamp[s] = self.clock
            slots.append(s)
            if count:
                self.counts[2 if self.fresh[s] else 0][member] += 1
                self.fresh[s] = False
        out, evicted = [], 0
        if len(misses) > len(self.free):
            candidates = sorted((self.stamp[s], s) for s in range(len(self.owner))
                                if self.owner[s] >= 0 and self.stamp[s] < self.clock)
            victims = sorted(s for _, s in
                             candidates[:len(misses) - len(self.free) + spare])
            for s in reversed(victims):
                if self.dirty[s]:
                    out.append((self.owner[s], s))
                del self.where[self.owner[s]]
                self.owner[s], self.stamp[s] = -1, None
                self.dirty[s] = self.fresh[s] = False
                self.free.append(s)
            evicted = len(victims)
        taken = []
        for r in misses:
            s = self.free.pop()
            self.where[r], self.owner[s], self.stamp[s] = s, r, self.clock
            self.dirty[s] = self.fresh[s] = False
            taken.append(s)
        it = iter(taken)
        slots = [s if s is not None else next(it) for s in slots]
        return slots, misses, taken, out, evicted


@st.composite
def runs(draw):
    rows = draw(st.integers(1, 60))
    capacity = draw(st.integers(1, rows))
    bounds = sorted(set(draw(st.lists(st.integers(1, max(rows - 1, 1)), max_size=3))))
    steps = []
    for _ in range(draw(st.integers(1, 12))):
        asked = draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=capacity))
        steps.append((asked, draw(st.booleans()), draw(st.integers(0, capacity)),
                      draw(st.lists(st.integers(0, len(asked) - 1), max_size=4))
                      if asked else [],
                      draw(st.sampled_from(["dirty", "fresh"])),
                      draw(st.lists(st.tuples(st.integers(0, rows - 1),
                                              st.sampled_from([1, 2, 7, 2**31 - 1])),
                                    max_size=4, unique_by=lambda t: t[0]))))
    return rows, capacity, bounds, steps


def _check_step(index, got, want):
    slots, misses, taken, out, evicted = want
    assert isinstance(got, Step)
    assert got.slots.tolist() == slots
    assert got.miss_rows.tolist() == misses
    assert got.miss_slots.tolist() == taken
    assert list(zip(got.out_rows.tolist(), got.out_slots.tolist())) == out
    assert got.evicted == evicted


@settings(max_examples=examples(150), deadline=None)
@given(runs())
def test_the_kernel_and_the_torch_twin_follow_the_policy(run):
    """... and each row keeps the version last set for it (0 at first: a dict, the oracle),
    whether cached, evicted or read in since (the index moves it between ``where`` and the
    cache row's ``version``)."""
    rows, capacity, bounds, steps = run
    indexes = {"torch": CacheIndex(rows, capacity, bounds, TORCH_OPS)}
    if cpu.available():
        indexes["native"] = CacheIndex(rows, capacity, bounds, FUSED_CPU)
    model = Model(rows, capacity, bounds)
    versions = {}  # shard row -> its version (0 where not set)
    for asked, count, spare, marked, flag, set_versions in steps:
        versions.update({r: (v + 1) % 2**31 for r, v in set_versions})  # (set, then advanced)
        want = model.step(asked, count, spare)
        for i in marked:
            getattr(model, flag)[want[0][i]] = True
        for index in indexes.values():
            got = index.step(torch.tensor(asked, dtype=torch.int64), count, spare)
            _check_step(index, got, want)
            if marked:  # the engine marks updated (dirty) and renewed (fresh) rows
                index.mark(getattr(index, flag), got.slots[torch.tensor(marked)])
            if set_versions:  # (the engine's writes of rows' checksums)
                at = torch.tensor([r for r, _ in set_versions])
                index.set_versions(at, torch.tensor([v for _, v in set_versions],
                                                    dtype=torch.int32))
                assert index.versions(at, advance=True).tolist() == [
                    versions[r] for r, _ in set_versions]
            assert index.versions(torch.arange(rows)).tolist() == [
                versions.get(r, 0) for r in range(rows)]
            assert index.counts.tolist() == model.counts
            assert index.n_free == len(model.free)
            assert index.free[:index.n_free].tolist() == model.free
            assert index.owner.tolist() == model.owner
            held = {r: int(index.where[r]) for r in range(rows) if index.where[r] >= 0}
            assert held == model.where
            assert index.dirty_slots().tolist() == [s for s in range(capacity)
                                                    if model.dirty[s]]
    if "native" in indexes:
        for key in STATE:
            assert torch.equal(getattr(indexes["native"], key), getattr(indexes["torch"], key))


def test_a_step_beyond_the_capacity_changes_nothing():
    index = CacheIndex(10, 2)
    assert index.step(torch.tensor([1, 2, 3])) is None
    assert index.clock == 0 and index.n_free == 2 and bool((index.where == -1).all())


def test_the_capacity_is_checked():
    with pytest.raises(ValueError, match="1 to"):
        CacheIndex(10, 0)


@pytest.mark.parametrize("kernel", [True, False])
def test_rows_unused_for_thousands_of_steps_are_evicted_oldest_first(kernel):
    """Ages beyond the kernel's histogram (4095 steps) are ordered exactly too."""
    if kernel:
        require_native()
    index, model = CacheIndex(20, 8, (), FUSED_CPU if kernel else TORCH_OPS), Model(20, 8, [])
    steps = [[5, 1, 2], [3, 0], [7, 6, 4]] + [[]] * 5000 + [[9], [8, 10, 11]]
    for asked in steps:
        want = model.step(asked, True, 2)
        _check_step(index, index.step(torch.tensor(asked, dtype=torch.int64), True, 2), want)
    assert index.owner.tolist() == model.owner
    # the second step evicted rows 3, 0 (used at clock 2) and 7 (clock 3, the lowest cache row)
    assert want[4] == 3 and sorted(model.where) == [4, 6, 8, 9, 10, 11]


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_the_kernel_splits_over_threads_with_the_same_result(threads):
    """Steps large enough for the kernel's chunks (rows, cache rows, victims) equal the torch
    twin's step for step on any thread count: skewed rows, evictions every few steps, ties in
    age, dirty and fresh rows, and members counted."""
    require_native()
    rows, capacity = 60_000, 12_000
    bounds = [7_000, 20_000, 41_000]
    g = torch.Generator().manual_seed(threads)
    indexes = {k: CacheIndex(rows, capacity, bounds, FUSED_CPU if k == "native" else TORCH_OPS)
               for k in ("native", "torch")}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    evictions = written = 0
    try:
        for step in range(14):
            asked = torch.unique((torch.rand(9_000, generator=g) ** 3 * rows).long())
            asked = asked[torch.randperm(asked.numel(), generator=g)]  # first-occurrence order
            spare = [0, capacity // 8, 37][step % 3]
            got = {}
            for name, index in indexes.items():
                got[name] = index.step(asked, step % 4 != 3, spare)
                marked = got[name].slots[::3 + step % 2]
                index.mark(index.dirty if step % 5 else index.fresh, marked)
            a, b = got["native"], got["torch"]
            for field in Step._fields:
                x, y = getattr(a, field), getattr(b, field)
                assert (x == y) if isinstance(x, int) else torch.equal(x, y), (step, field)
            evictions += a.evicted > 0
            written += a.out_rows.numel()
        assert evictions >= 5 and written > 0  # (the run exercised the eviction's chunks)
        for key in STATE + ("counts",):
            assert torch.equal(getattr(indexes["native"], key), getattr(indexes["torch"], key))
        assert indexes["native"].n_free == indexes["torch"].n_free
    finally:
        torch.set_num_threads(before)
