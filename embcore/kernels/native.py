"""The fused CPU kernels (``csrc/``): built on first use, loaded with ctypes.

The kernels are plain C++ (their own small thread pool, no OpenMP runtime, no torch headers),
so they build in a few seconds with the system's C++ compiler and do not depend on torch's C++
ABI. ``csrc/kernels.cpp`` includes the kernels' headers (``csrc/*.h``, one per concern): one
translation unit, one compiler call, one library. The first call compiles it into a cache
(``$XDG_CACHE_HOME/embcore``, else ``~/.cache/embcore``, else the temp directory), keyed by every
source file, the flags (``ABI_VERSION`` among them), the compiler and this CPU; later processes
load the cached library. Where no compiler works, ``available`` is False, a ``RuntimeWarning``
says why once, and every caller uses its torch-ops twin (same results, slower).

Every C function is declared here once, next to its wrapper, as a list of its arguments by name
and kind (args.py: ``read(I64)``, a contiguous CPU int64 tensor the kernel reads;
``INT64``, a scalar; ...): the ctypes signature and the checks of every call come from that
list. A tensor of the wrong dtype, layout, device or length is a ``TypeError`` /
``ValueError`` naming the kernel and the argument, raised before the kernel runs. The values
inside index tensors (ids within the table, offsets within the ids) are the callers' contract:
they are checked where the inputs come in (``inputs/canonical.py``, ``ConcatDedup``'s limits),
not on every call.

Every wrapper takes and returns torch tensors and is tested against ``ops/reference.py`` and
``ops/reference_optim.py``. ``set_enabled(False)`` switches the kernels off for this process
(tests use it to exercise the torch-ops path).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..numerics import rounding
from ..numerics.rounding import ROW_TYPES
from .args import (
    ANY,
    DOUBLE,
    F32,
    HYPER,
    I16,
    I32,
    I64,
    INT,
    INT64,
    ROWS,
    STRING,
    U8,
    Hyper,
    Kernel,
    PartsArg,
    allocated,
    array,
    ctypes_array,
    hyper_layout_errors,
    kernels,
    read,
    read_rows,
    set_loader,
    written,
    written_rows,
)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "kernels.cpp"  # the translation unit: it includes every header of CSRC
# The instruction set is this CPU's (-march=native: F16C's conversions, AVX-512, ...), or the one
# EMBCORE_NATIVE_ARCH names (e.g. x86-64: the portable paths, which tests check give the same bits).
ARCH = os.environ.get("EMBCORE_NATIVE_ARCH", "native")
FLAGS = ("-O3", f"-march={ARCH}", "-fno-math-errno", "-fopenmp-simd", "-pthread", "-std=c++17",
         "-shared", "-fPIC")
# The kernels' ABI version, its one source: the build passes it as -DEC_ABI_VERSION (the
# library's ec_abi_version() returns it) and _load refuses a library reporting another. Bumped
# when a kernel's arguments or EcHyper change (2: ec_sparse_update takes an EcHyper, 3: ec_vocab_*,
# 4: ec_copy_rows, 5: ec_vocab_step's spare rows, 6: ec_sparse_update's row strides,
# 7: ec_concat_dedup's id limits and steps, 8: ec_cache_step, ec_set_flags, ec_expand,
# 9: ec_cache_step's threads, 10: ec_will_need, 11: 16-bit rows in ec_lookup and ec_sparse_update,
# ec_round16, 12: ec_vocab_*'s compact maps: int32 or int64 slots (with fingerprints) and steps,
# no row_used, the rows held apart from the capacity; ec_vocab_grow), 13: ec_vocab_find_many,
# ec_vocab_step_many, 14: ec_vocab_find_many's shard rows.
ABI_VERSION = 14
DEFINES = (f"-DEC_ABI_VERSION={ABI_VERSION}",)

# Optimizer rules of ec_sparse_update (the enum in csrc/update.h).
SGD, ADAGRAD, ROWWISE_ADAGRAD = 0, 1, 2

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_enabled = True
_error: str | None = None


# The library's own description, read at load time.
_ABI_VERSION_OF = Kernel("ec_abi_version", INT, [])
_HYPER_SIZE = Kernel("ec_hyper_size", INT64, [])
_HYPER_FIELD_NAME = Kernel("ec_hyper_field_name", STRING, [("i", INT)])
_HYPER_FIELD = Kernel("ec_hyper_field", DOUBLE, [("h", HYPER), ("i", INT)])


def set_enabled(enabled: bool) -> bool:
    """Switches the fused kernels on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def enabled() -> bool:
    """Whether the kernels are switched on (``set_enabled``; they may still be unbuilt)."""
    return _enabled


def available() -> bool:
    """True when the kernels are enabled and built (building them now if needed)."""
    return _enabled and _load() is not None


