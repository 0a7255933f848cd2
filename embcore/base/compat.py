"""The one place embcore touches torch's private APIs: each use guarded, with a public fallback,
or, where torch has no public equivalent, named here for the module that needs it.

The rule: no torch private API (``x._values``, ``torch.ops.aten._...``, DCP's ``_StorageInfo``)
anywhere else in the package. ``PRIVATE_NAMES`` (at the end) lists every one embcore relies on,
what it is used for and where; ``TESTED_TORCH`` the torch releases they were checked on, which
tests/test_compat.py pins (it fails on any other release, and when a declared name is gone).
Each private fast path here is a small function that

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

The names without a public equivalent are constants here, imported by their one user:
checkpoint.py's restricted unpickler must resolve the private classes and functions that a
``torch.distributed.checkpoint`` (DCP) index pickles (``DCP_INDEX_PRIVATE_GLOBALS``,
``PICKLED_PATH_MODULES``), and finds that index under DCP's file names (``DCP_INDEX``,
``dcp_index_name``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable
from typing import Any

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
    nested: Any = x  # (a NestedTensor: torch.Tensor's type has no offsets() or lengths())
    return nested.values(), nested.offsets(), nested.lengths()


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


# ------------------------------------------------------------------ torch's is_fx_tracing notice
FX_TRACING_LOGGER = "torch.fx._symbolic_trace"
_FX_TRACING_NOTICE = "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"


class _FxTracingNotice(logging.Filter):
    """Drops torch's notice that ``is_fx_tracing()`` also means ``torch.export`` (logged once a
    process, by ``torch.fx._symbolic_trace.is_fx_tracing_warning``). Torch's own
    ``torch.nested.nested_tensor_from_jagged`` asks ``is_fx_tracing()``, so the notice, meant
    for the callers of that function, greets everyone who builds jagged ids (the guide's first
    example, a TorchRec batch through inputs/kjt.py). Only that message: anything else the
    logger says passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_FX_TRACING_NOTICE)


def quiet_fx_tracing_notice() -> None:
    """Adds the filter above to torch's ``torch.fx._symbolic_trace`` logger (once; on import
    of embcore)."""
    logger = logging.getLogger(FX_TRACING_LOGGER)
    if not any(isinstance(f, _FxTracingNotice) for f in logger.filters):
        logger.addFilter(_FxTracingNotice())


quiet_fx_tracing_notice()


# ------------------------------------------------------------------------------ sparse COO
# Feature guard: the private accessors exist on this torch.
# ------------------------------------------------------------ the GPU kernels as torch operators
# (kernels/gpu/launch.py, kernels/gpu/ops.py)
_DISPATCH_STACK = getattr(torch._C, "_len_torch_dispatch_stack", None)
_FUNCTION_STACK = getattr(torch._C, "_len_torch_function_stack", None)


def modes_active() -> bool:
    """Whether a torch dispatch or function mode is active (a tracer's: ``FakeTensorMode``,
    ``make_fx``, functionalization, ``with torch.device(...)``): the private counters of torch's
    two mode stacks; True where torch lacks them. kernels/gpu/launch.py launches a kernel past
    its operator only when none is (a call through the operator: tens of microseconds more)."""
    if _DISPATCH_STACK is None or _FUNCTION_STACK is None:
        return True
    return bool(_DISPATCH_STACK()) or bool(_FUNCTION_STACK())


def functionalization_mode() -> type | None:
    """torch's functionalization mode class (``torch._subclasses.functional_tensor``), for a
    ``triton_op``'s rule under it (kernels/gpu/ops.py: an interpreted kernel's operator kept
    whole); None where it is missing."""
    try:
        module = importlib.import_module("torch._subclasses.functional_tensor")
    except ImportError:
        return None
    mode: type | None = getattr(module, "FunctionalTensorMode", None)
    return mode


