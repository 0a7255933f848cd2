"""The GPU kernels of a batch's preparation, in Triton: its ids checked, concatenated, deduplicated.

Imported only by ``kernels/gpu/ops.py``, on first use, like ``rows.py`` (without triton it
still imports: kernels/gpu/lang.py). Each replaces a handful of torch ops of the device step
by one launch, with the torch ops' results bit for bit (ops/bags.py and inputs/canonical.py are
their readable references):

- ``id_bounds_kernel``: each part's ``[min, max]`` (the report that inputs/canonical.py's
  ``Verdicts`` keeps) and the batch's verdict, nonzero when an id is out of ``[0, vocab)``;
- ``concat_shift_kernel``: the parts concatenated, each part's ids shifted by its own amount
  (a physical table's features: ops/backend.py ``Backend.dedup``);
- ``runs_kernel``: the runs of equal ids in sorted ids, as ``bags.dedup_padded`` gives them
  (the distinct ids and each one's first occurrence, padded to the ids' count).

The parts come as a tuple of tensors (one pointer each) with their sizes, so that nothing is
concatenated before the kernel. ``id_bounds_kernel`` and ``runs_kernel`` are one program
looping over blocks (a scan: each block's ranks continue the last block's); the batches of a
step are small, and one launch is what a step pays for on a device.
"""

from __future__ import annotations

from .lang import jit, tl  # (None where triton is missing)

_BIG = 2**62  # (above any id a check accepts; the empty lanes' stand-in)


@jit
def id_bounds_kernel(parts, sizes, vocabs, report_ptr, verdict_ptr, N: tl.constexpr,
                     BLOCK: tl.constexpr):
    """``report[2 i], report[2 i + 1]`` = min, max of non-empty ``parts[i]`` (``sizes[i]``
    int64 ids); ``verdict`` = 1 when any part has an id outside ``[0, vocabs[i])``, else 0."""
    bad = tl.zeros((), tl.int64)
    for i in tl.static_range(N):
        n = sizes[i]
        lo = tl.full((BLOCK,), _BIG, tl.int64)
        hi = tl.full((BLOCK,), -_BIG, tl.int64)
        for s in range(0, n, BLOCK):
            o = s + tl.arange(0, BLOCK)
            live = o < n
            v = tl.load(parts[i] + o, mask=live, other=0)
            lo = tl.minimum(lo, tl.where(live, v, _BIG))
            hi = tl.maximum(hi, tl.where(live, v, -_BIG))
        least = tl.min(lo, 0)
        most = tl.max(hi, 0)
        tl.store(report_ptr + 2 * i, least)
        tl.store(report_ptr + 2 * i + 1, most)
        bad = bad | ((least < 0) | (most >= vocabs[i])).to(tl.int64)
    tl.store(verdict_ptr, bad)


@jit
def concat_shift_kernel(parts, sizes, starts, shifts, out_ptr, N: tl.constexpr,
                        BLOCK: tl.constexpr):
    """``out[starts[i] + k] = parts[i][k] + shifts[i]`` for ``k < sizes[i]``; program (b, i)
    writes block b of part i."""
    b = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    for i in tl.static_range(N):
        if which == i:
            o = b * BLOCK + tl.arange(0, BLOCK)
            live = o < sizes[i]
            v = tl.load(parts[i] + o, mask=live, other=0)
            tl.store(out_ptr + starts[i] + o, v + shifts[i], mask=live)


@jit
def runs_kernel(sorted_ptr, unique_ptr, uoff_ptr, n, BLOCK: tl.constexpr):
    """For ``n`` sorted int64 ids: ``unique[u]`` the u-th distinct id and ``uoff[u]`` its first
    position, for u < U; ``uoff[u] = n`` for U <= u <= n and ``unique[u]`` the largest id for
    U <= u < n (``bags.dedup_padded``'s padding)."""
    count = tl.zeros((), tl.int64)  # distinct ids in the blocks before
    for s in range(0, n, BLOCK):
        o = s + tl.arange(0, BLOCK).to(tl.int64)
        live = o < n
        v = tl.load(sorted_ptr + o, mask=live, other=0)
        before = tl.load(sorted_ptr + o - 1, mask=live & (o > 0), other=0)
        first = live & ((o == 0) | (v != before))
        rank = count + tl.cumsum(first.to(tl.int64), 0) - 1
        tl.store(uoff_ptr + rank, o, mask=first)
        tl.store(unique_ptr + rank, v, mask=first)
        count = count + tl.sum(first.to(tl.int64), 0)
    largest = tl.load(sorted_ptr + n - 1, mask=n > 0, other=0)
    for s in range(0, n + 1, BLOCK):
        o = s + tl.arange(0, BLOCK).to(tl.int64)
        pad = (o >= count) & (o <= n)
        tl.store(uoff_ptr + o, tl.zeros((BLOCK,), tl.int64) + n, mask=pad)
        tl.store(unique_ptr + o, tl.zeros((BLOCK,), tl.int64) + largest, mask=pad & (o < n))
