"""The dtype rules (config/dtypes.py) are the only ones: the planner counts the bytes the builder
allocates, for every row dtype (float64 slots included) and slot shape."""

import pytest
import torch

import embcore as ec
from embcore.config.dtypes import ROW_DTYPES, row_bytes, slot_dtype, working_dtype

OPTIMIZERS = [ec.SGD(learning_rate=0.1), ec.Adagrad(learning_rate=0.1),
              ec.RowwiseAdagrad(learning_rate=0.1), ec.Adam(learning_rate=0.1)]


def test_the_rules():
    assert [slot_dtype(d) for d in ROW_DTYPES] == [torch.float32, torch.float64, torch.float32,
                                                   torch.float32, torch.float32, torch.float32]
    assert all(working_dtype(d) == slot_dtype(d) for d in ROW_DTYPES)
    # 3 values of 8 bytes, a row-wise slot of 8, a full slot of 3 x 8
    assert row_bytes(3, torch.float64, [True, False]) == 24 + 8 + 24
    assert row_bytes(3, torch.float16, [True, False]) == 6 + 4 + 12
    # an 8-bit row: 3 bytes, its float32 scale, then the slots
    assert row_bytes(3, torch.float8_e5m2, [True, False]) == 3 + 4 + 4 + 12


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_an_8_bit_row_with_rowwise_adagrad_takes_at_most_0_27_of_float32(dtype):
    """A 128-wide row, its scale and its row-wise Adagrad slot: 136 bytes against 516, in the
    dtype rule, the plan and ec.profile's table."""
    assert row_bytes(128, dtype, [True]) == 136 <= 0.27 * row_bytes(128, torch.float32, [True])
    t = ec.TableConfig(vocabulary_size=1000, dim=128, name="t", dtype=dtype)
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.RowwiseAdagrad(learning_rate=0.1))
    assert emb.plan.bytes_per_rank() == [1000 * 136]


@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=str)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_the_planner_counts_what_the_builder_allocates(dtype, opt):
    tables = [ec.TableConfig(vocabulary_size=10, dim=6, name="a", dtype=dtype),
              ec.TableConfig(vocabulary_size=7, dim=6, name="b", dtype=dtype),
              ec.TableConfig(vocabulary_size=5, dim=3, name="c", dtype=dtype)]
    emb = ec.Embedding({t.name: ec.FeatureConfig(table=t) for t in tables}, opt)
    emb.enqueue({"a": torch.tensor([1]), "b": torch.tensor([2]), "c": torch.tensor([3])})
    emb.dequeue()  # (the store is built)
    store = emb._store
    held = 0
    for p in range(len(emb.plan.physical)):
        rows = store[p]
        held += rows.table.numel() * rows.table.element_size()
        for slot in rows.slots.values():
            assert slot.dtype == slot_dtype(dtype)
            held += slot.numel() * slot.element_size()
    assert emb.plan.bytes_per_rank() == [held]
