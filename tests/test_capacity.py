"""The exchange's counters (``Embedding.exchange_stats``) and the capacity model (capacity.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import embcore as ec
from tests.distributed import run_on

# ------------------------------------------------------------------------------ counters
ROWS, B = 20, 6


def _tables():
    # row_mod (a: D 4), table (b: D 8, on one owner), replicated (c: D 2): one physical each
    return {n: ec.TableConfig(vocabulary_size=ROWS, dim=d, name=n)
            for n, d in [("a", 4), ("b", 8), ("c", 2)]}


def _ids(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {n: torch.randint(0, ROWS, (B,), generator=g) for n in "abc"}


def _counters_worker(rank, world, init, result_dir):
    init()
    out = {}
    for name, compression in [("fp32", None), ("mixed", ec.ExchangeCompression("bf16", "fp8"))]:
        torch.manual_seed(0)
        fc = {n: ec.FeatureConfig(table=t) for n, t in _tables().items()}
        emb = ec.Embedding(fc, ec.SGD(0.1), sharding={"a": "row_mod", "b": "table",
                                                      "c": "replicated"},
                           exchange_compression=compression, timeout=60)
        for step in range(2):
            emb.enqueue(_ids(rank, step))
            acts = emb.dequeue()
            emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
        out[name] = {"stats": emb.exchange_stats(reset=True), "after": emb.exchange_stats(),
                     "owner": emb.plan.table("b").owner}
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump(out, f)


def _want(rank, world, owner_b, fwd_width, bwd_width):
    """Bytes by hand from the routes: each distinct id this rank looks up that another rank
    holds travels there (8 bytes) and comes back as a row, its gradient goes back; the counts
    (8 bytes to and from each other rank) precede the ids."""
    want = {}
    for n, d, holder in [("a", 4, lambda i: i % world), ("b", 8, lambda i: owner_b)]:
        mine = [0] * 4  # ids sent, ids received, rows sent, rows received (per step summed)
        for step in range(2):
            asks = {r: _ids(r, step)[n].unique() for r in range(world)}
            ask = sum(int(holder(i) != rank) for i in asks[rank].tolist())
            asked = sum(int(holder(i) == rank) for r in range(world) if r != rank
                        for i in asks[r].tolist())
            mine[0] += 8 * (world - 1) + 8 * ask
            mine[1] += 8 * (world - 1) + 8 * asked
            mine[2] += asked
            mine[3] += ask
        want[n] = {"ids_sent": mine[0], "ids_received": mine[1],
                   "rows_sent": mine[2] * fwd_width(d), "rows_received": mine[3] * fwd_width(d),
                   "gradients_sent": mine[3] * bwd_width(d),
                   "gradients_received": mine[2] * bwd_width(d)}
    dense = 2 * (ROWS * 2 * 4 + ROWS * 4)  # two steps of a (N, D) float32 sum and its (N,) mask
    want["c"] = {"ids_sent": 0, "ids_received": 0, "rows_sent": 0, "rows_received": 0,
                 "gradients_sent": dense, "gradients_received": dense}
    return want


@pytest.mark.slow
def test_exchange_stats_count_every_byte_of_a_two_process_step(tmp_path):
    run_on(2, _counters_worker, str(tmp_path))
    widths = {"fp32": (lambda d: 4 * d, lambda d: 4 * d),
              "mixed": (lambda d: 2 * d, lambda d: d + 4)}  # bf16; fp8 + a float32 scale
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        for name, (fwd, bwd) in widths.items():
            stats = got[name]["stats"]
            want = _want(rank, 2, got[name]["owner"], fwd, bwd)
            for table, w in want.items():
                assert {k: stats[table][k] for k in w} == w, (name, rank, table)
                assert stats[table]["collectives"] > 0 and stats[table]["seconds"] > 0
            assert got[name]["after"] == {}  # reset


def test_one_process_counts_nothing():
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(0.1))
    emb.enqueue({"f": torch.tensor([1, 2])})
    emb.apply_gradients({"f": torch.ones(2, 4) + 0 * emb.dequeue()["f"]})
    assert emb.exchange_stats() == {}
