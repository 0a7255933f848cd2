"""The GPU kernels, in Triton: the pooled lookup and the fused backward + optimizer update.

Imported only by ``kernels/gpu/launch.py``, on first use (this module imports triton through
``lang.py``; embcore itself never needs it; without triton it still imports, and the
kernels are inert plain functions). Both kernels work on tiles of ``BLOCK_R`` output rows
(lookup) or ``BLOCK_U`` distinct rows (update) by ``BLOCK_D`` columns; any D is handled by
masking the columns past D. Every sum runs in float32 in the order the CPU kernels use
(csrc/lookup.h, csrc/update.h):

- lookup: bag r = ``sum_k scales[k] * table[ids[k]]`` over ``k in [offsets[r], offsets[r+1])``,
  k ascending, starting from zero (a unit lookup is a plain copy);
- update: the gradient of distinct row u = ``sum_j scale(order[j]) * grad_out[bag(order[j])]``
  over ``j in [unique_offsets[u], unique_offsets[u+1])``, j ascending; then, per row, the update
  step's five steps (docs/semantics.md section 3): multiplier, clipping, the rule, decoupled
  weight decay, weight clipping.

Tables of float16 / bfloat16 rows (``ROWS`` 1 / 2) are widened to float32 as they are read; the
update rounds its float32 result back, to nearest or, with ``STOCHASTIC``, by numerics/rounding.py's
rule bit for bit (``_row_keys``: each row's identity through its key rows and segments, hashed
with the step's key; ``_round_stochastic`` with the bits ``lowbias32(key + c * 0x9E3779B9)`` of
column c).

Divisions and square roots are the correctly rounded ``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and
``sqrt`` are approximate on NVIDIA GPUs), so SGD / Adagrad / RowwiseAdagrad do the CPU kernel's
arithmetic, operation for operation (a compiler may still fuse a multiply-add on either side).
Powers (AdagradMomentum, FTRL) are ``exp2(y * log2(x))``, to a few float32 ulps.
"""

from __future__ import annotations

from ..rules import Rule
from .lang import jit, tl, triton  # (None where triton is missing)

# Rules of ``sparse_update_kernel`` (``RULE``), numbered by rules.py; NONE only sums the gradients
# (combine backward). An optimizer's record (config/optimizers.py) names its rule (``rule``) and
# gives its h1..h5, F1, F2 (``triton_args``).
# (tl.constexpr: a compiled kernel reads no other globals; the interpreter takes either)
NONE, SGD, ADAGRAD, ROWWISE_ADAGRAD, MOMENTUM, ADAM, FTRL = (
    tl.constexpr(int(r)) if tl is not None else int(r) for r in Rule)


# -- 8-bit rows: codes widened and rounded by integer arithmetic (numerics/rounding.py's rule) ----

@jit
def _widen8(c, ROWS: tl.constexpr):
    """uint8 codes -> their float32 values: float8_e4m3fn (ROWS 3) or float8_e5m2 (ROWS 4)."""
    c = c.to(tl.uint32)
    sign = (c & 0x80) << 24
    if ROWS == 3:  # 4 exponent bits (bias 7), 3 mantissa bits; 0x7F / 0xFF NaN
        e = (c >> 3) & 0xF
        m = c & 0x7
        normal = tl.where((c & 0x7F) == 0x7F, 0x7FC00000, ((e + 120) << 23) | (m << 20))
        sub = m.to(tl.float32) * 0.001953125  # m * 2**-9
    else:  # 5 exponent bits (bias 15), 2 mantissa bits; exponent 31 infinite or NaN
        e = (c >> 2) & 0x1F
        m = c & 0x3
        normal = tl.where(e == 31, 0x7F800000 | (m << 21), ((e + 112) << 23) | (m << 21))
        sub = m.to(tl.float32) * 1.52587890625e-05  # m * 2**-16
    mag = tl.where(e == 0, sub.to(tl.uint32, bitcast=True), normal)
    return (sign | mag).to(tl.float32, bitcast=True)


