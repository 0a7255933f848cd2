"""A rank that rejects its gradients makes every rank fail at once, with nothing written.

With a sharded engine (W = 2, gloo), ``apply_gradients`` checks each process's gradients locally,
then every process agrees on the outcome with one small collective before the gradient exchange
(step/gradients.py ``agree_gradients``). So when rank 1's gradients are rejected (wrong shape,
wrong dtype, a gradient multiplier that raises), rank 1 raises its own error and rank 0 an error
of the same kind naming rank 1 and quoting it, both well within the engine's timeout (30 s here),
instead of rank 0 waiting in the exchange until the timeout. On both ranks nothing is written
(tables, slots, ``step``), the batch still awaits its gradients, a learning-rate callable has not
moved, and a retry on both ranks applies the batch exactly once (docs/semantics.md section 3).

A NaN gradient is not a rejection: with ``skip_nonfinite_gradients=True`` every process skips
that optimizer's tables for the step (the flag travels in the same collective), the call
completes and counts.
"""

from __future__ import annotations

import os
import re
import time
import warnings

import pytest
import torch
from distributed import run_on

import embcore as ec
from embcore.state.dtensors import gather_whole
from embcore.step.gradients import reject_gradients

FAST = 10.0  # seconds: "at once", against the engine's 30 s timeout
DIMS = {"a": 4, "b": 3}


class Counter:
    """A learning rate (no argument) or gradient multiplier (``step``) that counts its calls;
    ``fail`` makes it raise ZeroDivisionError."""

    def __init__(self, value: float) -> None:
        self.value, self.calls, self.fail = value, 0, False

    def __call__(self, *step: int) -> float:
        self.calls += 1
        if self.fail:
            raise ZeroDivisionError("the multiplier divided by zero")
        return self.value


def make(skip_b: bool = False, timeout: float = 30):
    """Table "a" sharded by rows (Adagrad, a counting learning rate and multiplier), table "b"
    replicated (its own Adagrad); the same initial values for every engine made here."""
    lr, mult = Counter(0.1), Counter(0.5)
    torch.manual_seed(3)
    a = ec.TableConfig(vocabulary_size=20, dim=DIMS["a"], combiner="sum", name="a")
    b = ec.TableConfig(vocabulary_size=12, dim=DIMS["b"], combiner="mean", name="b",
                       optimizer=ec.Adagrad(learning_rate=0.2,
                                            skip_nonfinite_gradients=skip_b))
    emb = ec.Embedding({"fa": ec.FeatureConfig(table=a), "fb": ec.FeatureConfig(table=b)},
                       ec.Adagrad(learning_rate=lr, gradient_multiplier=mult),
                       sharding={"a": "row_mod", "b": "replicated"}, timeout=timeout)
    return emb, lr, mult


def batch(rank: int, n: int) -> dict[str, torch.Tensor]:
    return {"fa": (torch.tensor([1, 2, 2, 7]) + 3 * rank + n) % 20,
            "fb": (torch.tensor([3, 5, 3, 0]) + rank + n) % 12}


def grads(rank: int, n: int) -> dict[str, torch.Tensor]:
    return {f"f{t}": torch.linspace(-1.0, 1.0 + n + rank, 4 * d).reshape(4, d)
            for t, d in DIMS.items()}


def state(emb) -> dict[str, torch.Tensor]:
    """Whole tables and slots (collectives), and the step."""
    out = {t.name: v.clone() for t, v in emb.embedding_tables.items()}
    for name in emb.table_names().values():
        place = emb.plan.table(name)
        for slot in place.slot_names:
            out[f"{name}/{slot}"] = gather_whole(place, emb.plan.physical[place.physical],
                                                 emb._store.local(name, slot), emb.comm).clone()
    out["step"] = torch.tensor(emb.step)
    return out


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def step(emb, rank: int, n: int) -> None:
    emb.enqueue(batch(rank, n))
    emb.dequeue()
    emb.apply_gradients(grads(rank, n))


def _engines_at_step_one(rank, **kw):
    """An engine one step in with the next batch dequeued, a reference one step in (to take the
    same steps without the rejected calls), the first's state, and its rate and multiplier."""
    emb, lr, mult = make(**kw)
    ref, _, _ = make(**kw)
    step(emb, rank, 0)
    step(ref, rank, 0)
    emb.enqueue(batch(rank, 1))
    emb.dequeue()
    return emb, ref, state(emb), lr, mult


