"""The GPU kernels as torch operators, ``torch.ops.embcore.*``: each Triton kernel's entry point
registered with ``torch.library``, its schema, its fake (meta) implementation and the
arguments it writes.

Imported only by ``kernels/gpu/launch.py`` once triton loads (it imports the kernels); the
wrappers there (``gpu.lookup``, ``gpu.sparse_update``, ...) turn the callers' objects (an
optimizer, a ``Hyper``, a rounding) into these operators' arguments. Each operator:

- has a schema of tensors and numbers (FBGEMM's table-batched ops are the model: the table and
  its slots ``Tensor(a!)``, optional tensors ``Tensor?``, hyper-parameters as floats);
- has a fake implementation giving its outputs' shapes and dtypes from its inputs' (so that
  ``FakeTensorMode``, ``torch.compile`` and ``torch.export`` trace it without running it);
- declares what it writes (``mutates_args``): the rows it updates in place;
- launches its kernel with every argument by name (``kernels/gpu/args.py``).

``lookup``, ``row_gradients``, ``sparse_update`` and ``move_rows`` are ``triton_op``s: with
compiled kernels, a compiler (``torch.compile``'s AOT dispatch) sees their Triton kernels
through ``wrap_triton``. Under Triton's interpreter (``TRITON_INTERPRET=1``, the tests without
a GPU) ``wrap_triton`` cannot capture a kernel (torch/_library/triton.py hands an interpreted
kernel back as it is), so a tracer keeps each operator whole there (``_keep_whole``). The hash
index's operators (``hash_find``, ``hash_insert``, ``hash_delete``) are opaque ``custom_op``s:
their kernels reach the index's slots and keys through the addresses in ``maps``, which no
tracer can follow, so none may look inside; ``hash_insert`` and ``hash_delete`` declare
``maps`` written, so that a tracer keeps them, in order. The batch's operators (``id_bounds``,
``concat_shift``, ``concat_offsets``, ``jagged_offsets``, ``bag_index``, ``dedup_runs``,
``concat_bags``:
kernels/gpu/batch.py) are opaque ``custom_op``s too: some of their kernels take the parts as a
tuple of pointers, which ``wrap_triton`` does not trace, and all are launched alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import custom_op, triton_op, wrap_triton

from ...base import compat
from ..rules import Rule
from .args import BITS, CODED, CONSTEXPR, F32, FLOAT, I8, I32, I64, INT, ROWS, Launch, tensor
from .batch import (
    bag_index_kernel,
    concat_bags_kernel,
    concat_shift_kernel,
    id_bounds_kernel,
    jagged_offsets_kernel,
    runs_kernel,
)
from .index import hash_delete_kernel, hash_find_kernel, hash_insert_kernel
from .init import CONSTANTS, init_rows_kernel
from .move import move_rows_kernel
from .rows import lookup_kernel, sparse_update_kernel

NAMESPACE = "embcore"


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid_rows(d: int, block_d: int) -> int:
    """Rows per program: about 2048 elements per tile (at most 64 rows)."""
    return max(1, min(64, 2048 // block_d))


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # (no triton: this module imported by a doctest collection)
        return False
    return isinstance(lookup_kernel, InterpretedFunction)


def _keep_whole(mode: Any, op: Any, types: Any, args: Any, kwargs: Any) -> Any:
    """A ``triton_op``'s rule under functionalization when its kernels are interpreted: the
    operator stays one node (functionalized as a custom op) instead of being traced into."""
    return mode.__torch_dispatch__(op, types, args, kwargs)


def _registered(op: Any, fake: Any) -> Any:
    """``op`` (a ``triton_op``) with its fake implementation ``fake``, kept whole when the
    kernels are interpreted."""
    op.register_fake(fake)
    functionalizing = compat.functionalization_mode()
    if _interpreted() and functionalizing is not None:
        op.register_torch_dispatch(functionalizing, _keep_whole)
    return op


# -- lookup ------------------------------------------------------------------------------------

LOOKUP = Launch(lookup_kernel, [
    ("table_ptr", tensor(CODED)), ("rs_ptr", tensor(F32, optional=True)), ("ids_ptr", tensor(I64)),
    ("offsets_ptr", tensor(I64, optional=True)), ("scales_ptr", tensor(F32, optional=True)),
    ("skip_ptr", tensor(I64, optional=True)),
    ("out_ptr", tensor(F32, writes=True)), ("R", INT), ("D", INT),
    ("UNIT", CONSTEXPR), ("SCALED", CONSTEXPR), ("CHECKED", CONSTEXPR), ("ROWS", CONSTEXPR),
    ("BLOCK_R", CONSTEXPR), ("BLOCK_D", CONSTEXPR),
], stand_in="ids_ptr")

# The kernels' ROWS: a table's rows (an 8-bit table's by its codes' uint8 view and the dtype
# of its rows, given by the presence of its (N,) row scales: float8_e4m3fn 3, float8_e5m2 4).
_ROW_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_CODES_8 = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}


def _rows_code(table: torch.Tensor, row_scales: torch.Tensor | None, dtype8: int) -> int:
    return _ROW_CODES[table.dtype] if row_scales is None else dtype8


def _lookup(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
            scales: torch.Tensor | None, num_rows: int,
            skip: torch.Tensor | None = None, row_scales: torch.Tensor | None = None,
            dtype8: int = 0) -> torch.Tensor:
    """``embcore::lookup``: ``out[r] = sum_k scales[k] * table[ids[k]]`` over bag r
    (``offsets`` None: row ``ids[r]``); (R, D) float32; zeros, nothing read, where the
    one-value int64 ``skip`` (the batch's verdict of its checks on the device) is nonzero.
    An 8-bit table comes as its uint8 codes with ``row_scales`` (N,) float32 and ``dtype8``
    (3 float8_e4m3fn, 4 float8_e5m2): row i is ``float32(code) * row_scales[i]``.
    FBGEMM: the pooled forward
    ``fbgemm::split_embedding_codegen_forward_{unweighted,weighted}_pt2_wrapper`` (``scales``
    its ``indice_weights``) for one table, ``..._nobag_...`` for unit bags."""
    d = table.shape[1]
    out = torch.empty(num_rows, d, dtype=torch.float32, device=table.device)  # (R, D)
    if num_rows == 0 or d == 0:
        return out
    block_d = min(_next_pow2(d), 256)
    block_r = _grid_rows(d, block_d)
    unit = offsets is None
    if offsets is not None:
        offsets = offsets.contiguous()
    scaled = scales is not None and not unit
    wrap_triton(lookup_kernel)[(_cdiv(num_rows, block_r), _cdiv(d, block_d))](*LOOKUP.declared(
        table_ptr=table, ids_ptr=ids.contiguous(), offsets_ptr=offsets,
        scales_ptr=scales.to(torch.float32).contiguous() if scaled and scales is not None
        else None,
        skip_ptr=skip, out_ptr=out, R=num_rows, D=d, UNIT=unit, SCALED=scaled,
        CHECKED=skip is not None, ROWS=_rows_code(table, row_scales, dtype8), BLOCK_R=block_r,
        BLOCK_D=block_d, rs_ptr=row_scales))
    return out


def _lookup_fake(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
                 scales: torch.Tensor | None, num_rows: int,
                 skip: torch.Tensor | None = None, row_scales: torch.Tensor | None = None,
                 dtype8: int = 0) -> torch.Tensor:
    return table.new_empty((num_rows, table.shape[1]), dtype=torch.float32)  # (R, D)


lookup = _registered(triton_op(f"{NAMESPACE}::lookup", _lookup, mutates_args=()), _lookup_fake)


# -- the fused backward + update, and the summed row gradients ---------------------------------

SPARSE_UPDATE = Launch(sparse_update_kernel, [
    ("w_ptr", tensor(CODED, writes=True, optional=True)),
    ("s1_ptr", tensor(F32, writes=True, optional=True)),
    ("s2_ptr", tensor(F32, writes=True, optional=True)),
    ("rs_ptr", tensor(F32, writes=True, optional=True)),
    ("rows_ptr", tensor(I64, optional=True)), ("U", INT), ("D", INT), ("grad_ptr", tensor(F32)),
    ("uoff_ptr", tensor(I64, optional=True)), ("order_ptr", tensor(I64, optional=True)),
    ("bags_ptr", tensor(I64, optional=True)), ("scales_ptr", tensor(F32, optional=True)),
    ("skip_ptr", tensor(I64, optional=True)),
    ("out_ptr", tensor(F32, writes=True, optional=True)),
    ("keyrows_ptr", tensor(I64, optional=True)), ("n_keys", INT),
    ("seg_ptr", tensor(I64, optional=True)), ("nseg", INT), ("step_key", INT), ("col0", INT),
    ("lr", FLOAT), ("gmul", FLOAT), ("clip_lo", FLOAT), ("clip_hi", FLOAT), ("wd", FLOAT),
    ("wmin", FLOAT), ("wmax", FLOAT),
    ("h1", FLOAT), ("h2", FLOAT), ("h3", FLOAT), ("h4", FLOAT), ("h5", FLOAT),
    ("RULE", CONSTEXPR), ("F1", CONSTEXPR), ("F2", CONSTEXPR), ("DIRECT", CONSTEXPR),
    ("UNIT", CONSTEXPR), ("SCALED", CONSTEXPR), ("MULTIPLIED", CONSTEXPR),
    ("CLIPPED", CONSTEXPR), ("DECAYED", CONSTEXPR), ("BOUNDED", CONSTEXPR), ("ROWS", CONSTEXPR),
    ("STOCHASTIC", CONSTEXPR), ("KEYED", CONSTEXPR), ("CHECKED", CONSTEXPR), ("BLOCK_U", CONSTEXPR),
    ("BLOCK_D", CONSTEXPR),
], stand_in="grad_ptr")


def _sparse_update(table: torch.Tensor, slot1: torch.Tensor | None, slot2: torch.Tensor | None,
                   rows: torch.Tensor, grad: torch.Tensor, unique_offsets: torch.Tensor | None,
                   order: torch.Tensor | None, bags: torch.Tensor | None,
                   scales: torch.Tensor | None, key_rows: torch.Tensor | None,
                   segments: torch.Tensor | None, step_key: int, col0: int,
                   learning_rate: float, gradient_multiplier: float, clip_min: float,
                   clip_max: float, weight_decay: float, weight_min: float, weight_max: float,
                   rule: int, rule_args: list[float], flag1: bool, flag2: bool,
                   skip: torch.Tensor | None = None, row_scales: torch.Tensor | None = None,
                   dtype8: int = 0) -> None:
    """``embcore::sparse_update``: updates ``table[rows]`` and its slots in place, each row
    once, by the optimizer rule ``rule`` (kernels/rules.py) with its hyper-parameters
    ``rule_args`` (h1..h5) and flags, after the update step's options (docs/semantics.md
    section 3). ``grad``: (U, D) summed row gradients, or with ``unique_offsets`` / ``order``
    (a ``Dedup``'s) the (R, D) output gradients, ``bags`` / ``scales`` each occurrence's
    output row and scale. ``segments`` (3, T) int64 and ``key_rows``: a 16-bit table's
    stochastic rounding (numerics/rounding.py; None: to nearest). A nonzero one-value int64
    ``skip`` (the batch's verdict of its checks on the device) leaves everything as it was;
    a row without occurrences (the padding of ``bags.dedup_padded``) too. An 8-bit table comes
    as ``_lookup``'s (uint8 codes, ``row_scales``, ``dtype8``): its rows get new codes and
    scales. FBGEMM: the fused
    backward + optimizer
    ``fbgemm::split_embedding_backward_codegen_{optimizer}_{unweighted,weighted}_pt2_wrapper``
    (its ``dev_weights`` ``Tensor(b!)``, ``momentum1`` / ``momentum2``
    ``Tensor(g!)`` / ``Tensor(j!)``: here ``table``, ``slot1``, ``slot2``)."""
    u, d = rows.numel(), table.shape[1]
    if u == 0 or d == 0:
        return
    inf = float("inf")
    direct = unique_offsets is None
    block_d = _next_pow2(d)
    block_u = _grid_rows(d, block_d)
    h = [float(x) for x in rule_args] + [0.0] * (5 - len(rule_args))
    stochastic = segments is not None
    wrap_triton(sparse_update_kernel)[(_cdiv(u, block_u),)](*SPARSE_UPDATE.declared(
        w_ptr=table, s1_ptr=slot1, s2_ptr=slot2, rs_ptr=row_scales, rows_ptr=rows, U=u, D=d,
        grad_ptr=grad.to(torch.float32).contiguous(), uoff_ptr=unique_offsets,
        order_ptr=order, bags_ptr=bags,
        scales_ptr=None if scales is None else scales.to(torch.float32).contiguous(),
        skip_ptr=skip, out_ptr=None, keyrows_ptr=key_rows,
        n_keys=key_rows.numel() if key_rows is not None else 0, seg_ptr=segments,
        nseg=segments.shape[1] if segments is not None else 0, step_key=step_key, col0=col0,
        lr=learning_rate, gmul=gradient_multiplier, clip_lo=clip_min, clip_hi=clip_max,
        wd=weight_decay, wmin=weight_min, wmax=weight_max,
        h1=h[0], h2=h[1], h3=h[2], h4=h[3], h5=h[4],
        RULE=rule, F1=flag1, F2=flag2, DIRECT=direct, UNIT=bags is None,
        SCALED=scales is not None, MULTIPLIED=gradient_multiplier != 1.0,
        CLIPPED=clip_min != -inf or clip_max != inf, DECAYED=weight_decay != 0.0,
        BOUNDED=weight_min != -inf or weight_max != inf, ROWS=_rows_code(table, row_scales, dtype8),
        STOCHASTIC=stochastic, KEYED=key_rows is not None, CHECKED=skip is not None,
        BLOCK_U=block_u, BLOCK_D=block_d))


def _sparse_update_fake(*args: Any, **kwargs: Any) -> None:
    return None


sparse_update = _registered(triton_op(f"{NAMESPACE}::sparse_update", _sparse_update,
                                      mutates_args=("table", "slot1", "slot2", "row_scales")),
                            _sparse_update_fake)


def _row_gradients(grad: torch.Tensor, unique_offsets: torch.Tensor, order: torch.Tensor,
                   bags: torch.Tensor | None, scales: torch.Tensor | None) -> torch.Tensor:
    """``embcore::row_gradients``: (U, D) float32, each distinct row's occurrences' gradients
    summed in order (U = ``unique_offsets.numel() - 1``; ``sparse_update_kernel``'s first
    step alone). FBGEMM: the backward of the ``none`` optimizer,
    ``fbgemm::split_embedding_backward_codegen_none_{unweighted,weighted}_pt2_wrapper``
    (its gradients of the unique indices)."""
    u, d = unique_offsets.numel() - 1, grad.shape[1]
    out = torch.empty(u, d, dtype=torch.float32, device=grad.device)  # (U, D)
    if u <= 0 or d == 0:
        return out
    block_d = _next_pow2(d)
    block_u = _grid_rows(d, block_d)
    wrap_triton(sparse_update_kernel)[(_cdiv(u, block_u),)](*SPARSE_UPDATE.declared(
        w_ptr=None, s1_ptr=None, s2_ptr=None, rows_ptr=None, U=u, D=d,
        grad_ptr=grad.to(torch.float32).contiguous(), uoff_ptr=unique_offsets.contiguous(),
        order_ptr=order.contiguous(), bags_ptr=None if bags is None else bags.contiguous(),
        scales_ptr=None if scales is None else scales.to(torch.float32).contiguous(),
        skip_ptr=None, out_ptr=out, keyrows_ptr=None, n_keys=0, seg_ptr=None, nseg=0,
        step_key=0, col0=0,
        lr=0.0, gmul=1.0, clip_lo=0.0, clip_hi=0.0, wd=0.0, wmin=0.0, wmax=0.0,
        h1=0.0, h2=0.0, h3=0.0, h4=0.0, h5=0.0,
        RULE=int(Rule.NONE), F1=False, F2=False, DIRECT=False, UNIT=bags is None,
        SCALED=scales is not None, MULTIPLIED=False, CLIPPED=False, DECAYED=False,
        BOUNDED=False, ROWS=0, STOCHASTIC=False, KEYED=False, CHECKED=False, BLOCK_U=block_u,
        BLOCK_D=block_d))
    return out


def _row_gradients_fake(grad: torch.Tensor, unique_offsets: torch.Tensor, order: torch.Tensor,
                        bags: torch.Tensor | None, scales: torch.Tensor | None) -> torch.Tensor:
    return grad.new_empty((unique_offsets.shape[0] - 1, grad.shape[1]),
                          dtype=torch.float32)  # (U, D)


row_gradients = _registered(triton_op(f"{NAMESPACE}::row_gradients", _row_gradients,
                                      mutates_args=()), _row_gradients_fake)


# -- rows between a cache and its slow tier ----------------------------------------------------

MOVE_ROWS = Launch(move_rows_kernel, [
    ("src_ptr", tensor(BITS)), ("src_idx_ptr", tensor(I64)),
    ("dst_ptr", tensor(BITS, writes=True)), ("dst_idx_ptr", tensor(I64)),
    ("take_ptr", tensor(I8)), ("n", INT), ("D", INT),
    ("BLOCK_R", CONSTEXPR), ("BLOCK_D", CONSTEXPR),
], stand_in="src_idx_ptr")

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _move_rows(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
               dst_idx: torch.Tensor, take: torch.Tensor) -> None:
    """``embcore::move_rows``: ``dst[dst_idx[i]] = src[src_idx[i]]`` where ``take[i]`` (bit
    copies of whole rows; either array may be pinned host memory). FBGEMM: the cache's row moves
    (``fbgemm::lxu_cache_flush`` writes cache rows back to ``uvm_weights``, ``Tensor(a!)``)."""
    n = src_idx.numel()
    width = src[0].numel() if src.shape[0] else dst[0].numel()
    if n == 0 or width == 0:
        return
    view = _BITS[src.element_size()]  # (any dtype moves as integers of its size)
    block_d = min(_next_pow2(width), 256)
    block_r = _grid_rows(width, block_d)
    wrap_triton(move_rows_kernel)[(_cdiv(n, block_r), _cdiv(width, block_d))](
        *MOVE_ROWS.declared(src_ptr=src.view(view), src_idx_ptr=src_idx.contiguous(),
                             dst_ptr=dst.view(view), dst_idx_ptr=dst_idx.contiguous(),
                             take_ptr=take.to(torch.int8).contiguous(), n=n, D=width,
                             BLOCK_R=block_r, BLOCK_D=block_d))


def _move_rows_fake(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                    dst_idx: torch.Tensor, take: torch.Tensor) -> None:
    return None


move_rows = _registered(triton_op(f"{NAMESPACE}::move_rows", _move_rows, mutates_args=("dst",)),
                        _move_rows_fake)


# -- the hash index (state/vocab/device_hash.py) ------------------------------------------------

_HASH_BLOCK = 128

HASH_FIND = Launch(hash_find_kernel, [
    ("keys_ptr", tensor(I64)), ("n", INT), ("maps_ptr", tensor(I64)),
    ("which_ptr", tensor(I32, optional=True)), ("out_ptr", tensor(I64, writes=True)),
    ("BLOCK", CONSTEXPR), ("ONE", CONSTEXPR), ("SLOT64", CONSTEXPR),
], stand_in="keys_ptr")

_CHANGE = [  # hash_insert_kernel's and hash_delete_kernel's arguments (the same)
    ("keys_ptr", tensor(I64)), ("places_ptr", tensor(I64)), ("take_ptr", tensor(I8)),
    ("n", INT), ("maps_ptr", tensor(I64)), ("which_ptr", tensor(I32, optional=True)),
    ("BLOCK", CONSTEXPR), ("ONE", CONSTEXPR), ("SLOT64", CONSTEXPR)]
HASH_INSERT = Launch(hash_insert_kernel, _CHANGE, stand_in="keys_ptr")
HASH_DELETE = Launch(hash_delete_kernel, _CHANGE, stand_in="keys_ptr")


def _hash_find(keys: torch.Tensor, maps: torch.Tensor, which: torch.Tensor | None,
              slot64: bool) -> torch.Tensor:
    """``embcore::hash_find``: (n,) int64, the place of each key in its index, -1 where absent
    (``maps``: (M, 3) int64 rows of each index's addresses, ``which`` each key's row of it,
    None for one). FBGEMM: ``fbgemm::pruned_hashmap_lookup`` (a key's dense index, -1 where
    pruned)."""
    n = keys.numel()
    out = torch.empty(n, dtype=torch.int64, device=keys.device)  # (n,)
    if n:
        hash_find_kernel[(_cdiv(n, _HASH_BLOCK),)](*HASH_FIND.declared(
            keys_ptr=keys.contiguous(), n=n, maps_ptr=maps, which_ptr=which, out_ptr=out,
            BLOCK=_HASH_BLOCK, ONE=which is None, SLOT64=slot64))
    return out


hash_find = custom_op(f"{NAMESPACE}::hash_find", _hash_find, mutates_args=())


@hash_find.register_fake
def _hash_find_fake(keys: torch.Tensor, maps: torch.Tensor, which: torch.Tensor | None,
                    slot64: bool) -> torch.Tensor:
    return keys.new_empty((keys.numel(),), dtype=torch.int64)  # (n,)


def _hash_insert(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor, maps: torch.Tensor,
                which: torch.Tensor | None, slot64: bool) -> None:
    """``embcore::hash_insert``: inserts ``keys[i]`` at place ``places[i]`` of its index where
    ``take[i]`` (the keys absent and distinct). Writes the slots ``maps`` addresses (declared as
    writing ``maps``). FBGEMM: ``fbgemm::pruned_hashmap_insert`` (``hash_table`` ``Tensor(a!)``)."""
    n = keys.numel()
    if n:
        hash_insert_kernel[(_cdiv(n, _HASH_BLOCK),)](*HASH_INSERT.declared(
            keys_ptr=keys.contiguous(), places_ptr=places.contiguous(),
            take_ptr=take.to(torch.int8).contiguous(), n=n, maps_ptr=maps, which_ptr=which,
            BLOCK=_HASH_BLOCK, ONE=which is None, SLOT64=slot64))


def _hash_delete(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor, maps: torch.Tensor,
                which: torch.Tensor | None, slot64: bool) -> None:
    """``embcore::hash_delete``: deletes ``keys[i]``, held at place ``places[i]`` of its index,
    where ``take[i]`` (declared as writing ``maps``, as ``hash_insert``). FBGEMM: none (its
    pruned hash map is rebuilt, not deleted from)."""
    n = keys.numel()
    if n:
        hash_delete_kernel[(_cdiv(n, _HASH_BLOCK),)](*HASH_DELETE.declared(
            keys_ptr=keys.contiguous(), places_ptr=places.contiguous(),
            take_ptr=take.to(torch.int8).contiguous(), n=n, maps_ptr=maps, which_ptr=which,
            BLOCK=_HASH_BLOCK, ONE=which is None, SLOT64=slot64))


hash_insert = custom_op(f"{NAMESPACE}::hash_insert", _hash_insert, mutates_args=("maps",))
hash_delete = custom_op(f"{NAMESPACE}::hash_delete", _hash_delete, mutates_args=("maps",))


@hash_insert.register_fake
def _hash_insert_fake(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor,
                      maps: torch.Tensor, which: torch.Tensor | None, slot64: bool) -> None:
    return None


@hash_delete.register_fake
def _hash_delete_fake(keys: torch.Tensor, places: torch.Tensor, take: torch.Tensor,
                      maps: torch.Tensor, which: torch.Tensor | None, slot64: bool) -> None:
    return None


# -- a dynamic table's new rows (state/vocab/vocabulary.py) ------------------------------------

INIT_ROWS = Launch(init_rows_kernel, [
    ("ids_ptr", tensor(I64)), ("rows_ptr", tensor(I64)), ("take_ptr", tensor(I8)), ("n", INT),
    ("out_ptr", tensor((*ROWS, torch.int16), writes=True)), ("stride", INT), ("C", INT),
    ("col0", INT), ("seed", INT), ("k_ptr", tensor((torch.float64,))),
    ("BF16", CONSTEXPR), ("BLOCK_N", CONSTEXPR), ("BLOCK_D", CONSTEXPR),
], stand_in="ids_ptr")


def _init_rows(ids: torch.Tensor, rows: torch.Tensor, take: torch.Tensor, out: torch.Tensor,
               col0: int, seed: int, constants: torch.Tensor) -> None:
    """``embcore::init_rows``: writes row ``rows[i]`` of ``out`` (N, C) with the default
    initial values of raw id ``ids[i]`` (columns ``col0 .. col0 + C`` of its logical table)
    where ``take[i]``; ``constants``: float64 in ``init.CONSTANTS``' order, ``seed`` the table's
    as an int64 (kernels/gpu/init.py). FBGEMM: none (its tables start from given weights)."""
    n, c = ids.numel(), out.shape[1]
    if n == 0 or c == 0:
        return
    assert constants.numel() == len(CONSTANTS)
    block_d = min(_next_pow2(c), 128)
    block_n = _grid_rows(c, block_d)
    bf16 = out.dtype == torch.bfloat16
    init_rows_kernel[(_cdiv(n, block_n), _cdiv(c, block_d))](*INIT_ROWS.declared(
        ids_ptr=ids.contiguous(), rows_ptr=rows.contiguous(),
        take_ptr=take.to(torch.int8).contiguous(), n=n,
        out_ptr=out.view(torch.int16) if bf16 else out, stride=out.stride(0), C=c, col0=col0,
        seed=seed, k_ptr=constants, BF16=bf16, BLOCK_N=block_n, BLOCK_D=block_d),
        enable_fp_fusion=False)


init_rows = custom_op(f"{NAMESPACE}::init_rows", _init_rows, mutates_args=("out",))


@init_rows.register_fake
def _init_rows_fake(ids: torch.Tensor, rows: torch.Tensor, take: torch.Tensor,
                    out: torch.Tensor, col0: int, seed: int, constants: torch.Tensor) -> None:
    return None


# -- a batch's preparation (ops/backend.py, inputs/canonical.py) ----------------------------------
#
# Opaque ``custom_op``s: their kernels take the parts as a tuple of pointers, which
# ``wrap_triton`` does not trace; a tracer keeps each whole (their fake implementations give the
# shapes, from the inputs' alone).

_BATCH_BLOCK = 1024


def _parts(parts: list[torch.Tensor], what: str) -> tuple[torch.Tensor, ...]:
    for t in parts:
        if t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"embcore::{what}: parts must be 1-d int64 tensors, got "
                            f"{t.dtype} of shape {tuple(t.shape)}")
    return tuple(t.contiguous() for t in parts)


def _id_bounds(parts: list[torch.Tensor], vocabs: list[int], flags: list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``embcore::id_bounds``: ((F + 2 N,) int64 the F one-value ``flags`` (0: good), then each
    non-empty part's min and max, () int64 1 when a flag is nonzero or an id of part i is
    outside ``[0, vocabs[i])``, else 0); inputs/canonical.py's checks of a batch on the device,
    one launch for the batch."""
    got = _parts(parts, "id_bounds")
    if len(vocabs) != len(got) or any(t.numel() == 0 for t in got) or not got:
        raise ValueError("embcore::id_bounds: one vocabulary size per non-empty part")
    for f in flags:
        if f.numel() != 1 or f.dtype not in (torch.int64, torch.bool):
            raise TypeError("embcore::id_bounds: flags must be one-value int64 or bool tensors")
    report = torch.empty(len(flags) + 2 * len(got), dtype=torch.int64, device=got[0].device)
    verdict = torch.empty((), dtype=torch.int64, device=got[0].device)
    id_bounds_kernel[(1,)](got, tuple(t.numel() for t in got), tuple(int(v) for v in vocabs),
                           tuple(f.to(torch.int64) for f in flags), report, verdict,
                           N=len(got), F=len(flags), BLOCK=_BATCH_BLOCK)
    return report, verdict


id_bounds = custom_op(f"{NAMESPACE}::id_bounds", _id_bounds, mutates_args=())


@id_bounds.register_fake
def _id_bounds_fake(parts: list[torch.Tensor], vocabs: list[int], flags: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return (parts[0].new_empty(len(flags) + 2 * len(parts), dtype=torch.int64),
            parts[0].new_empty((), dtype=torch.int64))


def _concatenated(parts: list[torch.Tensor], shifts: list[int], what: str,
                  tail: int | None) -> torch.Tensor:
    got = _parts(parts, what)
    if len(shifts) != len(got) or not got or (tail is not None and min(
            t.numel() for t in got) == 0):
        raise ValueError(f"embcore::{what}: one shift per part"
                         + ("" if tail is None else ", each part of one entry or more"))
    sizes = tuple(t.numel() - (tail is not None) for t in got)
    starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
    out = torch.empty(sum(sizes) + (tail is not None), dtype=torch.int64, device=got[0].device)
    if max(sizes) or tail is not None:
        concat_shift_kernel[(max(1, _cdiv(max(sizes), _BATCH_BLOCK)), len(got))](
            got, sizes, starts, tuple(int(v) for v in shifts), out,
            0 if tail is None else int(tail), N=len(got), TAIL=tail is not None,
            BLOCK=_BATCH_BLOCK)
    return out


def _concat_shift(parts: list[torch.Tensor], shifts: list[int]) -> torch.Tensor:
    """``embcore::concat_shift``: (sum of sizes,) int64, the parts concatenated, part i's ids
    plus ``shifts[i]`` (a physical table's features' rows: ops/backend.py)."""
    return _concatenated(parts, shifts, "concat_shift", None)


concat_shift = custom_op(f"{NAMESPACE}::concat_shift", _concat_shift, mutates_args=())


@concat_shift.register_fake
def _concat_shift_fake(parts: list[torch.Tensor], shifts: list[int]) -> torch.Tensor:
    return parts[0].new_empty(sum(t.shape[0] for t in parts), dtype=torch.int64)


def _concat_offsets(parts: list[torch.Tensor], shifts: list[int], total: int) -> torch.Tensor:
    """``embcore::concat_offsets``: jagged offsets concatenated, ((sum of B_i) + 1,) int64: each
    part's (B_i + 1,) offsets but its last, plus ``shifts[i]`` (the ids before it), then
    ``total`` (step/preprocess.py: a physical table's features' bags as one)."""
    return _concatenated(parts, shifts, "concat_offsets", total)


concat_offsets = custom_op(f"{NAMESPACE}::concat_offsets", _concat_offsets, mutates_args=())


@concat_offsets.register_fake
def _concat_offsets_fake(parts: list[torch.Tensor], shifts: list[int], total: int
                         ) -> torch.Tensor:
    return parts[0].new_empty(sum(t.shape[0] - 1 for t in parts) + 1, dtype=torch.int64)


def _jagged_offsets(offsets: torch.Tensor, nnz: int, mean: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``embcore::jagged_offsets``: ((n,) int64 the offsets made safe to index with, () int64
    1 where the given ones are malformed, else 0, and with ``mean`` (nnz,) float32 each id's
    mean scale of unweighted bags, else (0,)) of (n >= 2,) int64 ``offsets`` over ``nnz`` ids
    (``Backend.offsets_verdict`` and ``combiner_scales``' in one launch)."""
    (given,) = _parts([offsets], "jagged_offsets")
    n = given.numel()
    if n < 2:
        raise ValueError("embcore::jagged_offsets: offsets of one bag or more (2 entries)")
    safe = torch.empty_like(given)
    verdict = torch.empty((), dtype=torch.int64, device=given.device)
    scales = torch.empty(nnz if mean else 0, dtype=torch.float32, device=given.device)
    jagged_offsets_kernel[(1,)](given, n, nnz, safe, verdict, scales, MEAN=mean,
                                LOG=max(1, (n - 1).bit_length()), BLOCK=_BATCH_BLOCK)
    return safe, verdict, scales


jagged_offsets = custom_op(f"{NAMESPACE}::jagged_offsets", _jagged_offsets, mutates_args=())


@jagged_offsets.register_fake
def _jagged_offsets_fake(offsets: torch.Tensor, nnz: int, mean: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(offsets), offsets.new_empty((), dtype=torch.int64),
            offsets.new_empty(nnz if mean else 0, dtype=torch.float32))


def _bag_index(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """``embcore::bag_index``: (nnz,) int64 the bag of each id of valid (n >= 1,) int64 jagged
    ``offsets`` over ``nnz`` ids (``bags.bag_index``'s, one launch)."""
    (given,) = _parts([offsets], "bag_index")
    out = torch.empty(nnz, dtype=torch.int64, device=given.device)
    if nnz:
        n = given.numel()
        bag_index_kernel[(_cdiv(nnz, _BATCH_BLOCK),)](
            given, n, nnz, out, LOG=max(1, (n - 1).bit_length()), BLOCK=_BATCH_BLOCK)
    return out


bag_index = custom_op(f"{NAMESPACE}::bag_index", _bag_index, mutates_args=())


@bag_index.register_fake
def _bag_index_fake(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    return offsets.new_empty(nnz, dtype=torch.int64)


def _concat_bags(ids: list[torch.Tensor], adds: list[int], offsets: list[torch.Tensor],
                 scales: list[torch.Tensor], bags: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``embcore::concat_bags``: a physical table's features' bags as one (step/preprocess.py):
    (nnz,) int64 the ``ids`` concatenated, part i's plus ``adds[i]`` (``concat_shift``'s);
    ((sum of B_i) + 1,) int64 offsets, each part's valid (B_i + 1,) ``offsets`` but its last
    plus the ids before it, then nnz (``concat_offsets``'); (nnz,) float32 the ``scales``
    concatenated (one (nnz_i,) float32 part a part of ids); with ``bags`` (nnz,) int64 each
    id's bag (``bags.bag_index`` of those offsets), else (0,). One launch."""
    got = _parts(offsets, "concat_bags")
    parts = _parts(ids, "concat_bags")
    if (not got or len(parts) != len(got) or len(adds) != len(got) or len(scales) != len(got)
            or min(t.numel() for t in got) == 0):
        raise ValueError("embcore::concat_bags: one ids part, shift and scales part per offsets "
                         "part, each offsets part of one entry or more")
    for t, i in zip(scales, parts):
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != i.numel():
            raise TypeError("embcore::concat_bags: scales must be 1-d float32 tensors, one "
                            "scale an id")
    sc = tuple(t.contiguous() for t in scales)
    counts = tuple(t.numel() - 1 for t in got)
    rows = tuple(sum(counts[:i]) for i in range(len(counts)))
    sizes = [t.numel() for t in parts]
    shifts = tuple(sum(sizes[:i]) for i in range(len(sizes) + 1))
    total = shifts[-1]
    device = got[0].device
    out_ids = torch.empty(total, dtype=torch.int64, device=device)
    out = torch.empty(sum(counts) + 1, dtype=torch.int64, device=device)
    out_scales = torch.empty(total, dtype=torch.float32, device=device)
    out_bags = torch.empty(total if bags else 0, dtype=torch.int64, device=device)
    concat_bags_kernel[(max(1, _cdiv(max(max(counts), max(sizes)), _BATCH_BLOCK)), len(got))](
        parts, tuple(int(a) for a in adds), got, counts, rows, shifts, sc, out_ids, out,
        out_scales, out_bags, total, N=len(got), BAGS=bags,
        LOG=max(1, max(counts).bit_length()), BLOCK=_BATCH_BLOCK)
    return out_ids, out, out_scales, out_bags


concat_bags = custom_op(f"{NAMESPACE}::concat_bags", _concat_bags, mutates_args=())


@concat_bags.register_fake
def _concat_bags_fake(ids: list[torch.Tensor], adds: list[int], offsets: list[torch.Tensor],
                      scales: list[torch.Tensor], bags: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    nnz = sum(t.shape[0] for t in ids)
    return (offsets[0].new_empty(nnz, dtype=torch.int64),
            offsets[0].new_empty(sum(t.shape[0] - 1 for t in offsets) + 1, dtype=torch.int64),
            offsets[0].new_empty(nnz, dtype=torch.float32),
            offsets[0].new_empty(nnz if bags else 0, dtype=torch.int64))


def _dedup_runs(sorted_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``embcore::dedup_runs``: ((n,) int64 unique, (n + 1,) int64 unique offsets) of (n,)
    sorted int64 ids, padded as ``bags.dedup_padded`` pads them (FBGEMM's
    ``fbgemm::jagged_unique_indices`` keeps its counts on the device likewise)."""
    (ids,) = _parts([sorted_ids], "dedup_runs")
    n = ids.numel()
    unique = torch.empty(n, dtype=torch.int64, device=ids.device)
    uoff = torch.empty(n + 1, dtype=torch.int64, device=ids.device)
    runs_kernel[(1,)](ids, unique, uoff, n, BLOCK=_BATCH_BLOCK)
    return unique, uoff


dedup_runs = custom_op(f"{NAMESPACE}::dedup_runs", _dedup_runs, mutates_args=())


@dedup_runs.register_fake
def _dedup_runs_fake(sorted_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = sorted_ids.shape[0]
    return sorted_ids.new_empty(n, dtype=torch.int64), sorted_ids.new_empty(n + 1,
                                                                             dtype=torch.int64)


OPS = {"lookup": lookup, "row_gradients": row_gradients, "sparse_update": sparse_update,
       "move_rows": move_rows, "hash_find": hash_find, "hash_insert": hash_insert,
       "hash_delete": hash_delete, "init_rows": init_rows, "id_bounds": id_bounds,
       "concat_shift": concat_shift, "concat_offsets": concat_offsets,
       "jagged_offsets": jagged_offsets, "bag_index": bag_index, "dedup_runs": dedup_runs,
       "concat_bags": concat_bags}


def _eager(body: Any) -> Any:
    """``body`` as its operator's eager kernel runs it (the Triton kernels launched as they are,
    not through ``wrap_triton``'s traceable wrapper), without the dispatcher."""
    return compat.without_triton_wrapping(body)


# Each operator's kernel launched directly: what kernels/gpu/launch.py calls where no tracer can
# see the call. The dispatcher's Python path of a ``custom_op`` costs tens of microseconds a call,
# and for an operator that writes its arguments torch 2.13's ``utils.fill_defaults`` (reading
# ``schema.arguments``, a new list, once per argument) about a millisecond for
# ``sparse_update``'s 24: measured on this repository's CPU, calls with no rows, through the
# operator / direct, lookup 56 / 6 us, sparse_update 808 / 2 us.
DIRECT = {"lookup": _eager(_lookup), "row_gradients": _eager(_row_gradients),
          "sparse_update": _eager(_sparse_update), "move_rows": _eager(_move_rows),
          "hash_find": _hash_find, "hash_insert": _hash_insert, "hash_delete": _hash_delete,
          "init_rows": _init_rows, "id_bounds": _id_bounds, "concat_shift": _concat_shift,
          "concat_offsets": _concat_offsets, "jagged_offsets": _jagged_offsets,
          "bag_index": _bag_index, "dedup_runs": _dedup_runs, "concat_bags": _concat_bags}