@jit
def _narrow8(q, u, STOCHASTIC: tl.constexpr, ROWS: tl.constexpr):
    """float32 tile ``q`` (finite values within +-max_finite) -> uint8 codes of float8_e4m3fn
    (ROWS 3) / float8_e5m2 (ROWS 4), to nearest even or stochastically with the uint32 random
    bits ``u``: numerics/rounding.py's ``quantize`` bit for bit (a NaN's sign aside)."""
    b = q.to(tl.uint32, bitcast=True)
    a = b & 0x7FFFFFFF
    sign = (b >> 24) & 0x80
    E4M3 = ROWS == 3
    DROP = 20 if E4M3 else 21                  # float32 mantissa bits below a normal result's
    NORMAL = 0x3C800000 if E4M3 else 0x38800000  # the smallest normal: 2**-6, 2**-14
    INV_SPACING = 512.0 if E4M3 else 65536.0   # 1 / the subnormal spacing, 2**-9 or 2**-16
    SPACING_BITS = 1.1641532182693481e-10 if E4M3 else 9.094947017729282e-13  # 2**-24 spacing
    OFFSET = 960 if E4M3 else 448              # (127 - bias) << mantissa bits
    TOP = 0x7E if E4M3 else 0x7B               # max_finite's code: 448, 57344
    mag = a.to(tl.float32, bitcast=True)
    if STOCHASTIC:
        hn = (a + (u >> (32 - DROP))) >> DROP
        # a subnormal result: |q| + (u >> 8) * 2**-24 * spacing, truncated to the spacing
        sub = (mag + (u >> 8).to(tl.float32) * SPACING_BITS) * INV_SPACING
        k = sub.to(tl.int32).to(tl.uint32)
    else:  # to nearest even: in bits (normal), by the exact quotient's fraction (subnormal)
        hn = (a + ((1 << (DROP - 1)) - 1) + ((a >> DROP) & 1)) >> DROP
        x = mag * INV_SPACING
        k0 = x.to(tl.int32)
        frac = x - k0.to(tl.float32)
        k = (k0 + ((frac > 0.5) | ((frac == 0.5) & ((k0 & 1) == 1))).to(tl.int32)).to(tl.uint32)
    finite_sign = sign
    if STOCHASTIC:  # (the reference's sign: of q < 0, so -0.0 becomes +0.0)
        finite_sign = tl.where(q < 0.0, 0x80, 0).to(tl.uint32)
    code = finite_sign | tl.where(a >= NORMAL, tl.minimum(hn - OFFSET, TOP), k)
    if ROWS == 3:  # no infinity: NaN (an infinity's NaN is positive, as the reference's)
        code = tl.where(a > 0x7F800000, sign | 0x7F, tl.where(a == 0x7F800000, 0x7F, code))
    else:
        code = tl.where(a > 0x7F800000, sign | 0x7F, tl.where(a == 0x7F800000, sign | 0x7C, code))
    return code.to(tl.uint8)


@jit
def _read_rows(table_ptr, rs_ptr, row, cols, D, mask, ROWS: tl.constexpr):
    """The float32 values of ``table[row, cols]`` (broadcast tiles), 8-bit rows (ROWS 3, 4)
    widened and multiplied by their scale ``rs[row]``."""
    if ROWS >= 3:
        c = tl.load(table_ptr + row * D + cols, mask=mask, other=0)
        return _widen8(c, ROWS) * tl.load(rs_ptr + row, mask=mask, other=1.0)
    else:
        return tl.load(table_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)


