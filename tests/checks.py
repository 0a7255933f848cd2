"""Assertions several test files share."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from embcore.config.optimizers import Optimizer
from embcore.ops.reference_optim import reference_update


def check_rows_updated(opt: Optimizer, lr: float, step: int, table: torch.Tensor,
                       slots: dict[str, torch.Tensor], rows: torch.Tensor,
                       row_grads: torch.Tensor, new_table: torch.Tensor,
                       new_slots: dict[str, torch.Tensor], tol: dict[str, float]) -> None:
    """``new_table`` and ``new_slots`` (on the CPU) equal ``reference_update`` of ``table`` and
    ``slots`` on ``rows`` (with their summed gradients ``row_grads``) up to ``tol``
    (``assert_close``'s rtol and atol); every other row is bit-identical."""
    want_w, want_s = reference_update(opt, table[rows], row_grads,
                                      {k: v[rows] for k, v in slots.items()}, lr=lr, step=step)
    torch.testing.assert_close(new_table[rows].double(), torch.tensor(
        want_w, dtype=torch.float64).reshape(-1, table.shape[1]), **tol)
    for k in slots:
        torch.testing.assert_close(new_slots[k][rows].double(), torch.tensor(
            want_s[k], dtype=torch.float64).reshape(slots[k][rows].shape), **tol)
    untouched = torch.ones(table.shape[0], dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(new_table[untouched], table[untouched])
    for k in slots:
        assert torch.equal(new_slots[k][untouched], slots[k][untouched])


def check_fresh_run(proc: subprocess.CompletedProcess, partial_skips: bool = False) -> None:
    """Checks the pytest run (given ``-rs``: its skips' reasons listed) that a wrapper test made in
    a fresh interpreter: it exited 0 with cases passed and none failed. When every case skipped,
    the wrapper is skipped too, with the run's reasons: visible, never a pass. A case skipped
    beside passing ones fails the wrapper unless ``partial_skips``."""
    out = proc.stdout + proc.stderr
    tail = out[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r" in [\d.]+s", ln)]
    assert lines, f"no pytest summary (exit {proc.returncode}):\n{tail}"
    counts = {kind: int(n) for n, kind in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", lines[-1])}
    assert proc.returncode == 0 and not counts.get("failed") and not counts.get("error") \
        and not counts.get("errors"), tail
    reasons = "; ".join(ln for ln in proc.stdout.splitlines() if ln.startswith("SKIPPED"))
    if not counts.get("passed"):
        assert counts.get("skipped"), f"no case ran:\n{tail}"
        pytest.skip(f"every case skipped in the fresh interpreter: {reasons}")
    assert partial_skips or not counts.get("skipped"), f"cases skipped: {reasons}\n{tail}"


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (a fused multiply-add), in float64 numpy: the product
    of two float32 is exact in float64, the sum's rounding error is recovered exactly (TwoSum)
    and the float64 sum rounded to odd, which then rounds to float32 as the exact value does."""
    p = a.astype(np.float64) * b.astype(np.float64)  # exact
    q = c.astype(np.float64)
    s = p + q
    bb = s - p
    err = (p - (s - bb)) + (q - bb)  # s + err == p + q exactly
    even = (s.view(np.int64) & 1) == 0
    s = np.where((err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def fma_bag_sums(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                 scales: torch.Tensor | None) -> torch.Tensor:
    """(R, D) float32: bag r is ``acc = fma(scales[k], table[ids[k]], acc)`` over its ids in
    order from zeros (a scale of 1 when ``scales`` is None), by a plain loop: the rounding of
    torch's ``embedding_bag(mode="sum")`` on the CPU (FBGEMM's fused multiply-adds)."""
    rows = table.float().numpy()
    idx = ids.tolist()
    bounds = offsets.tolist()
    w = scales.float().numpy() if scales is not None else np.ones(len(idx), np.float32)
    out = np.zeros((len(bounds) - 1, rows.shape[1]), np.float32)
    for r in range(len(bounds) - 1):
        for k in range(bounds[r], bounds[r + 1]):
            out[r] = fma32(np.full(rows.shape[1], w[k], np.float32), rows[idx[k]], out[r])
    return torch.from_numpy(out)


@contextlib.contextmanager
def unblocking(fifos: list[Path], after: float = 3.0):
    """Yields a list that stays empty unless a reader blocked on one of ``fifos``: then, after
    ``after`` seconds, the FIFOs are opened as writers and closed again (the reader reads an
    end of file), so a reader that hangs (before the fix) ends, and the list says so."""
    done, had_to = threading.Event(), []

    def guard() -> None:
        if done.wait(after):
            return
        while not done.is_set():
            for p in fifos:
                had_to.append(p)
                with contextlib.suppress(OSError):
                    os.close(os.open(p, os.O_RDWR | os.O_NONBLOCK))
            done.wait(0.1)

    t = threading.Thread(target=guard, daemon=True)
    t.start()
    try:
        yield had_to
    finally:
        done.set()
        t.join()
