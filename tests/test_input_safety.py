"""Malformed ids, jagged offsets and sparse indices: a clean error, no state change, no crash.

The fused kernels read ``table + id * D`` and walk offsets through raw pointers, so every input is
checked before it reaches them (docs/semantics.md sections 1 and 8), whatever
``validate_weights_and_indices`` says. Each malformed input below goes through every entry point
that canonicalizes inputs (``Embedding.lookup``, ``enqueue(training=True)`` + ``dequeue``, the
layer's training forward, ``ec.serving_embedding_lookup``, the serving module's eager forward)
and must raise ``ValueError`` / ``TypeError`` naming the feature, with tables and slots
bit-identical afterwards and the engine still usable. The inputs that crashed the process before
the checks run in a child process, so a segfault fails a test instead of killing pytest.

``python tests/test_input_safety.py [cases_per_kind [seed]] [--fallbacks]`` runs the seeded fuzz at
a larger size (``--fallbacks``: kernels off, compat's public paths) and prints the figures
docs/semantics.md section 8 quotes.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from native_required import requires_native
from switches import kernels, private_paths

import embcore as ec
from embcore.base import compat
from embcore.kernels import cpu

ROOT = Path(__file__).resolve().parent.parent
BAD = "clicks"       # the feature given the malformed inputs; errors must name it
VOCAB, DIM, B = 10, 4, 3
ENTRIES = ("lookup", "enqueue", "enqueue_pipelined", "layer", "serving", "module")
DEBUG = False
TRAINING = ("enqueue", "enqueue_pipelined", "layer")


def jagged(values, offsets, dtype=torch.int64, offsets_dtype=torch.int64) -> torch.Tensor:
    """A jagged tensor with exactly these parts (nested_tensor_from_jagged checks nothing)."""
    return torch.nested.nested_tensor_from_jagged(torch.tensor(values, dtype=dtype),
                                                  torch.tensor(offsets, dtype=offsets_dtype))


def sparse(indices, values, shape, coalesced: bool | None = None,
           dtype=torch.int64) -> torch.Tensor:
    """A COO tensor with exactly these stored entries; torch checks nothing (invariants off)."""
    idx = torch.tensor(indices, dtype=torch.int64).reshape(len(shape), -1)
    return torch.sparse_coo_tensor(idx, torch.tensor(values, dtype=dtype), shape,
                                   is_coalesced=coalesced, check_invariants=False)


def with_offsets(nt: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``nt`` with its stored offsets replaced (how a 2-D offsets tensor can reach us)."""
    nt._offsets = offsets
    return nt


def make_config(seq: int, validate: bool) -> dict[str, ec.FeatureConfig]:
    items = ec.TableConfig(vocabulary_size=VOCAB, dim=DIM, combiner="mean", name="items")
    users = ec.TableConfig(vocabulary_size=7, dim=DIM, combiner="sum", name="users")
    return {"user": ec.FeatureConfig(table=users, name="user"),
            BAD: ec.FeatureConfig(table=items, max_sequence_length=seq,
                                  validate_weights_and_indices=validate, name=BAD)}


def valid_batch(seq: int) -> tuple[dict, dict | None]:
    """A well-formed batch of B rows for both features (jagged bags, or dense sequences)."""
    clicks = (torch.tensor([[1, 2], [3, 0], [9, 9]]) if seq
              else jagged([1, 2, 3, 9, 9], [0, 2, 3, 5]))
    weights = None if seq else {"user": None, BAD: jagged([1., 2., 1., 1., 3.], [0, 2, 3, 5],
                                                          dtype=torch.float32)}
    return {"user": torch.tensor([1, 2, 3]), BAD: clicks}, weights


