"""The kernels of raw ids: deduplication by hashing, the id maps' find, step, index and growth, one
map or several at once, new rows' initial values (csrc/vocab.h).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence

import torch

from .args import (
    DOUBLE,
    F32,
    I32,
    I64,
    INT,
    INT64,
    U8,
    Kernel,
    PartsArg,
    allocated,
    array,
    ctypes_array,
    read,
    written,
)
from .library import threads

_DEDUP_RAW = Kernel("ec_dedup_raw", INT64, [
    ("ids", read(I64)),               # (n,)
    ("n", INT64),
    ("unique", allocated(I64)),       # (U,)
    ("inverse", allocated(I64)),      # (n,)
    ("order", allocated(I64)),        # (n,)
    ("uoff", allocated(I64)),         # (U + 1,)
])


def dedup_raw(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    """Deduplicates raw ids (any int64) by hashing, in O(nnz).

    Args:
        ids: (nnz,) contiguous int64 CPU ids.

    Returns:
        ``(unique (U,), inverse (nnz,), order (nnz,), unique_offsets (U + 1,))``: the distinct
        ids in order of first occurrence, ``unique[inverse] == ids``, and each distinct id's
        occurrences ``order[unique_offsets[u]:unique_offsets[u+1]]`` (ascending positions).
    """
    n = ids.numel()
    buf = torch.empty(4 * n + 1, dtype=torch.int64)  # [unique | inverse | order | offsets]
    base = buf.data_ptr()
    u = _DEDUP_RAW.call((ids, None), n, base, base + 8 * n, base + 16 * n, base + 24 * n)
    return buf[:u], buf[n:2 * n], buf[2 * n:3 * n], buf[3 * n:3 * n + u + 1]


_DEDUP_RAW_RUNS = Kernel("ec_dedup_raw_runs", INT64, [
    ("parts", PartsArg()),              # (nparts,) part p: lens[p] ids
    ("lens", array(ctypes.c_int64)),    # (nparts,)
    ("run_parts", array(ctypes.c_int64)),  # (R + 1,) run r: parts [run_parts[r], run_parts[r+1])
    ("nruns", INT64),
    ("ids_out", allocated(I64)),        # (n,)
    ("unique", allocated(I64)),         # (U,)
    ("inverse", allocated(I64)),        # (n,)
    ("order", allocated(I64)),          # (n,)
    ("uoff", allocated(I64)),           # (U + 1,)
    ("run_unique", allocated(I64)),     # (R,)
    ("nt", INT),
])


def dedup_raw_runs(parts: Sequence[torch.Tensor], runs: Sequence[int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, list[int]]:
    """Concatenates raw-id parts and deduplicates them run by run, in one call.

    Args:
        parts: contiguous int64 CPU ids (one tensor per feature).
        runs: how many consecutive parts each run holds (the features of one stacked member):
            an id of one run is not the same as that id in another.

    Returns:
        ``(ids (nnz,), unique (U,), inverse (nnz,), order (nnz,), unique_offsets (U + 1,),
        per run its distinct ids)``: ``dedup_raw``'s layout over the whole, each run's distinct
        ids a block of ``unique`` (in order of first occurrence), views of one buffer.
    """
    lens = [t.numel() for t in parts]
    n, r = sum(lens), len(runs)
    bounds = [0, *itertools.accumulate(runs)]
    if any(k < 0 for k in runs) or bounds[-1] != len(parts):
        raise ValueError(f"{_DEDUP_RAW_RUNS.name}: runs must count the {len(parts)} parts in "
                         f"turn (none negative), got {list(runs)}")
    buf = torch.empty(5 * n + 1 + r, dtype=torch.int64)  # [ids|unique|inverse|order|uoff|runs]
    base = buf.data_ptr()
    u = _DEDUP_RAW_RUNS.call((parts, lens, None), ctypes_array(ctypes.c_int64, len(lens))(*lens),
                             ctypes_array(ctypes.c_int64, r + 1)(*bounds), r, base,
                             base + 8 * n, base + 16 * n, base + 24 * n, base + 32 * n,
                             base + 8 * (4 * n + 1 + n), threads())
    run_unique = buf[5 * n + 1:5 * n + 1 + r].tolist()
    return (buf[:n], buf[n:n + u], buf[2 * n:3 * n], buf[3 * n:4 * n],
            buf[4 * n:4 * n + u + 1], run_unique)


_VOCAB_FIND = Kernel("ec_vocab_find", INT64, [
    ("slots", read(I32 + I64, nonempty=True)),  # (S,) the index
    ("size", INT64),
    ("wide_slots", INT),
    ("row_key", read(I64)),           # (A,)
    ("n_rows", INT64),
    ("last_use", read(I32 + I64)),    # (A,)
    ("wide_steps", INT),
    ("cut", INT64),
    ("ids", read(I64)),               # (n,)
    ("n", INT64),
    ("fill", INT64),
    ("rows", written(I64)),           # (n,)
    ("nt", INT),
])


def _wide(t: torch.Tensor) -> int:
    """1 for an int64 tensor of a ``NativeVocabMap`` (slots or steps), 0 for int32 (the kernels
    check the dtypes themselves)."""
    return int(t.dtype == torch.int64)


def _same_steps(kernel: Kernel, *tensors: torch.Tensor) -> None:
    """The per-row step arrays of one call (last_use, frequency, born) share one dtype."""
    dtypes = {getattr(t, "dtype", None) for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"{kernel.name}: last_use, frequency and born must share one dtype "
                        f"(int32 or int64), got {sorted(map(str, dtypes))}")


def vocab_find(slots: torch.Tensor, row_key: torch.Tensor, last_use: torch.Tensor, cut: int,
               ids: torch.Tensor, fill: int = -1) -> tuple[torch.Tensor, int]:
    """``(rows (n,), missing)``: the int64 rows of contiguous int64 ``ids`` in a
    ``NativeVocabMap``'s index ``slots`` (int32 or int64) over its rows' ``row_key`` (int64) and
    ``last_use`` (int32 or int64, read only with a TTL) (``fill``: not resident, or last used
    before step ``cut``) and how many are not found."""
    n = ids.numel()
    out = torch.empty(n, dtype=torch.int64)
    c = row_key.numel()
    missing = _VOCAB_FIND.call((slots, None), slots.numel(), _wide(slots), (row_key, None), c,
                               (last_use, c), _wide(last_use), cut, (ids, None), n, fill,
                               (out, n), threads())
    return out, missing


_VOCAB_SPLIT = Kernel("ec_vocab_split", INT64, [
    ("ids", read(I64)),               # (n,)
    ("rows", read(I64)),              # (n,)
    ("n", INT64),
    ("hit_rows", allocated(I64)),     # (n - M,)
    ("miss_ids", allocated(I64)),     # (M,)
    ("miss_pos", allocated(I64)),     # (M,)
])


def vocab_split(ids: torch.Tensor, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hit_rows (H,), miss_ids (M,), miss_pos (M,))`` of (n,) contiguous int64 ``ids`` and
    their ``rows`` from ``vocab_find``: the rows found, in order; the ids not found, ascending,
    and where they are in ``ids``."""
    n = ids.numel()
    buf = torch.empty(3 * n, dtype=torch.int64)  # [hit_rows | miss_ids | miss_pos]
    base = buf.data_ptr()
    m = _VOCAB_SPLIT.call((ids, None), (rows, n), n, base, base + 8 * n, base + 16 * n)
    return buf[:n - m], buf[n:n + m], buf[2 * n:2 * n + m]


