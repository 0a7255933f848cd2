"""The reference dynamic vocabulary (state/vocab/reference.py): its rules on hand-made cases, and its
invariants on random streams of steps. It is the oracle the raw-id tables will be tested
against."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

from embcore.state.vocab.reference import ReferenceVocabulary as Vocab


def test_admission_at_first_sight_rows_in_ascending_id_order():
    v = Vocab(capacity=4)
    assert v.lookup([30, 10, 20, 10], training=True) == [2, 0, 1, 0]
    assert v.resident() == ([10, 20, 30], [0, 1, 2])
    # any int64: the lowest id takes the last free row, the other evicts 10 (same last use as
    # 20 and 30; the smaller id goes first)
    assert v.lookup([2**63 - 1, -(2**63)], training=True) == [0, 3]


def test_admit_after_counts_training_steps_only():
    v = Vocab(capacity=4, admit_after=2)
    assert v.lookup([7, 7], training=True) == [None, None]  # seen in one step: counted once
    assert v.lookup([7], training=False) == [None]           # evaluation counts nothing
    assert v.lookup([7], training=True) == [0]                # second training step: admitted


def test_lru_evicts_the_least_recently_used_never_an_id_of_this_step():
    v = Vocab(capacity=2)
    v.lookup([10, 20], training=True)
    v.lookup([10], training=True)
    assert v.lookup([30], training=True) == [1]  # 20 (last used at step 1) leaves its row
    assert v.resident() == ([10, 30], [0, 1])
    v.lookup([10, 40], training=True)             # 30 is evictable, 10 is used by this step
    assert v.resident() == ([10, 40], [0, 1])


def test_lfu_evicts_the_least_frequently_used_and_ties_go_to_the_smaller_id():
    v = Vocab(capacity=2, eviction="lfu")
    v.lookup([10, 20], training=True)
    v.lookup([20], training=True)
    v.lookup([20], training=True)
    assert v.lookup([30], training=True) == [0]   # 10 (used once) leaves row 0
    tie = Vocab(capacity=2)
    tie.lookup([20, 10], training=True)           # same last use: the smaller id goes first
    assert tie.lookup([30], training=True) == [0] and tie.resident()[0] == [20, 30]


def test_ttl_expires_ids_unused_for_more_than_k_training_steps():
    v = Vocab(capacity=4, ttl_steps=2)
    v.lookup([1], training=True)                  # step 1
    v.lookup([2], training=True)                  # step 2
    v.lookup([2], training=True)                  # step 3: 1 unused for 2 steps, still there
    assert v.resident()[0] == [1, 2]
    v.lookup([2], training=True)                  # step 4: unused for 3 > 2 steps: expired
    assert v.resident()[0] == [2]
    assert v.lookup([3], training=True) == [0]    # its row is free again (the lowest)


def test_overflow_is_an_error_and_changes_nothing():
    v = Vocab(capacity=2, admit_after=1)
    v.lookup([1], training=True)
    before = (v.step, dict(v.rows), dict(v.counts), dict(v.last_use), dict(v.frequency))
    with pytest.raises(ValueError, match="admits 2 new ids but the shard holds 2 rows"):
        v.lookup([1, 2, 3], training=True)        # 1 is used: only one row can be freed
    assert (v.step, v.rows, v.counts, v.last_use, v.frequency) == before
    assert v.lookup([2, 3], training=True) == [1, 0]  # 1 is evicted now (not used by this step)


def test_an_evicted_id_counts_again_before_readmission():
    v = Vocab(capacity=1, admit_after=2)
    v.lookup([5], training=True)
    assert v.lookup([5], training=True) == [0]
    v.lookup([6], training=True)
    assert v.lookup([6], training=True) == [0]    # 5 evicted
    assert v.lookup([5], training=True) == [None]  # counting from zero again
    assert v.lookup([5], training=True) == [0]


@st.composite
def streams(draw):
    capacity = draw(st.integers(1, 6))
    vocab = Vocab(capacity=capacity, eviction=draw(st.sampled_from(["lru", "lfu"])),
                  admit_after=draw(st.integers(1, 3)),
                  ttl_steps=draw(st.sampled_from([None, 1, 3])))
    steps = draw(st.lists(st.tuples(st.lists(st.integers(-5, 12), max_size=8), st.booleans()),
                          max_size=25))
    return vocab, steps


@settings(max_examples=examples(200), deadline=None)
@given(streams())
def test_invariants_on_random_streams(case):
    v, steps = case
    for ids, training in steps:
        before = (v.step, dict(v.rows), dict(v.counts))
        expired = {i for i, u in v.last_use.items()
                   if v.ttl_steps is not None and v.step + 1 - u > v.ttl_steps}
        try:
            got = v.lookup(ids, training)
        except ValueError:
            assert training and (v.step, v.rows, v.counts) == before  # nothing changed
            continue
        rows = list(v.rows.values())
        assert len(rows) == len(set(rows)) <= v.capacity and all(0 <= r < v.capacity
                                                                  for r in rows)
        assert got == [v.rows.get(i) for i in ids]
        if not training:
            assert (v.step, v.rows, v.counts) == before
            continue
        assert v.step == before[0] + 1
        for i in (set(ids) & set(before[1])) - expired:  # a step's resident ids keep their rows
            assert v.rows[i] == before[1][i]
        assert not (expired - set(ids)) & set(v.rows)  # expired ids not used again are gone
        assert not set(v.rows) & set(v.counts)  # an id is counted only while not resident