class Target:
    """One entry point over a fresh engine with the two features."""

    def __init__(self, entry: str, seq: int = 0, validate: bool = True) -> None:
        self.entry, self.seq = entry, seq
        self.fc = make_config(seq, validate)
        if entry in ("layer", "module"):
            self.layer = ec.EmbeddingLayer(self.fc, ec.Adagrad(learning_rate=0.1))
            self.emb = self.layer.engine
            self.module = self.layer.for_serving()
        else:
            self.emb = ec.Embedding(self.fc, ec.Adagrad(learning_rate=0.1),
                                    pipeline_execution=entry == "enqueue_pipelined")

    def call(self, features: dict, weights: dict | None) -> dict[str, torch.Tensor]:
        """The entry point's activations (after the training step, for the training ones)."""
        if self.entry == "lookup":
            return self.emb.lookup(features, weights)
        if self.entry in ("enqueue", "enqueue_pipelined"):
            self.emb.enqueue(features, weights, training=True)
            acts = self.emb.dequeue()
            self.emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
            return {k: v.detach() for k, v in acts.items()}
        if self.entry == "layer":
            self.layer.train()
            acts = self.layer(features, weights)
            sum(a.sum() for a in acts.values()).backward()
            return {k: v.detach() for k, v in acts.items()}
        if self.entry == "serving":
            return ec.serving_embedding_lookup(features, weights, self.emb.embedding_tables,
                                               self.fc)
        return self.module(features, weights)

    def state(self) -> dict[str, torch.Tensor]:
        out = {k: v.clone() for k, v in self.emb.state_dict().items()}
        if self.entry == "module":
            out.update({f"module/{k}": v.clone() for k, v in self.module.state_dict().items()})
        return out


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def fallbacks(on: bool):
    """With ``on``, the torch-ops twins of the kernels and compat's public paths."""
    with kernels(not on), private_paths(not on):
        yield


def expect_rejected(target: Target, ids: torch.Tensor, weights: torch.Tensor | None,
                    exc: type[Exception], match: str) -> None:
    """The call raises ``exc`` naming the feature and saying ``match``; nothing changes; the
    next valid call works."""
    features, _ = valid_batch(target.seq)
    features[BAD] = ids
    w = None if weights is None else {"user": None, BAD: weights}
    before = target.state()
    with pytest.raises(exc) as info:
        target.call(features, w)
    message = str(info.value)
    assert f"'{BAD}'" in message and match in message, message
    assert same_state(before, target.state()), "a rejected call changed the state"
    good, good_w = valid_batch(target.seq)
    out = target.call(good, good_w)
    assert out[BAD].shape == ((B, target.seq, DIM) if target.seq else (B, DIM))


# --------------------------------------------------------------- the enumerated malformed inputs
@dataclass(frozen=True)
class Bad:
    name: str
    make: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    exc: type[Exception]
    match: str
    weighted: bool = False   # carries weights: bag features only


def _ids(x):
    return lambda: (x() if callable(x) else x, None)