_VOCAB_VALID = Kernel("ec_vocab_valid", INT64, [
    ("rows", read(I64)),              # (n,)
    ("n", INT64),
    ("born", read(I32 + I64)),        # (A,)
    ("wide_steps", INT),
    ("n_rows", INT64),
    ("since", INT64),
    ("keep", written(U8)),            # (n,)
])


def vocab_valid(rows: torch.Tensor, born: torch.Tensor, since: int) -> tuple[torch.Tensor, int]:
    """``(keep (n,) bool, kept)``: which of contiguous int64 ``rows`` are in the rows ``born``
    (int32 or int64) covers, used (``born >= 0``) and got their id at or before step ``since``
    (``VocabMap.valid``), and how many."""
    n = rows.numel()
    keep = torch.empty(n, dtype=torch.bool)
    kept = _VOCAB_VALID.call((rows, None), n, (born, None), _wide(born), born.numel(), since,
                             (keep, n))
    return keep, kept


_VOCAB_STEP = Kernel("ec_vocab_step", INT64, [
    ("slots", written(I32 + I64, nonempty=True)),  # (S,) the index
    ("size", INT64),
    ("wide_slots", INT),
    ("row_key", written(I64)),        # (A,)
    ("last_use", written(I32 + I64)),  # (A,)
    ("frequency", written(I32 + I64)),  # (A,)
    ("born", written(I32 + I64)),     # (A,)
    ("wide_steps", INT),
    ("n_rows", INT64),
    ("capacity", INT64),
    ("hit_rows", read(I64)),          # (H,)
    ("n_hit", INT64),
    ("new_ids", read(I64)),           # (A,)
    ("n_new", INT64),
    ("t", INT64),
    ("cut", INT64),
    ("lfu", INT),
    ("new_rows", written(I64)),       # (A,)
    ("info", array(ctypes.c_int64)),  # (7,) free, evictable, hint (in/out), n_freed, resident,
    #                                   queue entries, next entry (in/out)
    ("spare", INT64),
    ("freed", written(I64, optional=True)),  # (spare,)
    ("queue", written(I64, optional=True)),  # (queue_cap, 3)
    ("queue_cap", INT64),
])


