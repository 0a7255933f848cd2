"""The GPU kernels of a hash index over its owner's keys, in Triton: find, insert and delete.

Imported only by ``kernels/gpu/ops.py``, on first use, like ``rows.py`` (without triton it
still imports: kernels/gpu/lang.py). An index (``state/vocab/device_hash.py``) maps a key to
the place ``v`` where its owner holds it (a row of a map: ``owner_keys[v]`` is the key), by open
addressing with linear probing over ``S`` slots (a power of two) plus one spare slot at index
``S`` that no probe reaches. A slot holds only a place, int32 (or int64 for owners of 2**31 - 2
places or more):

- ``slot[s]``: 0 empty, -1 deleted (a tombstone: probes go on past it), ``v + 1`` for place ``v``,
  whose key is ``owner_keys[v]`` (read only there);
- a key's probe starts at ``mix(key) & (S - 1)`` and walks ``+1`` (modulo ``S``) until it finds
  the key or an empty slot. ``mix`` is SplitMix64's finaliser of the key xor a salt (the owner of
  a raw id is ``splitmix64(id) % W``: the salt keeps a shard's keys from sharing their low bits).

Each kernel works on one index, or on several in one launch (the maps of stacked tables): a
table ``maps`` of each index's addresses (its slots, its owner's keys) and ``S - 1``, and each
lane's row of it (``which``).

``hash_insert_kernel`` takes keys known to be absent and distinct: each claims the first empty or
deleted slot of its probe with an atomic compare-and-swap (lanes racing for a slot: one wins, the
others probe on), so which slot a key lands in may depend on the schedule; what ``find`` answers
does not. ``hash_delete_kernel`` finds the slot holding a given place along its key's probe and
marks it deleted. Lanes that do nothing aim their compare-and-swap at the spare slot. Every
kernel loops until each lane of its block is done; the index keeps at least a quarter of its
slots empty (``DeviceHash``), so every probe ends.
"""

from __future__ import annotations

from .lang import jit, tl  # (None where triton is missing)


@jit
def _slot_of(key, mask):
    """(BLOCK,) int64 keys -> their first slot: SplitMix64's finaliser of ``key ^ salt``, the
    low bits (``mask`` = S - 1)."""
    z = (key ^ 0x5851F42D4C957F2D).to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return z.to(tl.int64, bitcast=True) & mask


@jit
def _maps(maps_ptr, which_ptr, offs, live, ONE: tl.constexpr, SLOT64: tl.constexpr):
    """Each lane's index: ``(slots, owner, mask)``, pointers to its slots (int32, or int64 with
    SLOT64) and to its owner's int64 keys, and its S - 1. ``maps`` is (M, 3) int64 rows
    ``(slots' address, owner's address, S - 1)``; lane i's row is ``which[i]`` (ONE: row 0)."""
    if ONE:
        w = tl.zeros(offs.shape, tl.int64)
    else:
        w = tl.load(which_ptr + offs, mask=live, other=0).to(tl.int64)
    row = maps_ptr + 3 * w
    if SLOT64:
        slots = tl.load(row).to(tl.pointer_type(tl.int64))
    else:
        slots = tl.load(row).to(tl.pointer_type(tl.int32))
    owner = tl.load(row + 1).to(tl.pointer_type(tl.int64))
    return slots, owner, tl.load(row + 2)


@jit
def _taken(keys_ptr, places_ptr, take_ptr, n, maps_ptr, which_ptr, BLOCK: tl.constexpr,
           ONE: tl.constexpr, SLOT64: tl.constexpr):
    """A block's lanes of an insert or a delete: ``(slots, mask, active, key, place + 1)``,
    ``active`` where the lane is in range and taken."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    slots, _, mask = _maps(maps_ptr, which_ptr, offs, live, ONE, SLOT64)
    active = live & (tl.load(take_ptr + offs, mask=live, other=0) != 0)
    key = tl.load(keys_ptr + offs, mask=active, other=0)
    val = tl.load(places_ptr + offs, mask=active, other=0) + 1
    return slots, mask, active, key, val


@jit
def hash_find_kernel(keys_ptr, n, maps_ptr, which_ptr, out_ptr, BLOCK: tl.constexpr,
                     ONE: tl.constexpr, SLOT64: tl.constexpr):
    """``out[i]`` = the place of ``keys[i]`` in its index, -1 where absent, for ``i < n``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    slots, owner, mask = _maps(maps_ptr, which_ptr, offs, live, ONE, SLOT64)
    key = tl.load(keys_ptr + offs, mask=live, other=0)
    s = _slot_of(key, mask)
    out = tl.full((BLOCK,), -1, tl.int64)
    active = live
    while tl.max(active.to(tl.int32), axis=0) > 0:
        v = tl.load(slots + s, mask=active, other=0).to(tl.int64)
        held = active & (v > 0)
        k = tl.load(owner + (v - 1), mask=held, other=0)
        found = held & (k == key)
        out = tl.where(found, v - 1, out)
        active = active & (v != 0) & ~found
        s = tl.where(active, (s + 1) & mask, s)
    tl.store(out_ptr + offs, out, mask=live)


@jit
def hash_insert_kernel(keys_ptr, places_ptr, take_ptr, n, maps_ptr, which_ptr,
                       BLOCK: tl.constexpr, ONE: tl.constexpr, SLOT64: tl.constexpr):
    """Inserts ``keys[i]`` at place ``places[i]`` of its index where ``take[i]`` (i < n; the
    keys absent from it and distinct)."""
    slots, mask, active, key, val = _taken(keys_ptr, places_ptr, take_ptr, n, maps_ptr,
                                           which_ptr, BLOCK, ONE, SLOT64)
    if SLOT64:
        val = val.to(tl.int64)
    else:
        val = val.to(tl.int32)
    s = _slot_of(key, mask)
    spare = mask + 1
    while tl.max(active.to(tl.int32), axis=0) > 0:
        cur = tl.load(slots + s, mask=active, other=1)
        open_ = active & (cur <= 0)
        at = tl.where(open_, s, spare)  # (the others' compare-and-swap lands in the spare slot)
        old = tl.atomic_cas(slots + at, cur, val)
        won = open_ & (old == cur)
        active = active & ~won
        s = tl.where(active & ~open_, (s + 1) & mask, s)  # a lost race retries the same slot


@jit
def hash_delete_kernel(keys_ptr, places_ptr, take_ptr, n, maps_ptr, which_ptr,
                       BLOCK: tl.constexpr, ONE: tl.constexpr, SLOT64: tl.constexpr):
    """Deletes ``keys[i]``, held at place ``places[i]`` of its index, where ``take[i]``."""
    slots, mask, active, key, val = _taken(keys_ptr, places_ptr, take_ptr, n, maps_ptr,
                                           which_ptr, BLOCK, ONE, SLOT64)
    s = _slot_of(key, mask)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        v = tl.load(slots + s, mask=active, other=0).to(tl.int64)
        found = active & (v == val)
        if SLOT64:
            tl.store(slots + s, tl.full((BLOCK,), -1, tl.int64), mask=found)
        else:
            tl.store(slots + s, tl.full((BLOCK,), -1, tl.int32), mask=found)
        active = active & ~found & (v != 0)
        s = tl.where(active, (s + 1) & mask, s)
