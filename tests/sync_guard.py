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


class _NoSync(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if func in _SYNCING:
            if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size")):
                raise AssertionError(f"{func} would synchronise with a CUDA device")
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_) \
                and _bool_index(args):
            raise AssertionError(f"{func} with a boolean index would synchronise with a CUDA "
                                 f"device")
        if packet in (aten._to_copy, aten.copy_) and "device" in kwargs:
            src = args[0]
            if isinstance(src, torch.Tensor) and kwargs["device"] is not None \
                    and torch.device(kwargs["device"]).type != src.device.type:
                raise AssertionError(f"{func} copies between devices")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Fails (``AssertionError``) on any op in the block that would synchronise on CUDA."""
    with _NoSync():
        yield