def vocab_step(slots: torch.Tensor, row_key: torch.Tensor, last_use: torch.Tensor,
               frequency: torch.Tensor, born: torch.Tensor, capacity: int, resident: int,
               hit_rows: torch.Tensor, new_ids: torch.Tensor, t: int, cut: int, lfu: bool,
               hint: int, spare: int = 0, freed: torch.Tensor | None = None,
               queue: torch.Tensor | None = None, queued: tuple[int, int] = (0, 0)
               ) -> tuple[torch.Tensor | None, int, int, int, int, int, tuple[int, int]]:
    """One training step's changes to a ``NativeVocabMap`` (``ec_vocab_step`` in
    ``csrc/vocab.h``): its index ``slots`` and its first A rows (``row_key`` int64, ``last_use``,
    ``frequency``, ``born`` of one dtype, int32 or int64) of ``capacity`` rows, ``resident`` ids
    before the step; A must be the capacity or at least ``resident`` plus the admissions.
    ``spare``: when it evicts, free up to that many more rows, written to ``freed`` (spare,).
    ``queue``: None, or an LRU map's queue of eviction candidates (Q, 3) int64, ``queued`` its
    ``(entries held, next entry)`` (0 entries after any other change to the rows).

    Returns:
        ``(new_rows (A,) or None on overflow, free, evictable, hint, n_freed, resident,
        queued)``: on overflow nothing changed and ``free`` / ``evictable`` count the rows; else
        the new free-row hint, ``freed[:n_freed]`` the rows freed beyond the step's needs, the
        resident ids after the step and the queue's state.

    Raises:
        RuntimeError: the rows held are too few for the admissions (nothing changed).
    """
    _same_steps(_VOCAB_STEP, last_use, frequency, born)
    c, a = row_key.numel(), new_ids.numel()
    new_rows = torch.empty(a, dtype=torch.int64)
    info = (ctypes.c_int64 * 7)(0, 0, hint, 0, resident, *queued)
    spare = max(spare, 0)
    q = 0 if queue is None else queue.shape[0]
    rc = _VOCAB_STEP.call((slots, None), slots.numel(), _wide(slots), (row_key, None),
                          (last_use, c), (frequency, c), (born, c), _wide(born), c, capacity,
                          (hit_rows, None), hit_rows.numel(), (new_ids, None), a, t, cut,
                          int(lfu), (new_rows, a), info, spare,
                          (freed if spare > 0 else None, spare), (queue, 3 * q), q)
    if rc == -2:
        raise RuntimeError(f"{_VOCAB_STEP.name}: {c} rows held for {resident} resident ids and "
                           f"{a} admissions of a map of {capacity} rows")
    if rc != 0:
        return None, info[0], info[1], hint, 0, resident, queued
    return new_rows, 0, 0, info[2], info[3], info[4], (info[5], info[6])



def _seed64(seed: int) -> int:
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s


_INIT_NORMAL = Kernel("ec_init_normal", None, [
    ("seed", INT64),
    ("ids", read(I64)),               # (n,)
    ("rows", read(I64)),              # (n,) rows of table
    ("n", INT64),
    ("c0", INT64),
    ("c1", INT64),
    ("lo", DOUBLE),
    ("width", DOUBLE),
    ("div", DOUBLE),
    ("table", written(F32, dim=2)),   # (N, stride), stride >= c1 - c0
    ("stride", INT64),
])


