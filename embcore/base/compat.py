"""The one place embcore touches torch's private APIs: each use guarded, with a public fallback.

The rule: no torch private API (``x._values``, ``torch.ops.aten._...``) anywhere else in the
package. Each private use here is a small function that

- takes the private path only when the module switch is on and a feature guard says the private
  API exists (and applies to these arguments), and
- otherwise takes a public path that returns the same results (exceptions are documented).

Each function's docstring records what its private path was measured to gain. (One candidate
was measured and dropped: ``torch.ops.aten._embedding_bag_forward_only.out``, which wrote the
backward of a combine into a kept buffer, is about twice as slow as the public
``F.embedding_bag`` on torch 2.13, so ops/combine.py uses the public op.) Measured on torch 2.13
CPU, AMD EPYC, 2 cores shared with other jobs: ``timeit``, the best of 7 or more repeats, the CPU
time of one thread unless said. Tests run every function with the switch on and off
(``set_private_fast_paths``) and compare.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_private = True


def set_private_fast_paths(enabled: bool) -> bool:
    """Switches the private fast paths on or off for this process; returns the previous setting.

    Off, every function here takes its public fallback (tests use it to exercise both paths).
    """
    global _private
    previous, _private = _private, bool(enabled)
    return previous


def private_fast_paths() -> bool:
    """Whether the private fast paths are switched on."""
    return _private


# ----------------------------------------------------------------------------- jagged tensors
def jagged_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(values, offsets, lengths or None)`` of a ``torch.nested`` jagged tensor.

    Private path: the NestedTensor's stored fields ``x._values``, ``x._offsets``, ``x._lengths``
    (guard: both ``_values`` and ``_offsets`` exist and are tensors, and ``x`` is not a float
    tensor requiring grad under grad mode, where ``values()``'s autograd view of ``x`` would
    matter; ``_values`` is not that view). Public fallback: ``x.values()``,
    ``x.offsets()``, ``x.lengths()``. Same tensors either way (``values()`` is a view of
    ``_values``: same storage, shape and strides; ``offsets()`` and ``lengths()`` return the
    fields themselves).

    Measured per call, all three parts: 3 bags of up to 5 ids and W2-sized (2048 bags of 20
    ids) alike: private 0.37 us (int ids), 0.64 us (float weights, grad mode on: the autograd
    guard), public 23-25 us. The public cost is ``values()`` alone (``torch._nested_get_values``
    through the NestedTensor subclass's Python dispatch; ``offsets()`` and ``lengths()`` are
    plain attribute reads) and does not depend on the size. Not the ~80 us once claimed, but
    paid for the ids and again for the weights of every jagged feature of every batch.

    The caller need not check ``x._ragged_idx``: for a jagged tensor of rank 2 the ragged dim is
    always 1. NestedTensor's size is ``(B, *values.shape[:r], j, *values.shape[r + 1:])`` with
    ``r = ragged_idx - 1``, of rank ``values.dim() + 1``, so rank 2 means 1-D values and ``r = 0``;
    the batch dim 0 cannot be ragged (``jagged_dim`` must be >= 1; transpose / permute of dim 0
    raise). ``x.dim() == 2`` is the whole check (verified in tests/test_compat.py).
    """
    if _private:
        values, offsets = getattr(x, "_values", None), getattr(x, "_offsets", None)
        if (isinstance(values, torch.Tensor) and isinstance(offsets, torch.Tensor)
                and not _autograd_matters(x, values)):
            return values, offsets, getattr(x, "_lengths", None)
    return x.values(), x.offsets(), x.lengths()


# Reads a tensor subclass's attributes without its __torch_function__ (None where missing).
_NO_SUBCLASS_TORCH_FUNCTION = getattr(torch._C, "DisableTorchFunctionSubclass", None)


def _autograd_matters(x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``x.values()``'s autograd view of ``x`` could matter: a float NestedTensor that
    requires grad, with grad mode on. Cheapest first: the dtype and grad mode cost ~0.1 us (and
    ids are integers); ``x.requires_grad`` goes through NestedTensor's ``__torch_function__``
    (~10 us) unless read under ``DisableTorchFunctionSubclass`` (~0.3 us, the same value)."""
    dtype = values.dtype
    if not ((dtype.is_floating_point or dtype.is_complex) and torch.is_grad_enabled()):
        return False
    if _NO_SUBCLASS_TORCH_FUNCTION is None:
        return x.requires_grad
    with _NO_SUBCLASS_TORCH_FUNCTION():
        return x.requires_grad


# ------------------------------------------------------------------------------ sparse COO
# Feature guard: the private accessors exist on this torch.
_HAS_SPARSE_PRIVATE = hasattr(torch.Tensor, "_indices") and hasattr(torch.Tensor, "_values")


def sparse_parts(x: torch.Tensor,
                 check: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices (k, nnz), values (nnz,))`` of a sparse COO tensor, in stored order.

    Works on coalesced and uncoalesced tensors alike. Private path: ``x._indices()`` and
    ``x._values()``, which torch's sparse docs name as the way to read an uncoalesced tensor's
    stored entries (the public ``indices()`` / ``values()`` refuse uncoalesced tensors).

    Public fallback (switch off, or the private accessors missing): ``indices()`` / ``values()``
    of ``x`` when it is coalesced (the same tensors as the private path), else of
    ``x.coalesce()``. On that last path the entries come sorted by position and **duplicate
    positions are summed** (two ids stored at one position become their sum), where the private
    path keeps every stored entry in its order; an uncoalesced input without duplicate positions
    gives the same entries, sorted.

    ``check``, when given, is called with the stored ``(indices, values)`` before anything
    indexes with them, and raises on bad ones. That matters on the public path: ``coalesce()``
    indexes with the stored indices unchecked, and an index outside the shape corrupts the heap
    (torch 2.13: "munmap_chunk(): invalid pointer"). No public API reads an uncoalesced tensor's
    stored indices, so there the check reads them with ``_indices()`` (the one private use the
    switch does not turn off); where it is missing, an uncoalesced tensor is refused
    (``RuntimeError``) rather than coalesced unchecked.

    Measured per call, coalesced 2048 x 20 (40960 entries): private 0.74 us, public 1.41 us; the
    same entries uncoalesced (shuffled): private 0.73 us, public (the coalesce) 3.2 ms.
    """
    if _private and _HAS_SPARSE_PRIVATE:
        indices, values = x._indices(), x._values()
    elif x.is_coalesced():
        indices, values = x.indices(), x.values()
    else:
        if check is not None:
            if not _HAS_SPARSE_PRIVATE:
                raise RuntimeError("this torch cannot read an uncoalesced sparse tensor's indices "
                                   "to check them before coalescing; pass coalesced tensors")
            check(x._indices(), x._values())
            check = None
        x = x.coalesce()
        indices, values = x.indices(), x.values()
    if check is not None:
        check(indices, values)
    return indices, values
