"""The GPU kernel that moves whole rows between two arrays, in Triton: a cache and its slow tier.

Imported only by ``kernels/gpu/ops.py``, on first use, like ``rows.py`` (without triton it
still imports: kernels/gpu/lang.py). ``move_rows_kernel`` copies row ``src_idx[i]`` of
``src`` to row ``dst_idx[i]`` of ``dst`` for every ``i < n`` where ``take[i]`` is set: both
arrays (R, D) contiguous of one dtype (bit copies: float rows of any width, slots included).
Either array may be pinned host memory (a GPU's slow tier, state/tier/cache.py): the GPU reads or
writes it directly over the bus, so that how many rows move never has to be known on the host.
Each program moves ``BLOCK_R`` rows by ``BLOCK_D`` columns.
"""

from __future__ import annotations

from .lang import jit, tl  # (None where triton is missing)


@jit
def move_rows_kernel(src_ptr, src_idx_ptr, dst_ptr, dst_idx_ptr, take_ptr, n, D,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = r < n
    live = live & (tl.load(take_ptr + r, mask=live, other=0) != 0)
    s = tl.load(src_idx_ptr + r, mask=live, other=0)
    d = tl.load(dst_idx_ptr + r, mask=live, other=0)
    m = live[:, None] & (c < D)[None, :]
    x = tl.load(src_ptr + s[:, None] * D + c[None, :], mask=m)
    tl.store(dst_ptr + d[:, None] * D + c[None, :], x, mask=m)