J6 = [0, 1, 2, 3, 4, 5]
OFFSETS = "jagged offsets"
MALFORMED = [
    # jagged offsets
    Bad("offsets fall to -1", _ids(lambda: jagged(J6, [0, 2, -1, 5, 6])), ValueError, OFFSETS),
    Bad("offsets fall", _ids(lambda: jagged(J6, [0, 4, 2, 6])), ValueError, OFFSETS),
    Bad("last offset below nnz", _ids(lambda: jagged(J6, [0, 1, 2, 3, 4])), ValueError, OFFSETS),
    Bad("last offset past nnz", _ids(lambda: jagged(J6, [0, 2, 7])), ValueError, OFFSETS),
    Bad("last offset huge", _ids(lambda: jagged(J6, [0, 2, 10**12])), ValueError, OFFSETS),
    Bad("first offset above 0", _ids(lambda: jagged(J6, [1, 2, 6])), ValueError, OFFSETS),
    Bad("first offset negative", _ids(lambda: jagged(J6, [-3, 2, 6])), ValueError, OFFSETS),
    Bad("first offset int64 min", _ids(lambda: jagged(J6, [-2**63, 6])), ValueError, OFFSETS),
    Bad("offsets int32 falling", _ids(lambda: jagged(J6, [0, 5, 1, 6],
                                                     offsets_dtype=torch.int32)),
        ValueError, OFFSETS),
    Bad("offsets empty", _ids(lambda: jagged(J6, [])), ValueError, OFFSETS),
    Bad("offsets 2-D", _ids(lambda: with_offsets(jagged(J6, [0, 2, 6]),
                                                 torch.tensor([[0, 2, 6]]))),
        ValueError, OFFSETS),
    Bad("offsets float", _ids(lambda: jagged(J6, [0, 2, 6], offsets_dtype=torch.float32)),
        TypeError, OFFSETS),
    Bad("offsets int16", _ids(lambda: jagged(J6, [0, 2, 6], offsets_dtype=torch.int16)),
        TypeError, OFFSETS),
    Bad("offsets bool", _ids(lambda: jagged([0], [0, 1], offsets_dtype=torch.bool)),
        TypeError, OFFSETS),
    # ids out of range (checked whatever validate_weights_and_indices says)
    Bad("dense id = vocabulary_size", _ids(lambda: torch.tensor([[1], [VOCAB], [2]])),
        ValueError, "has id 10"),
    Bad("dense id -1", _ids(lambda: torch.tensor([[1], [-1], [2]])), ValueError, "has id -1"),
    Bad("dense id 1e8", _ids(lambda: torch.tensor([[1], [10**8], [2]])), ValueError, "has id"),
    Bad("dense id int64 min", _ids(lambda: torch.tensor([[-2**63], [0], [0]])), ValueError,
        "has id"),
    Bad("dense id int64 max", _ids(lambda: torch.tensor([[2**63 - 1], [0], [0]])), ValueError,
        "has id"),
    Bad("dense int32 id -1, rank 2", _ids(lambda: torch.tensor([[1, -1], [2, 3], [4, 5]],
                                                                dtype=torch.int32)),
        ValueError, "has id -1"),
    Bad("jagged id 10", _ids(lambda: jagged([1, 10], [0, 1, 2, 2])), ValueError, "has id 10"),
    Bad("jagged id -1", _ids(lambda: jagged([1, -1], [0, 1, 2, 2])), ValueError, "has id -1"),
    Bad("jagged id 1e8", _ids(lambda: jagged([10**8], [0, 0, 1, 1])), ValueError, "has id"),
    Bad("jagged float ids", _ids(lambda: jagged([1.0], [0, 1], dtype=torch.float32)),
        TypeError, "int32 or int64"),
    Bad("sparse id 10", _ids(lambda: sparse([[0, 1], [0, 0]], [1, 10], (3, 2))), ValueError,
        "has id 10"),
    Bad("sparse id -1", _ids(lambda: sparse([[0, 1], [0, 0]], [-1, 1], (3, 2))), ValueError,
        "has id -1"),
    # sparse indices
    Bad("sparse index -1 in dim 0", _ids(lambda: sparse([[-1, 1], [0, 0]], [1, 2], (3, 2))),
        ValueError, "sparse index -1 in dim 0"),
    Bad("sparse index -1 in dim 1", _ids(lambda: sparse([[0, 1], [0, -1]], [1, 2], (3, 2))),
        ValueError, "sparse index -1 in dim 1"),
    Bad("sparse index = size in dim 0", _ids(lambda: sparse([[0, 3], [0, 0]], [1, 2], (3, 2))),
        ValueError, "sparse index 3 in dim 0"),
    Bad("sparse index = size in dim 1", _ids(lambda: sparse([[0, 1], [0, 2]], [1, 2], (3, 2))),
        ValueError, "sparse index 2 in dim 1"),
    Bad("sparse index 1e9", _ids(lambda: sparse([[0, 10**9], [0, 0]], [1, 2], (3, 2))),
        ValueError, "sparse index 1000000000 in dim 0"),
    Bad("sparse index past size, marked coalesced",
        _ids(lambda: sparse([[0, 5], [0, 0]], [1, 2], (3, 2), coalesced=True)),
        ValueError, "sparse index 5 in dim 0"),
    Bad("sparse indices out in both dims (coalesce() corrupted the heap)",
        _ids(lambda: sparse([[1, -2, 0, 4], [-2, 1, 2, -1]], [7, 6, 2, 5], (3, 1))),
        ValueError, "in dim 0"),
    Bad("sparse rank 3 index = size in dim 2",
        _ids(lambda: sparse([[0, 1], [0, 0], [0, 2]], [1, 2], (3, 1, 2))),
        ValueError, "sparse index 2 in dim 2"),
    Bad("sparse rank 3 index -5 in dim 1",
        _ids(lambda: sparse([[0, 1], [-5, 0], [0, 1]], [1, 2], (3, 1, 2))),
        ValueError, "sparse index -5 in dim 1"),
    # weights (bag features only)
    Bad("jagged weights: fewer values", lambda: (
        jagged([1, 2, 3], [0, 1, 3, 3]), jagged([1.0, 2.0], [0, 1, 3, 3], dtype=torch.float32)),
        ValueError, "weights hold 2 values", weighted=True),
    Bad("jagged weights: more values", lambda: (
        jagged([1, 2, 3], [0, 1, 3, 3]), jagged([1.] * 9, [0, 1, 3, 3], dtype=torch.float32)),
        ValueError, "weights hold 9 values", weighted=True),
    Bad("jagged weights: fewer values, shared offsets", lambda: _shared_offsets(2),
        ValueError, "weights hold 2 values", weighted=True),
    Bad("jagged weights: other offsets", lambda: (
        jagged([1, 2, 3], [0, 1, 3, 3]), jagged([1.0] * 3, [0, 2, 3, 3], dtype=torch.float32)),
        ValueError, "same offsets", weighted=True),
    Bad("jagged weights: float offsets", lambda: (
        jagged([1, 2, 3], [0, 1, 3, 3]),
        jagged([1.0] * 3, [0, 1, 3, 3], dtype=torch.float32, offsets_dtype=torch.float32)),
        TypeError, "weights' jagged offsets", weighted=True),
    Bad("jagged weights: 2-D values", lambda: (
        jagged([1, 2, 3], [0, 1, 3, 3]),
        torch.nested.nested_tensor_from_jagged(torch.ones(3, 1), torch.tensor([0, 1, 3, 3]))),
        ValueError, "same offsets", weighted=True),
    Bad("sparse weights: fewer entries", lambda: (
        sparse([[0, 1, 2], [0, 0, 1]], [1, 2, 3], (3, 2), coalesced=False),
        sparse([[0, 1], [0, 0]], [1.0, 1.0], (3, 2), coalesced=False, dtype=torch.float32)),
        ValueError, "weights hold 2 entries", weighted=True),
    Bad("sparse weights: index out of range", lambda: (
        sparse([[0, 1], [0, 0]], [1, 2], (3, 2)),
        sparse([[1, -2, 0, 4], [-2, 1, 2, -1]], [1.0] * 4, (3, 2), dtype=torch.float32)),
        ValueError, "(weights): sparse index", weighted=True),
    Bad("sparse weights: other indices", lambda: (
        sparse([[0, 1], [0, 0]], [1, 2], (3, 2)),
        sparse([[0, 1], [1, 0]], [1.0, 1.0], (3, 2), dtype=torch.float32)),
        ValueError, "same indices", weighted=True),
]