def without_triton_wrapping(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` run with ``wrap_triton`` switched off (torch's ``torch._library.triton``): its
    Triton kernels launch as they are, not through the traceable wrapper (kernels/gpu/ops.py,
    an operator's kernel called directly). The thread-local switch is set directly where torch
    has it (the context manager costs 5 us a call); else the context manager."""
    module = importlib.import_module("torch._library.triton")
    switch = getattr(module, "wrap_triton_enabled", None)
    if switch is None:
        def run(*args: Any) -> Any:
            with module.set_wrap_triton_enabled(False):
                return body(*args)
    else:
        def run(*args: Any) -> Any:
            previous = getattr(switch, "value", True)
            switch.value = False
            try:
                return body(*args)
            finally:
                switch.value = previous
    run.__name__ = body.__name__
    return run


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


# ------------------------------------------------------------------- DTensor's Shard(0) chunks
def shard_chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``(first row, rows)`` of ``rank``'s chunk of a ``rows``-row tensor placed ``Shard(0)`` over
    ``world`` ranks, as DTensor cuts it: ``torch.chunk``'s rule, ``ceil(rows / world)`` rows per
    rank, the last chunks smaller or empty (an empty chunk starts at ``rows``). state/dtensors.py
    lays its checkpoint shards out this way.

    Private path: ``torch.distributed.tensor.Shard.local_shard_size_and_offset`` (a static method
    outside DTensor's documented API; guard: it exists), DTensor's own rule, so the chunks stay
    the ones ``DTensor.from_local`` and DCP expect. Public fallback: that rule, restated. Not a
    speed path (either costs microseconds, once per table and rank of a ``state_dict``); the two
    are compared in tests/test_compat.py, which fails if DTensor's rule ever changes.
    """
    if _private:
        from torch.distributed.tensor import Shard  # imported by dtensors.py already

        sizer = getattr(Shard, "local_shard_size_and_offset", None)
        if sizer is not None:
            size, start = sizer(rows, world, rank)
            return int(start), int(size)
    full = -(-rows // world)  # ceil
    start = min(full * rank, rows)
    return start, min(full, rows - start)


# ------------------------------------------------------------ DCP's index: names and classes
DCP_INDEX = ".metadata"
"""The file DCP writes its index to (``torch.distributed.checkpoint.filesystem._metadata_fn``)."""


def dcp_index_name(rank: int | None = None) -> str:
    """The file name of DCP's index: ``.metadata``, or a rank's own ``__{rank}.metadata`` (what
    ``FileSystemReader.read_metadata(rank=...)`` reads: ``FileSystemReader._get_metadata_path``)."""
    return DCP_INDEX if rank is None else f"__{rank}{DCP_INDEX}"


# (module, name) of the private globals a DCP index pickles, which checkpoint.py's restricted
# unpickler must resolve (beside DCP's public metadata dataclasses, which it lists itself).
DCP_INDEX_PRIVATE_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
})

# The modules pathlib's classes pickle under: ``pathlib``, and from Python 3.13 on its private
# ``pathlib._local`` (a DCP index holds the checkpoint's path, ``StorageMeta.checkpoint_id``).
PICKLED_PATH_MODULES: tuple[str, ...] = ("pathlib", "pathlib._local")

# The warning DCP's save and load give when no process group is used (W = 1), which
# checkpoint.py silences: the start of its text (torch.distributed.checkpoint.state_dict_saver
# and state_dict_loader).
DCP_NO_PROCESS_GROUP_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


# --------------------------------------------------------------------------- the private names
TESTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 14))
"""The torch releases ``(major, minor)``, first and last inclusive, on which every name of
``PRIVATE_NAMES`` was checked to exist and to mean what embcore takes it to mean, and the whole
test suite run: torch 2.13 (2.13.0) and 2.14 (2.14.1; each name read again in its source: the
fields and signatures are unchanged from 2.13; the suite with Triton 3.8.0, TorchRec 1.9.2 and
FBGEMM's CPU build 1.9.0: 1,867 passed, 28 skipped, 2026-12-07). pyproject.toml's torch
requirement is this range (``>=2.13,<2.15``; tests/test_compat.py checks that the two agree).
tests/test_compat.py fails on a torch outside it: re-check each name below on it
(tests/test_compat.py, test_checkpoint.py, test_shards.py, test_input_safety.py), run the suite,
then widen the range and pyproject's."""

def size_oblivious_export() -> contextlib.AbstractContextManager[Any]:
    """Around ``torch.export``: size-oblivious reasoning on the inputs' dynamic sizes, so that a
    size traced as 2 or more also serves 0 and 1 (torch's ops guard on ``size != 1``, which would
    fix a jagged batch's bag count at >= 2). torch's own switch for export,
    ``torch.fx.experimental._config.backed_size_oblivious`` (experimental; guard: it exists);
    without it, a no-op (such a program then refuses batches of one jagged bag). Process-wide
    while it is held. Used by serving/serve.py ``ServingModule.export``."""
    try:
        config = importlib.import_module("torch.fx.experimental._config")
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(config, "backed_size_oblivious") or not hasattr(config, "patch"):
        return contextlib.nullcontext()
    return config.patch(backed_size_oblivious=True)


def compile_aoti_package(program: Any, path: str, inductor_configs: dict[str, Any] | None) -> str:
    """``torch._inductor.aoti_compile_and_package``: AOTInductor's compiler, documented by
    torch (its export tutorials) under a private module. Used by serving/serve.py
    ``ServingModule.compile_package``. Without it (torch < 2.6) a clear error, no fallback."""
    compile_and_package = _inductor("aoti_compile_and_package")
    return str(compile_and_package(program, package_path=path, inductor_configs=inductor_configs))


def load_aoti_package(path: str) -> Any:
    """``torch._inductor.aoti_load_package``: AOTInductor's loader (a callable over the inputs
    the package was traced with), documented by torch under a private module. Used by
    serving/package.py ``load_package``."""
    return _inductor("aoti_load_package")(path)


def _inductor(name: str) -> Any:
    """``torch._inductor.<name>``, or a RuntimeError saying this torch lacks it (torch >= 2.6
    has AOTInductor's compiler and loader)."""
    try:
        inductor = importlib.import_module("torch._inductor")
    except ImportError as e:
        raise RuntimeError(f"AOTInductor is not available in this torch ({e})") from None
    function = getattr(inductor, name, None)
    if function is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch._inductor.{name} "
                           f"(torch >= 2.6 has it)")
    return function


PRIVATE_NAMES: dict[str, str] = {
    # "module:attribute.path" (an attribute, a dataclass field or an annotated field of a class)
    #   -> where embcore uses it, and what for
    "torch.fx.experimental._config:backed_size_oblivious": "compat.size_oblivious_export: "
        "torch.export of a serving module whose jagged inputs may hold 0 or 1 bags",
    "torch._inductor:aoti_compile_and_package": "compat.aoti_compile_and_package: "
        "ServingModule.compile_package's AOTInductor package (serving without Python embcore)",
    "torch._inductor:aoti_load_package": "compat.load_aoti_package: ec.load_package's loader of "
        "an AOTInductor package (after its checksums are verified)",
    "torch.fx._symbolic_trace:is_fx_tracing_warning": "compat.quiet_fx_tracing_notice: the "
        "notice it logs (to its module's logger) for every torch.nested jagged tensor made",
    "torch:Tensor._indices": "compat.sparse_parts: a sparse COO tensor's stored indices "
                             "(uncoalesced too; the checked coalesce reads them as well)",
    "torch:Tensor._values": "compat.sparse_parts: a sparse COO tensor's stored values",
    "torch.nested._internal.nested_tensor:NestedTensor._values":
        "compat.jagged_parts: a jagged tensor's values without values()'s Python dispatch",
    "torch.nested._internal.nested_tensor:NestedTensor._offsets":
        "compat.jagged_parts: a jagged tensor's offsets",
    "torch.nested._internal.nested_tensor:NestedTensor._lengths":
        "compat.jagged_parts: a jagged tensor's lengths (or None)",
    "torch:_C.DisableTorchFunctionSubclass":
        "compat._autograd_matters: reads a NestedTensor's requires_grad without its "
        "__torch_function__",
    "torch.distributed.tensor:Shard.local_shard_size_and_offset":
        "compat.shard_chunk (state/dtensors.py): the rows of each rank's Shard(0) chunk",
    "torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING":
        "checkpoint.py: the unpickler resolves it (TensorProperties pickles its memory format "
        "as one)",
    "torch.distributed.checkpoint.filesystem:_StorageInfo":
        "checkpoint.py: the unpickler resolves it (an index entry's file, offset and length)",
    "torch.distributed.checkpoint.filesystem:_StorageInfo.relative_path":
        "checkpoint.py: refuses an index entry whose data file lies outside the checkpoint",
    "torch.distributed.checkpoint.filesystem:_StorageInfo.transform_descriptors":
        "checkpoint.py: refuses an index entry that asks for stream transforms",
    "torch.serialization:_get_layout":
        "checkpoint.py: the unpickler resolves it (torch.layout's pickle reducer)",
    "torch.distributed.checkpoint.filesystem:_metadata_fn":
        "checkpoint.py: the index file's name, DCP_INDEX",
    "torch.distributed.checkpoint.filesystem:FileSystemReader._get_metadata_path":
        "checkpoint.py: a rank's index file name, dcp_index_name(rank), which its reader "
        "re-implements",
    "torch:_C._len_torch_dispatch_stack": "compat.modes_active (kernels/gpu/launch.py): a "
        "Triton kernel launched past its operator only when no tracer's mode is active",
    "torch:_C._len_torch_function_stack": "compat.modes_active: the same, function modes",
    "torch._subclasses.functional_tensor:FunctionalTensorMode": "compat.functionalization_mode "
        "(kernels/gpu/ops.py): an interpreted kernel's operator kept whole when functionalized",
    "torch._library.triton:wrap_triton_enabled": "compat.without_triton_wrapping "
        "(kernels/gpu/ops.py): an operator's kernels launched as they are, called directly",
    "torch._library.triton:set_wrap_triton_enabled": "compat.without_triton_wrapping: the "
        "same, where the switch itself is missing",
    "torch.distributed.checkpoint.metadata:StorageMeta.load_id":
        "checkpoint.py: its reader stamps the index with the reader's load_id, as "
        "FileSystemReader.read_metadata does",
}
