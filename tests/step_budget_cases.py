"""The device step's budget (issue 54, point 6): host synchronisations and device ops of one steady
training step on the Triton backend, counted on the CPU (kernels in Triton's interpreter,
``gpu.force_on_cpu``; tests/sync_guard.py ``Counts``: every dispatched op, and each that would
make the host wait for a CUDA device, ``tolist()`` / ``cpu()`` included). Run in a fresh
interpreter by tests/test_triton.py, like the other Triton cases.

The shape of the issue's table: 4 tables of D 16, batch 32, inputs made before counting, after
three steps (steady: the workspaces and maps warmed). ``CEILING`` is today's count, a ceiling
that only comes down: a change that adds a synchronisation or an op to the step fails here, and
the work of issue 54 lowers it towards ``TARGET`` (no synchronisation; dense <= 12 ops, jagged
<= 16, raw ids <= 40).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from sync_guard import Counts  # noqa: E402

import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402

if CUDA:
    pytest.skip("counted on the CPU's emulation of the device step (a GPU runs the real one)",
                allow_module_level=True)
if not gpu.available():
    pytest.skip(f"triton does not load: {gpu.error()}", allow_module_level=True)
if not gpu.interpreted():
    pytest.skip("the kernels were loaded before TRITON_INTERPRET=1 was set: run this file alone",
                allow_module_level=True)

# (syncs, ops) of a steady step, per input kind, for every optimizer family below
CEILING = {"dense": (0, 12), "jagged": (0, 19), "raw": (5, 369)}
TARGET = {"dense": (0, 12), "jagged": (0, 16), "raw": (0, 40)}
OPTIMIZERS = {"SGD": ec.SGD, "Adagrad": ec.Adagrad, "Adam": ec.Adam, "FTRL": ec.FTRL}


def _engine(kind: str, optimizer: type) -> ec.Embedding:
    features = {}
    for k in range(4):
        raw = kind == "raw"  # (200 rows for 128 new ids a step: LRU evicting)
        t = ec.TableConfig(vocabulary_size=200 if raw else 1000, dim=16, name=f"t{k}",
                           dynamic=ec.DynamicVocabulary(eviction="lru") if raw else None)
        features[f"f{k}"] = ec.FeatureConfig(table=t)
    return ec.Embedding(features, optimizer(learning_rate=0.1))


def _batch(kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    if kind == "dense":
        return {f"f{k}": torch.randint(0, 1000, (32,), generator=g) for k in range(4)}
    if kind == "jagged":  # bags of 5
        return {f"f{k}": torch.nested.nested_tensor_from_jagged(
            torch.randint(0, 1000, (160,), generator=g), torch.arange(0, 161, 5))
            for k in range(4)}
    return {f"f{k}": torch.randint(0, 2**40, (32,), generator=g) for k in range(4)}


def _step(emb: ec.Embedding, batch: dict[str, torch.Tensor]) -> None:
    emb.enqueue(batch, training=True)
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})


@pytest.fixture(autouse=True)
def _on_the_device_path():
    previous = gpu.force_on_cpu(True)
    try:
        yield
    finally:
        gpu.force_on_cpu(previous)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(CEILING))
def test_a_steady_step_stays_within_its_budget(kind, optimizer):
    emb = _engine(kind, OPTIMIZERS[optimizer])
    assert emb.plan.backend == "Triton"
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        _step(emb, _batch(kind, g))
    batch = _batch(kind, g)
    with Counts() as counted:
        _step(emb, batch)
    syncs, ops = CEILING[kind]
    assert counted.syncs <= syncs and counted.ops <= ops, (
        f"{kind}, {optimizer}: {counted.syncs} synchronisations (ceiling {syncs}) and "
        f"{counted.ops} device ops (ceiling {ops}) a steady step; the synchronisations: "
        f"{sorted(set(counted.why))}")


@pytest.mark.parametrize("alone", [True, False], ids=["a table alone", "stacked tables"])
def test_a_raw_id_step_reads_back_only_its_maps_counts(alone):
    """A steady raw-id step (LRU, evicting from its third step on: 40 rows a table, 16 new ids a
    step) reads back from its maps only their counts, once a table (one read for stacked tables
    together): no boolean mask, no scalar read of the rows still valid, no copy of the
    new ids to the host for their initial values. The rows and the eviction are the CPU's."""
    def build():  # (tables of two dims are not stacked)
        torch.manual_seed(0)  # (the tables' seed)
        return ec.Embedding({f"f{k}": ec.FeatureConfig(table=ec.TableConfig(
            vocabulary_size=40, dim=8 + 8 * k if alone else 16, name=f"t{k}",
            dynamic=ec.DynamicVocabulary(eviction="lru"))) for k in range(2)},
            ec.Adagrad(learning_rate=0.1))

    emb = build()
    g = torch.Generator().manual_seed(1)
    batches = [{f"f{k}": torch.randint(0, 2**40, (16,), generator=g) for k in range(2)}
               for _ in range(5)]
    for b in batches[:4]:
        _step(emb, b)
    with Counts() as counted:
        _step(emb, batches[4])
    reads = [w for w in counted.why if "unique_consecutive" not in w]  # (dedup: not the maps)
    assert reads == ["Tensor.tolist reads values back"] * (2 if alone else 1), reads
    gpu.force_on_cpu(False)
    cpu = build()
    assert cpu.plan.backend != "Triton"
    for b in batches:
        _step(cpu, b)
    for name in ("t0", "t1"):
        ids, rows = emb.vocabulary(name)
        want_ids, want_rows = cpu.vocabulary(name)
        assert torch.equal(ids, want_ids) and torch.equal(rows, want_rows)
        torch.testing.assert_close(emb.embedding_tables[name], cpu.embedding_tables[name],
                                   rtol=1e-6, atol=1e-7)
