"""The GPU kernels (``kernels/gpu/rows.py``, Triton): when they apply, and their wrappers.

``usable(...)`` is this package's ``cpu.usable``: True when every tensor is on a CUDA device
and Triton imports (checked once, on the first CUDA tensor; triton is an optional dependency and
is never imported for CPU tensors). The choice points are ``ops/combine.py`` (the lookup, and the
summed row gradients of ``combine_backward``) and ``ops/update.py`` (the fused backward +
optimizer update); on the CPU nothing here runs.

What the kernels cover (everything else falls back to the torch-ops paths, on any device):

- ``lookup``: float32, float16 and bfloat16 tables (16-bit rows widened: float32 activations),
  unit bags or bags with offsets and optional scales;
- ``sparse_update``: float32, float16 and bfloat16 tables (16-bit rows rounded back as
  numerics/rounding.py says, bit for bit) and float32 slots, SGD, Adagrad, RowwiseAdagrad,
  AdagradMomentum, Adam (lazy; ``lazy_adam=False`` moves every row and takes the torch path) and
  FTRL, each with every option of the update step (docs/semantics.md section 3: gradient
  multiplier, gradient clipping, decoupled weight decay, weight clipping), from summed row
  gradients or from the output gradients' occurrences;
- deduplication stays torch ops on the GPU (``bags.dedup``: ``torch.sort`` + ``unique_consecutive``,
  stable, so the occurrence order is the CPU's).

Tests run the kernels on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set when
the kernels are first loaded): ``force_on_cpu(True)`` makes ``usable`` accept CPU tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ...config.optimizers import Optimizer, record_of
from ...numerics.rounding import ROW_TYPES, Rounding
from .. import rules
from ..hyper import Hyper

_kernels: Any = None   # the module kernels/gpu/rows.py once imported; False: triton missing
_more: dict[str, Any] = {}  # the other kernel modules (kernels/gpu/index.py, ...) imported
_error: str | None = None
_forced = False


def _load() -> Any:
    """kernels/gpu/rows.py, imported on first use; None when triton is not importable."""
    global _kernels, _error
    if _kernels is None:
        try:
            from . import lang, rows
        except Exception as e:  # a triton that does not load here
            _kernels, _error = False, f"{type(e).__name__}: {e}"
        else:
            if lang.MISSING is None:
                _kernels = rows
            else:  # triton is not installed
                _kernels, _error = False, lang.MISSING
    return _kernels or None


def _load_more(name: str) -> Any:
    """Another module of Triton kernels (``index``, ``move``), imported on first use
    once ``_load`` succeeded (None without triton)."""
    if name not in _more:
        if _load() is None:
            return None
        _more[name] = importlib.import_module(f"{__package__}.{name}")
    return _more[name]


def _load_hash() -> Any:
    return _load_more("index")


def _load_move() -> Any:
    return _load_more("move")


def available() -> bool:
    """Whether Triton imports (imports it now if not yet tried)."""
    return _load() is not None


def error() -> str | None:
    """Why the kernels could not be imported, or None."""
    _load()
    return _error


def interpreted() -> bool:
    """Whether the kernels were loaded for Triton's interpreter (``TRITON_INTERPRET=1`` was set
    when they were first loaded: triton reads it when it decorates a kernel)."""
    k = _load()
    if k is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(k.lookup_kernel, InterpretedFunction)


def force_on_cpu(enabled: bool) -> bool:
    """Tests only: ``usable`` accepts CPU tensors (the kernels run in Triton's interpreter).
    Returns the previous setting. Refused unless the kernels are interpreted (``interpreted``)."""
    global _forced
    if enabled and not interpreted():
        raise RuntimeError("force_on_cpu(True) needs the kernels loaded under TRITON_INTERPRET=1 "
                           "(set before their first use): compiled Triton kernels cannot read "
                           "CPU tensors")
    previous, _forced = _forced, bool(enabled)
    return previous


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: every tensor on CUDA (or forced, see ``force_on_cpu``), not
    traced, and Triton importable."""
    if not _forced:
        for t in tensors:  # a loop, not all(genexpr): this runs several times per step
            if not t.is_cuda:
                return False
    if torch.compiler.is_compiling():
        return False
    return _load() is not None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid_rows(d: int, block_d: int) -> int:
    """Rows per program: about 2048 elements per tile (at most 64 rows)."""
    return max(1, min(64, 2048 // block_d))


# -- lookup ----------------------------------------------------------------------------------

def lookup_supported(table: torch.Tensor) -> bool:
    return table.dtype in ROW_TYPES and table.dim() == 2 and table.is_contiguous()


def lookup(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
           scales: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """``out[r] = sum_k scales[k] * table[ids[k]]`` over bag r (``offsets`` None: row ids[r]).

    Args:
        table: (N, D) contiguous float32, float16 or bfloat16.
        ids: (nnz,) int64 rows of ``table``.
        offsets: (R + 1,) int64 bag boundaries, or None for one id per row with scale 1.
        scales: (nnz,) float32, or None for 1.
        num_rows: R.

    Returns:
        (R, D) float32.
    """
    k = _load()
    d = table.shape[1]
    out = torch.empty(num_rows, d, dtype=torch.float32, device=table.device)  # (R, D)
    if num_rows == 0 or d == 0:
        return out
    block_d = min(_next_pow2(d), 256)
    block_r = _grid_rows(d, block_d)
    grid = (_cdiv(num_rows, block_r), _cdiv(d, block_d))
    k.lookup_kernel[grid](
        table, ids.contiguous(), ids if offsets is None else offsets.contiguous(),
        table if scales is None else scales.to(torch.float32).contiguous(), out, num_rows, d,
        UNIT=offsets is None, SCALED=scales is not None and offsets is not None,
        BLOCK_R=block_r, BLOCK_D=block_d)
    return out


# -- the fused backward + update ------------------------------------------------------------------

def update_rule(opt: Optimizer) -> tuple[int, tuple[float, ...], bool, bool] | None:
    """(rule, its hyper-parameters h1..h5, flag 1, flag 2) for the kernel, or None: the optimizer's
    record's ``rule`` and ``triton_args`` (the kernel updates the touched rows only)."""
    record = record_of(opt)
    if record is None or opt.updates_every_row:
        return None
    rule = rules.of(record.rule, rules.TRITON)
    if rule is None:
        return None
    h, f1, f2 = record.triton_args(opt)
    return int(rule), tuple(h), f1, f2


def update_supported(opt: Optimizer, table: torch.Tensor, slots: dict[str, torch.Tensor]) -> bool:
    """Whether ``sparse_update`` handles this optimizer, table and slots."""
    if table.dtype not in ROW_TYPES or table.dim() != 2 or not table.is_contiguous():
        return False
    for s in slots.values():
        if s.dtype != torch.float32 or not s.is_contiguous():
            return False
    return update_rule(opt) is not None


def sparse_update(opt: Optimizer, table: torch.Tensor, slots: dict[str, torch.Tensor],
                  rows: torch.Tensor, hyper: Hyper, grad: torch.Tensor,
                  unique_offsets: torch.Tensor | None = None, order: torch.Tensor | None = None,
                  bags: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                  round_to: Rounding | None = None) -> None:
    """Updates ``table[rows]`` and its slots in place, each row once (``cpu.sparse_update``'s
    contract, for every optimizer ``update_supported`` accepts).

    Args:
        opt: the rule and its own hyper-parameters.
        table: (N, D) contiguous float32, float16 or bfloat16; slots: ``{name: (N, D) or
            (N, 1)}`` contiguous float32.
        rows: (U,) distinct int64 rows.
        hyper: learning rate and the update step's options (``update._hyper``).
        grad: with ``unique_offsets``, the (R, D) output gradients; without, (U, D) row u the
            summed gradient of ``rows[u]``.
        unique_offsets, order: a ``Dedup``'s (occurrences of each row, sorted).
        bags: (nnz,) the output row of each occurrence; None when occurrence k is row k.
        scales: (nnz,) float32 scale of each occurrence; None for 1.
        round_to: a 16-bit table's rounding (None: to nearest); the rows' keys, their bits and
            the rounding are computed in the kernel (its segments kept on the device).
    """
    k = _load()
    got = update_rule(opt)
    assert got is not None, "update_supported checked the optimizer"
    rule, h, f1, f2 = got
    names = [s.name for s in opt.slots]
    s1 = slots[names[0]] if len(names) > 0 else table
    s2 = slots[names[1]] if len(names) > 1 else table
    stochastic = table.dtype != torch.float32 and round_to is not None and round_to.stochastic
    _launch(k, rule, h, f1, f2, table, s1, s2, rows, grad, unique_offsets, order, bags, scales,
            None, hyper, round_to=round_to if stochastic else None)


def row_gradients(grad: torch.Tensor, unique_offsets: torch.Tensor, order: torch.Tensor,
                  bags: torch.Tensor | None, scales: torch.Tensor | None) -> torch.Tensor:
    """(U, D) float32: each distinct row's occurrences' gradients summed (``combine_backward``)."""
    k = _load()
    u = unique_offsets.numel() - 1
    out = torch.empty(u, grad.shape[1], dtype=torch.float32, device=grad.device)  # (U, D)
    _launch(k, k.NONE, (), False, False, out, out, out, unique_offsets, grad, unique_offsets,
            order, bags, scales, out, Hyper(0.0), num_rows=u)
    return out


def _launch(k: Any, rule: int, h: tuple[float, ...], f1: bool, f2: bool, table: torch.Tensor,
            s1: torch.Tensor, s2: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
            unique_offsets: torch.Tensor | None, order: torch.Tensor | None,
            bags: torch.Tensor | None, scales: torch.Tensor | None, out: torch.Tensor | None,
            hyper: Hyper, num_rows: int | None = None, round_to: Rounding | None = None) -> None:
    u = rows.numel() if num_rows is None else num_rows
    d = table.shape[1] if out is None else out.shape[1]
    if u == 0 or d == 0:
        return
    inf = float("inf")
    direct = unique_offsets is None
    block_d = _next_pow2(d)
    block_u = _grid_rows(d, block_d)
    h = tuple(float(x) for x in h) + (0.0,) * (5 - len(h))
    dummy = rows
    key_rows = round_to.key_rows if round_to is not None else None
    seg = round_to.segments.packed(rows.device) if round_to is not None else dummy
    k.sparse_update_kernel[(_cdiv(u, block_u),)](
        table, s1, s2, rows, u, d, grad.to(torch.float32).contiguous(),
        dummy if direct else unique_offsets, dummy if direct else order,
        dummy if bags is None else bags, grad if scales is None else scales.to(torch.float32),
        table if out is None else out,
        key_rows.to(rows.device) if key_rows is not None else dummy,
        key_rows.numel() if key_rows is not None else 0, seg,
        round_to.segments.bases.numel() if round_to is not None else 0,
        round_to.key_of_step if round_to is not None else 0,
        round_to.col0 if round_to is not None else 0,
        float(hyper.learning_rate), float(hyper.gradient_multiplier), float(hyper.clip_min),
        float(hyper.clip_max), float(hyper.weight_decay), float(hyper.weight_min),
        float(hyper.weight_max), *h,
        RULE=getattr(rule, "value", rule), F1=f1, F2=f2, DIRECT=direct, UNIT=bags is None,
        SCALED=scales is not None,
        MULTIPLIED=hyper.gradient_multiplier != 1.0,
        CLIPPED=hyper.clip_min != -inf or hyper.clip_max != inf,
        DECAYED=hyper.weight_decay != 0.0,
        BOUNDED=hyper.weight_min != -inf or hyper.weight_max != inf,
        ROWS=ROW_TYPES[table.dtype] if out is None else 0, STOCHASTIC=round_to is not None,
        KEYED=key_rows is not None, BLOCK_U=block_u, BLOCK_D=block_d)


# -- the hash index (state/vocab/device_hash.py) ---------------------------------------------------

_HASH_BLOCK = 128


def _hash_args(which: torch.Tensor | None, slot64: bool) -> dict[str, Any]:
    return {"BLOCK": _HASH_BLOCK, "ONE": which is None, "SLOT64": slot64}


def hash_find(keys: torch.Tensor, maps: torch.Tensor, which: torch.Tensor | None,
              slot64: bool) -> torch.Tensor:
    """(n,) int64: the place of each of the (n,) int64 ``keys`` in its index, -1 where absent.
    ``maps``: (M, 3) int64 on the device, per index its slots' address (int64 slots with
    ``slot64``, else int32), its owner's keys' address and its slots less one (a power of two
    less one); ``which``: (n,) int32 each key's index, None for one (kernels/gpu/index.py)."""
    k = _load_hash()
    n = keys.numel()
    out = torch.empty(n, dtype=torch.int64, device=keys.device)
    if n:
        k.hash_find_kernel[(_cdiv(n, _HASH_BLOCK),)](
            keys.contiguous(), n, maps, keys if which is None else which, out,
            **_hash_args(which, slot64))
    return out


def hash_insert(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor,
                maps: torch.Tensor, which: torch.Tensor | None, slot64: bool) -> None:
    """Inserts ``keys[i]`` at place ``places[i]`` (int64 >= 0) of its index where the (n,) bool
    ``take`` is set; those keys must be absent from it and distinct (``hash_find``'s maps)."""
    k = _load_hash()
    n = keys.numel()
    if n:
        k.hash_insert_kernel[(_cdiv(n, _HASH_BLOCK),)](
            keys.contiguous(), places.contiguous(), take.to(torch.int8).contiguous(), n, maps,
            keys if which is None else which, **_hash_args(which, slot64))


def hash_delete(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor,
                maps: torch.Tensor, which: torch.Tensor | None, slot64: bool) -> None:
    """Deletes ``keys[i]``, held at place ``places[i]`` of its index, where the (n,) bool
    ``take`` is set (``hash_find``'s maps)."""
    k = _load_hash()
    n = keys.numel()
    if n:
        k.hash_delete_kernel[(_cdiv(n, _HASH_BLOCK),)](
            keys.contiguous(), places.contiguous(), take.to(torch.int8).contiguous(), n, maps,
            keys if which is None else which, **_hash_args(which, slot64))


# -- rows between a cache and its slow tier (state/tier/cache.py) ----------------------------------

def move_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
              take: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` where the (n,) bool ``take[i]`` (``src``, ``dst``:
    (R, ...) contiguous, one dtype; either may be pinned host memory; kernels/gpu/move.py)."""
    k = _load_move()
    n = src_idx.numel()
    width = src[0].numel() if src.shape[0] else dst[0].numel()
    if n == 0 or width == 0:
        return
    assert src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
    # bit copies: any dtype moves as integers of its size
    view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[src.element_size()]
    block_d = min(_next_pow2(width), 256)
    block_r = _grid_rows(width, block_d)
    grid = (_cdiv(n, block_r), _cdiv(width, block_d))
    k.move_rows_kernel[grid](src.view(view), src_idx.contiguous(), dst.view(view),
                             dst_idx.contiguous(), take.to(torch.int8).contiguous(), n, width,
                             BLOCK_R=block_r, BLOCK_D=block_d)
