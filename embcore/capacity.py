"""The capacity model: how a spec's tables would train at W ranks over a network (pure arithmetic).

    python -m embcore.capacity --spec examples/criteo/spec.json --ranks 8,16,64 --network 100Gbit
    python -m embcore.capacity --calibrate rates.json   # measure this machine's compute rates

For each rank count W, from an ``ec.EmbeddingSpec`` (its file: tables, features, optimizer,
dtype, sharding, memory budget, exchange compression), a batch per rank, and a network
(bandwidth and latency per rank), ``project`` gives:
- **memory**: the planner's bytes per rank (``ShardingPlan.bytes_per_rank(fast=True)``: rows,
  slots, raw-id maps, caches), the largest rank's;
- **bytes a step**: what the largest-loaded rank sends and receives in the exchange
  (step/exchange.py), the same quantities ``Embedding.exchange_stats`` counts: per sharded
  table, the distinct ids of a rank's batch that other ranks hold (8 bytes each, plus 8 bytes of
  counts per peer), their rows back (in the forward wire format) and their gradients (in the
  backward one); a whole-table (``"table"``) owner answers every rank; a column split asks every
  rank for every id and gets a slice of each row; a replicated table sums its ``(N, D)``
  gradient and ``(N,)`` mask (counted once each way, timed as a ring: ``2 (W - 1) / W`` times);
- **step time** = compute + exchange (the sharded step does not overlap them), and its
  **bottleneck**: ``memory`` when a rank's bytes exceed ``memory`` (the model does not fit),
  else the larger of ``compute`` and ``exchange``.

Distinct ids: a table's lookups a rank a step are the batch x the features reading it x
``pooling`` (or a profile's ``lookups_per_batch``: profile one rank's batches); the distinct
ones among L lookups are those expected from the table's curve (the share of lookups its k
hottest ids take: a profile's, else the planner's Zipf(1) prior, tiers.py), or ``distinct`` x L
when a ratio is given. Weak scaling: each rank keeps its batch, so the rows an owner updates are
its share of the distinct ids of the global batch (W x L lookups).

Compute = ``lookup`` seconds x lookups x D + ``update`` seconds x rows updated x D + ``table``
seconds x physical tables, with ``Rates`` measured on one process (``calibrate``). The default
rates were measured on this project's benchmark machine (2 x86 cores, torch 2.13 CPU, Adagrad,
one thread per rank); measure yours with ``--calibrate``. Exchange = per collective
``latency x (W - 1)`` (point-to-point to each peer) + the larger of the bytes sent and received
over ``bandwidth``. The model's check against measured 2- and 4-process runs is in
benchmarks/RESULTS.md ("Capacity model").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config.budget import parse_budget
from .config.exchange import ExchangeCompression
from .config.spec import EmbeddingSpec
from .inputs.features import Features
from .planning.plan import PhysicalTable, ShardingPlan, make_plan
from .planning.profile import LookupProfile
from .planning.tiers import Curve, zipf_curve
from .step.codec import Wire

ID_BYTES = 8     # an id on the wire (int64)
COUNT_BYTES = 8  # the count sent to each peer before an exchange of ids


@dataclass(frozen=True)
class Network:
    """Each rank's link: ``bandwidth`` in bytes per second each way, ``latency`` in seconds."""

    bandwidth: float
    latency: float = 10e-6

    @classmethod
    def parse(cls, bandwidth: str | float, latency: str | float = 10e-6) -> Network:
        """``"100Gbit"``, ``"25Gbit/s"``, ``"400gbps"``, ``"12.5GB/s"`` (bytes) or bytes per
        second; latency ``"10us"``, ``"2ms"`` or seconds.

        Raises:
            ValueError: a value that is not a positive rate or time, naming it.
        """
        return cls(_rate(bandwidth), _seconds(latency))


_BITS = {"bit": 1 / 8, "b": 1 / 8, "bps": 1 / 8, "byte": 1.0, "B": 1.0}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "g": 1e9, "G": 1e9, "t": 1e12,
           "T": 1e12}