def init_normal(seed: int, ids: torch.Tensor, rows: torch.Tensor, columns: tuple[int, int],
                lo: float, width: float, div: float, table: torch.Tensor) -> None:
    """Writes ``float32(inverse_normal(lo + hashing.uniform(seed, ids, c1)[:, c0:c1] * width) /
    div)``, ``(c0, c1) = columns``, into rows ``rows`` of contiguous float32 ``table``
    (n_rows, c1 - c0) (``vocabulary.initial_values``' default)."""
    c0, c1 = columns
    stride, n = table.shape[-1], ids.numel()
    if c1 - c0 > stride:
        raise ValueError(f"{_INIT_NORMAL.name}: columns {columns} need a table {c1 - c0} wide, "
                         f"got shape {tuple(table.shape)}")
    _INIT_NORMAL.call(_seed64(seed), (ids, None), (rows, n), n, c0, c1, lo, width, div,
                      (table, None), stride)


# The maps of stacked dynamic tables stepped together: a row of ``maps`` per map (csrc/vocab.h's
# MapField order), built by ``map_fields``.
MAP_FIELDS = ("slots", "size", "wide_slots", "row_key", "n_rows", "last_use", "frequency", "born",
              "wide_steps", "capacity", "step", "cut", "lfu", "start", "seed", "queue",
              "queue_cap")
VOCAB_INFO = 7  # vocab_step's info: a row of vocab_step_many's per map

_VOCAB_FIND_MANY = Kernel("ec_vocab_find_many", None, [
    ("maps", read(I64, dim=2)),       # (M, len(MAP_FIELDS))
    ("n_maps", INT64),
    ("ids", read(I64)),               # (n,)
    ("offsets", read(I64)),           # (M + 1,)
    ("rows", written(I64)),           # (n,)
    ("missing", written(I64)),        # (M,)
    ("fill", INT64),
    ("shard", INT),
    ("nt", INT),
])

_VOCAB_STEP_MANY = Kernel("ec_vocab_step_many", INT64, [
    ("maps", read(I64, dim=2)),       # (M, len(MAP_FIELDS))
    ("n_maps", INT64),
    ("ids", read(I64)),               # (n,)
    ("offsets", read(I64)),           # (M + 1,)
    ("rows", written(I64)),           # (n,)
    ("new_offsets", read(I64)),       # (M + 1,)
    ("new_ids", written(I64)),        # (A,)
    ("new_rows", written(I64)),       # (A,)
    ("info", written(I64)),           # (M, VOCAB_INFO)
    ("table", written(F32, optional=True, dim=2)),  # (N, stride) or None
    ("stride", INT64),
    ("c0", INT64),
    ("c1", INT64),
    ("lo", DOUBLE),
    ("width", DOUBLE),
    ("div", DOUBLE),
    ("slot_addrs", array(ctypes.c_int64)),    # (n_slots,) float32 (N, slot_widths[s]) arrays
    ("slot_widths", array(ctypes.c_int64)),   # (n_slots,)
    ("slot_values", array(ctypes.c_double)),  # (n_slots,)
    ("n_slots", INT64),
    ("nt", INT),
])


def map_fields(slots: torch.Tensor, row_key: torch.Tensor, last_use: torch.Tensor,
               frequency: torch.Tensor, born: torch.Tensor, capacity: int, step: int, cut: int,
               lfu: bool, start: int, seed: int, queue: torch.Tensor | None = None
               ) -> list[int]:
    """One map's row of ``vocab_find_many``'s and ``vocab_step_many``'s ``maps``: the addresses
    and sizes of a ``NativeVocabMap``'s contiguous CPU arrays (``slots`` int32 or int64, the
    int64 ``row_key``, the step arrays of one dtype, int32 or int64), its capacity, the step
    ``step`` and its ``cut``, the eviction, the member's first shard row, its seed and its
    eviction queue (None, or (Q, 3) int64: ``vocab_step``'s). The tensors must stay alive and
    unchanged until the calls that take the row return."""
    n = row_key.numel()
    if queue is not None and (queue.dtype != torch.int64 or not queue.is_cpu
                              or not queue.is_contiguous() or queue.dim() != 2
                              or queue.shape[1] != 3):
        raise ValueError(f"map_fields: queue must be a contiguous (Q, 3) CPU int64 tensor, got "
                         f"{queue.dtype} {tuple(queue.shape)} on {queue.device}")
    for name, t, dtypes in (("slots", slots, (torch.int32, torch.int64)),
                            ("row_key", row_key, (torch.int64,)),
                            ("last_use", last_use, (last_use.dtype,)),
                            ("frequency", frequency, (last_use.dtype,)),
                            ("born", born, (last_use.dtype,))):
        if (t.dtype not in dtypes or t.dtype not in (torch.int32, torch.int64) or not t.is_cpu
                or not t.is_contiguous() or (name != "slots" and t.numel() != n)
                or t.numel() == 0):
            raise ValueError(f"map_fields: {name} must be a non-empty contiguous CPU int32/int64 "
                             f"tensor (the step arrays of one dtype, {n} rows), got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return [slots.data_ptr(), slots.numel(), _wide(slots), row_key.data_ptr(), n,
            last_use.data_ptr(), frequency.data_ptr(), born.data_ptr(), _wide(last_use),
            capacity, step, cut, int(lfu), start, _seed64(seed),
            0 if queue is None else queue.data_ptr(), 0 if queue is None else queue.shape[0]]


