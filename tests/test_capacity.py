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


# ------------------------------------------------------------------------------ the model
from embcore import capacity  # noqa: E402

RATES = capacity.Rates(lookup=1e-6, update=1e-6, table=1e-3)


def _tiny(compression=None):
    a = ec.TableConfig(vocabulary_size=100, dim=4, name="a")
    b = ec.TableConfig(vocabulary_size=10, dim=2, name="b")
    return ec.EmbeddingSpec({"fa": ec.FeatureConfig(table=a), "fb": ec.FeatureConfig(table=b)},
                            ec.SGD(0.1), sharding={"a": "row_mod", "b": "replicated"},
                            exchange_compression=compression)


def _project(network, compression=None, memory=None):
    (p,) = capacity.project(_tiny(compression), [2], network, batch=8, rates=RATES,
                            distinct_ratio=0.5, memory=memory)
    return p


def test_bytes_and_memory_of_a_tiny_spec_by_hand():
    p = _project(capacity.Network(1000.0, 1e-3))
    # SGD keeps no slot: a's 50 rows x 4 x 4 bytes + b's 10 x 2 x 4 on each rank
    assert p.memory_bytes == 50 * 16 + 10 * 8 and p.fits
    # a: 8 lookups, 4 distinct, 2 held by the other rank: the counts (8), 2 ids, 2 rows of 16
    # bytes one way and 2 gradients the other; b: its (10, 2) gradient and (10,) mask summed
    a, b = 8 + 2 * 8 + 2 * 16 + 2 * 16, 10 * 3 * 4
    assert p.sent_bytes == p.received_bytes == a + b
    assert p.collectives == 4 + 2 + 1  # a: counts, ids, rows, gradients; b: 2; the agreement
    compute = (2 * 1e-3  # two physical tables
               + 1e-6 * (8 * 4 + 8 * 2)  # lookups x D
               + 1e-6 * (8 / 2 * 4 + 8 * 2))  # rows updated x D (a: the owners share 8)
    assert p.compute_s == pytest.approx(compute)
    assert p.exchange_s == pytest.approx(7 * 1e-3 * 1 + (a + b) / 1000.0)
    assert p.step_s == pytest.approx(compute + p.exchange_s)
    assert p.examples_per_s == pytest.approx(2 * 8 / p.step_s)


def test_compression_shrinks_the_rows_not_the_ids():
    p = _project(capacity.Network(1000.0, 1e-3), ec.ExchangeCompression("fp8", "bf16"))
    a = 8 + 2 * 8 + 2 * (4 + 4) + 2 * (4 * 2)  # fp8 rows + a float32 scale; bf16 gradients
    assert p.sent_bytes == a + 10 * 3 * 4  # (a replicated table's all_reduce: not compressed)


def test_the_bottleneck_moves_to_the_exchange_as_the_network_slows_and_to_memory():
    fast, slow = (_project(capacity.Network(bw, lat)) for bw, lat in [(1e12, 0.0), (1e3, 1e-3)])
    assert fast.bottleneck == "compute" and slow.bottleneck == "exchange"
    assert fast.compute_s == slow.compute_s and slow.exchange_s > 100 * fast.exchange_s
    assert _project(capacity.Network(1e12), memory=879).bottleneck == "memory"
    assert _project(capacity.Network(1e12), memory=880).fits


def test_one_rank_exchanges_nothing():
    (p,) = capacity.project(_tiny(), [1], capacity.Network(1.0), batch=8, rates=RATES,
                            distinct_ratio=0.5)
    assert p.sent_bytes == p.received_bytes == p.collectives == 0 and p.exchange_s == 0


def test_distinct_ids_of_a_uniform_table_are_the_expected_number():
    got = capacity.distinct(lambda k: k / 1000, 1000, 500)
    assert got == pytest.approx(1000 * (1 - (1 - 1 / 1000) ** 500), rel=1e-9)
    assert capacity.distinct(lambda k: 1.0, 10**6, 10**4) == pytest.approx(1.0)  # one hot id


def test_the_network_and_rates_are_parsed_or_refused():
    assert capacity.Network.parse("100Gbit").bandwidth == pytest.approx(12.5e9)
    net = capacity.Network.parse("12.5GB/s", "5us")
    assert net.bandwidth == pytest.approx(12.5e9) and net.latency == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="'100 furlongs' is not a rate"):
        capacity.Network.parse("100 furlongs")
    with pytest.raises(ValueError, match="latency '-1' is not a time"):
        capacity.Network.parse("1Gbit", "-1")
    with pytest.raises(ValueError, match="rank counts must be integers >= 1, got 0"):
        capacity.project(_tiny(), [0, 2], capacity.Network(1.0), batch=8)


def test_a_rates_file_round_trips_or_is_named(tmp_path):
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({"lookup": 1e-9, "update": 2e-9, "table": 1e-4, "wire": 0.0}))
    assert capacity.Rates.load(path).update == 2e-9
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a rates file"):
        capacity.Rates.load(path)


def test_the_command_line_projects_the_criteo_spec(capsys):
    spec = os.path.join(os.path.dirname(__file__), "..", "examples", "criteo", "spec.json")
    assert capacity.main(["--spec", spec, "--ranks", "8,16", "--network", "25Gbit"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "25 Gbit/s" in out[1] and out[2].split()[0] == "ranks"
    assert [line.split()[0] for line in out[3:]] == ["8", "16"]
    assert capacity.main(["--spec", spec, "--ranks", "8", "--json", "--compression",
                          "fp8"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ranks"] == 8 and row["bottleneck"] in ("compute", "exchange", "memory")
    with pytest.raises(SystemExit):
        capacity.main(["--spec", spec, "--ranks", "8", "--network", "fast"])


def test_pooling_per_table_multiplies_its_lookups_and_names_unknown_tables():
    net = capacity.Network(1e12, 0.0)
    one, three = (capacity.project(_tiny(), [2], net, batch=8, rates=RATES, distinct_ratio=0.5,
                                   pooling=pool)[0] for pool in (1.0, {"a": 3}))
    # a: 24 lookups, 12 distinct, 6 held elsewhere (b unchanged)
    assert three.sent_bytes - one.sent_bytes == (6 - 2) * (8 + 16 + 16)
    with pytest.raises(ValueError, match=r"pooling names tables \['zz'\]"):
        capacity.project(_tiny(), [2], net, batch=8, pooling={"zz": 2})