def _rate(value: str | float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*([kKmMgGtT]?)(bits?|bps|bytes?|b|B)"
                         r"(?:/s)?\s*", str(value))
        if m is None:
            raise ValueError(f"network bandwidth {value!r} is not a rate: write e.g. '100Gbit', "
                             f"'25Gbit/s' or '12.5GB/s'")
        unit = m.group(3)
        per = _BITS["bit" if unit.startswith("bit") else "byte" if unit.startswith("byte")
                    else unit]
        out = float(m.group(1)) * _PREFIX[m.group(2)] * per
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"network bandwidth {value!r} must be a finite rate > 0")
    return out


def _seconds(value: str | float) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*(s|ms|us|ns)?\s*", str(value))
        if m is None:
            raise ValueError(f"network latency {value!r} is not a time: write e.g. '10us', "
                             f"'2ms' or a number of seconds")
        out = float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1.0}[
            m.group(2)]
    if not (math.isfinite(out) and out >= 0):
        raise ValueError(f"network latency {value!r} must be a finite time >= 0")
    return out


@dataclass(frozen=True)
class Rates:
    """One process's compute, in seconds: per lookup and value of D (gather, combine, and the
    gradient's scatter), per updated row and value of D (dedup, optimizer), per physical table
    and step (fixed costs); with several processes, per byte a process sends or receives
    (routing, packing and unpacking the exchange's buffers) and per value a lossy exchange
    encodes or decodes."""

    lookup: float
    update: float
    table: float
    wire: float = 0.0
    codec: float = 0.0
    source: str = "given"

    @classmethod
    def load(cls, path: str | Path) -> Rates:
        """Raises ValueError naming ``path``: not a rates file written by ``--calibrate``."""
        try:
            d = json.loads(Path(path).read_text())
            rates = cls(float(d["lookup"]), float(d["update"]), float(d["table"]),
                        float(d.get("wire", 0.0)), float(d.get("codec", 0.0)),
                        str(d.get("source", path)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a rates file (python -m embcore.capacity "
                             f"--calibrate {path} writes one): {e}") from None
        if not all(math.isfinite(v) and v >= 0 for v in (rates.lookup, rates.update,
                                                          rates.table, rates.wire,
                                                          rates.codec)):
            raise ValueError(f"{path}: rates must be finite numbers >= 0, got {rates}")
        return rates


# Measured by ``calibrate`` on this project's benchmark machine (2 x86 cores, torch 2.13 CPU,
# one thread, Adagrad, float32); a GPU's or a bigger CPU's are smaller: calibrate there.
DEFAULT_RATES = Rates(lookup=4.1e-9, update=8.7e-10, table=1.2e-4, wire=2.5e-9,
                      codec=4.0e-8, source="default (2-core x86 CPU, one thread a rank)")


@dataclass(frozen=True)
class Projection:
    """One rank count's projection (bytes and seconds per step; the largest rank's)."""

    ranks: int
    memory_bytes: int   # fast-memory bytes of the largest rank
    fits: bool          # memory_bytes <= the memory per rank given (True without one)
    sent_bytes: int     # bytes the most loaded rank sends a step
    received_bytes: int
    collectives: int    # a step's collectives
    compute_s: float
    exchange_s: float
    step_s: float
    examples_per_s: float  # global examples a second (W x batch / step)
    bottleneck: str        # "memory", "exchange" or "compute"


def distinct(curve: Curve, rows: int, lookups: float) -> float:
    """Expected distinct ids among ``lookups`` draws from a table whose k hottest of ``rows`` ids
    take ``curve(k)`` of its lookups (each id of a bucket between k = 2^(i/2) points drawn with
    the bucket's mean probability)."""
    if lookups <= 0 or rows <= 0:
        return 0.0
    total, k, prev = 0.0, 0, 0.0
    while k < rows:
        nxt = min(rows, max(k + 1, int(k * math.sqrt(2))))
        share = curve(nxt)
        p = max(share - prev, 0.0) / (nxt - k)
        total += (nxt - k) * -math.expm1(lookups * math.log1p(-min(p, 1 - 1e-16)))
        k, prev = nxt, share
    return min(total, lookups, float(rows))


def _width(name: str, dim: int) -> int:
    return dim * 4 if name == "fp32" else Wire(name).width(dim)


def project(spec: EmbeddingSpec, ranks: Sequence[int], network: Network, *, batch: int,
            rates: Rates = DEFAULT_RATES, pooling: float | Mapping[str, float] = 1.0,
            distinct_ratio: float | None = None, profile: LookupProfile | None = None,
            memory: int | None = None) -> list[Projection]:
    """The projection of ``spec`` at each rank count (the module docstring says how).

    Args:
        spec: the tables, features, optimizer, sharding, memory budget and compression.
        ranks: rank counts W >= 1.
        network: each rank's link.
        batch: examples a rank a step.
        rates: one process's compute rates.
        pooling: ids per example and feature (without a profile): one number, or per table
            name (tables not named: 1).
        distinct_ratio: distinct ids over lookups, for every table (None: the curves).
        profile: measured lookups and curves per table (``ec.profile``).
        memory: fast-memory bytes per rank (None: not checked).

    Raises:
        ValueError: a rank count < 1, a batch < 1, a pooling <= 0 or a ratio outside (0, 1].
    """
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1 (examples a rank a step), got {batch!r}")
    features = Features(spec.feature_config, spec.optimizer)
    names = [n for n, _, _ in features.table_specs()]
    hot = dict(pooling) if isinstance(pooling, Mapping) else dict.fromkeys(names, pooling)
    unknown = sorted(set(hot) - set(names))
    if unknown:
        raise ValueError(f"pooling names tables {unknown} that the spec has not; its tables: "
                         f"{names}")
    for n, v in hot.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"pooling of table {n!r} must be a number > 0 (ids per example "
                             f"and feature), got {v!r}")
    if distinct_ratio is not None and not 0 < distinct_ratio <= 1:
        raise ValueError(f"distinct ratio must be in (0, 1] (distinct ids over lookups), got "
                         f"{distinct_ratio!r}")
    for w in ranks:
        if not isinstance(w, int) or w < 1:
            raise ValueError(f"rank counts must be integers >= 1, got {w!r} in {list(ranks)}")
    comp = ExchangeCompression.of(spec.exchange_compression)
    lookups: dict[str, float] = {n: v * batch * hot.get(n, 1.0)
                                 for n, v in features.lookups_per_table().items()}
    if profile is not None:
        lookups.update({n: v for n, v in profile.lookups().items() if n in lookups})
    rows = {n: t.vocabulary_size for n, t, _ in features.table_specs()}
    curves = {n: (profile.curve(n, r) if profile is not None else None) or zipf_curve(r)
              for n, r in rows.items()}

    def unique(name: str, n_lookups: float) -> float:
        if distinct_ratio is not None:
            return min(distinct_ratio * n_lookups, float(rows[name]))
        return distinct(curves[name], rows[name], n_lookups)

    out = []
    for w in ranks:
        plan = make_plan(features.table_specs(), w, spec.sharding,
                         lookups=dict(features.lookups_per_table()),
                         memory_budget=parse_budget(spec.memory_budget))
        mem = max(plan.bytes_per_rank(fast=True))
        sent = [0.0] * w
        received = [0.0] * w
        wire_s, calls, compute = 0.0, 0, 0.0
        for p in plan.physical:
            u = {n: unique(n, lookups[n]) for n in p.tables}  # a rank's distinct ids
            updated = sum(unique(n, lookups[n] * w) for n in p.tables)  # the global batch's
            compute += rates.table + rates.lookup * sum(lookups[n] for n in p.tables) * p.dim
            if w == 1:
                compute += rates.update * updated * p.dim
                continue
            s, r, c, ring = _exchange(plan, p, sum(u.values()), comp, w)
            sent = [a + b for a, b in zip(sent, s)]
            received = [a + b for a, b in zip(received, r)]
            calls += c
            wire_s += ring
            if p.strategy != "replicated":  # (a lossy format's rows: encoded, then decoded)
                per_row = ID_BYTES + _width(comp.forward, p.dim) + _width(comp.backward, p.dim)
                moved = max(a + b for a, b in zip(s, r)) / per_row  # rows out and in
                lossy = (comp.forward != "fp32") + (comp.backward != "fp32")
                compute += rates.codec * moved * lossy * p.dim
            # every replica updates every row; the owners share the rest (the planner balances
            # whole tables); a column split updates every row, a slice of it on each rank
            share = updated if p.strategy in ("replicated", "column") else updated / w
            width = p.dim / w if p.strategy == "column" else p.dim
            compute += rates.update * share * width
        biggest = max(max(a, b) for a, b in zip(sent, received))
        compute += rates.wire * max(a + b for a, b in zip(sent, received))
        calls += 1 if w > 1 else 0  # the step's agreement (step/gradients.py)
        exchange = (calls * network.latency * (w - 1)
                    + (biggest + wire_s) / network.bandwidth) if w > 1 else 0.0
        fits = memory is None or mem <= memory
        step = compute + exchange
        out.append(Projection(w, mem, fits, int(max(sent)), int(max(received)), calls,
                              compute, exchange, step, w * batch / step,
                              "memory" if not fits else
                              "exchange" if exchange > compute else "compute"))
    return out


def _exchange(plan: ShardingPlan, p: PhysicalTable, u: float, comp: ExchangeCompression,
              w: int) -> tuple[list[float], list[float], int, float]:
    """One physical table's step at ``w`` ranks, each rank looking up ``u`` distinct ids:
    (bytes each rank sends, receives, collectives, extra bytes a ring all_reduce moves)."""
    fwd, bwd = _width(comp.forward, p.dim), _width(comp.backward, p.dim)
    counts = COUNT_BYTES * (w - 1)
    if p.strategy == "replicated":
        dense = p.stored_rows * (p.dim + 1) * p.dtype.itemsize  # (N, D) and (N,) summed
        ring = dense * (2 * (w - 1) / w) - dense
        return [float(dense)] * w, [float(dense)] * w, 2, max(ring, 0.0)
    if p.strategy == "column":  # every id to every rank; a slice of each row back
        part = math.ceil(p.dim / w)
        one = (counts + ID_BYTES * u * (w - 1)
               + (_width(comp.forward, part) + _width(comp.backward, part)) * u * (w - 1))
        return [one] * w, [one] * w, 4, 0.0
    if p.strategy == "table":  # the owner answers every rank
        owner = plan.table(p.tables[0]).owner
        sent = [counts + ID_BYTES * u + bwd * u if r != owner else counts + fwd * u * (w - 1)
                for r in range(w)]
        got = [counts + fwd * u if r != owner else counts + (ID_BYTES + bwd) * u * (w - 1)
               for r in range(w)]
        return sent, got, 4, 0.0
    away = u * (w - 1) / w  # row_div, row_mod, hash: ids spread evenly over the owners
    one = counts + ID_BYTES * away + (fwd + bwd) * away
    return [one] * w, [one] * w, 4, 0.0


# ------------------------------------------------------------------------------ calibration

WARMUP = 3  # untimed steps before ``timed_steps`` times any


def timed_steps(emb: Any, batches: Sequence[Any], steps: int, stats: bool = False) -> list[float]:
    """Seconds of each of ``steps`` training steps of engine ``emb`` (enqueue, dequeue, apply of
    a small gradient) over ``batches`` in turn, after ``WARMUP`` untimed ones; ``stats``: the
    exchange statistics reset when the timed steps begin. The calibration's and
    benchmarks/studies' timing."""
    import torch

    took = []
    for s in range(WARMUP + steps):
        if stats and s == WARMUP:
            emb.exchange_stats(reset=True)
        start = time.perf_counter()
        emb.enqueue(batches[s % len(batches)])
        acts = emb.dequeue()
        emb.apply_gradients({k: torch.full_like(a, 1e-3) for k, a in acts.items()})
        if s >= WARMUP:
            took.append(time.perf_counter() - start)
    return took

def calibrate(steps: int = 8) -> Rates:
    """Measures ``Rates`` on this machine: one process, one thread, four float32 tables of
    D 64 with Adagrad, at three shapes (many lookups of few rows; as many rows as lookups; a
    tiny batch), each a few warm-up and ``steps`` timed steps, fitted by least squares of the
    relative errors; then ``wire`` and ``codec`` from two processes (gloo, a row_mod step in
    fp32 and fp8: ``_calibrate_wire``). About a minute."""
    import numpy as np
    import torch

    from . import engine as ec_engine
    from .config import optimizers as ec_opt
    from .config import tables as ec_tables

    torch.set_num_threads(1)
    d, n_tables, vocab = 64, 4, 200_000
    shapes = [(8192, 64), (8192, vocab), (4096, vocab), (16, 16)]  # (batch, ids drawn from)
    rows, times = [], []
    g = torch.Generator().manual_seed(0)
    for b, span in shapes:
        tables = [ec_tables.TableConfig(vocabulary_size=vocab, dim=d, name=f"t{i}")
                  for i in range(n_tables)]
        emb = ec_engine.Embedding(
            {f"f{i}": ec_tables.FeatureConfig(table=t) for i, t in enumerate(tables)},
            ec_opt.Adagrad(0.05), sharding="table")
        batches = [{f"f{i}": torch.randint(0, span, (b,), generator=g) for i in range(n_tables)}
                   for _ in range(3)]
        took = timed_steps(emb, batches, steps)
        u = statistics.mean(float(v.unique().numel()) for bt in batches for v in bt.values())
        # one physical table (stacked): lookups x D, distinct rows x D, one table
        rows.append([n_tables * b * d, n_tables * u * d, 1.0])
        times.append(statistics.median(took))
    t = np.array(times)
    sol, *_ = np.linalg.lstsq(np.array(rows) / t[:, None], np.ones_like(t),
                              rcond=None)  # (relative errors: the tiny batch counts as much)
    lookup, update, table = (max(float(v), 0.0) for v in sol)
    rates = Rates(lookup, update, table, source=f"calibrated {time.strftime('%Y-%m-%d')}, "
                                                f"torch {torch.__version__}, one thread")
    return _calibrate_wire(rates, steps)


def _wire_worker(rank: int, port: int, steps: int, out: str) -> None:
    """``calibrate``'s 2-process half: the W1-like step of ``_wire_shape`` in fp32 and fp8,
    written by rank 0 as [step seconds, exchange seconds, bytes sent + received] per format."""
    import torch
    import torch.distributed as dist

    from . import engine as ec_engine
    from .config import optimizers as ec_opt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    fc, batches = _wire_shape(rank)
    got = {}
    for name in ("fp32", "fp8"):
        emb = ec_engine.Embedding(fc, ec_opt.Adagrad(0.05), sharding="row_mod",
                                  exchange_compression=name)
        took = timed_steps(emb, batches, steps, stats=True)
        st = emb.exchange_stats()
        moved = sum(v[f"{k}_{d}"] for v in st.values() for k in ("ids", "rows", "gradients")
                    for d in ("sent", "received"))
        mine = torch.tensor([statistics.median(took),
                             sum(v["seconds"] for v in st.values()) / steps, moved / steps],
                            dtype=torch.float64)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        got[name] = torch.stack(both).max(0).values.tolist()
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


def _wire_shape(rank: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """4 tables x 200,000 rows x D 64 and a rank's 3 batches of 4096 uniform ids a table."""
    import torch

    from .config import tables as ec_tables

    fc = {f"f{i}": ec_tables.FeatureConfig(
        table=ec_tables.TableConfig(vocabulary_size=200_000, dim=64, name=f"t{i}"))
        for i in range(4)}
    g = torch.Generator().manual_seed(rank)
    return fc, [{k: torch.randint(0, 200_000, (4096,), generator=g) for k in fc}
                for _ in range(3)]


def _calibrate_wire(rates: Rates, steps: int) -> Rates:
    """``rates`` with ``wire`` and ``codec`` from a 2-process run (gloo on this machine): the
    step's time outside the collectives, less the one-process compute ``rates`` project, per
    byte exchanged (fp32), then per value encoded or decoded (fp8)."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "wire.json")
        mp.spawn(_wire_worker, args=(port, steps, out), nprocs=2, join=True)
        got = json.loads(Path(out).read_text())
    fc, _ = _wire_shape(0)
    spec = EmbeddingSpec(fc, None, sharding="row_mod")
    (base,) = project(spec, [2], Network(1e12, 0.0), batch=4096, rates=rates,
                      distinct_ratio=None)
    step, exch, moved = got["fp32"]
    wire = max(step - exch - base.compute_s, 0.0) / moved
    step8, exch8, moved8 = got["fp8"]
    rows = moved8 / (ID_BYTES + 2 * Wire("fp8").width(64))  # rows out and in
    codec = max(step8 - exch8 - base.compute_s - wire * moved8, 0.0) / (rows * 2 * 64)
    return dataclasses.replace(rates, wire=wire, codec=codec)


# ------------------------------------------------------------------------------ command line
def _size(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def report(spec_name: str, spec: EmbeddingSpec, network: Network, rates: Rates, batch: int,
           rows: list[Projection]) -> str:
    """The table ``main`` prints."""
    comp = ExchangeCompression.of(spec.exchange_compression)
    opt = type(spec.optimizer).__name__ if spec.optimizer is not None else "none"
    head = [(f"spec {spec_name}: batch {batch} a rank, optimizer {opt}, exchange "
            f"{comp.forward} forward / {comp.backward} backward"),
            (f"network {network.bandwidth * 8 / 1e9:g} Gbit/s a rank, latency "
            f"{network.latency * 1e6:g} us; compute rates: {rates.source}"),
            (f"{'ranks':>5} {'memory/rank':>12} {'sent/step':>11} {'recv/step':>11} "
            f"{'compute ms':>10} {'exchange ms':>11} {'step ms':>9} {'examples/s':>11}  "
            f"bottleneck")]
    for r in rows:
        head.append(f"{r.ranks:>5} {_size(r.memory_bytes):>12} {_size(r.sent_bytes):>11} "
                    f"{_size(r.received_bytes):>11} {r.compute_s * 1e3:>10.2f} "
                    f"{r.exchange_s * 1e3:>11.2f} {r.step_s * 1e3:>9.2f} "
                    f"{r.examples_per_s:>11,.0f}  {r.bottleneck}")
    return "\n".join(head)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embcore.capacity", description=(
        "Projects a spec's per-rank memory, bytes exchanged a step, step time and bottleneck "
        "at each rank count."))
    ap.add_argument("--spec", help="an ec.EmbeddingSpec JSON file (spec.to_dict())")
    ap.add_argument("--ranks", default="1,2,4,8", help="rank counts, comma-separated")
    ap.add_argument("--network", default="100Gbit", help="bandwidth a rank: 25Gbit, 12.5GB/s")
    ap.add_argument("--latency", default="10us", help="a message's latency: 10us, 1ms")
    ap.add_argument("--batch", type=int, default=4096, help="examples a rank a step")
    ap.add_argument("--pooling", default="1", help="ids per example and feature: one number, "
                    "or one per table in the spec's order, comma-separated")
    ap.add_argument("--distinct", type=float, default=None,
                    help="distinct ids over lookups (default: each table's Zipf prior)")
    ap.add_argument("--profile", default=None, help="an ec.profile file (measured lookups)")
    ap.add_argument("--memory", default=None, help="fast memory a rank: 80GiB")
    ap.add_argument("--compression", default=None,
                    help="override the spec's exchange compression: fp32, bf16, fp16, fp8")
    ap.add_argument("--rates", default=None, help="a rates file written by --calibrate")
    ap.add_argument("--calibrate", metavar="OUT", default=None,
                    help="measure this machine's compute rates into OUT (JSON) and stop")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = ap.parse_args(argv)
    if args.calibrate:
        rates = calibrate()
        Path(args.calibrate).write_text(json.dumps(asdict(rates), indent=1))
        print(json.dumps(asdict(rates)))
        return 0
    if args.spec is None:
        ap.error("--spec is required (or --calibrate OUT)")
    try:
        spec = EmbeddingSpec.from_dict(json.loads(Path(args.spec).read_text()))
    except (OSError, ValueError, TypeError) as e:
        ap.error(f"--spec {args.spec}: {e}")
    if args.compression is not None:
        spec = EmbeddingSpec(spec.feature_config, spec.optimizer, sharding=spec.sharding,
                             memory_budget=spec.memory_budget,
                             pipeline_execution=spec.pipeline_execution,
                             exchange_compression=args.compression)
    try:
        ranks = [int(x) for x in args.ranks.split(",")]
        network = Network.parse(args.network, args.latency)
        rates = Rates.load(args.rates) if args.rates else DEFAULT_RATES
        profile = LookupProfile.load(args.profile) if args.profile else None
        hot = [float(x) for x in args.pooling.split(",")]
        names = [n for n, _, _ in Features(spec.feature_config, None).table_specs()]
        if len(hot) not in (1, len(names)):
            raise ValueError(f"--pooling has {len(hot)} values; give one, or one per table "
                             f"({len(names)}: {names})")
        rows = project(spec, ranks, network, batch=args.batch, rates=rates,
                       pooling=hot[0] if len(hot) == 1 else dict(zip(names, hot)),
                       distinct_ratio=args.distinct, profile=profile,
                       memory=parse_budget(args.memory))
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        for r in rows:
            print(json.dumps(asdict(r)))
    else:
        print(report(args.spec, spec, network, rates, args.batch, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
