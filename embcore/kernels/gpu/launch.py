"""The GPU kernels (``kernels/gpu/rows.py``, Triton): when they apply, and their wrappers.

``usable(...)`` is this package's ``cpu.usable``: True when every tensor is on a CUDA device
and Triton imports (checked once, on the first CUDA tensor; triton is an optional dependency and
is never imported for CPU tensors). The choice points are ``ops/combine.py`` (the lookup, and the
summed row gradients of ``combine_backward``) and ``ops/update.py`` (the fused backward +
optimizer update); on the CPU nothing here runs.

What the kernels cover (everything else falls back to the torch-ops paths, on any device):

- ``lookup``: float32, float16 and bfloat16 tables (16-bit rows widened: float32 activations),
  and 8-bit tables (float8_e4m3fn, float8_e5m2: codes widened times their row's scale), unit
  bags or bags with offsets and optional scales;
- ``sparse_update``: float32, float16 and bfloat16 tables (16-bit rows rounded back as
  numerics/rounding.py says, bit for bit), 8-bit tables (new codes and row scales as
  ``rounding.quantize``, bit for bit, its codes decoded and encoded by integer arithmetic on
  their uint8 view) and float32 slots, SGD, Adagrad, RowwiseAdagrad,
  AdagradMomentum, Adam (lazy; ``lazy_adam=False`` moves every row and takes the torch path) and
  FTRL, each with every option of the update step (docs/semantics.md section 3: gradient
  multiplier, gradient clipping, decoupled weight decay, weight clipping), from summed row
  gradients or from the output gradients' occurrences;
- ``init_rows``: a dynamic table's new rows, the default initializer's values (the CPU's bits)
  into float32, float16 and bfloat16 tables;
- a batch's preparation (kernels/gpu/batch.py): every feature's ids' bounds and verdict
  (``id_bounds``), a physical table's features' ids concatenated and shifted (``concat_shift``)
  and, after a stable ``torch.sort`` (the occurrence order is the CPU's), the runs of a dedup of
  fixed capacity (``dedup_runs``, ``bags.dedup_padded``'s); the exact dedup elsewhere stays
  torch ops (``bags.dedup``: ``torch.sort`` + ``unique_consecutive``).

Each kernel runs as a torch operator, ``torch.ops.embcore.<name>`` (kernels/gpu/ops.py,
registered when the kernels load; ``operators()``): the wrappers here turn the callers' objects
(an optimizer, a ``Hyper``, a rounding) into the operators' tensors and numbers.

Tests run the kernels on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set when
the kernels are first loaded): ``force_on_cpu(True)`` makes ``usable`` accept CPU tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from ...base import compat
from ...config.dtypes import SCALED, SCALES
from ...config.optimizers import Optimizer, record_of
from ...numerics.rounding import ROW_TYPES, Rounding
from .. import rules
from ..hyper import Hyper, HyperValues

_kernels: Any = None   # the module kernels/gpu/rows.py once imported; False: triton missing
_ops: Any = None       # kernels/gpu/ops.py (the operators, ``torch.ops.embcore.*``) once imported
_error: str | None = None
_forced = False


def _load() -> Any:
    """kernels/gpu/rows.py, imported on first use with the operators of kernels/gpu/ops.py
    (registered then); None when triton is not importable."""
    global _kernels, _ops, _error
    if _kernels is None:
        try:
            from . import lang, rows
        except Exception as e:  # a triton that does not load here
            _kernels, _error = False, f"{type(e).__name__}: {e}"
        else:
            if lang.MISSING is None:
                from . import ops
                _kernels, _ops = rows, ops
            else:  # triton is not installed
                _kernels, _error = False, lang.MISSING
    return _kernels or None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _direct(t: torch.Tensor) -> bool:
    """Whether a call may launch its kernel past the dispatcher (``ops.DIRECT``): eagerly, on a
    plain tensor, no mode active. Any tracer (``torch.compile``, ``FakeTensorMode``,
    ``make_fx``, ``torch.export``, a tensor subclass) sees the operator instead."""
    if torch.compiler.is_compiling() or type(t) not in _PLAIN:
        return False
    return not compat.modes_active()  # (a tracer's modes: FakeTensorMode, make_fx, ...)


def _op(name: str, t: torch.Tensor) -> Any:
    """The operator ``name`` (kernels/gpu/ops.py), or its kernel launched directly where no
    tracer can see the call (``_direct``: the same function, without the dispatcher's cost)."""
    return _ops.DIRECT[name] if _direct(t) else _ops.OPS[name]


def operators() -> dict[str, Any]:
    """The GPU kernels' torch operators by name (``torch.ops.embcore.<name>``, registered when
    the kernels load: kernels/gpu/ops.py); empty without triton."""
    return dict(_ops.OPS) if _load() is not None else {}


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


# -- lookup ----------------------------------------------------------------------------------

def lookup_supported(table: torch.Tensor) -> bool:
    """Whether ``lookup`` reads ``table`` (an 8-bit one with its ``row_scales``)."""
    return ((table.dtype in ROW_TYPES or table.dtype in SCALED) and table.dim() == 2
            and table.is_contiguous())


def _codes(table: torch.Tensor, row_scales: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``(table, None, 0)``, or an 8-bit table's uint8 view, its (N,) float32 scales and the
    kernels' code of its dtype (3 float8_e4m3fn, 4 float8_e5m2)."""
    if table.dtype not in SCALED:
        return table, None, 0
    assert row_scales is not None and row_scales.dtype == torch.float32, "8-bit rows' scales"
    return (table.view(torch.uint8), row_scales.reshape(-1),
            3 if table.dtype == torch.float8_e4m3fn else 4)


def lookup(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
           scales: torch.Tensor | None, num_rows: int,
           skip: torch.Tensor | None = None,
           row_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``out[r] = sum_k scales[k] * table[ids[k]]`` over bag r (``offsets`` None: row ids[r]).

    Args:
        table: (N, D) contiguous float32, float16 or bfloat16.
        ids: (nnz,) int64 rows of ``table``.
        offsets: (R + 1,) int64 bag boundaries, or None for one id per row with scale 1.
        scales: (nnz,) float32, or None for 1.
        num_rows: R.
        skip: the batch's verdict of its checks on the device (``Bags.verdict``), or None.
        row_scales: (N, 1) float32 scales of an 8-bit table's rows; None for the others.

    Returns:
        (R, D) float32 (zeros, no row read, where ``skip`` is nonzero).
    """
    _load()
    codes, rs, dtype8 = _codes(table, row_scales)
    return _op("lookup", table)(codes, ids, offsets, scales, num_rows, skip, rs, dtype8)


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
    if not lookup_supported(table) or (table.dtype in SCALED and SCALES not in slots):
        return False
    for s in slots.values():
        if s.dtype != torch.float32 or not s.is_contiguous():
            return False
    return update_rule(opt) is not None


def sparse_update(opt: Optimizer, table: torch.Tensor, slots: dict[str, torch.Tensor],
                  rows: torch.Tensor, hyper: Hyper | HyperValues, grad: torch.Tensor,
                  unique_offsets: torch.Tensor | None = None, order: torch.Tensor | None = None,
                  bags: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                  round_to: Rounding | None = None, skip: torch.Tensor | None = None) -> None:
    """Updates ``table[rows]`` and its slots in place, each row once (``cpu.sparse_update``'s
    contract, for every optimizer ``update_supported`` accepts).

    Args:
        opt: the rule and its own hyper-parameters.
        table: (N, D) contiguous float32, float16, bfloat16 or 8-bit; slots: ``{name: (N, D)
            or (N, 1)}`` contiguous float32 (an 8-bit table's row scales among them, ``scales``).
        rows: (U,) distinct int64 rows.
        hyper: learning rate and the update step's options (``update._hyper``).
        grad: with ``unique_offsets``, the (R, D) output gradients; without, (U, D) row u the
            summed gradient of ``rows[u]``.
        unique_offsets, order: a ``Dedup``'s (occurrences of each row, sorted).
        bags: (nnz,) the output row of each occurrence; None when occurrence k is row k.
        scales: (nnz,) float32 scale of each occurrence; None for 1.
        round_to: a 16- or 8-bit table's rounding (None: to nearest); the rows' keys, their bits and
            the rounding are computed in the kernel (its segments kept on the device).
        skip: the batch's verdict of its checks on the device (``Bags.verdict``): nonzero,
            nothing is written; None: no verdict.
    """
    _load()
    got = update_rule(opt)
    assert got is not None, "update_supported checked the optimizer"
    rule, h, f1, f2 = got
    names = [s.name for s in opt.slots]
    stochastic = table.dtype != torch.float32 and round_to is not None and round_to.stochastic
    r = round_to if stochastic else None  # (to nearest: the kernel's own cast)
    key_rows = r.key_rows.to(rows.device) if r is not None and r.key_rows is not None else None
    codes, rs, dtype8 = _codes(table, slots.get(SCALES))
    _op("sparse_update", table)(
        codes, slots[names[0]] if len(names) > 0 else None,
        slots[names[1]] if len(names) > 1 else None, rows, grad, unique_offsets, order, bags,
        scales, key_rows, r.segments.packed(rows.device) if r is not None else None,
        r.key_of_step if r is not None else 0, r.col0 if r is not None else 0,
        float(hyper.learning_rate), float(hyper.gradient_multiplier), float(hyper.clip_min),
        float(hyper.clip_max), float(hyper.weight_decay), float(hyper.weight_min),
        float(hyper.weight_max), rule, list(h), f1, f2, skip, rs, dtype8)


def row_gradients(grad: torch.Tensor, unique_offsets: torch.Tensor, order: torch.Tensor,
                  bags: torch.Tensor | None, scales: torch.Tensor | None) -> torch.Tensor:
    """(U, D) float32: each distinct row's occurrences' gradients summed (``combine_backward``)."""
    _load()
    return _op("row_gradients", grad)(grad, unique_offsets, order, bags, scales)


# -- the hash index (state/vocab/device_hash.py) ---------------------------------------------------

def hash_find(keys: torch.Tensor, maps: torch.Tensor, which: torch.Tensor | None,
              slot64: bool) -> torch.Tensor:
    """(n,) int64: the place of each of the (n,) int64 ``keys`` in its index, -1 where absent.
    ``maps``: (M, 3) int64 on the device, per index its slots' address (int64 slots with
    ``slot64``, else int32), its owner's keys' address and its slots less one (a power of two
    less one); ``which``: (n,) int32 each key's index, None for one (kernels/gpu/index.py)."""
    _load()
    return _op("hash_find", keys)(keys, maps, which, slot64)


def hash_insert(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor,
                maps: torch.Tensor, which: torch.Tensor | None, slot64: bool) -> None:
    """Inserts ``keys[i]`` at place ``places[i]`` (int64 >= 0) of its index where the (n,) bool
    ``take`` is set; those keys must be absent from it and distinct (``hash_find``'s maps)."""
    _load()
    _op("hash_insert", keys)(keys, places, take, maps, which, slot64)


def hash_delete(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor,
                maps: torch.Tensor, which: torch.Tensor | None, slot64: bool) -> None:
    """Deletes ``keys[i]``, held at place ``places[i]`` of its index, where the (n,) bool
    ``take`` is set (``hash_find``'s maps)."""
    _load()
    _op("hash_delete", keys)(keys, places, take, maps, which, slot64)


# -- a dynamic table's new rows (state/vocab/vocabulary.py) ----------------------------------------

_constants: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def init_rows(ids: torch.Tensor, rows: torch.Tensor, take: torch.Tensor, out: torch.Tensor,
              col0: int, seed: int, constants: tuple[float, ...]) -> None:
    """Writes row ``rows[i]`` of ``out`` (N, C) contiguous float32, float16 or bfloat16 with
    the default initial values of raw id ``ids[i]`` (int64) where the (n,) bool ``take`` is
    set: columns ``col0 .. col0 + C`` of its logical table, ``seed`` the table's (an int64),
    ``constants`` the float64 values in ``init.CONSTANTS``' order (kernels/gpu/init.py; kept
    on the device, one tensor per distinct tuple)."""
    _load()
    key = (constants, out.device)
    k = _constants.get(key)
    if k is None:
        k = _constants[key] = torch.tensor(constants, dtype=torch.float64, device=out.device)
    _op("init_rows", out)(ids, rows, take, out, col0, seed, k)


# -- rows between a cache and its slow tier (state/tier/cache.py) ----------------------------------

def move_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
              take: torch.Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` where the (n,) bool ``take[i]`` (``src``, ``dst``:
    (R, ...) contiguous, one dtype; either may be pinned host memory; kernels/gpu/move.py)."""
    _load()
    assert src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
    _op("move_rows", dst)(src, src_idx, dst, dst_idx, take)


# -- a batch's preparation (ops/backend.py, inputs/canonical.py) ---------------------------------

def id_bounds(parts: list[torch.Tensor], vocabs: list[int],
              flags: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """((F + 2 N,) int64 the F one-value ``flags`` (0: good) then ``[min, max]`` of each of the
    N non-empty int64 ``parts``, () int64 verdict: 1 where a flag is nonzero or an id of part
    i is outside ``[0, vocabs[i])``), one launch (kernels/gpu/batch.py)."""
    _load()
    return _op("id_bounds", parts[0])(parts, vocabs, flags or [])


def concat_shift(parts: list[torch.Tensor], shifts: list[int]) -> torch.Tensor:
    """The int64 ``parts`` concatenated, part i's ids plus ``shifts[i]``, one launch."""
    _load()
    return _op("concat_shift", parts[0])(parts, shifts)


def concat_offsets(parts: list[torch.Tensor], shifts: list[int], total: int) -> torch.Tensor:
    """Jagged offsets concatenated: each part's but its last plus ``shifts[i]``, then ``total``;
    one launch."""
    _load()
    return _op("concat_offsets", parts[0])(parts, shifts, total)


def concat_bags(ids: list[torch.Tensor], adds: list[int], offsets: list[torch.Tensor],
                scales: list[torch.Tensor], bags: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A physical table's features' int64 ``ids`` (part i's plus ``adds[i]``), valid jagged
    ``offsets`` (shifted by the ids before them, ended by the ids' count) and float32
    ``scales`` as one, with ``bags`` each id's bag too (else (0,)); one launch."""
    _load()
    return _op("concat_bags", offsets[0])(ids, adds, offsets, scales, bags)


def jagged_offsets(offsets: torch.Tensor, nnz: int, mean: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the offsets made safe to index with, their verdict, with ``mean`` each id's mean scale)
    of (n >= 2,) int64 jagged ``offsets`` over ``nnz`` ids, one launch."""
    _load()
    return _op("jagged_offsets", offsets)(offsets, nnz, mean)


def bag_index(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """(nnz,) int64 the bag of each id of valid (n >= 1,) int64 jagged ``offsets``, one
    launch."""
    _load()
    return _op("bag_index", offsets)(offsets, nnz)


def dedup_runs(sorted_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique (n,), unique_offsets (n + 1,))`` of (n,) sorted int64 ids, padded as
    ``bags.dedup_padded`` pads them, one launch."""
    _load()
    return _op("dedup_runs", sorted_ids)(sorted_ids)