def error() -> str | None:
    """Why the kernels could not be built, or None."""
    _load()
    return _error


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: enabled, built, and every tensor on the CPU."""
    if not _enabled or torch.compiler.is_compiling():  # (traced tensors have no data)
        return False
    for t in tensors:  # a loop, not all(genexpr): this runs several times per step
        if not t.is_cpu:
            return False
    return (_lib if _tried else _load()) is not None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    for root in (Path(base) / "embcore", Path(tempfile.gettempdir()) / f"embcore-{os.getuid()}"):
        try:
            root.mkdir(parents=True, exist_ok=True)
            if os.access(root, os.W_OK):
                return root
        except OSError:
            continue
    raise OSError("no writable cache directory for embcore's kernels")


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _compiler() -> str:
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    raise OSError("no C++ compiler (c++, g++ or clang++) on PATH")


def _sources(csrc: Path = CSRC) -> list[Path]:
    """Every source file of the library (``kernels.cpp`` and the headers it includes)."""
    return sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))


def _build_key(cxx: str, version: Sequence[str], csrc: Path = CSRC) -> str:
    """The cache key of a build: every source file by name and content, the flags and defines
    (``ABI_VERSION``), the compiler and this CPU."""
    parts = [f"{p.name}\n{p.read_text()}" for p in _sources(csrc)]
    return hashlib.sha256("\n".join([*parts, " ".join(FLAGS + DEFINES), cxx, *version,
                                     _cpu_signature()]).encode()).hexdigest()[:16]


def _build() -> Path:
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.splitlines()[:1]
    target = _cache_dir() / f"kernels-{_build_key(cxx, version)}.so"
    if target.exists():
        return target
    print(f"embcore: compiling the fused CPU kernels into {target.parent} (once per machine and "
          f"version, a few seconds)", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:  # one translation unit: kernels.cpp includes the headers
        proc = subprocess.run([cxx, *FLAGS, *DEFINES, str(SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise OSError(f"{Path(cxx).name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders (torchrun ranks) each win whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            lib = ctypes.CDLL(str(_build()))
            functions = [(kernel, kernel.signature(lib)) for kernel in kernels()]
            if lib.ec_abi_version() != ABI_VERSION:
                raise OSError(f"stale kernel library (ABI version {lib.ec_abi_version()}, "
                              f"expected {ABI_VERSION})")
            mismatch = hyper_layout_errors(lib)
            if mismatch:
                raise OSError("Hyper and the kernels' EcHyper disagree: " + "; ".join(mismatch))
            for kernel, fn in functions:
                kernel.bind(fn)
            _lib = lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            _error = f"{type(e).__name__}: {e}"
            warnings.warn(f"embcore: the fused CPU kernels could not be built ({_error}); using "
                          f"torch ops instead (same results, slower)", RuntimeWarning,
                          stacklevel=3)
        _tried = True
    return _lib


class _Local(threading.local):
    single = False  # inside single_threaded() (a class default: a missing attribute would cost
    #                 a caught AttributeError, a microsecond, on every kernel call)


_local = _Local()



def _why_unloaded() -> str | None:
    """None once the library is loaded and every kernel bound, else why it is not."""
    return None if _load() is not None else (_error or "the kernels are switched off")


set_loader(_why_unloaded)

def _threads() -> int:
    """Threads of a kernel: torch's count, or 1 on a thread inside ``single_threaded()``."""
    return 1 if _local.single else torch.get_num_threads()


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Kernels called by this thread inside it run on one thread: the pipeline's background
    worker, whose helpers would otherwise take every core beside the caller's own."""
    before = _local.single
    _local.single = True
    try:
        yield
    finally:
        _local.single = before


