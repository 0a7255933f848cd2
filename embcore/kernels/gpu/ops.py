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
``maps`` written, so that a tracer keeps them, in order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.library import custom_op, triton_op, wrap_triton

from ...base import compat
from ..rules import Rule
from .args import BITS, CODED, CONSTEXPR, F32, FLOAT, I8, I32, I64, INT, ROWS, Launch, tensor
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


OPS = {"lookup": lookup, "row_gradients": row_gradients, "sparse_update": sparse_update,
       "move_rows": move_rows, "hash_find": hash_find, "hash_insert": hash_insert,
       "hash_delete": hash_delete, "init_rows": init_rows}


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
          "init_rows": _init_rows}