def _rejection_worker(rank, world, init):
    init()
    emb, ref, before, lr, mult = _engines_at_step_one(rank)
    good = grads(rank, 1)
    cases = {  # name: (rank 1's gradients or None: good, rank 0's, what each rank raises)
        "shape": ({**good, "fa": torch.ones(3, DIMS["a"])}, good,
                  {1: (ValueError, "has shape [3, 4]"),
                   0: (ValueError, "rank 1 of 2 rejected its gradients")}),
        "dtype": ({**good, "fb": torch.ones(4, DIMS["b"], dtype=torch.int64)}, good,
                  {1: (TypeError, "has dtype torch.int64"),
                   0: (TypeError, "rank 1 of 2 rejected its gradients")}),
        "not_a_tensor": ({**good, "fa": [[0.0] * 4] * 4}, good,
                         {1: (TypeError, "must be a tensor or None"),
                          0: (TypeError, "rank 1 of 2 rejected its gradients")}),
        "both": ({**good, "fa": torch.ones(3, DIMS["a"])},
                 {**good, "fb": torch.ones(4, DIMS["b"], dtype=torch.int64)},
                 {1: (ValueError, "has shape"), 0: (TypeError, "has dtype")}),
        "multiplier": (good, good,
                       {1: (ZeroDivisionError, "divided by zero"),
                        0: (RuntimeError, "rank 1 of 2 rejected its gradients")}),
    }
    for name, (on_1, on_0, raises) in cases.items():
        mult.fail = name == "multiplier" and rank == 1
        error, words = raises[rank]
        start = time.monotonic()
        with pytest.raises(error, match=re.escape(words)) as info:
            emb.apply_gradients(on_1 if rank == 1 else on_0)
        elapsed = time.monotonic() - start
        assert elapsed < FAST, (name, elapsed)
        text = str(info.value)
        if rank == 0 and name != "both":  # the other rank's error, quoted
            assert raises[1][1] in text, (name, text)
            assert "nothing is written on any process" in text and "retry" in text
        if rank == 1 or name == "both":  # its own error, as with one process
            assert "rejected its gradients" not in text, (name, text)
        assert_same(state(emb), before)
        assert lr.calls == 1, (name, lr.calls)  # evaluated after the agreement only
    mult.fail = False
    # what the engine does when the gradients' structure is refused before apply_step: the
    # helper engine.py calls (a structure mismatch, the test below)
    if rank == 1:
        with pytest.raises(ValueError, match="structure"):
            reject_gradients(emb._queue.awaiting().wait().prepared, emb.plan, emb.comm,
                             emb.device, ValueError("gradients: the structure differs"))
    else:
        with pytest.raises(ValueError, match="rank 1 of 2 rejected .* structure differs"):
            emb.apply_gradients(good)
    assert_same(state(emb), before)
    # a learning-rate callable that raises on rank 1 only: a second agreement, every rank
    # raises at once, nothing written (rank 0's callable was called)
    lr.fail = rank == 1
    start = time.monotonic()
    with pytest.raises(ZeroDivisionError if rank == 1 else RuntimeError,
                       match="divided by zero" if rank == 1 else "rank 1 of 2 rejected"):
        emb.apply_gradients(good)
    assert time.monotonic() - start < FAST
    assert_same(state(emb), before)
    assert lr.calls == 2
    lr.fail = False
    # the documented recovery: the batch still awaits its gradients; a retry applies it once
    emb.apply_gradients(good)
    step(ref, rank, 1)
    assert emb.step == ref.step == 2 and lr.calls == 3
    with pytest.raises(RuntimeError, match="called twice"):
        emb.apply_gradients(good)
    step(emb, rank, 2)
    step(ref, rank, 2)
    assert_same(state(emb), state(ref))


@pytest.mark.slow
def test_rejected_gradients_on_one_rank_fail_every_rank_at_once():
    run_on(2, _rejection_worker)


def _nonfinite_worker(rank, world, init):
    init()
    emb, ref, before, _, _ = _engines_at_step_one(rank, skip_b=True)
    g = grads(rank, 1)
    if rank == 1:
        g["fb"][2, 1] = float("nan")
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        emb.apply_gradients(g)
    assert time.monotonic() - start < FAST
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    where = "features ['fb'] hold" if rank == 1 else "a gradient on another process holds"
    assert len(said) == 1 and where in said[0] and "['b'] is skipped" in said[0], said
    after = state(emb)
    assert after["step"] == 2  # the call completes and counts
    for k in ("b", "b/accumulators"):
        assert torch.equal(after[k], before[k]), k
    assert not torch.equal(after["a"], before["a"])
    ref.enqueue(batch(rank, 1))
    ref.dequeue()
    ref.apply_gradients({**grads(rank, 1), "fb": None})  # table "a" as emb's
    want = state(ref)
    for k in ("a", "a/accumulators"):
        assert torch.equal(after[k], want[k]), k
    with pytest.raises(RuntimeError, match="called twice"):
        emb.apply_gradients(g)


@pytest.mark.slow
def test_nonfinite_gradient_on_one_rank_skips_on_every_rank():
    run_on(2, _nonfinite_worker)


def _structure_worker(rank, world, init, result_dir):
    init()
    emb, _, _ = make(timeout=5)
    emb.enqueue(batch(rank, 0))
    emb.dequeue()
    done = os.path.join(result_dir, "rank0.txt")
    if rank == 1:
        try:
            emb.apply_gradients({"fa": grads(rank, 0)["fa"]})  # "fb" missing
        except ValueError:
            pass
        deadline = time.monotonic() + 20
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    try:
        emb.apply_gradients(grads(rank, 0))
        result = "applied"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = type(e).__name__
    with open(done + ".tmp", "w") as f:
        f.write(f"{time.monotonic() - start:.2f} {result}")
    os.replace(done + ".tmp", done)
    time.sleep(0.5)
    os._exit(0)


@pytest.mark.slow
def test_structure_mismatch_on_one_rank_fails_every_rank_at_once(tmp_path):
    try:
        run_on(2, _structure_worker, str(tmp_path))
    except Exception:  # noqa: BLE001 - the processes leave with os._exit on purpose
        pass
    seconds, result = (tmp_path / "rank0.txt").read_text().split()
    assert result == "ValueError" and float(seconds) < 3, (seconds, result)