def concat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` of 1-D tensors, on the calling thread alone when they are contiguous
    CPU tensors of one dtype (one ``memmove`` each).

    ``torch.cat`` of a batch's scales (over 32768 elements) is a parallel op: it wakes torch's
    OpenMP workers, which then spin for about 7.5 ms waiting for the next one, on the core the
    kernels' helper needs (a W2 step: torch's idle worker took 45% of the second core). A copy of
    a few MB needs no second thread.
    """
    first = parts[0]
    if torch.compiler.is_compiling():  # (traced tensors have no data)
        return torch.cat(list(parts))
    for p in parts:  # a loop, not all(genexpr): this runs twice per table and step
        if not (p.is_cpu and p.dim() == 1 and p.dtype == first.dtype and p.is_contiguous()):
            return torch.cat(list(parts))
    out = torch.empty(sum(p.numel() for p in parts), dtype=first.dtype)
    size, at = out.element_size(), out.data_ptr()
    for p in parts:
        ctypes.memmove(at, p.data_ptr(), p.numel() * size)
        at += p.numel() * size
    return out


def dedup(ids: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable sort with run-length encoding, as ``preprocess.dedup``.

    Args:
        ids: (nnz,) contiguous int64 CPU ids in ``[0, num_rows)``.
        num_rows: an upper bound of the ids (sets the radix sort's passes).

    Returns:
        ``(unique (U,), order (nnz,), unique_offsets (U + 1,))``.
    """
    got = concat_dedup([ids], [0], num_rows)
    if isinstance(got, int):
        raise RuntimeError("ec_concat_dedup reported an id out of range without limits")
    _, unique, order, uoff = got
    return unique, order, uoff


def concat_dedup(parts: Sequence[torch.Tensor], adds: Sequence[int], num_rows: int,
                 limits: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | int:
    """Concatenates ``parts[i] + adds[i]`` and deduplicates the result, in one call.

    Args:
        parts: contiguous int64 CPU id tensors (one per feature).
        adds: the row offset added to each part.
        num_rows: an upper bound of the shifted ids.
        limits: None, or each part's bound: its ids must lie in ``[0, limits[i])`` (checked in
            the same pass as the copy).

    Returns:
        ``(ids (nnz,), unique (U,), order (nnz,), unique_offsets (U + 1,))``, views of one
        buffer; or, when ``limits`` are given and part ``i`` has an id outside its own, ``i``.
    """
    return ConcatDedup([t.numel() for t in parts], adds, num_rows, limits)(parts)


_CONCAT_DEDUP = Kernel("ec_concat_dedup", INT64, [
    ("parts", PartsArg()),                 # (nparts,) part p: lens[p] ids, steps[p] apart
    ("lens", array(ctypes.c_int64)),     # (nparts,)
    ("steps", array(ctypes.c_int64)),    # (nparts,), or None: all 1
    ("adds", array(ctypes.c_int64)),     # (nparts,) added to part p's ids
    ("limits", array(ctypes.c_int64)),   # (nparts,) part p's ids in [0, limits[p]), or None
    ("nparts", INT64),
    ("bits", INT),                       # the shifted ids lie in [0, 2^bits)
    ("ids_out", allocated(I64)),         # (n,) the shifted ids, n = sum of lens
    ("order", allocated(I64)),           # (n,)
    ("unique", allocated(I64)),          # (U,)
    ("uoff", allocated(I64)),            # (U + 1,)
    ("nt", INT),
])


class ConcatDedup:
    """``concat_dedup`` for parts of fixed lengths: the call's fixed arguments converted once
    (the fast path makes one per batch layout and calls it every step)."""

    def __init__(self, lens: Sequence[int], adds: Sequence[int], num_rows: int,
                 limits: Sequence[int] | None = None) -> None:
        k = len(lens)
        if len(adds) != k or (limits is not None and len(limits) != k):
            raise ValueError(f"ConcatDedup: {k} parts but {len(adds)} adds and "
                             f"{None if limits is None else len(limits)} limits; give one each")
        longs = ctypes_array(ctypes.c_int64, k)
        self.k, self.n, self.sizes = k, sum(lens), list(lens)
        self.lens, self.adds, self._longs = longs(*lens), longs(*adds), longs
        self.limits = None if limits is None else longs(*limits)
        self.bits = max(int(num_rows) - 1, 1).bit_length()

    def __call__(self, parts: Sequence[torch.Tensor], steps: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | int:
        """``parts``: int64 CPU tensors of the lengths given, contiguous, or ``steps[i]``
        elements apart (e.g. a column of a wider batch) when ``steps`` are given."""
        n = self.n
        buf = torch.empty(4 * n + 1, dtype=torch.int64)  # [ids | order | unique | uoff]
        base = buf.data_ptr()
        u = _CONCAT_DEDUP.call((parts, self.sizes, steps), self.lens,
                               None if steps is None else self._longs(*steps), self.adds,
                               self.limits, self.k, self.bits, base, base + 8 * n, base + 16 * n,
                               base + 24 * n, _threads())
        if u < 0:
            return -1 - u
        # the four views in one call (a view costs about a microsecond: this runs every step)
        ids, order, unique, _, uoff, _ = buf.split_with_sizes([n, n, u, n - u, u + 1, n - u])
        return ids, unique, order, uoff


_LOOKUP = Kernel("ec_lookup", None, [
    ("type", INT),                            # ROW_TYPES[table.dtype]
    ("table", read(ROWS, dim=2)),             # (N, d) float32, float16 or bfloat16
    ("d", INT64),
    ("ids", read(I64)),                       # (nnz,) rows of table
    ("offsets", read(I64, optional=True)),    # (r_rows + 1,); None: bag r is ids[r] alone
    ("scales", read(F32, optional=True)),     # (nnz,); None: all 1
    ("r_rows", INT64),
    ("out", written(F32, dim=2)),             # (r_rows, d)
    ("nt", INT),
])


def lookup(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
           scales: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out[r] = sum_k scales[k] * table[ids[k]]`` over bag r (``offsets`` None: row ids[r]).

    Args:
        table: (N, D) contiguous float32, float16 or bfloat16 (rows widened to float32).
        ids: (nnz,) int64 rows of ``table``.
        offsets: (R + 1,) int64 bag boundaries, or None for one id per row with scale 1.
        scales: (nnz,) float32, or None for 1.
        out: (R, D) contiguous float32, written.
    """
    d, r = table.shape[-1], out.shape[0]
    _LOOKUP.call(ROW_TYPES.get(table.dtype, 0), (table, None), d,
                 (ids, r if offsets is None else None), (offsets, r + 1),
                 (scales, ids.numel()), r, (out, r * d), _threads())
    return out


class TableLookup:
    """``lookup`` from one table: the table's arguments checked once, here, and bound
    (``Kernel.partial``); each call checks the rest, as ``lookup`` does, and that the table
    still has the storage it was bound with (else binds it again, as ``SparseUpdate``). For the rows
    objects, which read the same table every step.

    Args:
        table: as ``lookup``'s (kept referenced).
    """

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self._bind()

    def _bind(self) -> None:
        table = self.table
        self.d = table.shape[-1]
        self._at = table.data_ptr()
        self._call = _LOOKUP.partial(type=ROW_TYPES.get(table.dtype, 0), table=(table, None),
                                     d=self.d)

    def __call__(self, ids: torch.Tensor, offsets: torch.Tensor | None,
                 scales: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """``lookup(table, ids, offsets, scales, out)``."""
        table = self.table
        if table.data_ptr() != self._at:
            self._bind()  # (its storage was replaced since: checked and bound again)
        d, r = self.d, out.shape[0]
        self._call((ids, r if offsets is None else None), (offsets, r + 1),
                   (scales, ids.numel()), r, (out, r * d), _threads())
        return out


_COPY_ROWS = Kernel("ec_copy_rows", None, [
    ("src", read_rows(ANY)),          # rows src_stride bytes apart
    ("src_stride", INT64),
    ("src_rows", read(I64)),          # (n,)
    ("dst", written_rows(ANY)),       # rows dst_stride bytes apart, src's dtype and width
    ("dst_stride", INT64),
    ("dst_rows", read(I64)),          # (n,)
    ("n", INT64),
    ("row_bytes", INT64),
    ("nt", INT),
])


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
              dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows] = src[src_rows]`` in one pass: 2-D CPU tensors of one dtype and width,
    rows contiguous; ``src_rows`` / ``dst_rows`` (n,) int64, contiguous, in range."""
    size, n = src.element_size(), src_rows.numel()
    _COPY_ROWS.call((src, None), src.stride(0) * size, (src_rows, None), (dst, src),
                    dst.stride(0) * size, (dst_rows, n), n, src.shape[-1] * size, _threads())


_WILL_NEED = Kernel("ec_will_need", INT64, [
    ("base", read_rows(ANY)),         # rows stride bytes apart
    ("stride", INT64),
    ("rows", read(I64)),              # (n,)
    ("n", INT64),
    ("row_bytes", INT64),
])


def will_need(src: torch.Tensor, rows: torch.Tensor) -> int:
    """Asks the kernel to read the pages under rows ``rows`` ((n,) int64, contiguous, in range)
    of ``src`` (a 2-D CPU tensor of a mapped file, rows contiguous; each row's whole stride:
    a record's other fields too) ahead (``madvise(MADV_WILLNEED)``); returns the system calls
    made."""
    size = src.element_size()
    return _WILL_NEED.call((src, None), src.stride(0) * size, (rows, None), rows.numel(),
                           max(src.stride(0), src.shape[-1]) * size)


_BAG_OF = Kernel("ec_bag_of", None, [
    ("offsets", read(I64)),           # (r_rows + 1,)
    ("r_rows", INT64),
    ("bags", written(I64)),           # (nnz,)
])


def bag_of(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """(nnz,) int64: the bag of every occurrence."""
    out = torch.empty(nnz, dtype=torch.int64)
    _BAG_OF.call((offsets, None), offsets.numel() - 1, (out, nnz))
    return out


_EXPAND = Kernel("ec_expand", None, [
    ("values", read(I64)),            # (U,)
    ("order", read(I64)),             # (nnz,)
    ("uoff", read(I64)),              # (U + 1,)
    ("n_unique", INT64),
    ("out", written(I64)),            # (nnz,)
])


def expand(values: torch.Tensor, order: torch.Tensor, unique_offsets: torch.Tensor
           ) -> torch.Tensor:
    """(nnz,) int64: ``values`` (U,) of a ``Dedup``'s distinct rows at their occurrences
    (``values[dedup.inverse]`` without the inverse)."""
    u, nnz = values.numel(), order.numel()
    out = torch.empty(nnz, dtype=torch.int64)
    _EXPAND.call((values, None), (order, None), (unique_offsets, u + 1), u, (out, nnz))
    return out


_MINMAX = Kernel("ec_minmax", None, [
    ("ids", read(I64, nonempty=True)),  # (n,)
    ("n", INT64),
    ("out", array(ctypes.c_int64)),     # (2,) smallest, largest
])


def minmax(ids: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest of (n > 0,) contiguous int64 ids."""
    out = (ctypes.c_int64 * 2)()
    _MINMAX.call((ids, None), ids.numel(), out)
    return out[0], out[1]


_OFFSETS_ERROR = Kernel("ec_offsets_error", INT64, [
    ("offsets", read(I64, nonempty=True)),  # (n,)
    ("n", INT64),
    ("nnz", INT64),
])


def offsets_error(offsets: torch.Tensor, nnz: int) -> int:
    """-1 when (n >= 1,) contiguous int64 ``offsets`` start at 0, never decrease and end at
    ``nnz``; else the first entry breaking that (0: the first is not 0; i: ``offsets[i] <
    offsets[i - 1]``; n - 1: the last is not ``nnz``)."""
    return _OFFSETS_ERROR.call((offsets, None), offsets.numel(), nnz)


_FIRST_UNORDERED = Kernel("ec_first_unordered", INT64, [
    ("idx", read(I64, dim=2)),        # (k, n)
    ("k", INT64),
    ("n", INT64),
])


def first_unordered(indices: torch.Tensor) -> int:
    """-1 when the columns of (k, n) contiguous int64 ``indices`` strictly increase in
    lexicographic order (a coalesced COO tensor's indices); else the first column j >= 1 that is
    not greater than column j - 1 (out of order, or a duplicate)."""
    return _FIRST_UNORDERED.call((indices, None), indices.shape[0], indices.shape[-1])


COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}

_COMBINER_SCALES = Kernel("ec_combiner_scales", None, [
    ("offsets", read(I64)),                   # (r_rows + 1,)
    ("r_rows", INT64),
    ("weights", read(F32, optional=True)),    # (nnz,); None: all 1
    ("combiner", INT),                        # COMBINERS' code
    ("out", written(F32)),                    # (nnz,)
])


def combiner_scales(offsets: torch.Tensor, weights: torch.Tensor | None, combiner: str,
                    nnz: int) -> torch.Tensor:
    """As ``inputs.combiner_scales``: (nnz,) float32 per-id scales applying the combiner."""
    code = COMBINERS.get(combiner)
    if code is None:
        raise ValueError(f"combiner_scales: combiner {combiner!r} is none of {sorted(COMBINERS)}")
    out = torch.empty(nnz, dtype=torch.float32)
    _COMBINER_SCALES.call((offsets, None), offsets.numel() - 1, (weights, nnz), code,
                          (out, nnz))
    return out


_GRADIENT_ROWS = read_rows(F32)  # a part of the output gradient (occurrences)
_SUMMED_GRADIENT = read(F32, dim=2)  # the (U, D) summed gradient (direct)

_SPARSE_UPDATE = Kernel("ec_sparse_update", None, [
    ("rule", INT),                            # SGD, ADAGRAD or ROWWISE_ADAGRAD
    ("type", INT),                            # ROW_TYPES[w.dtype]
    ("w", written(ROWS, dim=2)),              # (N, d) float32, float16 or bfloat16
    ("acc", written(F32, optional=True)),     # (N, d) or (N, 1); None for SGD
    ("d", INT64),
    ("rows", read(I64)),                      # (U,) distinct
    ("u_rows", INT64),
    ("uoff", read(I64, optional=True)),       # (U + 1,); None: direct
    ("order", read(I64, optional=True)),      # (nnz,)
    ("bags", read(I64, optional=True)),       # (nnz,); None: occurrence k is row k
    ("scales", read(F32, optional=True)),     # (nnz,); None: all 1
    ("slices", array(ctypes.c_void_p)),       # (nslices,) gradient parts (_GRADIENT_ROWS)
    ("starts", array(ctypes.c_int64)),        # (nslices + 1,) their first output rows
    ("strides", array(ctypes.c_int64)),       # (nslices,) their row strides
    ("nslices", INT64),
    ("hyper", HYPER),
    ("stochastic", INT),                      # 16-bit rows: 1 stochastic rounding, 0 nearest
    ("key_rows", read(I64, optional=True)),   # (n_keys,) per table row, its identity's row
    ("n_keys", INT64),                        # rows from n_keys on are their own
    ("seg_starts", read(I64)),                # (nseg + 1,)
    ("seg_bases", read(I64)),                 # (nseg,)
    ("seg_muls", read(I64)),                  # (nseg,)
    ("nseg", INT64),
    ("col0", INT64),
    ("step_key", INT64),
    ("nt", INT),
])


def _native_rules() -> dict[int, str]:
    """The kernel's rules by id, named as the constants above (``RowwiseAdagrad`` ->
    ``ROWWISE_ADAGRAD``): every optimizer whose record has a ``native_rule``."""
    import re

    from ..config.optimizers import records
    return {r.native_rule: re.sub(r"(?<=[a-z])(?=[A-Z])", "_", r.name).upper()
            for r in records() if r.native_rule is not None}


_RULES = _native_rules()
_NEAREST = rounding.nearest()


def sparse_update(rule: int, table: torch.Tensor, acc: torch.Tensor | None, rows: torch.Tensor,
                  hyper: Hyper, grads: Sequence[torch.Tensor],
                  starts: Sequence[int] | None = None, unique_offsets: torch.Tensor | None = None,
                  order: torch.Tensor | None = None, bags: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None,
                  round_to: rounding.Rounding | None = None) -> None:
    """Updates ``table[rows]`` (and ``acc[rows]``) in place, each row once.

    Args:
        rule: ``SGD``, ``ADAGRAD`` or ``ROWWISE_ADAGRAD``.
        table: (N, D) contiguous float32, float16 or bfloat16 parameters (16-bit rows are
            widened, updated in float32 and rounded back by ``round_to``: numerics/rounding.py).
        acc: (N, D) or (N, 1) contiguous float32 accumulators; None for SGD.
        rows: (U,) distinct int64 rows.
        hyper: the optimizer's hyper-parameters by name (``Hyper``; infinities for no bound).
        grads: the gradient source: with ``unique_offsets``, the output gradient rows split in
            consecutive (R_i, D) float32 parts (rows ``starts[i]:starts[i+1]``), each with unit
            column stride and any row stride (e.g. column slices of a wider gradient: no copy);
            without, one contiguous (U, D) tensor, row u the summed gradient of ``rows[u]``.
        starts: (len(grads) + 1) first output row of each part (needed with several parts).
        unique_offsets, order: as returned by ``dedup`` (occurrences of each row, sorted).
        bags: (nnz,) the output row of each occurrence; None when occurrence k is row k.
        scales: (nnz,) float32 scale of each occurrence; None for 1.
        round_to: how a 16-bit table's rows are rounded (None: to nearest; numerics/rounding.py).

    Raises:
        TypeError, ValueError: an argument the kernel cannot take (named).
    """
    _check_rule(rule, acc)
    if (unique_offsets is None) != (order is None):
        raise ValueError(f"{_SPARSE_UPDATE.name}: give both unique_offsets and order "
                         f"(occurrences) or neither (a summed gradient)")
    n_rows, d, u = table.shape[0], table.shape[-1], rows.numel()
    slices, starts_, strides, n = _gradient_args(table, d, u, grads, starts, unique_offsets)
    nnz = order.numel() if isinstance(order, torch.Tensor) else None
    r = _NEAREST if round_to is None else round_to
    seg = r.segments
    nseg = seg.bases.numel()
    n_keys = 0 if r.key_rows is None else r.key_rows.numel()
    _SPARSE_UPDATE.call(
        rule, ROW_TYPES.get(table.dtype, 0), (table, None),
        (acc, n_rows * (1 if rule == ROWWISE_ADAGRAD else d)), d,
        (rows, None), u, (unique_offsets, u + 1), (order, None), (bags, nnz), (scales, nnz),
        slices, starts_, strides, n, hyper,
        int(r.stochastic), (r.key_rows, None), n_keys, (seg.starts, nseg + 1), (seg.bases, nseg),
        (seg.muls, nseg), nseg, r.col0, r.key_of_step, _threads())


def _check_rule(rule: int, acc: torch.Tensor | None) -> None:
    name = _SPARSE_UPDATE.name
    if rule not in _RULES:
        raise ValueError(f"{name}: rule {rule!r} is none of {', '.join(_RULES.values())} "
                         f"({tuple(_RULES)})")
    if acc is None and rule != SGD:
        raise ValueError(f"{name}: rule {rule} needs the accumulators 'acc', got None")


def _gradient_args(table: torch.Tensor, d: int, u: int, grads: Sequence[torch.Tensor],
                   starts: Sequence[int] | None, unique_offsets: torch.Tensor | None
                   ) -> tuple[Any, Any, Any, int]:
    """``sparse_update``'s gradient source checked, as the kernel's ``slices``, ``starts``,
    ``strides`` and ``nslices``."""
    name = _SPARSE_UPDATE.name
    n = len(grads)
    addresses, row_strides = [], []
    if unique_offsets is None:  # one (U, D) summed gradient
        if n != 1:
            raise ValueError(f"{name}: a summed gradient is one (U, D) tensor, got {n}")
        addresses.append(_SUMMED_GRADIENT.address(name, "slices[0]", (grads[0], u * d)))
        row_strides.append(d)
    else:  # the output gradient's parts
        if starts is None:
            if n > 1:
                raise ValueError(f"{name}: {n} gradient parts need their 'starts'")
            starts = [0] * (n + 1)
        elif len(starts) != n + 1:
            raise ValueError(f"{name}: 'starts' must have {n + 1} entries (one more than the "
                             f"gradient parts), got {len(starts)}")
        like = table if table.dtype is torch.float32 else None
        for i, g in enumerate(grads):  # (one pass: this runs once per table and step)
            addresses.append(_GRADIENT_ROWS.address(name, "slices", (g, like), i))
            shape = g.shape
            if shape[1] != d and g.numel():
                raise ValueError(f"{name}: gradient part {i} must have {d} columns (as the "
                                 f"table), got {shape[1]}")
            if n > 1 and shape[0] != starts[i + 1] - starts[i]:
                raise ValueError(f"{name}: gradient part {i} must have starts[{i + 1}] - "
                                 f"starts[{i}] = {starts[i + 1] - starts[i]} rows, got "
                                 f"{shape[0]}")
            row_strides.append(g.stride(0) if shape[0] > 1 else shape[1])
    return (ctypes_array(ctypes.c_void_p, n)(*addresses),
            None if starts is None else ctypes_array(ctypes.c_int64, n + 1)(*starts),
            ctypes_array(ctypes.c_int64, n)(*row_strides), n)


class SparseUpdate:
    """``sparse_update`` of one table (and its accumulators) under one rule: the table's
    arguments checked once, here, and bound (``Kernel.partial``); each call checks the rest,
    as ``sparse_update`` does, and that the table and accumulators still have the storage they
    were bound with (else binds them again: a storage replaced, e.g. by a ``resize_`` that
    grows it; one that shrinks keeps its memory, so no write leaves it). The rounding to
    nearest's arguments (``round_to`` None) are bound too. For the rows objects, which update
    the same table every step; not for concurrent calls (its gradient arrays are reused).

    Args:
        rule, table, acc: as ``sparse_update``'s (kept referenced: the kernel writes them).

    Raises:
        TypeError, ValueError: an argument the kernel cannot take (named), here or at a call.
    """

    def __init__(self, rule: int, table: torch.Tensor, acc: torch.Tensor | None) -> None:
        _check_rule(rule, acc)
        self.rule, self.table, self.acc = rule, table, acc
        self._n = 0  # the arrays of ``_parts``, for this many gradient parts
        self._slices: Any = None
        self._strides: Any = None
        self._starts: Any = None
        self._starts_of: list[int] = []
        self._bind()

    def _bind(self) -> None:
        rule, table, acc = self.rule, self.table, self.acc
        n_rows, self.d = table.shape[0], table.shape[-1]
        self._at = (table.data_ptr(), None if acc is None else acc.data_ptr())
        fixed = {"rule": rule, "type": ROW_TYPES.get(table.dtype, 0), "w": (table, None),
                 "acc": (acc, n_rows * (1 if rule == ROWWISE_ADAGRAD else self.d)), "d": self.d}
        self._call = _SPARSE_UPDATE.partial(**fixed)
        seg = _NEAREST.segments
        nseg = seg.bases.numel()
        self._nearest = _SPARSE_UPDATE.partial(
            **fixed, stochastic=0, key_rows=(None, None), n_keys=0,
            seg_starts=(seg.starts, nseg + 1), seg_bases=(seg.bases, nseg),
            seg_muls=(seg.muls, nseg), nseg=nseg, col0=_NEAREST.col0,
            step_key=_NEAREST.key_of_step)

    def _parts(self, grads: Sequence[torch.Tensor], starts: Sequence[int]
               ) -> tuple[Any, Any, Any, int]:
        """``_gradient_args`` of output gradient parts with their ``starts``, the same checks,
        into arrays kept across calls (a layout's ``starts`` are the same every step)."""
        n = len(grads)
        if n != self._n:
            self._n = n
            self._slices = ctypes_array(ctypes.c_void_p, n)()
            self._strides = ctypes_array(ctypes.c_int64, n)()
            self._starts = ctypes_array(ctypes.c_int64, n + 1)(*starts)
            self._starts_of = list(starts)
        elif starts != self._starts_of:
            self._starts = ctypes_array(ctypes.c_int64, n + 1)(*starts)
            self._starts_of = list(starts)
        name, d, slices, strides = _SPARSE_UPDATE.name, self.d, self._slices, self._strides
        like = self.table if self.table.dtype is torch.float32 else None
        for i, g in enumerate(grads):
            slices[i] = _GRADIENT_ROWS.address(name, "slices", (g, like), i)
            rows, cols = g.shape
            if cols != d and rows:
                raise ValueError(f"{name}: gradient part {i} must have {d} columns (as the "
                                 f"table), got {cols}")
            if rows != starts[i + 1] - starts[i]:
                raise ValueError(f"{name}: gradient part {i} must have starts[{i + 1}] - "
                                 f"starts[{i}] = {starts[i + 1] - starts[i]} rows, got {rows}")
            strides[i] = g.stride(0) if rows > 1 else cols
        return slices, self._starts, strides, n

    def __call__(self, rows: torch.Tensor, hyper: Hyper, grads: Sequence[torch.Tensor],
                 starts: Sequence[int] | None = None,
                 unique_offsets: torch.Tensor | None = None, order: torch.Tensor | None = None,
                 bags: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                 round_to: rounding.Rounding | None = None) -> None:
        """``sparse_update(rule, table, acc, rows, hyper, grads, ...)``."""
        table, acc = self.table, self.acc
        if table.data_ptr() != self._at[0] or (acc is not None and
                                               acc.data_ptr() != self._at[1]):
            self._bind()  # (their storage was replaced since: checked and bound again)
        if (unique_offsets is None) != (order is None):
            raise ValueError(f"{_SPARSE_UPDATE.name}: give both unique_offsets and order "
                             f"(occurrences) or neither (a summed gradient)")
        d, u = self.d, rows.numel()
        if unique_offsets is None or starts is None or len(starts) != len(grads) + 1:
            slices, starts_, strides, n = _gradient_args(table, d, u, grads, starts,
                                                         unique_offsets)
        else:
            slices, starts_, strides, n = self._parts(grads, starts)
        nnz = order.numel() if order is not None else None
        if round_to is None:
            self._nearest((rows, None), u, (unique_offsets, u + 1), (order, None), (bags, nnz),
                          (scales, nnz), slices, starts_, strides, n, hyper, _threads())
            return
        r = _NEAREST if round_to is None else round_to
        seg = r.segments
        nseg = seg.bases.numel()
        n_keys = 0 if r.key_rows is None else r.key_rows.numel()
        self._call((rows, None), u, (unique_offsets, u + 1), (order, None), (bags, nnz),
                   (scales, nnz), slices, starts_, strides, n, hyper, int(r.stochastic),
                   (r.key_rows, None), n_keys, (seg.starts, nseg + 1), (seg.bases, nseg),
                   (seg.muls, nseg), nseg, r.col0, r.key_of_step, _threads())


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
                             base + 8 * (4 * n + 1 + n), _threads())
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
                               (out, n), _threads())
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


_CACHE_STEP = Kernel("ec_cache_step", INT64, [
    ("rows", read(I64)),              # (U,) distinct shard rows
    ("n_rows", INT64),
    ("where", written(I32)),          # (N,) the cache row of each shard row, or -1
    ("owner", written(I64)),          # (C,) the shard row of each cache row, or -1
    ("stamp", written(I64)),          # (C,)
    ("dirty", written(U8)),           # (C,)
    ("fresh", written(U8)),           # (C,)
    ("free_rows", written(I64)),      # (C,) a stack of the free cache rows
    ("capacity", INT64),
    ("clock", INT64),
    ("spare", INT64),
    ("slots", written(I64)),          # (U,)
    ("miss_rows", written(I64)),      # (U,) (M used)
    ("miss_slots", written(I64)),     # (U,) (M used)
    ("out_rows", written(I64)),       # (most,) (O used)
    ("out_slots", written(I64)),      # (most,) (O used)
    ("bounds", read(I64, optional=True)),    # (T - 1,) the first row of members 1..T-1
    ("n_bounds", INT64),
    ("counts", written(I64, optional=True)),  # (3, T) hits, misses, new per member
    ("io", array(ctypes.c_int64)),    # (4,) n_free (in/out), n_miss, n_out, n_evicted
    ("nt", INT),
])


def cache_step(rows: torch.Tensor, where: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor,
               dirty: torch.Tensor, fresh: torch.Tensor, free: torch.Tensor, n_free: int,
               clock: int, spare: int, bounds: torch.Tensor | None,
               counts: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                          int, int] | None:
    """One step of a cache's index (``ec_cache_step`` in ``csrc/cache_index.h``;
    ``CacheIndex.step`` is its torch-ops twin and documents it).

    Returns:
        ``(slots (U,), miss_rows (M,), miss_slots (M,), out_rows (O,), out_slots (O,),
        n_free, n_evicted)``, or None when ``rows`` outnumber the cache rows (nothing changed).
    """
    n, c = rows.numel(), owner.numel()
    if not 0 <= n_free <= c:
        raise ValueError(f"{_CACHE_STEP.name}: n_free must lie in [0, {c}] (the cache rows), "
                         f"got {n_free}")
    slots = torch.empty(n, dtype=torch.int64)
    miss_rows = torch.empty(n, dtype=torch.int64)
    miss_slots = torch.empty(n, dtype=torch.int64)
    most = min(n + max(spare, 0), c)  # rows an eviction may write back
    out_rows = torch.empty(most, dtype=torch.int64)
    out_slots = torch.empty(most, dtype=torch.int64)
    io = (ctypes.c_int64 * 4)(n_free, 0, 0, 0)
    n_bounds = 0 if bounds is None else bounds.numel()
    rc = _CACHE_STEP.call((rows, None), n, (where, None), (owner, None), (stamp, c),
                          (dirty, c), (fresh, c), (free, c), c, clock, spare, (slots, n),
                          (miss_rows, n), (miss_slots, n), (out_rows, most), (out_slots, most),
                          (bounds, None), n_bounds, (counts, 3 * (n_bounds + 1)), io,
                          _threads())
    if rc != 0:
        return None
    m, o = io[1], io[2]
    return (slots, miss_rows[:m], miss_slots[:m], out_rows[:o], out_slots[:o], io[0], io[3])


_SET_FLAGS = Kernel("ec_set_flags", None, [
    ("flags", written(U8)),           # (C,)
    ("idx", read(I64)),               # (n,)
    ("n", INT64),
    ("value", INT),
])


def set_flags(flags: torch.Tensor, idx: torch.Tensor, value: bool) -> None:
    """``flags[idx] = value``: ``flags`` a contiguous bool tensor, ``idx`` (n,) int64 in range."""
    _SET_FLAGS.call((flags, None), (idx, None), idx.numel(), int(value))


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
                          _threads())
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
        ctypes_array(ctypes.c_double, k)(*(float(v) for _, v in slots)), k, _threads())
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


def main() -> int:
    """Builds the kernels now and says where they are (``python -m embcore kernels``)."""
    if _load() is None:
        print(f"embcore kernels unavailable: {_error}", file=sys.stderr)
        return 1
    print(f"embcore kernels: {getattr(_lib, '_name', '?')}")
    return 0


_ROUND16 = Kernel("ec_round16", None, [
    ("type", INT),                            # ROW_TYPES[float16 or bfloat16]
    ("src", read(F32)),                       # (n,)
    ("bits", read(I32, optional=True)),       # (n,) random bits; None: to nearest
    ("dst", written(I16)),                    # (n,)
    ("n", INT64),
])


def round16(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``x`` rounded to ``dtype`` (float16 / bfloat16) by the kernels' rule (csrc/half.h):
    to nearest, or stochastically with the uint32 random ``bits`` (int64 values, ``x``'s shape).
    For tests of numerics/rounding.py's reference."""
    if dtype not in rounding.COMPACT:
        raise TypeError(f"round16 rounds into {rounding.COMPACT}, not {dtype}")
    src = x.to(torch.float32).contiguous().reshape(-1)
    b = None if bits is None else bits.reshape(-1).to(torch.int64).to(torch.int32).contiguous()
    out = torch.empty(src.numel(), dtype=torch.int16)
    n = src.numel()
    _ROUND16.call(ROW_TYPES[dtype], (src, None), (b, n), (out, n), n)
    return out.view(dtype).reshape(x.shape)