def map_fields_seed(seed: int) -> int:
    """A seed as ``map_fields`` writes it (the int64 of its low 64 bits)."""
    return _seed64(seed)


def _runs_of(kernel: Kernel, offsets: torch.Tensor, maps: int, n: int) -> list[int]:
    """Each map's run length from ``offsets`` (M + 1,), checked to rise from 0 to ``n``."""
    o = offsets.tolist()
    steps = list(itertools.pairwise(o))
    if len(o) != maps + 1 or o[0] != 0 or o[-1] != n or any(b < a for a, b in steps):
        raise ValueError(f"{kernel.name}: offsets must rise from 0 to the {n} ids, a run per "
                         f"map ({maps}), got {o}")
    return [b - a for a, b in steps]


def vocab_find_many(maps: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                    fill: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows (n,), missing (M,))``: ``vocab_find`` of each map (a row of ``maps``:
    ``map_fields``) over its distinct ids ``ids[offsets[m]:offsets[m + 1]]`` at its cut, -1 where
    not found (with ``fill``: shard rows, the map's ``start`` plus its row, ``fill`` where not
    found); how many of each map's are not found. On the threads, a map each."""
    n, m = ids.numel(), maps.shape[0]
    _runs_of(_VOCAB_FIND_MANY, offsets, m, n)
    rows = torch.empty(n, dtype=torch.int64)
    missing = torch.empty(m, dtype=torch.int64)
    _VOCAB_FIND_MANY.call((maps, m * len(MAP_FIELDS)), m, (ids, n), (offsets, m + 1), (rows, n),
                          (missing, m), -1 if fill is None else fill, int(fill is not None),
                          threads())
    return rows, missing