@jit
def lookup_kernel(table_ptr, rs_ptr, ids_ptr, offsets_ptr, scales_ptr, skip_ptr, out_ptr, R, D,
                  UNIT: tl.constexpr, SCALED: tl.constexpr, CHECKED: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = sum over bag r of scale * table[id], for a BLOCK_R x BLOCK_D tile of ``out``.

    UNIT: bag r is the single id ``ids[r]`` with scale 1 (no offsets, no scales).
    SCALED: per-occurrence ``scales`` (else 1).
    CHECKED: ``skip`` (int64, one value) is the batch's verdict of its checks on the device;
    nonzero, no row is read (its ids may be out of range) and every output row is zero.
    ROWS: the table's rows, as ``sparse_update_kernel``'s; 8-bit rows (3, 4) are read as their
    uint8 codes, widened and multiplied by their row's scale ``rs`` (N,) float32.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)                 # (BLOCK_R,)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)              # (BLOCK_D,)
    live_r = r < R
    out_r = live_r
    r64 = r.to(tl.int64)
    if CHECKED:
        live_r = live_r & (tl.load(skip_ptr + r64 * 0) == 0)  # (the one value, per lane)
    live_c = cols < D
    if UNIT:
        row = tl.load(ids_ptr + r64, mask=live_r, other=0)                 # (BLOCK_R,) int64
        tile = live_r[:, None] & live_c[None, :]
        acc = _read_rows(table_ptr, rs_ptr, row[:, None], cols[None, :], D, tile, ROWS)
    else:
        # The bags' bounds as (BLOCK_R, 1) columns, so that everything in the loop is one 2-D
        # layout (Triton 3.6's layout pass fails on 1-D loads in this loop mixed with the 2-D
        # tile: "mask type matches ptr type"; 3.9 compiles either form).
        r2 = r64[:, None]                                                  # (BLOCK_R, 1)
        start = tl.load(offsets_ptr + r2, mask=live_r[:, None], other=0)  # (BLOCK_R, 1) int64
        end = tl.load(offsets_ptr + r2 + 1, mask=live_r[:, None], other=0)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        # The j-th id of every bag of the tile at once; shorter bags are masked off.
        for j in range(0, tl.max(tl.max(end - start, axis=1), axis=0).to(tl.int32)):
            k = start + j                                                  # (BLOCK_R, 1)
            live = k < end
            row = tl.load(ids_ptr + k, mask=live, other=0)                 # (BLOCK_R, 1)
            x = _read_rows(table_ptr, rs_ptr, row, cols[None, :], D, live & live_c[None, :],
                           ROWS)
            if SCALED:
                x = tl.load(scales_ptr + k, mask=live, other=0.0) * x
            acc += x
    tl.store(out_ptr + r64[:, None] * D + cols[None, :], acc,
             mask=out_r[:, None] & live_c[None, :])


# -- the optimizer rules on a tile (step 3 of the update): (w, slot 1, slot 2) -> new ones ---------

@jit
def _adagrad(w, g, a, lr):
    an = a + g * g
    # an == 0 implies g == 0: dividing by sqrt(0 + 1) gives the rule's zero step (as the CPU)
    empty = (an <= 0.0).to(tl.float32)
    return w - lr * tl.div_rn(g, tl.sqrt_rn(an + empty)), an


@jit
def _rowwise_adagrad(w, g, a, lr, D):
    """``a`` is (BLOCK_U,): one accumulator per row; masked columns of ``g`` are zero."""
    an = a + tl.sum(g * g, axis=1) / D
    root = tl.sqrt_rn(tl.where(an <= 0.0, 1.0, an))[:, None]  # (NaN stays NaN: it propagates)
    return tl.where((an <= 0.0)[:, None], w, w - lr * tl.div_rn(g, root)), an


@jit
def _pow(x, y):
    """``x ** y`` for x >= 0 (0 ** 0 = 1, 0 ** y = 0 for y > 0)."""
    positive = x > 0.0
    p = tl.exp2(y * tl.log2(tl.where(positive, x, 1.0)))
    return tl.where(positive, p, tl.where(y == 0.0, 1.0, 0.0))


@jit
def _momentum(w, g, a, m, lr, momentum, beta2, epsilon, neg_inv_exponent,
              NESTEROV: tl.constexpr, PLAIN_SUM: tl.constexpr):
    if PLAIN_SUM:  # beta2 == 1
        a = a + g * g
    else:
        a = beta2 * a + (1.0 - beta2) * g * g
    scaled = g * _pow(a + epsilon, neg_inv_exponent)
    m = momentum * m + scaled
    if NESTEROV:
        step = momentum * m + scaled
    else:
        step = m
    return w - lr * step, a, m


@jit
def _adam(w, g, m, v, lr, beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon,
          SUM_INSIDE_SQRT: tl.constexpr):
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    if SUM_INSIDE_SQRT:
        den = tl.sqrt_rn(v + epsilon * epsilon)
    else:
        den = tl.sqrt_rn(v) + epsilon
    return w - lr * tl.div_rn(m, den), m, v


@jit
def _ftrl(w, g, a, lin, lr, p, l1, l2, beta, MULTIPLY_LINEAR: tl.constexpr):
    a_new = a + g * g
    pw_new = _pow(a_new, p)
    grown = pw_new - _pow(a, p)
    if MULTIPLY_LINEAR:
        lin = lin + lr * g - grown * w
        quad = pw_new + 2.0 * lr * l2 + beta
        threshold = lr * l1
    else:
        lin = lin + g - tl.div_rn(grown, lr) * w
        quad = tl.div_rn(pw_new, lr) + 2.0 * l2 + tl.div_rn(beta, lr)
        threshold = l1
    keep = (tl.abs(lin) > threshold) & (quad > 0.0)
    sign = tl.where(lin > 0.0, 1.0, -1.0)
    w = tl.where(keep, tl.div_rn(sign * threshold - lin, tl.where(keep, quad, 1.0)), 0.0)
    return w, a_new, lin


# -- 16-bit rows: stochastic rounding (numerics/rounding.py's rule) -----------------------------

@jit
def _lowbias32(x):
    """uint32 -> uint32: Wellons' lowbias32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@jit
def _splitmix64(x):
    """uint64 -> uint64: SplitMix64's output for seed ``x`` (numerics/hashing.py)."""
    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@jit
def _row_keys(row, live, keyrows_ptr, n_keys, seg_ptr, nseg, step_key, col0,
              KEYED: tl.constexpr):
    """(BLOCK_U,) uint32 row keys of table rows ``row`` (numerics/rounding.py: the identity through
    the key rows and the segments, then ``low32(k) ^ high32(k)``), the first column folded in
    (``+ col0 * 0x9E3779B9``). ``seg_ptr``: (3, nseg) int64 starts, bases, strides."""
    k = row
    if KEYED:
        own = row >= n_keys
        k = tl.where(own, row, tl.load(keyrows_ptr + row, mask=live & ~own, other=0))
    ident = tl.zeros_like(k).to(tl.uint64)
    for s in range(0, nseg):  # the last segment starting at or below k (the first one at least)
        start = tl.load(seg_ptr + s)
        base = tl.load(seg_ptr + nseg + s).to(tl.uint64, bitcast=True)
        stride = tl.load(seg_ptr + 2 * nseg + s).to(tl.uint64, bitcast=True)
        cand = base + (k - start).to(tl.uint64, bitcast=True) * stride
        ident = tl.where((k >= start) | (s == 0), cand, ident)
    # (the scalars through a tensor: Triton passes small ints as int32, 0 and 1 as constants)
    sk = (tl.zeros_like(k) + step_key).to(tl.uint64, bitcast=True)
    c0 = (tl.zeros_like(k) + col0).to(tl.uint32)
    h = _splitmix64(_splitmix64(ident) ^ sk)
    return (h ^ (h >> 32)).to(tl.uint32) + c0 * 0x9E3779B9


@jit
def _round_stochastic(x, u, ROWS: tl.constexpr):
    """float32 tile ``x`` -> the uint16 bits of float16 (ROWS 1) / bfloat16 (ROWS 2) values,
    rounded stochastically with the uint32 random bits ``u`` (csrc/half.h)."""
    b = x.to(tl.uint32, bitcast=True)
    a = b & 0x7FFFFFFF
    nan = a > 0x7F800000
    if ROWS == 2:
        h = tl.where(nan, 0x7FC0, (b + (u >> 16)) >> 16)
    else:
        sign = (b >> 16) & 0x8000
        hn = ((a + (u >> 19)) >> 13) - 0x1C000
        hn = tl.minimum(hn, 0x7C00)
        # a subnormal result: |x| + (u >> 8) * 2**-48 in float32, truncated to 2**-24's multiples
        sub = a.to(tl.float32, bitcast=True) + (u >> 8).to(tl.float32) * 3.552713678800501e-15
        sub = tl.where(sub < 1.220703125e-4, sub, 0.0)
        hs = (sub * 16777216.0).to(tl.int32).to(tl.uint32)
        h = sign | tl.where(nan, 0x7E00, tl.where(a >= 0x38800000, hn, hs))
    return h.to(tl.uint16)


# (the rounding's scalars change every step or per table: not specialized on their values, so
# that a new step key is never a new compilation)
@(triton.jit(do_not_specialize=["n_keys", "nseg", "step_key", "col0"]) if triton is not None
  else (lambda fn: fn))
def sparse_update_kernel(
        w_ptr, s1_ptr, s2_ptr,                # (N, D) table; its slots (N, D) or (N, 1)
        rs_ptr,                               # (N,) 8-bit rows' scales (ROWS 3, 4)
        rows_ptr, U, D,                       # (U,) distinct rows
        grad_ptr,                             # (U, D) summed (DIRECT) or (R, D) output grads
        uoff_ptr, order_ptr, bags_ptr, scales_ptr,  # occurrences of each row (not DIRECT)
        skip_ptr,                             # CHECKED: the batch's verdict (nonzero: skip)
        out_ptr,                              # (U, D) summed gradients (RULE == NONE)
        keyrows_ptr, n_keys, seg_ptr, nseg, step_key, col0,  # STOCHASTIC: the rows' keys
        lr, gmul, clip_lo, clip_hi, wd, wmin, wmax,  # the update's steps 1-5
        h1, h2, h3, h4, h5,                   # the rule's own hyper-parameters (gpu.py)
        RULE: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr,  # the rule and its two flags
        DIRECT: tl.constexpr, UNIT: tl.constexpr, SCALED: tl.constexpr,
        MULTIPLIED: tl.constexpr, CLIPPED: tl.constexpr, DECAYED: tl.constexpr,
        BOUNDED: tl.constexpr, ROWS: tl.constexpr, STOCHASTIC: tl.constexpr,
        KEYED: tl.constexpr, CHECKED: tl.constexpr, BLOCK_U: tl.constexpr,
        BLOCK_D: tl.constexpr):
    """Updates BLOCK_U distinct rows (whole rows: BLOCK_D >= D) and their slots, in place.
    ROWS: the table's rows (0 float32, 1 float16, 2 bfloat16: widened, updated in float32 and
    rounded back, stochastically with STOCHASTIC; 3 float8_e4m3fn, 4 float8_e5m2: uint8 codes
    widened with their row's scale ``rs`` (N,) float32, updated in float32 and written back as
    new codes and a new scale, numerics/rounding.py's ``quantize``). CHECKED: a nonzero
    ``skip`` (the batch failed its checks on the device) leaves every row and slot as it was."""
    u = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)                 # (BLOCK_U,)
    cols = tl.arange(0, BLOCK_D)                                           # (BLOCK_D,)
    live_u = u < U
    live_c = cols < D
    u64 = u.to(tl.int64)
    if CHECKED:
        live_u = live_u & (tl.load(skip_ptr + u64 * 0) == 0)  # (the one value, per lane)
    if not DIRECT and RULE != NONE:
        # a row without occurrences pads a dedup of fixed capacity (ops/bags.py
        # ``dedup_padded``): nothing of it is read or written
        live_u = live_u & (tl.load(uoff_ptr + u64 + 1, mask=live_u, other=0)
                           > tl.load(uoff_ptr + u64, mask=live_u, other=0))
    tile = live_u[:, None] & live_c[None, :]

    # 1. the summed gradient of each row
    if DIRECT:
        g = tl.load(grad_ptr + u64[:, None] * D + cols[None, :], mask=tile, other=0.0)
    else:
        # (BLOCK_U, 1) columns, one 2-D layout in the loop: see lookup_kernel
        u2 = u64[:, None]
        start = tl.load(uoff_ptr + u2, mask=live_u[:, None], other=0)     # (BLOCK_U, 1) int64
        end = tl.load(uoff_ptr + u2 + 1, mask=live_u[:, None], other=0)
        g = tl.zeros([BLOCK_U, BLOCK_D], dtype=tl.float32)
        # The j-th occurrence of every row of the tile at once, in the order of ``order``.
        for j in range(0, tl.max(tl.max(end - start, axis=1), axis=0).to(tl.int32)):
            at = start + j                                                 # (BLOCK_U, 1)
            live = at < end
            k = tl.load(order_ptr + at, mask=live, other=0)                # occurrence
            if UNIT:
                b = k
            else:
                b = tl.load(bags_ptr + k, mask=live, other=0)              # its output row
            x = tl.load(grad_ptr + b * D + cols[None, :], mask=live & live_c[None, :],
                        other=0.0)
            if SCALED:
                x = tl.load(scales_ptr + k, mask=live, other=0.0) * x
            g += x
    if RULE == NONE:
        tl.store(out_ptr + u64[:, None] * D + cols[None, :], g, mask=tile)
        return

    # 2. multiplier and clipping
    if MULTIPLIED:
        g = g * gmul
    if CLIPPED:  # (masked lanes stay zero: a positive lower bound would make them nonzero)
        g = tl.where(tile, tl.minimum(tl.maximum(g, clip_lo), clip_hi), 0.0)

    # 3. the rule
    row = tl.load(rows_ptr + u64, mask=live_u, other=0)                   # (BLOCK_U,) int64
    at = row[:, None] * D + cols[None, :]                                  # (BLOCK_U, BLOCK_D)
    w_before = _read_rows(w_ptr, rs_ptr, row[:, None], cols[None, :], D, tile, ROWS)
    if RULE == SGD:
        w = w_before - lr * g
    elif RULE == ADAGRAD:
        w, a = _adagrad(w_before, g, tl.load(s1_ptr + at, mask=tile, other=0.0), lr)
        tl.store(s1_ptr + at, a, mask=tile)
    elif RULE == ROWWISE_ADAGRAD:
        w, a = _rowwise_adagrad(w_before, g, tl.load(s1_ptr + row, mask=live_u, other=0.0),
                                lr, D)
        tl.store(s1_ptr + row, a, mask=live_u)
    elif RULE == MOMENTUM:
        w, a, m = _momentum(w_before, g, tl.load(s1_ptr + at, mask=tile, other=0.0),
                            tl.load(s2_ptr + at, mask=tile, other=0.0),
                            lr, h1, h2, h3, h4, F1, F2)
        tl.store(s1_ptr + at, a, mask=tile)
        tl.store(s2_ptr + at, m, mask=tile)
    elif RULE == ADAM:
        w, m, v = _adam(w_before, g, tl.load(s1_ptr + at, mask=tile, other=0.0),
                        tl.load(s2_ptr + at, mask=tile, other=0.0),
                        lr, h1, h2, h3, h4, h5, F1)
        tl.store(s1_ptr + at, m, mask=tile)
        tl.store(s2_ptr + at, v, mask=tile)
    else:  # FTRL
        w, a, lin = _ftrl(w_before, g, tl.load(s1_ptr + at, mask=tile, other=1.0),
                          tl.load(s2_ptr + at, mask=tile, other=0.0), lr, h1, h2, h3, h4, F1)
        tl.store(s1_ptr + at, a, mask=tile)
        tl.store(s2_ptr + at, lin, mask=tile)

    # 4-5. decoupled weight decay, weight clipping
    if DECAYED:
        w = w - wd * w_before
    if BOUNDED:
        w = tl.minimum(tl.maximum(w, wmin), wmax)
    if ROWS == 0:
        tl.store(w_ptr + at, w, mask=tile)
    elif ROWS >= 3:  # new scales (max |w| of the finite values / max_finite) and codes
        TOP = 448.0 if ROWS == 3 else 57344.0  # max_finite
        finite = tl.abs(w) <= 3.4028234663852886e38
        s = tl.div_rn(tl.max(tl.where(finite & tile, tl.abs(w), 0.0), axis=1), TOP)  # (BLOCK_U,)
        s = tl.where(s > 0.0, s, 1.0)
        q = tl.div_rn(w, s[:, None])
        q = tl.where(tl.abs(q) <= 3.4028234663852886e38,
                     tl.minimum(tl.maximum(q, -TOP), TOP), q)
        if STOCHASTIC:
            key = _row_keys(row, live_u, keyrows_ptr, n_keys, seg_ptr, nseg, step_key, col0,
                            KEYED)                                         # (BLOCK_U,) uint32
            bits = _lowbias32(key[:, None] + cols[None, :].to(tl.uint32) * 0x9E3779B9)
        else:
            bits = tl.zeros([BLOCK_U, BLOCK_D], dtype=tl.uint32)
        tl.store(w_ptr + at, _narrow8(q, bits, STOCHASTIC, ROWS), mask=tile)
        tl.store(rs_ptr + row, s, mask=live_u)
    elif STOCHASTIC:
        key = _row_keys(row, live_u, keyrows_ptr, n_keys, seg_ptr, nseg, step_key, col0,
                        KEYED)                                             # (BLOCK_U,) uint32
        bits = _lowbias32(key[:, None] + cols[None, :].to(tl.uint32) * 0x9E3779B9)
        h = _round_stochastic(w, bits, ROWS)
        if ROWS == 1:
            tl.store(w_ptr + at, h.to(tl.float16, bitcast=True), mask=tile)
        else:
            tl.store(w_ptr + at, h.to(tl.bfloat16, bitcast=True), mask=tile)
    elif ROWS == 1:  # to nearest: the cast (round to nearest even)
        tl.store(w_ptr + at, w.to(tl.float16), mask=tile)
    else:  # to nearest even in bits (the interpreter's bfloat16 cast truncates)
        b = w.to(tl.uint32, bitcast=True)
        h = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0,
                     (b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.uint16)
        tl.store(w_ptr + at, h.to(tl.bfloat16, bitcast=True), mask=tile)