def _shared_offsets(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0, 1, 3, 3])
    ids = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2, 3]), offsets)
    w = torch.nested.nested_tensor_from_jagged(torch.ones(n), offsets)
    return ids, w


CONFIGS = [(0, True), (0, False), (3, False)]   # (max_sequence_length, validate)


@pytest.mark.parametrize("seq,validate", CONFIGS, ids=["bag", "bag-novalidate", "seq-novalidate"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_malformed_inputs_are_rejected_cleanly(entry, seq, validate):
    target = Target(entry, seq, validate)
    for bad in MALFORMED:
        if bad.weighted and seq:
            continue
        ids, weights = bad.make()
        try:
            expect_rejected(target, ids, weights, bad.exc, bad.match)
        except AssertionError as e:
            raise AssertionError(f"{bad.name}: {e}") from None


def test_malformed_inputs_rejected_by_the_torch_fallbacks():
    """The same checks with the kernels off and compat's public paths (no raw reads at all,
    but the same errors: the checks do not depend on the path)."""
    with fallbacks(True):
        target = Target("lookup", 0, False)
        for bad in MALFORMED:
            ids, weights = bad.make()
            try:
                expect_rejected(target, ids, weights, bad.exc, bad.match)
            except AssertionError as e:
                raise AssertionError(f"{bad.name}: {e}") from None


# ------------------------------------------------------------------ the seeded fuzz (random)
def _random_offsets(rng: random.Random) -> tuple[list[int], list[int], bool]:
    """Offsets that are valid about a third of the time, and values (ids) for them."""
    nnz = rng.randint(0, 8)
    values = [rng.randrange(VOCAB) for _ in range(nnz)]
    if rng.random() < 0.35:
        cuts = sorted(rng.randint(0, nnz) for _ in range(rng.randint(0, 4)))
        return values, [0, *cuts, nnz], True
    offsets = [rng.randint(-3, nnz + 3) for _ in range(rng.randint(1, 6))]
    ok = offsets[0] == 0 and offsets[-1] == nnz and all(
        a <= b for a, b in zip(offsets, offsets[1:]))
    return values, offsets, ok


def _random_sparse(rng: random.Random):
    shape = tuple(rng.randint(1, 4) for _ in range(rng.choice([2, 2, 3])))
    nnz = rng.randint(0, 6)
    lo = -2 if rng.random() < 0.6 else 0
    idx = [[rng.randint(lo, s - 1 + (2 if lo else 0)) for _ in range(nnz)] for s in shape]
    if not compat.private_fast_paths():  # the public path coalesces, summing duplicates' ids
        cols = list(dict.fromkeys(zip(*idx)))
        idx = [[c[d] for c in cols] for d in range(len(shape))]
        nnz = len(cols)
    ok = all(0 <= i < s for row, s in zip(idx, shape) for i in row)
    values = [rng.randrange(VOCAB) for _ in range(nnz)]
    return idx, values, shape, ok


def _random_ids(rng: random.Random) -> tuple[torch.Tensor, bool]:
    n = rng.randint(1, 6)
    pick = [rng.choice([-2**63, -10**8, -1, VOCAB, VOCAB + 1, 10**8, 2**63 - 1])
            if rng.random() < 0.2 else rng.randrange(VOCAB) for _ in range(n)]
    ok = all(0 <= i < VOCAB for i in pick)
    dtype = torch.int32 if all(-2**31 <= i < 2**31 for i in pick) and rng.random() < 0.5 \
        else torch.int64
    return torch.tensor(pick, dtype=dtype).reshape(n, 1), ok


def fuzz(cases_per_kind: int, seed: int = 0) -> dict[str, Counter]:
    """Random offsets / sparse indices / dense ids through random entry points, configs.

    Returns per kind: ``tried``, ``rejected`` (a ValueError / TypeError naming the feature),
    ``accepted`` (valid inputs, output checked), ``state_changed`` (rejected calls that changed
    a table or slot), ``wrong`` (a malformed input accepted, a valid one rejected, a bad message or
    a wrong output). Any crash kills the process, so a finished run had none.
    """
    rng = random.Random(seed)
    targets = {(e, s, v): Target(e, s, v) for e in ENTRIES for s, v in CONFIGS}
    refs = {s: Target("lookup", s, True) for s in (0, 3)}  # reference lookups, never trained
    out = {k: Counter() for k in ("offsets", "sparse", "ids")}
    for kind in out:
        for _ in range(cases_per_kind):
            key = rng.choice(list(targets))
            entry, seq, _ = key
            if entry in TRAINING:  # fresh: a valid batch fixes the shapes of later enqueues
                targets[key] = Target(*key)
            target = targets[key]
            if kind == "offsets":
                values, offsets, ok = _random_offsets(rng)
                odt = rng.choice([torch.int64, torch.int32])
                ids = jagged(values, offsets, offsets_dtype=odt)
                ref = jagged(values, offsets) if ok else None
            elif kind == "sparse":
                idx, values, shape, ok = _random_sparse(rng)
                claim = rng.choice([None, True, False])
                ids = sparse(idx, values, shape, coalesced=claim)
                ref = sparse(idx, values, shape, coalesced=False) if ok else None
            else:
                ids, ok = _random_ids(rng)
                ref = ids.long() if ok else None
            counts = out[kind]
            counts["tried"] += 1
            features, _ = valid_batch(seq)
            features[BAD] = ids
            before = target.state()
            try:
                if entry in TRAINING:  # the activations come from the tables before the update
                    ref_tables = {t.name: v.clone()
                                  for t, v in target.emb.embedding_tables.items()}
                got = target.call(features, None)
            except (ValueError, TypeError) as e:
                counts["rejected"] += 1
                if ok or f"'{BAD}'" not in str(e):
                    counts["wrong"] += 1
                    if DEBUG:
                        print("WRONG", key, ids, e)
                if not same_state(before, target.state()):
                    counts["state_changed"] += 1
                continue
            counts["accepted"] += 1
            if not ok:
                counts["wrong"] += 1
                continue
            tables = (ref_tables if entry in TRAINING
                      else {t.name: v for t, v in target.emb.embedding_tables.items()})
            ref_t = refs[seq]
            with torch.no_grad():
                for t, v in ref_t.emb.embedding_tables.items():
                    v.copy_(tables[t.name])
            want = ref_t.emb.lookup({"user": features["user"], BAD: ref})[BAD]
            if not torch.allclose(got[BAD], want, rtol=1e-5, atol=1e-6):
                counts["wrong"] += 1
                if DEBUG:
                    print("WRONG", key, ids, got[BAD], want)
    return out


@pytest.mark.parametrize("torch_fallbacks", [False, True], ids=["kernels", "fallbacks"])
def test_fuzz_offsets_sparse_indices_and_ids(torch_fallbacks):
    n = 40 if torch_fallbacks else 120
    with fallbacks(torch_fallbacks):
        counts = fuzz(cases_per_kind=n, seed=int(torch_fallbacks))
    for kind, c in counts.items():
        assert c["tried"] == n and c["rejected"] > 0 and c["accepted"] > 0, (kind, c)
        assert c["wrong"] == 0 and c["state_changed"] == 0, (kind, c)


# ------------------------------------------------------------- the crashers, in a child process
CRASHERS = textwrap.dedent("""
    import torch, embcore as ec
    from embcore.base import compat
    from embcore.kernels import cpu
    J = torch.nested.nested_tensor_from_jagged
    t = ec.TableConfig(vocabulary_size=10, dim=4, combiner="sum", name="t")
    f = ec.FeatureConfig(table=t, validate_weights_and_indices=False, name="clicks")
    cases = {
        "id 10": torch.tensor([10]), "id -1": torch.tensor([-1, 3]),
        "id 1e8": torch.tensor([10**8]),
        "offsets [0, 2, -1, 5, 6]": J(torch.arange(6), torch.tensor([0, 2, -1, 5, 6])),
        "offsets [0, 1, 2, 3, 4]": J(torch.arange(6), torch.tensor([0, 1, 2, 3, 4])),
        "offsets [0, 2, 10**9]": J(torch.arange(6), torch.tensor([0, 2, 10**9])),
        "sparse index 10**9": torch.sparse_coo_tensor(
            torch.tensor([[0, 10**9], [0, 0]]), torch.tensor([1, 2]), (2, 2),
            check_invariants=False),
        "sparse indices -2": torch.sparse_coo_tensor(
            torch.tensor([[1, -2, 0, 4], [-2, 1, 2, -1]]), torch.tensor([7, 6, 2, 5]), (3, 1),
            check_invariants=False),
    }
    for how in ("lookup", "train", "fallbacks"):
        if how == "fallbacks":  # the torch-ops twins, compat's public paths (coalesce())
            cpu.set_enabled(False)
            compat.set_private_fast_paths(False)
        emb = ec.Embedding({"clicks": f}, ec.SGD(learning_rate=0.1))
        for name, ids in cases.items():
            try:
                if how != "train":
                    emb.lookup({"clicks": ids})
                else:
                    emb.enqueue({"clicks": ids})
                    acts = emb.dequeue()
                    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
            except ValueError as e:
                assert "'clicks'" in str(e), e
                print("ValueError", how, name, flush=True)
            else:
                raise SystemExit(f"{how} {name}: accepted")
    print("done", flush=True)
""")


@pytest.mark.slow
def test_crashers_raise_in_a_child_process():
    proc = subprocess.run([sys.executable, "-c", CRASHERS], capture_output=True, text=True,
                          timeout=60, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert lines[-1] == "done" and len([x for x in lines if x.startswith("ValueError")]) == 24, \
        proc.stdout


# ------------------------------------------------------------------ valid edge cases still work
def row_table() -> torch.Tensor:
    return torch.arange(VOCAB, dtype=torch.float32)[:, None].repeat(1, DIM)  # row i holds i


def engine(seq: int = 0, combiner: str = "sum") -> ec.Embedding:
    t = ec.TableConfig(vocabulary_size=VOCAB, dim=DIM, combiner=combiner, name="t",
                       initializer=row_table())
    return ec.Embedding({BAD: ec.FeatureConfig(table=t, max_sequence_length=seq, name=BAD)},
                        ec.Adagrad(learning_rate=0.1))


def lookup_and_train(ids: torch.Tensor, seq: int = 0) -> torch.Tensor:
    """The lookup, checked equal to the training path's activations (which then trains)."""
    out = engine(seq).lookup({BAD: ids})[BAD]
    emb = engine(seq)
    emb.enqueue({BAD: ids})
    acts = emb.dequeue()
    emb.apply_gradients({k: torch.ones_like(v) for k, v in acts.items()})
    assert torch.equal(acts[BAD].detach(), out)
    return out


def test_empty_bags_and_all_empty_batches():
    out = lookup_and_train(jagged([3, 4], [0, 0, 2, 2]))
    assert out[:, 0].tolist() == [0.0, 7.0, 0.0]
    assert torch.equal(lookup_and_train(jagged([], [0, 0, 0])), torch.zeros(2, DIM))
    assert lookup_and_train(jagged([], [0])).shape == (0, DIM)                  # no bag at all
    assert torch.equal(lookup_and_train(jagged([], [0, 0]), seq=2), torch.zeros(1, 2, DIM))


def test_nnz_zero_of_every_kind():
    assert lookup_and_train(torch.zeros(0, dtype=torch.int64)).shape == (0, DIM)
    assert lookup_and_train(torch.zeros(0, 1, dtype=torch.int32)).shape == (0, DIM)
    empty = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.int64),
                                    torch.zeros(0, dtype=torch.int64), (3, 4))
    assert torch.equal(lookup_and_train(empty), torch.zeros(3, DIM))
    assert torch.equal(lookup_and_train(empty, seq=2), torch.zeros(3, 2, DIM))


def test_int32_and_non_contiguous_offsets_equal_int64():
    want = lookup_and_train(jagged([1, 2, 3, 9], [0, 2, 3, 4]))
    assert want[:, 0].tolist() == [3.0, 3.0, 9.0]
    assert torch.equal(lookup_and_train(jagged([1, 2, 3, 9], [0, 2, 3, 4],
                                               offsets_dtype=torch.int32)), want)
    strided = torch.tensor([0, -7, 2, -7, 3, -7, 4])[::2]  # a view: stride 2
    nt = torch.nested.nested_tensor_from_jagged(torch.tensor([1, 2, 3, 9]), strided)
    assert torch.equal(lookup_and_train(nt), want)
    # and through serving (the raw-pointer combine reads the offsets directly)
    emb = engine()
    got = ec.serving_embedding_lookup({BAD: nt}, None, emb.embedding_tables,
                                      emb.feature_config)[BAD]
    assert torch.equal(got, want)


def test_sparse_uncoalesced_and_falsely_coalesced_are_sorted():
    idx, vals = [[2, 0, 0, 1], [0, 1, 0, 2]], [5, 2, 1, 7]        # unsorted
    honest = sparse(idx, vals, (3, 3)).coalesce()
    want = lookup_and_train(honest)
    assert want[:, 0].tolist() == [3.0, 7.0, 5.0]
    assert torch.equal(lookup_and_train(sparse(idx, vals, (3, 3), coalesced=False)), want)
    assert torch.equal(lookup_and_train(sparse(idx, vals, (3, 3), coalesced=True)), want)
    # a duplicate position marked coalesced: kept as two ids, as an uncoalesced input is
    dup = [[0, 0, 1], [1, 1, 0]]
    assert torch.equal(lookup_and_train(sparse(dup, [2, 3, 4], (2, 2), coalesced=True)),
                       lookup_and_train(sparse(dup, [2, 3, 4], (2, 2), coalesced=False)))
    # sequence feature: the last index is the position, also after sorting
    seq = lookup_and_train(sparse(idx, vals, (3, 3), coalesced=True), seq=3)
    assert seq[..., 0].tolist() == [[1.0, 2.0, 0.0], [0.0, 0.0, 7.0], [5.0, 0.0, 0.0]]


def test_sparse_rank3():
    idx = [[1, 0, 0], [0, 1, 1], [0, 2, 0]]   # (b0, b1, position), unsorted
    out = lookup_and_train(sparse(idx, [5, 4, 3], (2, 2, 3), coalesced=False))
    assert out.shape == (2, 2, DIM)
    assert out[..., 0].tolist() == [[0.0, 7.0], [5.0, 0.0]]
    liar = lookup_and_train(sparse(idx, [5, 4, 3], (2, 2, 3), coalesced=True))
    assert torch.equal(liar, out)


def test_weights_with_validation_off_still_skip_only_the_finiteness_check():
    t = ec.TableConfig(vocabulary_size=VOCAB, dim=DIM, combiner="sum", name="t",
                       initializer=row_table())
    emb = ec.Embedding({BAD: ec.FeatureConfig(table=t, validate_weights_and_indices=False,
                                              name=BAD)})
    ids = jagged([1, 2], [0, 2])
    w = jagged([float("inf"), 1.0], [0, 2], dtype=torch.float32)
    assert emb.lookup({BAD: ids}, {BAD: w})[BAD][0, 0].item() == float("inf")  # not checked
    checked = engine()
    with pytest.raises(ValueError, match="non-finite weight"):
        checked.lookup({BAD: ids}, {BAD: w})


# ------------------------------------------------------------------------ the checks themselves
@requires_native
def test_kernel_checks_equal_their_torch_twins():
    from embcore.inputs.canonical import check_offsets, strictly_increasing
    from embcore.ops.backend import FUSED_CPU, TORCH_OPS
    rng = random.Random(1)
    for _ in range(300):
        values, offsets, ok = _random_offsets(rng)
        verdicts = []
        for backend in (TORCH_OPS, FUSED_CPU):
            try:
                check_offsets(torch.tensor(offsets), len(values), "f", backend)
                verdicts.append("ok")
            except ValueError as e:
                verdicts.append(str(e))
        assert verdicts[0] == verdicts[1] and (verdicts[0] == "ok") == ok, (offsets, verdicts)
        idx, _, shape, in_range = _random_sparse(rng)
        if in_range:
            t = torch.tensor(idx, dtype=torch.int64).reshape(len(shape), -1)
            want = len({tuple(c) for c in t.T.tolist()}) == t.shape[1] and \
                t.T.tolist() == sorted(t.T.tolist())
            for backend in (TORCH_OPS, FUSED_CPU):
                assert strictly_increasing(t, shape, backend) == want, (idx, backend)


@requires_native
@pytest.mark.parametrize("k", [1, 2, 3])
def test_first_unordered_finds_the_first_break_across_blocks(k):
    """The kernel counts a block (1024 columns) at a time before searching it: a break on either
    side of a block boundary, a duplicate or a descent, is found at its exact column."""
    n = 5000
    flat = torch.arange(n, dtype=torch.int64) * 7 + 3          # distinct, rising
    digits = [flat // 49 ** (k - 1)] + [flat // 49 ** (k - 1 - d) % 49 for d in range(1, k)]
    base = torch.stack(digits).contiguous()                    # (k, n) lexicographically rising
    assert cpu.first_unordered(base) == -1
    for j in (1, 2, 1023, 1024, 1025, 2048, 3001, n - 1):
        for how in ("duplicate", "descent"):
            idx = base.clone()
            idx[:, j] = idx[:, j - 1]                          # a duplicate of column j - 1
            if how == "descent":
                idx[-1, j] -= 1                                # now below it
            assert cpu.first_unordered(idx) == j, (j, how)
            offsets = torch.arange(n, dtype=torch.int64)
            offsets[j] = offsets[j - 1] - 1
            assert cpu.offsets_error(offsets, n - 1) == j


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1000
    with fallbacks("--fallbacks" in sys.argv):
        for kind, c in fuzz(n, seed=int(args[1]) if len(args) > 1 else 0).items():
            print(kind, dict(c))


def test_a_strided_nested_tensor_is_refused_with_the_layout_to_use():
    """A nested tensor of the strided layout (torch.nested's default) is not a jagged batch:
    refused naming the layout, before anything changes; its jagged twin trains."""
    t = ec.TableConfig(vocabulary_size=10, dim=4, name="t")
    emb = ec.Embedding({"f": ec.FeatureConfig(table=t)}, ec.SGD(learning_rate=0.1))
    before = emb.embedding_tables["t"].clone()
    strided = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])])
    with pytest.raises(TypeError, match="layout=torch.jagged"):
        emb.enqueue({"f": strided}, training=True)
    assert torch.equal(emb.embedding_tables["t"], before)
    jagged = torch.nested.nested_tensor([torch.tensor([1, 2]), torch.tensor([3])],
                                        layout=torch.jagged)
    emb.enqueue({"f": jagged}, training=True)
    assert emb.dequeue()["f"].shape == (2, 4)
