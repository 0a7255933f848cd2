"""The GPU kernels of a hash index (int64 key -> int64 value), in Triton: find and insert.

Imported only by ``kernels/gpu.py``, on first use, like ``triton_kernels.py`` (without triton it
still imports, with ``MISSING`` saying why). The index (``state/device_hash.py``) is open
addressing with linear probing over ``S`` slots (a power of two) plus one spare slot at index
``S`` that no probe reaches:

- ``slot_val[s]``: 0 empty, -1 deleted (a tombstone: probes go on past it), ``v + 1`` holding
  value ``v >= 0``; ``slot_key[s]``: the key it holds (read only where ``slot_val > 0``);
- a key's probe starts at ``mix(key) & (S - 1)`` and walks ``+1`` (modulo ``S``) until it finds
  the key or an empty slot. ``mix`` is SplitMix64's finaliser of the key xor a salt (the
  owner of a raw id is ``splitmix64(id) % W``: the salt keeps a shard's keys from sharing their
  low bits).

``hash_insert_kernel`` takes keys known to be absent and distinct: each claims the first empty
or deleted slot of its probe with an atomic compare-and-swap of ``slot_val`` (lanes racing for a
slot: one wins, the others probe on), so which slot a key lands in may depend on the schedule;
what ``find`` answers does not. Lanes that insert nothing aim their compare-and-swap at the
spare slot. Both kernels loop until every lane of their block is done; the index keeps at least
a quarter of its slots empty (``DeviceHash``), so every probe ends.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:  # triton is optional (see triton_kernels.py)
    triton = tl = None
    MISSING: str | None = f"{type(e).__name__}: {e}"
else:
    MISSING = None

jit = triton.jit if triton is not None else (lambda fn: fn)

SALT = 0x5851F42D4C957F2D  # xor-ed into a key before it is mixed (state/device_hash.py's twin)


@jit
def _slot_of(key, mask):
    """(BLOCK,) int64 keys -> their first slot: SplitMix64's finaliser of ``key ^ SALT``, the
    low bits (``mask`` = S - 1)."""
    z = (key ^ 0x5851F42D4C957F2D).to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return z.to(tl.int64, bitcast=True) & mask


@jit
def hash_find_kernel(keys_ptr, n, slot_key_ptr, slot_val_ptr, out_ptr, mask,
                     BLOCK: tl.constexpr):
    """``out[i]`` = the value of ``keys[i]``, -1 where absent, for ``i < n``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys_ptr + offs, mask=live, other=0)
    s = _slot_of(key, mask)
    out = tl.full((BLOCK,), -1, tl.int64)
    active = live
    while tl.max(active.to(tl.int32), axis=0) > 0:
        v = tl.load(slot_val_ptr + s, mask=active, other=0)
        held = active & (v > 0)
        k = tl.load(slot_key_ptr + s, mask=held, other=0)
        found = held & (k == key)
        out = tl.where(found, v - 1, out)
        active = active & (v != 0) & ~found
        s = tl.where(active, (s + 1) & mask, s)
    tl.store(out_ptr + offs, out, mask=live)


@jit
def hash_insert_kernel(keys_ptr, vals_ptr, take_ptr, n, slot_key_ptr, slot_val_ptr, slot_ptr,
                       mask, spare, BLOCK: tl.constexpr):
    """Inserts ``keys[i] -> vals[i]`` where ``take[i]`` (i < n; the keys absent and distinct)
    and writes the slot it took to ``slot[i]`` (``spare`` where not taken)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    active = live & (tl.load(take_ptr + offs, mask=live, other=0) != 0)
    key = tl.load(keys_ptr + offs, mask=active, other=0)
    val = tl.load(vals_ptr + offs, mask=active, other=0) + 1
    s = _slot_of(key, mask)
    got = tl.zeros((BLOCK,), tl.int64) + spare
    while tl.max(active.to(tl.int32), axis=0) > 0:
        cur = tl.load(slot_val_ptr + s, mask=active, other=1)
        open_ = active & (cur <= 0)
        at = tl.where(open_, s, spare)  # (the others' compare-and-swap lands in the spare slot)
        old = tl.atomic_cas(slot_val_ptr + at, cur, val)
        won = open_ & (old == cur)
        tl.store(slot_key_ptr + at, key, mask=won)
        got = tl.where(won, s, got)
        active = active & ~won
        s = tl.where(active & ~open_, (s + 1) & mask, s)  # a lost race retries the same slot
    tl.store(slot_ptr + offs, got, mask=live)
