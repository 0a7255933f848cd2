"""A dispatch mode that fails on every op that would make the host wait for a CUDA device.

On CPU tensors nothing waits, so a test cannot see a synchronisation by timing it; it can see the
ops that would cause one on CUDA: a value read back (``item``, ``bool(t)``, ``int(t)``:
``_local_scalar_dense``), an output whose size depends on the data (``nonzero``, boolean masks as
indices, ``masked_select``, ``unique``, ``repeat_interleave`` without an output size,
``bincount``), a copy between devices, and comparisons that answer a Python bool (``equal``).
``no_sync()`` raises ``AssertionError`` naming the op, where it is called.

What it cannot see: ``Tensor.tolist()`` and ``.cpu()`` of a CPU tensor (no op is dispatched);
code under test reads results through tensors only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SYNCING = {
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
    aten.nonzero.default, aten.nonzero_static.default if hasattr(aten, "nonzero_static") else None,
    aten.masked_select.default, aten.equal.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.bincount.default, aten.repeat_interleave.Tensor,
}
_SYNCING.discard(None)


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def syncing(func, args=(), kwargs=None) -> str | None:
    """Why ``func`` called with ``args`` / ``kwargs`` would make the host wait for a CUDA device
    (a message naming it), or None."""
    kwargs = kwargs or {}
    packet = func.overloadpacket
    if func in _SYNCING:
        if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
            return f"{func} would synchronise with a CUDA device"
    if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) \
            and _bool_index(args):
        return f"{func} with a boolean index would synchronise with a CUDA device"
    if packet in (aten._to_copy, aten.copy_) and "device" in kwargs:
        src = args[0]
        if isinstance(src, torch.Tensor) and kwargs["device"] is not None \
                and torch.device(kwargs["device"]).type != src.device.type:
            return f"{func} copies between devices"
    return None


class _NoSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = syncing(func, args, kwargs)
        if why is not None:
            raise AssertionError(why)
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Fails (``AssertionError``) on any op in the block that would synchronise on CUDA."""
    with _NoSync():
        yield


class Counts(TorchDispatchMode):
    """Counts the ops dispatched in its block (``ops``: each a launch on a device, for torch's
    own ops) and those that would synchronise on CUDA (``syncs``, with ``why``), without
    failing: the budget of a step (tests/step_budget_cases.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.why: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        why = syncing(func, args, kwargs)
        if why is not None:
            self._sync(why)
        return func(*args, **kwargs)

    def _sync(self, why: str) -> None:
        self.syncs += 1
        self.why.append(why)

    def __enter__(self):
        # ``tolist()`` / ``cpu()`` of a CPU tensor dispatch no op, but each reads a device tensor
        # back on CUDA: counted here by wrapping them for the block
        self._saved = torch.Tensor.tolist, torch.Tensor.cpu
        tolist, cpu = self._saved

        def counted_tolist(t, *a, **k):
            self._sync("Tensor.tolist reads values back")
            return tolist(t, *a, **k)

        def counted_cpu(t, *a, **k):
            self._sync("Tensor.cpu copies to the host")
            return cpu(t, *a, **k)

        torch.Tensor.tolist, torch.Tensor.cpu = counted_tolist, counted_cpu
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.cpu = self._saved
        return super().__exit__(*exc)