def vocab_step_many(maps: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                    rows: torch.Tensor, missing: torch.Tensor, info: torch.Tensor,
                    init: tuple[torch.Tensor, tuple[int, int], float, float, float] | None,
                    slots: Sequence[tuple[torch.Tensor, float]] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training step of each map after ``vocab_find_many`` gave ``rows`` and ``missing``,
    every id not found admitted (the caller checked that each map's admissions fit and reserved
    its rows: ``NativeVocabMap._reserve``); ``rows`` become shard rows (the map's ``start``
    added). ``info`` (M, VOCAB_INFO): ``vocab_step``'s per map, in (the free-row hint, the
    resident ids, the queue's state) and out. ``init``: None, or ``(table, columns, lo, width,
    div)`` to write the admitted ids' default initial values into their rows of the float32
    ``table`` (``init_normal``, each with its map's seed); with it, ``slots``: ``(slot, value)``
    pairs, each slot a contiguous float32 CPU ``(N, C)`` tensor whose admitted rows are set to
    ``value`` (an optimizer's fresh slots).

    Returns:
        ``(new_ids (A,), new_rows (A,) shard rows, new_offsets (M + 1,))``: each map's admitted
        ids (ascending) and rows at ``new_offsets[m]:new_offsets[m + 1]``.

    Raises:
        RuntimeError: a map's step failed (a caller's error).
    """
    n, m = ids.numel(), maps.shape[0]
    runs = _runs_of(_VOCAB_STEP_MANY, offsets, m, n)
    if len(missing) != m or any(not 0 <= a <= r for a, r in zip(missing.tolist(), runs)):
        raise ValueError(f"{_VOCAB_STEP_MANY.name}: missing must count each map's ids not "
                         f"found (0 to its run's {runs}), got {missing.tolist()}")
    new_offsets = torch.zeros(m + 1, dtype=torch.int64)
    torch.cumsum(missing, 0, out=new_offsets[1:])
    a = int(new_offsets[-1])
    new_ids = torch.empty(a, dtype=torch.int64)
    new_rows = torch.empty(a, dtype=torch.int64)
    table, (c0, c1), lo, width, div = init if init is not None else (None, (0, 0), 0.0, 0.0, 1.0)
    stride = table.shape[-1] if table is not None else 0
    if table is not None and c1 - c0 > stride:
        raise ValueError(f"{_VOCAB_STEP_MANY.name}: columns {(c0, c1)} need a table {c1 - c0} "
                         f"wide, got shape {tuple(table.shape)}")
    for slot, _ in slots:
        if (table is None or slot.dtype != torch.float32 or not slot.is_cpu
                or not slot.is_contiguous() or slot.dim() != 2
                or slot.shape[0] != table.shape[0]):
            raise ValueError(f"{_VOCAB_STEP_MANY.name}: a slot must be a contiguous float32 CPU "
                             f"(N, C) tensor of the table's rows (and a table given), got "
                             f"{slot.dtype} {tuple(slot.shape)} on {slot.device}")
    k = len(slots)
    failed = _VOCAB_STEP_MANY.call(
        (maps, m * len(MAP_FIELDS)), m, (ids, n), (offsets, m + 1), (rows, n),
        (new_offsets, m + 1), (new_ids, a), (new_rows, a), (info, VOCAB_INFO * m),
        (table, None), stride, c0, c1, lo, width, div,
        ctypes_array(ctypes.c_int64, k)(*(t.data_ptr() for t, _ in slots)),
        ctypes_array(ctypes.c_int64, k)(*(t.shape[1] for t, _ in slots)),
        ctypes_array(ctypes.c_double, k)(*(float(v) for _, v in slots)), k, threads())
    if failed:
        raise RuntimeError(f"{_VOCAB_STEP_MANY.name}: map {-1 - failed}'s step failed (its "
                           f"admissions were not checked or reserved)")
    return new_ids, new_rows, new_offsets


_VOCAB_INDEX = Kernel("ec_vocab_index", INT64, [
    ("slots", written(I32 + I64, nonempty=True)),  # (S,)
    ("size", INT64),
    ("wide_slots", INT),
    ("row_key", read(I64)),           # (A,)
    ("born", read(I32 + I64)),        # (A,)
    ("wide_steps", INT),
    ("n_rows", INT64),
])


def vocab_index(slots: torch.Tensor, row_key: torch.Tensor, born: torch.Tensor) -> int:
    """Rebuilds a ``NativeVocabMap``'s index ``slots`` (int32 or int64) from its rows' ids
    ``row_key`` (int64) and ``born`` (int32 or int64; a row is used when >= 0); returns how many
    rows are used."""
    c = row_key.numel()
    return _VOCAB_INDEX.call((slots, None), slots.numel(), _wide(slots), (row_key, None),
                             (born, c), _wide(born), c)


_VOCAB_GROW = Kernel("ec_vocab_grow", INT64, [
    ("old_key", read(I64)),           # (held,)
    ("old_last", read(I32 + I64)),    # (held,)
    ("old_freq", read(I32 + I64)),    # (held,)
    ("old_born", read(I32 + I64)),    # (held,)
    ("held", INT64),
    ("wide_old", INT),
    ("row_key", written(I64)),        # (A,)
    ("last_use", written(I32 + I64)),  # (A,)
    ("frequency", written(I32 + I64)),  # (A,)
    ("born", written(I32 + I64)),     # (A,)
    ("wide_steps", INT),
    ("n_rows", INT64),
    ("slots", written(I32 + I64, nonempty=True)),  # (S,)
    ("size", INT64),
    ("wide_slots", INT),
])


def vocab_grow(old: Sequence[torch.Tensor], new: Sequence[torch.Tensor],
               slots: torch.Tensor) -> int:
    """A ``NativeVocabMap``'s rows held grow: ``old`` (row_key, last_use, frequency, born) of
    ``held`` rows copied into the first rows of ``new`` (the same, of more rows; the steps of
    another dtype, int32 or int64, where they widen), the others free, and the index ``slots``
    rebuilt over them. Returns how many rows are used."""
    _same_steps(_VOCAB_GROW, *old[1:])
    _same_steps(_VOCAB_GROW, *new[1:])
    held, a = old[0].numel(), new[0].numel()
    if a < held:
        raise ValueError(f"{_VOCAB_GROW.name}: {a} rows for the {held} held")
    return _VOCAB_GROW.call((old[0], None), (old[1], held), (old[2], held), (old[3], held), held,
                            _wide(old[1]), (new[0], None), (new[1], a), (new[2], a), (new[3], a),
                            _wide(new[1]), a, (slots, None), slots.numel(), _wide(slots))
