"""Planning is arithmetic on counts (docs/semantics.md section 10, "Planning"): the planner, the
budget check and ``ec.profile`` make no tensor per row of a table, at any size, so a budget error
(or a plan that fits) comes before any table-sized allocation; ``memory_budget`` is a whole
number of bytes, never rounded.

Peak memory is measured in a child process (``ru_maxrss``: tracemalloc does not see torch's
allocations), as the growth of the child's peak from after its imports; the children that plan
2^33-row tables also run under an address-space limit, so that a per-row tensor fails at once
instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import embcore as ec
from embcore.config.budget import parse_budget
from embcore.config.tables import INIT_BLOCK_ROWS, initial_rows
from embcore.ops.backend import choose
from embcore.ops.workspace import Workspace
from embcore.planning.placement import (
    STRATEGIES,
    Placement,
    WholeTable,
    make_placement,
    split_sizes,
)
from embcore.planning.plan import make_plan
from embcore.state.build import RowsBuilder

ROOT = Path(__file__).parents[1]
MiB = 2**20
GROWTH = 64 * MiB  # what a child's peak may grow by: far below any table here (>= 2 GiB of ids)


ERROR = """
def error(f):  # the error a call raises, by type and text
    try:
        f()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None
"""


def _child(body: str, address_space: int | None = None) -> dict:
    """Runs ``body`` in a fresh python (this checkout's embcore) after ``import torch, embcore``;
    ``body`` leaves a dict in ``out`` (``error(f)``: what ``f()`` raises). Returns it with
    ``grew``: how far the child's peak resident memory rose from after its imports, in bytes,
    and ``peak``: that peak."""
    code = textwrap.dedent("""
        import json, resource, sys
        limit = {limit}
        if limit is not None:  # a per-row tensor of 2^33 rows fails here at once
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        sys.path.insert(0, {root!r})
        import torch, embcore as ec
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out = {{}}
    """).format(limit=address_space, root=str(ROOT))
    code += ERROR + textwrap.dedent(body) + textwrap.dedent("""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.update(grew=peak - base, peak=peak)
        print("RESULT " + json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    lines = [s for s in run.stdout.splitlines() if s.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])



# ----------------------------------------------------------------------- the budget's error first
@pytest.mark.slow
def test_a_budget_below_a_2_28_row_table_is_refused_before_any_table_sized_allocation():
    """2^28 x 128 with Adagrad (256 GiB) under "2GB": the plan offloads it, and the cache
    index (15 bytes a row, 4 GB) is over the budget: the budget's error, with the child's peak
    far below the table's rows (it listed 2^28 row ids, 2 GiB, before)."""
    got = _child("""
        t = ec.TableConfig(vocabulary_size=2**28, dim=128, name="t")
        out["error"] = error(lambda: ec.Embedding({"f": ec.FeatureConfig(table=t)},
                                                  ec.Adagrad(0.1), memory_budget="2GB"))
    """)
    assert got["error"] is not None and got["error"][0] == "ValueError", got
    assert got["error"][1].startswith("memory_budget=2000000000 bytes is below what must stay "
                                      "in fast memory on process 0"), got
    assert "raise the budget" in got["error"][1]
    assert got["grew"] < GROWTH, f"the child's peak grew by {got['grew'] / MiB:.0f} MiB"


@pytest.mark.slow
def test_a_2_33_row_table_is_planned_by_counting():
    """2^33 rows x 128 (4 TiB of float32 rows): its placements, held-row counts and plans over 1
    and 4 processes, with a budget that fits (offloaded, cached) and with one that does not (the
    budget's error), under an 8 GiB address-space limit and with the peak unmoved."""
    got = _child("""
        from embcore.planning.placement import STRATEGIES, make_placement
        from embcore.planning.plan import make_plan
        N = 2**33
        t = ec.TableConfig(vocabulary_size=N, dim=128, name="t")
        counts = {}
        for s in STRATEGIES:
            p = make_placement(s, N, 128, 4, owner=3)
            counts[s] = [p.held_count(r) for r in range(4)]
            counts[s + " span"] = [list(p.span(r)) for r in range(4)]
        out["counts"] = counts
        plans = {}
        for world, sharding in ((1, None), (4, "row_mod"), (4, "row_div"), (4, "table"),
                                (4, "column")):
            plan = make_plan([("t", t, ec.SGD(0.1))], world, sharding,
                             memory_budget=200 * 2**30)
            plans[f"{world} {sharding}"] = {
                "rows": list(plan.table("t").row_counts),
                "cache": list(plan.physical[0].cache_rows),
                "fast": plan.bytes_per_rank(fast=True), "text": str(plan)}
        out["plans"] = plans
        emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(0.1),
                           memory_budget="200GiB")
        out["engine"] = str(emb.plan)
        out["error"] = error(lambda: ec.Embedding({"f": ec.FeatureConfig(table=t)},
                                                  ec.Adagrad(0.1), memory_budget="4GiB"))
    """, address_space=8 * 2**30)
    n, q = 2**33, 2**31
    counts = got["counts"]
    assert counts["replicated"] == counts["column"] == [n] * 4
    assert counts["table"] == [0, 0, 0, n]
    assert counts["row_div"] == counts["row_mod"] == counts["hash"] == [q] * 4
    assert counts["row_mod span"] == [[r, 4, q] for r in range(4)]
    assert counts["row_div span"] == [[r * q, 1, q] for r in range(4)]
    budget = 200 * 2**30
    for key, plan in got["plans"].items():
        assert sum(plan["rows"]) == (4 * n if key.endswith("column") else n), key
        held = [r for r in plan["rows"] if r]
        assert all(0 < c < r for c, r in zip([c for c in plan["cache"] if c], held)), key
        assert max(plan["fast"]) <= budget, key
        assert "slow tier" in plan["text"], key
    assert "[slow tier, cached]" in got["engine"] and "8589934592" in got["engine"]
    assert got["error"] is not None and got["error"][0] == "ValueError", got
    assert got["error"][1].startswith("memory_budget=4294967296 bytes is below"), got
    assert got["grew"] < GROWTH, f"the child's peak grew by {got['grew'] / MiB:.0f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("budget", ["4GiB", None])
def test_the_criteo_spec_with_2_33_rows_fails_fast_with_the_budget_error(tmp_path, budget):
    """examples/criteo/spec.json edited to 2^33 rows for C3, trained with ``train.py --spec``:
    with a "4GiB" budget, the budget's error (the dynamic tables' maps, 49 bytes a row, are
    over it) where the engine is made; without one (the file's null), the build's error that
    the tables need more than the machine's memory, before it allocates them (4.4 TB)."""
    spec = json.loads((ROOT / "examples/criteo/spec.json").read_text())
    spec["tables"]["C3"]["vocabulary_size"] = 2**33
    spec["memory_budget"] = budget
    file = tmp_path / "spec.json"
    file.write_text(json.dumps(spec))
    got = _child(f"""
        sys.path.insert(0, {str(ROOT / "examples")!r})
        from criteo import train
        out["error"] = error(lambda: train.main([
            "--synthetic", "--synthetic-lines", "200", "--batch-size", "64", "--epochs", "1",
            "--no-progress", "--threads", "1", "--spec", {str(file)!r},
            "--out", {str(tmp_path / "out")!r}]))
    """, address_space=8 * 2**30)
    assert got["error"] is not None and got["error"][0] == "ValueError", got
    if budget is not None:
        assert got["error"][1].startswith("memory_budget=4294967296 bytes is below what must "
                                          "stay in fast memory on process 0"), got
        assert "the maps of dynamic tables" in got["error"][1]
    else:
        need = sum(t["vocabulary_size"] for t in spec["tables"].values()) * (2 * 128 * 4 + 49)
        assert re.match(rf"tables \['C1', .*'C26'\]: their rows and slots on this process "
                        rf"need {need} bytes of cpu memory, more than this machine's \d+ "
                        rf"bytes\. Give the engine a memory_budget", got["error"][1]), got
    assert got["grew"] < GROWTH, f"the child's peak grew by {got['grew'] / MiB:.0f} MiB"


def test_tables_beyond_the_devices_memory_are_refused_before_they_are_allocated(monkeypatch):
    """Without a budget, tables whose rows, slots and maps on this process exceed the
    machine's physical memory are the build's ValueError, naming them, before any allocation
    (where the system overcommits, an allocation could succeed and its first write fail)."""
    from embcore.state import build
    from embcore.state.vocab import torch_map as id_map
    big = ec.TableConfig(vocabulary_size=100, dim=8, name="big")
    small = ec.TableConfig(vocabulary_size=10, dim=8, name="small")
    emb = ec.Embedding({"b": ec.FeatureConfig(table=big), "s": ec.FeatureConfig(table=small)},
                       ec.Adagrad(0.1), sharding={"big": "table", "small": "table"})

    def allocate(*args, **kwargs):
        raise AssertionError("allocated")

    monkeypatch.setattr(id_map, "_physical_memory", lambda: 5000)  # bytes
    monkeypatch.setattr(build, "empty_table", allocate)
    need = (100 + 10) * 8 * 8
    with pytest.raises(ValueError, match=rf"tables \['big', 'small'\]: their rows and slots on "
                                         rf"this process need {need} bytes of cpu memory, more "
                                         rf"than this machine's 5000 bytes\. Give the engine a "
                                         rf"memory_budget"):
        emb.build()
    monkeypatch.undo()
    monkeypatch.setattr(id_map, "_physical_memory", lambda: need)  # fits exactly: built
    emb.build()
    assert emb.embedding_tables["big"].shape == (100, 8)


def test_profile_counts_the_ids_it_sees_not_the_rows_of_the_table():
    """``ec.profile`` of a 2^40-row static table (its counts were a tensor per row: 8 TiB)."""
    t = ec.TableConfig(vocabulary_size=2**40, dim=8, name="t")
    batches = [{"f": torch.tensor([1, 5, 5, 2**40 - 1])}, {"f": torch.tensor([5, 7])}]
    got = ec.profile(batches, {"f": ec.FeatureConfig(table=t)})
    assert got.tables["t"].distinct == 4 and got.tables["t"].lookups_per_batch == 3
    assert got.tables["t"].points == ((1, 0.5), (2, 4 / 6), (3, 5 / 6), (4, 1.0))


# ------------------------------------------------------------------ counts match the old rows
def _old_held_rows(p: Placement, rank: int) -> torch.Tensor:
    """The rows each strategy lists, by section 5's words, without the planner's arithmetic
    (the oracle): row blocks cut by numpy (``array_split``: the first ``N % W`` one longer),
    ``row_mod`` by a slice of every row."""
    if p.strategy in ("replicated", "column"):
        return torch.arange(p.rows)
    if isinstance(p, WholeTable):
        return torch.arange(p.rows if rank == p.owner else 0)
    if p.strategy in ("row_div", "hash"):
        return torch.from_numpy(np.array_split(np.arange(p.rows, dtype=np.int64), p.world)[rank])
    assert p.strategy == "row_mod"
    return torch.arange(p.rows)[rank::p.world]


def test_split_sizes_are_numpy_s_blocks():
    for n in range(0, 40):
        for parts in range(1, 7):
            want = [len(b) for b in np.array_split(np.arange(n), parts)]
            assert list(split_sizes(n, parts)) == want, (n, parts)


def _check_counted(plan, specs, budget) -> None:
    """The plan's arithmetic, recomputed from its choices (each table's placement, the physical
    tables' members in order): each rank's rows of a table are the oracle's; a physical shard
    holds its members' rows one after the other; without a budget, a rank's bytes are its rows'
    parameters and slots (a row-wise slot one float)."""
    opts = {name: o for name, _, o in specs}
    for p in plan.physical:
        start = [0] * plan.world_size
        for name in p.tables:
            t = plan.table(name)
            want = [len(_old_held_rows(t.placement, r)) for r in range(plan.world_size)]
            assert list(t.row_counts) == want, name
            assert list(t.local_offsets) == start, name
            start = [a + b for a, b in zip(start, want)]
        assert list(p.row_counts) == start
    if budget is not None:
        return
    want_bytes = [0] * plan.world_size
    for p in plan.physical:
        for r in range(plan.world_size):
            cols = p.columns[r][1] - p.columns[r][0]
            slots = sum(4 if s.rowwise else 4 * cols for s in opts[p.tables[0]].slots)
            want_bytes[r] += p.row_counts[r] * (4 * cols + slots)
    assert plan.bytes_per_rank() == want_bytes


@settings(max_examples=examples(150), deadline=None)
@given(strategy=st.sampled_from(sorted(STRATEGIES)), rows=st.integers(0, 300),
       dim=st.integers(1, 9), world=st.integers(1, 6), data=st.data())
def test_counts_and_spans_are_the_rows_each_strategy_listed(strategy, rows, dim, world, data):
    owner = data.draw(st.integers(0, world - 1))
    p = make_placement(strategy, rows, dim, world, owner=owner)
    for rank in range(world):
        old = _old_held_rows(p, rank)
        first, stride, count = p.span(rank)
        assert p.held_count(rank) == count == len(old)
        assert torch.equal(p.held_rows(rank), old)
        assert torch.equal(first + stride * torch.arange(count), old)
        start = data.draw(st.integers(-2, count + 2))
        stop = data.draw(st.integers(-2, count + 3))
        assert torch.equal(p.held_block(rank, start, stop), old[max(start, 0):max(stop, 0)])
        if count and not (p.held_everywhere or p.splits_columns):  # owned here, in order
            owner_of, local = p.owner_of(old)
            assert owner_of.eq(rank).all() and torch.equal(local, torch.arange(count))
    assert sum(p.held_count(r) for r in range(world)) == (
        rows * world if p.replicated or p.splits_columns else rows)


TABLES = st.lists(st.tuples(st.integers(1, 400), st.sampled_from([2, 8, 16, 32, 64]),
                            st.sampled_from(["sgd", "adagrad", "rowwise"]), st.booleans()),
                  min_size=1, max_size=4)
OPTIMIZERS = {"sgd": lambda: ec.SGD(0.1), "adagrad": lambda: ec.Adagrad(0.1),
              "rowwise": lambda: ec.RowwiseAdagrad(0.1)}


@settings(max_examples=examples(120), deadline=None)
@given(tables=TABLES, world=st.integers(1, 4),
       strategy=st.sampled_from(["auto", "replicated", "table", "row_div", "row_mod", "column"]),
       share=st.one_of(st.floats(0.3, 1.5), st.none()))
def test_plans_with_counted_rows_are_the_plans_with_listed_rows(tables, world, strategy, share):
    """Sharded plans over W processes, with and without a budget (a share of the tables'
    bytes: most fit, or offload tables, or are refused): the rows each rank holds, where they
    start in its shard and (without a budget) the bytes are the oracle's arithmetic
    (``_check_counted``); the caches and the fast bytes are what they were when the planner
    listed the rows (``held_count`` replaced by ``len`` of the oracle's lists)."""
    specs = [(f"t{i}", ec.TableConfig(vocabulary_size=n, dim=d, name=f"t{i}",
                                      dynamic=ec.DynamicVocabulary() if dyn else None),
              OPTIMIZERS[opt]()) for i, (n, d, opt, dyn) in enumerate(tables)]
    if strategy == "column":
        specs = [(n, c, ec.SGD(0.1) if o.slots and world > 1 else o) for n, c, o in specs]
    budget = None if share is None else int(share * sum(
        c.vocabulary_size * (c.dim * 4 + sum(4 if s.rowwise else 4 * c.dim for s in o.slots))
        for _, c, o in specs))

    def plan():
        try:
            return make_plan(specs, world, strategy, memory_budget=budget)
        except ValueError as e:
            return str(e)

    new = plan()
    if not isinstance(new, str):
        _check_counted(new, specs, budget)
    with mock.patch.object(Placement, "held_count",
                           lambda self, rank: len(_old_held_rows(self, rank))):
        old = plan()
    if isinstance(new, str) or isinstance(old, str):
        assert new == old
        return
    assert new.describe() == old.describe()
    assert [(t.row_counts, t.local_offsets) for t in new.tables] == \
        [(t.row_counts, t.local_offsets) for t in old.tables]
    assert [(p.row_counts, p.cache_rows, p.columns) for p in new.physical] == \
        [(p.row_counts, p.cache_rows, p.columns) for p in old.physical]
    assert new.bytes_per_rank(fast=True) == old.bytes_per_rank(fast=True)
    assert str(new) == str(old)


# ------------------------------------------------------------ the build, in bounded blocks
@given(first=st.integers(0, 3 * INIT_BLOCK_ROWS), stride=st.integers(1, 5),
       count=st.integers(0, 3 * INIT_BLOCK_ROWS))
@settings(max_examples=examples(60), deadline=None)
def test_init_blocks_cover_the_shard_in_bounded_blocks_aligned_to_the_initializers(
        first, stride, count):
    from embcore.state.build import init_blocks
    blocks = list(init_blocks(first, stride, count))
    assert [i for i, _ in blocks] == ([0] if count else []) + [j for _, j in blocks[:-1]]
    assert (blocks[-1][1] if blocks else 0) == count
    assert all(0 < j - i <= INIT_BLOCK_ROWS for i, j in blocks)
    # each block the initializer draws (INIT_BLOCK_ROWS logical rows) in one range only: the
    # last row of a range and the first of the next are in different blocks
    assert all((first + (j - 1) * stride) // INIT_BLOCK_ROWS
               < (first + j * stride) // INIT_BLOCK_ROWS for _, j in blocks[:-1])


@pytest.mark.parametrize("strategy", ["row_div", "row_mod", "column", "table"])
def test_a_shard_of_more_rows_than_a_block_gets_the_tables_initial_values(strategy):
    """A table of 2.5 blocks of rows over 3 processes: every process's shard, initialized in
    blocks, holds the table's initial values at its rows (and columns)."""
    n, dim, world, seed = 2 * INIT_BLOCK_ROWS + INIT_BLOCK_ROWS // 2 + 7, 3, 3, 11
    t = ec.TableConfig(vocabulary_size=n, dim=dim, name="t")
    whole = initial_rows(t, "t", seed, torch.arange(n))
    plan = make_plan([("t", t, ec.SGD(0.1))], world, strategy)
    for rank in range(world):
        rows = RowsBuilder(plan, {"t": t}, seed, rank, torch.device("cpu"), None,
                           Workspace(), choose("cpu")).build()[0]
        c0, c1 = plan.physical[0].columns[rank]
        held = plan.table("t").held_rows(rank)
        assert torch.equal(rows.table, whole[held, c0:c1]), (strategy, rank)


# -------------------------------------------------------------------- the budget's bytes
def test_an_integral_float_budget_is_taken_exactly_and_a_string_in_decimal():
    assert parse_budget(1.5e9) == 1_500_000_000 and isinstance(parse_budget(1.5e9), int)
    assert parse_budget(2.0**40) == 2**40
    assert parse_budget(0.0) == 0
    # (in binary floating point, 2.01 * 1000 is 2009.9999999999998)
    assert parse_budget("2.01KB") == 2010
    assert parse_budget("2.05GB") == 2_050_000_000
    assert parse_budget("0.3GB") == 300_000_000
    assert parse_budget("1.5GiB") == 3 * 2**29
    assert parse_budget("1.5e9") == 1_500_000_000
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    emb = ec.Embedding(ec.FeatureConfig(table=t), ec.SGD(0.1), memory_budget=1.5e9)
    assert not any(p.offloaded for p in emb.plan.physical)


@pytest.mark.parametrize("value, error, message", [
    (1.5, ValueError, (r"memory_budget 1\.5 is 1\.5 bytes, not a whole number of bytes; "
                       r"write a whole number, e\.g\. 1 or 2")),
    (1e9 + 0.5, ValueError, "not a whole number of bytes"),
    ("1.5B", ValueError, r"memory_budget '1\.5B' is 1\.5 bytes, not a whole number"),
    ("0.1KiB", ValueError, (r"is 102\.4 bytes, not a whole number of bytes; write a whole "
                            r"number, e\.g\. 102 or 103")),
    (float("nan"), ValueError, "memory_budget must be a finite number of bytes, got nan"),
    (float("inf"), ValueError, "memory_budget must be a finite number of bytes, got inf"),
    (-1.0, ValueError, r"memory_budget must be >= 0 bytes, got -1\.0"),
    (-1, ValueError, "memory_budget must be >= 0 bytes, got -1"),
    (True, TypeError, "got bool"),
    (False, TypeError, "got bool"),
])
def test_a_budget_that_is_not_a_whole_number_of_bytes_is_refused(value, error, message):
    with pytest.raises(error, match=message):
        parse_budget(value)
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    with pytest.raises(error, match=message):
        ec.Embedding(ec.FeatureConfig(table=t), ec.SGD(0.1), memory_budget=value)
    with pytest.raises(error, match=message):
        ec.EmbeddingSpec(ec.FeatureConfig(table=t), ec.SGD(0.1), memory_budget=value)


@pytest.mark.parametrize("unit, size", [
    ("B", 1), ("KB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12),
    ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)])
def test_each_unit_is_the_power_of_1000_or_1024_the_docs_say(unit, size):
    assert parse_budget(f"3{unit}") == 3 * size
    assert parse_budget(f"3 {unit.lower()}") == 3 * size  # (any case, a space before it)
    if size > 1:
        assert parse_budget(f"0.5{unit}") == size // 2
        assert parse_budget(f"1{unit}") - 1 == parse_budget(f"{size - 1}")


_BEYOND = [
    ("9" * 5000, r"memory_budget '9{40}'\.\.\. \(of 5000 characters\) is not a size"),
    ("9" * 30, r"memory_budget '9{30}' is more than 9223372036854775807 bytes"),
    ("9.3e18", r"memory_budget '9\.3e18' is more than 9223372036854775807 bytes"),
    ("8EiB", r"memory_budget '8EiB' is not a size"),
    ("inf", r"memory_budget 'inf' is not a size"),
    ("nan", r"memory_budget 'nan' is not a size"),
    ("-1", r"memory_budget '-1' is not a size"),
    ("-0", r"memory_budget '-0' is not a size"),
    (1e30, r"memory_budget 1e\+30 is more than 9223372036854775807 bytes"),
    (2**63, r"memory_budget 9223372036854775808 is more than 9223372036854775807 bytes"),
    (10**5000, r"memory_budget <an integer of 16610 bits> is more than 9223372036854775807"),
    (-10**5000, r"memory_budget must be >= 0 bytes, got -<an integer of 16610 bits>"),
]


@pytest.mark.parametrize("value, message", _BEYOND, ids=[m[:34] for _, m in _BEYOND])
def test_a_budget_beyond_any_machine_is_refused_before_it_is_expanded(value, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(value)
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    with pytest.raises(ValueError, match=message):
        ec.Embedding(ec.FeatureConfig(table=t), ec.SGD(0.1), memory_budget=value)


def test_the_largest_budget_and_zero_written_any_way_are_taken():
    assert parse_budget(2**63 - 1) == parse_budget("9223372036854775807") == 2**63 - 1
    assert parse_budget("0e99") == parse_budget("0.0e-99") == parse_budget(-0.0) == 0
    assert parse_budget("1e18") == 10**18 and parse_budget("0.001e21") == 10**18


def test_a_huge_exponent_is_refused_at_once_not_expanded():
    """Before the bound, ``"1e999999999"`` was expanded to an exact integer first (it never
    ended): run in a child with a deadline."""
    cases = {"1e999999999": r"memory_budget '1e999999999' is more than 9223372036854775807 bytes",
             "7e99999999TiB": r"memory_budget '7e99999999TiB' is more than 9223372036854775807",
             "1e-999999999": r"memory_budget '1e-999999999' is less than one byte but more than 0",
             "0e999999999": "0", "0.0e-999999999": "0"}
    code = ("import sys\nfrom embcore.config.budget import parse_budget\n"
            "for v in sys.argv[1:]:\n"
            "    try:\n        print(repr(parse_budget(v)))\n"
            "    except ValueError as e:\n        print(e)\n")
    got = subprocess.run([sys.executable, "-c", code, *cases], capture_output=True, text=True,
                         timeout=30, cwd=Path(ec.__file__).resolve().parents[1])
    assert got.returncode == 0, got.stderr
    for line, message in zip(got.stdout.splitlines(), cases.values(), strict=True):
        assert re.match(message, line), line


# -------------------------------------------------------------------- the profile it weighs by
_PROFILE = {"format": "embcore-profile-1", "batches": 3,
            "tables": {"t": {"lookups_per_batch": 2.0, "distinct": 5,
                             "points": [[1, 0.5], [5, 1.0]]}}}


@pytest.mark.parametrize("field, value, message", [
    ("lookups_per_batch", float("nan"), "has lookups_per_batch nan; it must be a finite number"),
    ("lookups_per_batch", float("inf"), "has lookups_per_batch inf; it must be a finite number"),
    ("distinct", -3, "has distinct -3; it must be an integer >= 0"),
    ("distinct", float("inf"), "has distinct inf; it must be an integer >= 0"),
    ("points", [[1, float("nan")], [5, 1.0]], r"has the share at k = 1 of nan; it must be"),
    ("points", [[0, 0.5], [5, 1.0]], r"has the point k = 0; it must be an integer above"),
    ("points", [[-2, 0.5], [5, 1.0]], r"has the point k = -2; it must be an integer above"),
    ("points", [[1, 0.5], [9, 1.0]], r"has the point k = 9; .* at most distinct \(5\)"),
    ("batches", -1, r"profile: batches is -1; it must be an integer >= 0"),
    ("batches", float("nan"), r"profile: batches is nan; it must be an integer >= 0"),
])
def test_a_profile_with_nan_infinite_or_negative_values_is_refused(tmp_path, field, value,
                                                                   message):
    d = json.loads(json.dumps(_PROFILE))
    (d if field == "batches" else d["tables"]["t"])[field] = value
    if field != "batches":
        message = rf"profile: table 't' {message}"
    with pytest.raises(ValueError, match=message):
        ec.LookupProfile.from_dict(d)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))  # (NaN and Infinity as Python's json writes them)
    with pytest.raises(ValueError, match=rf"{path}: {message}"):
        ec.LookupProfile.load(path)
    t = ec.TableConfig(vocabulary_size=10, dim=2, name="t")
    with pytest.raises(ValueError, match=message):
        ec.Embedding(ec.FeatureConfig(table=t), ec.SGD(0.1), memory_budget=100, profile=path)


def test_a_profile_made_by_hand_is_checked_as_a_loaded_one():
    from embcore.planning.profile import TableProfile

    ok = ec.LookupProfile(3, {"t": TableProfile(2.0, 5, ((1, 0.5), (5, 1.0)))})
    assert ec.LookupProfile.from_dict(ok.to_dict()) == ok
    with pytest.raises(ValueError, match="profile: table 't' has lookups_per_batch nan"):
        ec.LookupProfile(3, {"t": TableProfile(float("nan"), 5, ())})
    with pytest.raises(ValueError, match=r"profile: table 't' has the share at k = 5 of 0\.4"):
        ec.LookupProfile(3, {"t": TableProfile(1.0, 5, ((1, 0.5), (5, 0.4)))})
    with pytest.raises(TypeError, match="table 't' must be a TableProfile, got dict"):
        ec.LookupProfile(3, {"t": {"lookups_per_batch": 1.0}})


def test_a_profile_file_too_deep_or_of_huge_integers_is_named(tmp_path):
    for name, text in (("deep.json", "[" * 100_000 + "]" * 100_000),
                       ("digits.json", '{"batches": ' + "9" * 5000 + "}")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=rf"{tmp_path / name}: not an embcore profile"):
            ec.LookupProfile.load(tmp_path / name)
