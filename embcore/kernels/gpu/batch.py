"""The GPU kernels of a batch's preparation, in Triton: its ids checked, concatenated, deduplicated.

Imported only by ``kernels/gpu/ops.py``, on first use, like ``rows.py`` (without triton it
still imports: kernels/gpu/lang.py). Each replaces a handful of torch ops of the device step
by one launch, with the torch ops' results bit for bit (ops/bags.py and inputs/canonical.py are
their readable references):

- ``id_bounds_kernel``: each part's ``[min, max]`` after the batch's other flags (the report
  that inputs/canonical.py's ``Verdicts`` keeps) and the batch's verdict, nonzero when a flag is
  or an id is out of ``[0, vocab)``;
- ``concat_shift_kernel``: the parts concatenated, each part's ids shifted by its own amount
  (a physical table's features: ops/backend.py ``Backend.dedup``);
- ``jagged_offsets_kernel``: a feature's jagged offsets made safe to index with, their verdict,
  and the mean combiner's scales of its unweighted bags;
- ``bag_index_kernel``: each id's bag (``bags.bag_index``);
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
def id_bounds_kernel(parts, sizes, vocabs, flags, report_ptr, verdict_ptr, N: tl.constexpr,
                     F: tl.constexpr, BLOCK: tl.constexpr):
    """``report[j]`` = ``flags[j]`` (F one-value int64 tensors, 0: good) for j < F, then
    ``report[F + 2 i], report[F + 2 i + 1]`` = min, max of non-empty ``parts[i]`` (``sizes[i]``
    int64 ids); ``verdict`` = 1 when a flag is nonzero or a part has an id outside
    ``[0, vocabs[i])``, else 0."""
    bad = tl.zeros((), tl.int64)
    for j in tl.static_range(F):
        flag = tl.load(flags[j]).to(tl.int64)
        tl.store(report_ptr + j, flag)
        bad = bad | (flag != 0).to(tl.int64)
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
        tl.store(report_ptr + F + 2 * i, least)
        tl.store(report_ptr + F + 2 * i + 1, most)
        bad = bad | ((least < 0) | (most >= vocabs[i])).to(tl.int64)
    tl.store(verdict_ptr, bad)


@jit
def concat_shift_kernel(parts, sizes, starts, shifts, out_ptr, tail, N: tl.constexpr,
                        TAIL: tl.constexpr, BLOCK: tl.constexpr):
    """``out[starts[i] + k] = parts[i][k] + shifts[i]`` for ``k < sizes[i]``; program (b, i)
    writes block b of part i; with ``TAIL``, program (0, 0) writes ``tail`` after them all (the
    last of concatenated offsets)."""
    b = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    if TAIL:
        if (b == 0) & (which == 0):
            tl.store(out_ptr + starts[N - 1] + sizes[N - 1], tail.to(tl.int64))
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


@jit
def _larger(a, b):
    return tl.maximum(a, b)


@jit
def _bag_of(k, live, offsets_ptr, n, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """The bag of each id ``k`` (``live`` lanes) of valid (n,) int64 ``offsets``: the last bag
    starting at or before it (empty bags start where the next does), by ``LOG`` halvings."""
    lo = tl.zeros((BLOCK,), tl.int64)
    hi = tl.zeros((BLOCK,), tl.int64) + (n - 1)
    for _ in tl.static_range(LOG):
        mid = (lo + hi + 1) // 2
        open_ = lo < hi
        go = tl.load(offsets_ptr + mid, mask=live & open_, other=0) <= k
        lo = tl.where(open_ & go, mid, lo)
        hi = tl.where(open_ & ~go, mid - 1, hi)
    return lo


@jit
def bag_index_kernel(offsets_ptr, n, nnz, out_ptr, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """``out[k]`` = the bag of id k (k < nnz) of valid (n,) int64 ``offsets``."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = k < nnz
    tl.store(out_ptr + k, _bag_of(k, live, offsets_ptr, n, LOG, BLOCK), mask=live)


@jit
def jagged_offsets_kernel(offsets_ptr, n, nnz, safe_ptr, verdict_ptr, scales_ptr,
                          MEAN: tl.constexpr, LOG: tl.constexpr, BLOCK: tl.constexpr):
    """For (n,) int64 jagged ``offsets`` over ``nnz`` ids (n >= 2): ``safe`` the offsets made
    safe to index with (clamped to ``[0, nnz]``, the running max, 0 first and ``nnz`` last:
    ``Backend.offsets_verdict``), ``verdict`` 1 where they differ from the given ones (malformed),
    else 0; with ``MEAN``, ``scales[k]`` = 1 / the length of id k's bag of ``safe`` (the mean
    combiner's scale of unweighted bags, a correctly rounded float32 division), found by a
    binary search of ``LOG`` halvings (2**LOG >= n)."""
    running = tl.zeros((), tl.int64)
    bad = tl.zeros((), tl.int64)
    for s in range(0, n, BLOCK):
        o = s + tl.arange(0, BLOCK).to(tl.int64)
        live = o < n
        given = tl.load(offsets_ptr + o, mask=live, other=0)
        low = tl.where(o == n - 1, nnz, 0)
        high = tl.where(o == 0, 0, nnz)
        clamped = tl.minimum(tl.maximum(given, low), high)
        safe = tl.maximum(tl.associative_scan(tl.where(live, clamped, 0), 0, _larger), running)
        tl.store(safe_ptr + o, safe, mask=live)
        bad = bad | tl.max((live & (safe != given)).to(tl.int64), 0)
        running = tl.max(tl.where(live, safe, 0), 0)
    tl.store(verdict_ptr, bad)
    if MEAN:
        tl.debug_barrier()  # (every lane's safe offsets written before any is searched)
        for s in range(0, nnz, BLOCK):
            k = s + tl.arange(0, BLOCK).to(tl.int64)
            live = k < nnz
            lo = _bag_of(k, live, safe_ptr, n, LOG, BLOCK)
            start = tl.load(safe_ptr + lo, mask=live, other=0)
            end = tl.load(safe_ptr + lo + 1, mask=live & (lo + 1 < n), other=1)
            length = (end - start).to(tl.float32)
            tl.store(scales_ptr + k, tl.div_rn(tl.full((BLOCK,), 1.0, tl.float32), length),
                     mask=live)
