"""Assertions several test files share."""

from __future__ import annotations

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
