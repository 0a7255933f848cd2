"""The slow tier's row checksums: their definition (torch ops, the reference) and a move of rows
that writes or checks them (torch ops, and the fused CPU kernel ``cpu.copy_rows_summed``: a
backend's ``move_summed``, ops/backend.py).

A row of an offloaded table is its parameters and its optimizer slots, arrays ``a_1 .. a_k`` in
that order (docs/semantics.md, tables beyond memory). Its checksum, a 32-bit number:

- each array's row sum ``s = sum_j w_j * K * (2j + 1) mod 2**32``, over the row's bytes read as
  32-bit words ``w_j`` (native byte order, the last word zero-padded), ``K = 0x9E3779B1``;
- ``h = 2 * (key + version * K) + 1 mod 2**32`` (``key``: the shard row; ``version``: how many
  times its checksum was set, mod 2**31, a count the cache's index holds in fast memory,
  state/tier/index.py; 0 at first), then ``h = (h ^ s) * P mod 2**32`` for each array's
  ``s`` in order, ``P = 0x01000193`` (FNV's prime).

Each step is one-to-one in the word it adds (an odd weight, an odd multiplier), so a row with one
word changed never keeps its checksum; nor does a row's record of an earlier version (a lost
write: the file, or part of it, back to bytes it held before, its stored checksums with it),
whose seed differs from the current one for fewer than 2**31 writes of the row since; nor a row
holding another row's record of the same version (of another version: unless the versions differ
by the one amount mod 2**31 at which the two rows' ``key + version * K`` meet, ``K`` odd); a
zeroed row and a zero checksum never agree (``h`` stays odd). It costs a multiply-add per 4
bytes (vectorized), summed from the bytes just copied. Stored as int32 (the same 32 bits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kernels import cpu

WEIGHT = 0x9E3779B1
PRIME = 0x01000193
MASK = 0xFFFFFFFF


def row_sums(rows: Sequence[torch.Tensor], keys: torch.Tensor,
             versions: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) int32: the checksums of n rows, given as their arrays' rows ``rows`` ((n, w_a) each,
    any dtype, in the row's order), their keys ``keys`` ((n,) int64 shard rows) and their
    versions ``versions`` ((n,) integers, taken mod 2**32; None: 0). The reference: plain torch
    ops (64-bit integers, no overflow), what the kernel must match bit for bit."""
    h = (keys.to(torch.int64) * 2 + 1) & MASK
    if versions is not None:  # + version * 2K (mod 2**32, in 16-bit halves: no overflow)
        v, k2 = versions.to(torch.int64) & MASK, (2 * WEIGHT) & MASK
        h = (h + (v & 0xFFFF) * k2 + ((((v >> 16) * (k2 & 0xFFFF)) & 0xFFFF) << 16)) & MASK
    for r in rows:
        data = r.contiguous().view(torch.uint8).reshape(r.shape[0], -1)  # (n, bytes)
        pad = -data.shape[1] % 4
        if pad:
            data = torch.cat([data, data.new_zeros(data.shape[0], pad)], 1)
        words = data.view(torch.int32).to(torch.int64) & MASK  # (n, m)
        j = torch.arange(words.shape[1], dtype=torch.int64)
        weight = (WEIGHT * (2 * j + 1)) & MASK  # (m,) odd
        lo, hi = words & 0xFFFF, words >> 16  # w * c = lo * c + (hi * c mod 2**16) * 2**16
        s = ((lo * weight).sum(1) + (((hi * (weight & 0xFFFF)) & 0xFFFF) << 16).sum(1)) & MASK
        h = ((h ^ s) * PRIME) & MASK
    return torch.where(h >= 2**31, h - 2**32, h).to(torch.int32)


def move_summed_fused(src: Sequence[torch.Tensor], src_rows: torch.Tensor,
                      dst: Sequence[torch.Tensor] | None, dst_rows: torch.Tensor | None,
                      keys: torch.Tensor, sums: torch.Tensor, verify: bool,
                      versions: torch.Tensor | None = None) -> int:
    """``move_summed_torch`` on the fused CPU kernel (``cpu.copy_rows_summed``): one pass per
    array, each row summed from the bytes just copied. Every tensor on the CPU."""
    n = src_rows.numel()
    if n == 0:
        return -1
    acc = torch.empty(n, dtype=torch.int32)
    src_rows, keys = src_rows.contiguous(), keys.contiguous()
    dst_rows = dst_rows.contiguous() if dst_rows is not None else None
    last = len(src) - 1
    bad = -1
    for a, s in enumerate(src):
        bad = cpu.copy_rows_summed(s, src_rows, None if dst is None else dst[a], dst_rows,
                                   keys, acc, a == 0, sums if a == last else None, verify,
                                   versions)
    return bad


def move_summed_torch(src: Sequence[torch.Tensor], src_rows: torch.Tensor,
                      dst: Sequence[torch.Tensor] | None, dst_rows: torch.Tensor | None,
                      keys: torch.Tensor, sums: torch.Tensor, verify: bool,
                      versions: torch.Tensor | None = None) -> int:
    """Moves rows with their checksums: ``dst[a][dst_rows] = src[a][src_rows]`` for every array
    ``a`` (``dst`` None: nothing moves), then ``verify``: each row's checksum must equal
    ``sums[keys]``; else ``sums[keys]`` are set to them. ``src`` / ``dst``: 2-D tensors, rows
    contiguous (the row's arrays in order), on any devices; index tensors (n,) int64; ``sums``
    (N,) int32 (the tier's, on the CPU); ``versions`` ((n,) int32 on the CPU, or None: all 0)
    the rows' versions, which their checksums are keyed to. Torch ops (the backend's
    ``move_summed``; ``move_summed_fused`` gives the same results).

    Returns:
        the first ``i`` whose checksum differs (``verify``), else -1.
    """
    n = src_rows.numel()
    if n == 0:
        return -1
    moved = [s.index_select(0, src_rows.to(s.device)) for s in src]  # (n, w_a) each
    if dst is not None:
        assert dst_rows is not None
        for m, d in zip(moved, dst):
            d.index_copy_(0, dst_rows.to(d.device), m.to(d.device))
    got = row_sums([m.cpu() for m in moved], keys.cpu(), versions)
    keys = keys.to(sums.device)
    if not verify:
        sums[keys] = got
        return -1
    wrong = torch.nonzero(sums[keys] != got).flatten()
    return int(wrong[0]) if wrong.numel() else -1
