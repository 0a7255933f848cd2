"""The fused CPU kernels (``csrc/kernels.cpp``): built on first use, loaded with ctypes.

The kernels are plain C++ (their own small thread pool, no OpenMP runtime, no torch headers),
so they build in a few seconds with the system's C++ compiler and do not depend on torch's C++
ABI. The first call compiles them
into a cache (``$XDG_CACHE_HOME/embcore``, else ``~/.cache/embcore``, else the temp directory),
keyed by the source, the compiler and this CPU; later processes load the cached library. Where no
compiler works, ``available`` is False, a ``RuntimeWarning`` says why once, and every caller
uses its torch-ops twin (same results, slower).

Every wrapper takes and returns torch tensors (contiguous CPU float32 / int64) and is tested
against ``ops/reference.py`` and ``ops/reference_optim.py``. ``set_enabled(False)`` switches the
kernels off for this process (tests use it to exercise the torch-ops path).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
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

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "kernels.cpp"
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-pthread", "-std=c++17",
         "-shared", "-fPIC")
ABI_VERSION = 10  # ec_abi_version(): 2 since ec_sparse_update takes an EcHyper, 3: ec_vocab_*,
# 4: ec_copy_rows, 5: ec_vocab_step's spare rows, 6: ec_sparse_update's row strides,
# 7: ec_concat_dedup's id limits and steps, 8: ec_cache_step, ec_set_flags, ec_expand,
# 9: ec_cache_step's threads, 10: ec_will_need

# Optimizer rules of ec_sparse_update (the enum in kernels.cpp).
SGD, ADAGRAD, ROWWISE_ADAGRAD = 0, 1, 2

class Hyper(ctypes.Structure):
    """The optimizer hyper-parameters of ``sparse_update``, by name: kernels.cpp's ``EcHyper``.

    The fields (doubles, in this order, as the C++ struct; ``_load`` checks that both sides
    agree) and their "option off" defaults:

    - ``learning_rate``: required;
    - ``gradient_multiplier``: the gradient is multiplied by it first (default 1.0);
    - ``clip_min``, ``clip_max``: then clipped to ``[clip_min, clip_max]`` (default -inf, +inf);
    - ``weight_decay``: after the rule, ``w -= weight_decay * w_before`` (default 0.0);
    - ``weight_min``, ``weight_max``: then the weights are clipped (default -inf, +inf).

    Example: ``Hyper(learning_rate=0.1, clip_min=-1.0, clip_max=1.0)``.
    """

    _fields_ = [
        ("learning_rate", ctypes.c_double),
        ("gradient_multiplier", ctypes.c_double),
        ("clip_min", ctypes.c_double),
        ("clip_max", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("weight_min", ctypes.c_double),
        ("weight_max", ctypes.c_double),
    ]

    def __init__(self, learning_rate: float, *, gradient_multiplier: float = 1.0,
                 clip_min: float = -math.inf, clip_max: float = math.inf,
                 weight_decay: float = 0.0, weight_min: float = -math.inf,
                 weight_max: float = math.inf) -> None:
        super().__init__(float(learning_rate), float(gradient_multiplier), float(clip_min),
                         float(clip_max), float(weight_decay), float(weight_min),
                         float(weight_max))

    def as_dict(self) -> dict[str, float]:
        """``{field name: value}`` in field order."""
        return {name: getattr(self, name) for name, _ in self._fields_}

    def __repr__(self) -> str:
        return "Hyper(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Hyper):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # mutable, like every ctypes.Structure


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_enabled = True
_error: str | None = None

_P = ctypes.c_void_p
_I = ctypes.c_int64
_HP = ctypes.POINTER(Hyper)
_SIGNATURES = {
    "ec_abi_version": (ctypes.c_int, []),
    "ec_hyper_size": (_I, []),
    "ec_hyper_field_name": (ctypes.c_char_p, [ctypes.c_int]),
    "ec_hyper_field": (ctypes.c_double, [_HP, ctypes.c_int]),
    "ec_concat_dedup": (_I, [_P, _P, _P, _P, _P, _I, ctypes.c_int, _P, _P, _P, _P,
                             ctypes.c_int]),
    "ec_lookup": (None, [_P, _I, _P, _P, _P, _I, _P, ctypes.c_int]),
    "ec_sparse_update": (None, [ctypes.c_int, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I,
                                _HP, ctypes.c_int]),
    "ec_bag_of": (None, [_P, _I, _P]),
    "ec_copy_rows": (None, [_P, _I, _P, _P, _I, _P, _I, _I, ctypes.c_int]),
    "ec_minmax": (None, [_P, _I, _P]),
    "ec_offsets_error": (_I, [_P, _I, _I]),
    "ec_first_unordered": (_I, [_P, _I, _I]),
    "ec_combiner_scales": (None, [_P, _I, _P, ctypes.c_int, _P]),
    "ec_dedup_raw": (_I, [_P, _I, _P, _P, _P, _P]),
    "ec_vocab_find": (_I, [_P, _I, _P, _P, _I, _P, _I, _I, _P, ctypes.c_int]),
    "ec_vocab_valid": (_I, [_P, _I, _P, _P, _I, _I, _P]),
    "ec_vocab_split": (_I, [_P, _P, _I, _P, _P, _P]),
    "ec_vocab_step": (_I, [_P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _P, _I, _I, _I, ctypes.c_int,
                           _P, _P, _I, _P]),
    "ec_vocab_index": (None, [_P, _I, _P, _P, _I]),
    "ec_cache_step": (_I, [_P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P, _I,
                           _P, _P, ctypes.c_int]),
    "ec_set_flags": (None, [_P, _P, _I, ctypes.c_int]),
    "ec_will_need": (_I, [_P, _I, _P, _I, _I]),
    "ec_expand": (None, [_P, _P, _P, _I, _P]),
    "ec_init_normal": (None, [_I, _P, _P, _I, _I, _I, ctypes.c_double, ctypes.c_double,
                              ctypes.c_double, _P, _I]),
}


def set_enabled(enabled: bool) -> bool:
    """Switches the fused kernels on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


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


def _build() -> Path:
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=60).stdout.splitlines()[:1]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), cxx, *version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    print(f"embcore: compiling the fused CPU kernels into {target.parent} (once per machine and "
          f"version, a few seconds)", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True, timeout=600)
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
            for name, (res, args) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
            if lib.ec_abi_version() != ABI_VERSION:
                raise OSError("stale kernel library (ABI version mismatch)")
            mismatch = hyper_layout_errors(lib)
            if mismatch:
                raise OSError("Hyper and the kernels' EcHyper disagree: " + "; ".join(mismatch))
            _lib = lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            _error = f"{type(e).__name__}: {e}"
            warnings.warn(f"embcore: the fused CPU kernels could not be built ({_error}); using "
                          f"torch ops instead (same results, slower)", RuntimeWarning,
                          stacklevel=3)
        _tried = True
    return _lib


def hyper_layout_errors(lib: ctypes.CDLL, cls: type[ctypes.Structure] = Hyper) -> list[str]:
    """How ``cls`` (``Hyper``) and the library's ``EcHyper`` disagree; empty when they agree.

    Compares the sizes and the field names in order, then writes a distinct value into every
    field of ``cls`` by name and reads each back in C++ by the same name (``ec_hyper_field``
    reads ``offsetof(EcHyper, name)``). Microseconds: done at every load.
    """
    if lib.ec_hyper_size() != ctypes.sizeof(cls):  # nothing more to compare safely
        return [f"size {ctypes.sizeof(cls)} in Python, {lib.ec_hyper_size()} in C++"]
    if any(t is not ctypes.c_double for _, t in cls._fields_):
        return [f"fields {cls._fields_} in Python, doubles only in C++"]
    errors = []
    names = [name for name, _ in cls._fields_]
    cpp = []
    while len(cpp) <= len(names):  # one past the Python side's last: None unless C++ has more
        name = lib.ec_hyper_field_name(len(cpp))
        if name is None:
            break
        cpp.append(name.decode())
    if cpp != names:
        errors.append(f"fields {names} in Python, {cpp} in C++")
    h = cls.from_buffer_copy(bytes(ctypes.sizeof(cls)))  # zeros, without __init__
    for i, name in enumerate(names):
        setattr(h, name, 1.5 + i)
    ptr = ctypes.cast(ctypes.pointer(h), _HP)
    for i, name in enumerate(cpp):
        if name in names and lib.ec_hyper_field(ptr, i) != getattr(h, name):
            errors.append(f"field {name!r} does not round-trip")
    return errors


_ARRAYS: dict[tuple[type, int], type] = {}


def _array(ctype: type, n: int) -> type:
    """The ctypes array type ``ctype * n`` (cached: creating one costs microseconds)."""
    key = (ctype, n)
    t = _ARRAYS.get(key)
    if t is None:
        t = _ARRAYS[key] = ctype * n
    return t


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class _Local(threading.local):
    single = False  # inside single_threaded() (a class default: a missing attribute would cost
    #                 a caught AttributeError, a microsecond, on every kernel call)


_local = _Local()


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
    assert not isinstance(got, int)  # (no limits: always a result)
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


class ConcatDedup:
    """``concat_dedup`` for parts of fixed lengths: the call's fixed arguments converted once
    (the dense path makes one per batch layout and calls it every step)."""

    def __init__(self, lens: Sequence[int], adds: Sequence[int], num_rows: int,
                 limits: Sequence[int] | None = None) -> None:
        k = len(lens)
        longs = _array(ctypes.c_int64, k)
        self.k, self.n = k, sum(lens)
        self.lens, self.adds, self._longs = longs(*lens), longs(*adds), longs
        self.limits = None if limits is None else longs(*limits)
        self.bits = max(int(num_rows) - 1, 1).bit_length()
        self.pointers = _array(ctypes.c_void_p, k)

    def __call__(self, parts: Sequence[torch.Tensor], steps: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | int:
        """``parts``: int64 CPU tensors of the lengths given, contiguous, or ``steps[i]``
        elements apart (e.g. a column of a wider batch) when ``steps`` are given."""
        lib = _load()
        assert lib is not None
        n = self.n
        buf = torch.empty(4 * n + 1, dtype=torch.int64)  # [ids | order | unique | uoff]
        base = buf.data_ptr()
        u = lib.ec_concat_dedup(self.pointers(*[t.data_ptr() for t in parts]), self.lens,
                                None if steps is None else self._longs(*steps), self.adds,
                                self.limits, self.k, self.bits, base, base + 8 * n,
                                base + 16 * n, base + 24 * n, _threads())
        if u < 0:
            return -1 - u
        # the four views in one call (a view costs about a microsecond: this runs every step)
        ids, order, unique, _, uoff, _ = buf.split_with_sizes([n, n, u, n - u, u + 1, n - u])
        return ids, unique, order, uoff


def lookup(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
           scales: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """``out[r] = sum_k scales[k] * table[ids[k]]`` over bag r (``offsets`` None: row ids[r]).

    Args:
        table: (N, D) contiguous float32.
        ids: (nnz,) int64 rows of ``table``.
        offsets: (R + 1,) int64 bag boundaries, or None for one id per row with scale 1.
        scales: (nnz,) float32, or None for 1.
        out: (R, D) contiguous float32, written.
    """
    lib = _load()
    assert lib is not None
    rows = out.shape[0]
    lib.ec_lookup(table.data_ptr(), table.shape[1], ids.data_ptr(), _ptr(offsets), _ptr(scales),
                  rows, out.data_ptr(), _threads())
    return out


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
              dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows] = src[src_rows]`` in one pass: 2-D CPU tensors of one dtype and width,
    rows contiguous; ``src_rows`` / ``dst_rows`` (n,) int64, contiguous, in range."""
    lib = _load()
    assert lib is not None
    size = src.element_size()
    lib.ec_copy_rows(src.data_ptr(), src.stride(0) * size, src_rows.data_ptr(), dst.data_ptr(),
                     dst.stride(0) * size, dst_rows.data_ptr(), src_rows.numel(),
                     src.shape[1] * size, _threads())


def will_need(src: torch.Tensor, rows: torch.Tensor) -> int:
    """Asks the kernel to read the pages under rows ``rows`` ((n,) int64, contiguous, in range)
    of ``src`` (a 2-D CPU tensor of a mapped file, rows contiguous; each row's whole stride:
    a record's other fields too) ahead (``madvise(MADV_WILLNEED)``); returns the system calls
    made."""
    lib = _load()
    assert lib is not None
    size = src.element_size()
    return lib.ec_will_need(src.data_ptr(), src.stride(0) * size, rows.data_ptr(), rows.numel(),
                            max(src.stride(0), src.shape[1]) * size)


def bag_of(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """(nnz,) int64: the bag of every occurrence."""
    lib = _load()
    assert lib is not None
    out = torch.empty(nnz, dtype=torch.int64)
    lib.ec_bag_of(offsets.data_ptr(), offsets.numel() - 1, out.data_ptr())
    return out


def expand(values: torch.Tensor, order: torch.Tensor, unique_offsets: torch.Tensor
           ) -> torch.Tensor:
    """(nnz,) int64: ``values`` (U,) of a ``Dedup``'s distinct rows at their occurrences
    (``values[dedup.inverse]`` without the inverse)."""
    lib = _load()
    assert lib is not None
    out = torch.empty(order.numel(), dtype=torch.int64)
    lib.ec_expand(values.data_ptr(), order.data_ptr(), unique_offsets.data_ptr(),
                  values.numel(), out.data_ptr())
    return out


def minmax(ids: torch.Tensor) -> tuple[int, int]:
    """Smallest and largest of (n > 0,) contiguous int64 ids."""
    lib = _load()
    assert lib is not None
    out = (ctypes.c_int64 * 2)()
    lib.ec_minmax(ids.data_ptr(), ids.numel(), out)
    return out[0], out[1]


def offsets_error(offsets: torch.Tensor, nnz: int) -> int:
    """-1 when (n >= 1,) contiguous int64 ``offsets`` start at 0, never decrease and end at
    ``nnz``; else the first entry breaking that (0: the first is not 0; i: ``offsets[i] <
    offsets[i - 1]``; n - 1: the last is not ``nnz``)."""
    lib = _load()
    assert lib is not None
    return lib.ec_offsets_error(offsets.data_ptr(), offsets.numel(), nnz)


def first_unordered(indices: torch.Tensor) -> int:
    """-1 when the columns of (k, n) contiguous int64 ``indices`` strictly increase in
    lexicographic order (a coalesced COO tensor's indices); else the first column j >= 1 that is
    not greater than column j - 1 (out of order, or a duplicate)."""
    lib = _load()
    assert lib is not None
    return lib.ec_first_unordered(indices.data_ptr(), indices.shape[0], indices.shape[1])


COMBINERS = {"sum": 0, "mean": 1, "sqrtn": 2}


def combiner_scales(offsets: torch.Tensor, weights: torch.Tensor | None, combiner: str,
                    nnz: int) -> torch.Tensor:
    """As ``inputs.combiner_scales``: (nnz,) float32 per-id scales applying the combiner."""
    lib = _load()
    assert lib is not None
    out = torch.empty(nnz, dtype=torch.float32)
    lib.ec_combiner_scales(offsets.data_ptr(), offsets.numel() - 1, _ptr(weights),
                           COMBINERS[combiner], out.data_ptr())
    return out


def sparse_update(rule: int, table: torch.Tensor, acc: torch.Tensor | None, rows: torch.Tensor,
                  hyper: Hyper, grads: Sequence[torch.Tensor],
                  starts: Sequence[int] | None = None, unique_offsets: torch.Tensor | None = None,
                  order: torch.Tensor | None = None, bags: torch.Tensor | None = None,
                  scales: torch.Tensor | None = None) -> None:
    """Updates ``table[rows]`` (and ``acc[rows]``) in place, each row once.

    Args:
        rule: ``SGD``, ``ADAGRAD`` or ``ROWWISE_ADAGRAD``.
        table: (N, D) contiguous float32 parameters.
        acc: (N, D) or (N, 1) contiguous float32 accumulators; None for SGD.
        rows: (U,) distinct int64 rows.
        hyper: the optimizer's hyper-parameters by name (``Hyper``; infinities for no bound).
        grads: the gradient source: with ``unique_offsets``, the output gradient rows split in
            consecutive (R_i, D) float32 parts (rows ``starts[i]:starts[i+1]``), each with unit
            column stride and any row stride (e.g. column slices of a wider gradient: no copy);
            without, one contiguous (U, D) tensor, row u the summed gradient of ``rows[u]``.
        starts: (len(grads) + 1) first output row of each part.
        unique_offsets, order: as returned by ``dedup`` (occurrences of each row, sorted).
        bags: (nnz,) the output row of each occurrence; None when occurrence k is row k.
        scales: (nnz,) float32 scale of each occurrence; None for 1.
    """
    lib = _load()
    assert lib is not None
    n = len(grads)
    addresses, row_strides = [], []
    for g in grads:  # (one pass: this runs once per table and step)
        shape, stride = g.shape, g.stride()
        if len(shape) != 2 or g.dtype != torch.float32 or (shape[1] > 1 and stride[1] != 1):
            raise ValueError(f"sparse_update: gradient parts must be 2-D float32 with unit column "
                             f"stride, got {tuple(shape)} {g.dtype} strides {stride}")
        addresses.append(g.data_ptr())
        row_strides.append(stride[0] if shape[0] > 1 else shape[1])
    if unique_offsets is None and not grads[0].is_contiguous():
        raise ValueError("sparse_update: a (U, D) summed gradient must be contiguous")
    ptrs = _array(ctypes.c_void_p, n)(*addresses)
    st = _array(ctypes.c_int64, n + 1)(*(starts if starts is not None else [0] * (n + 1)))
    strides = _array(ctypes.c_int64, n)(*row_strides)
    if not isinstance(hyper, Hyper):
        raise TypeError(f"hyper must be a native.Hyper, got {type(hyper).__name__}")
    lib.ec_sparse_update(rule, table.data_ptr(), _ptr(acc), table.shape[1], rows.data_ptr(),
                         rows.numel(), _ptr(unique_offsets), _ptr(order), _ptr(bags),
                         _ptr(scales), ptrs, st, strides, n, ctypes.byref(hyper), _threads())


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
    lib = _load()
    assert lib is not None
    n = ids.numel()
    buf = torch.empty(4 * n + 1, dtype=torch.int64)  # [unique | inverse | order | offsets]
    base = buf.data_ptr()
    u = lib.ec_dedup_raw(ids.data_ptr(), n, base, base + 8 * n, base + 16 * n, base + 24 * n)
    return buf[:u], buf[n:2 * n], buf[2 * n:3 * n], buf[3 * n:3 * n + u + 1]


def vocab_find(slots: torch.Tensor, row_key: torch.Tensor, last_use: torch.Tensor, cut: int,
               ids: torch.Tensor, fill: int = -1) -> tuple[torch.Tensor, int]:
    """``(rows (n,), missing)``: the int64 rows of contiguous int64 ``ids`` in a
    ``NativeVocabMap``'s index (``fill``: not resident, or last used before step ``cut``) and
    how many are not found."""
    lib = _load()
    assert lib is not None
    out = torch.empty(ids.numel(), dtype=torch.int64)
    missing = lib.ec_vocab_find(slots.data_ptr(), slots.numel() - 1, row_key.data_ptr(),
                                last_use.data_ptr(), cut, ids.data_ptr(), ids.numel(), fill,
                                out.data_ptr(), _threads())
    return out, missing


def vocab_split(ids: torch.Tensor, rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hit_rows (H,), miss_ids (M,), miss_pos (M,))`` of (n,) contiguous int64 ``ids`` and
    their ``rows`` from ``vocab_find``: the rows found, in order; the ids not found, ascending,
    and where they are in ``ids``."""
    lib = _load()
    assert lib is not None
    n = ids.numel()
    buf = torch.empty(3 * n, dtype=torch.int64)  # [hit_rows | miss_ids | miss_pos]
    base = buf.data_ptr()
    m = lib.ec_vocab_split(ids.data_ptr(), rows.data_ptr(), n, base, base + 8 * n,
                           base + 16 * n)
    return buf[:n - m], buf[n:n + m], buf[2 * n:2 * n + m]


def vocab_valid(rows: torch.Tensor, row_used: torch.Tensor, born: torch.Tensor,
                since: int) -> tuple[torch.Tensor, int]:
    """``(keep (n,) bool, kept)``: which of contiguous int64 ``rows`` are in range, used and got
    their id at or before step ``since`` (``VocabMap.valid``), and how many."""
    lib = _load()
    assert lib is not None
    keep = torch.empty(rows.numel(), dtype=torch.bool)
    kept = lib.ec_vocab_valid(rows.data_ptr(), rows.numel(), row_used.data_ptr(),
                              born.data_ptr(), born.numel(), since, keep.data_ptr())
    return keep, kept


def vocab_step(slots: torch.Tensor, row_key: torch.Tensor, row_used: torch.Tensor,
               last_use: torch.Tensor, frequency: torch.Tensor, born: torch.Tensor,
               hit_rows: torch.Tensor, new_ids: torch.Tensor, t: int, cut: int, lfu: bool,
               hint: int, spare: int = 0, freed: torch.Tensor | None = None
               ) -> tuple[torch.Tensor | None, int, int, int, int]:
    """One training step's changes to a ``NativeVocabMap`` (kernels.cpp's ``ec_vocab_step``);
    ``spare``: when it evicts, free up to that many more rows, written to ``freed`` (spare,).

    Returns:
        ``(new_rows (A,) or None on overflow, free, evictable, hint, n_freed)``: on overflow
        nothing changed and ``free`` / ``evictable`` count the rows; else the new free-row
        hint, and ``freed[:n_freed]`` the rows freed beyond the step's needs.
    """
    lib = _load()
    assert lib is not None
    new_rows = torch.empty(new_ids.numel(), dtype=torch.int64)
    info = (ctypes.c_int64 * 4)(0, 0, hint, 0)
    rc = lib.ec_vocab_step(slots.data_ptr(), slots.numel() - 1, row_key.data_ptr(),
                           row_used.data_ptr(), last_use.data_ptr(), frequency.data_ptr(),
                           born.data_ptr(), row_key.numel(), hit_rows.data_ptr(),
                           hit_rows.numel(), new_ids.data_ptr(), new_ids.numel(), t, cut,
                           int(lfu), new_rows.data_ptr(), info, spare,
                           _ptr(freed) if spare > 0 else None)
    if rc != 0:
        return None, info[0], info[1], hint, 0
    return new_rows, 0, 0, info[2], info[3]


def cache_step(rows: torch.Tensor, where: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor,
               dirty: torch.Tensor, fresh: torch.Tensor, free: torch.Tensor, n_free: int,
               clock: int, spare: int, bounds: torch.Tensor | None,
               counts: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
    """One step of a cache's index (kernels.cpp's ``ec_cache_step``; ``CacheIndex.step`` is its
    torch-ops twin and documents it).

    Returns:
        ``(slots (U,), miss_rows (M,), miss_slots (M,), out_rows (O,), out_slots (O,),
        n_free, n_evicted)``, or None when ``rows`` outnumber the cache rows (nothing changed).
    """
    lib = _load()
    assert lib is not None
    n = rows.numel()
    slots = torch.empty(n, dtype=torch.int64)
    miss_rows = torch.empty(n, dtype=torch.int64)
    miss_slots = torch.empty(n, dtype=torch.int64)
    most = min(n + max(spare, 0), owner.numel())  # rows an eviction may write back
    out_rows = torch.empty(most, dtype=torch.int64)
    out_slots = torch.empty(most, dtype=torch.int64)
    io = (ctypes.c_int64 * 4)(n_free, 0, 0, 0)
    rc = lib.ec_cache_step(rows.data_ptr(), n, where.data_ptr(), owner.data_ptr(),
                           stamp.data_ptr(), dirty.data_ptr(), fresh.data_ptr(), free.data_ptr(),
                           owner.numel(), clock, spare, slots.data_ptr(), miss_rows.data_ptr(),
                           miss_slots.data_ptr(), out_rows.data_ptr(), out_slots.data_ptr(),
                           _ptr(bounds), 0 if bounds is None else bounds.numel(), _ptr(counts),
                           io, _threads())
    if rc != 0:
        return None
    m, o = io[1], io[2]
    return (slots, miss_rows[:m], miss_slots[:m], out_rows[:o], out_slots[:o], io[0], io[3])


def set_flags(flags: torch.Tensor, idx: torch.Tensor, value: bool) -> None:
    """``flags[idx] = value``: ``flags`` a contiguous bool tensor, ``idx`` (n,) int64 in range."""
    lib = _load()
    assert lib is not None
    lib.ec_set_flags(flags.data_ptr(), idx.data_ptr(), idx.numel(), int(value))


def _seed64(seed: int) -> int:
    s = seed & ((1 << 64) - 1)
    return s - (1 << 64) if s >= 1 << 63 else s


def init_normal(seed: int, ids: torch.Tensor, rows: torch.Tensor, columns: tuple[int, int],
                lo: float, width: float, div: float, table: torch.Tensor) -> None:
    """Writes ``float32(inverse_normal(lo + hashing.uniform(seed, ids, c1)[:, c0:c1] * width) /
    div)``, ``(c0, c1) = columns``, into rows ``rows`` of contiguous float32 ``table``
    (n_rows, c1 - c0) (``vocabulary.initial_values``' default)."""
    lib = _load()
    assert lib is not None
    c0, c1 = columns
    lib.ec_init_normal(_seed64(seed), ids.data_ptr(), rows.data_ptr(), ids.numel(), c0, c1, lo,
                       width, div, table.data_ptr(), table.shape[1])


def vocab_index(slots: torch.Tensor, row_key: torch.Tensor, row_used: torch.Tensor) -> None:
    """Rebuilds a ``NativeVocabMap``'s index ``slots`` from its per-row state."""
    lib = _load()
    assert lib is not None
    lib.ec_vocab_index(slots.data_ptr(), slots.numel() - 1, row_key.data_ptr(),
                       row_used.data_ptr(), row_key.numel())


def main() -> int:
    """Builds the kernels now and says where they are (``python -m embcore kernels``)."""
    if _load() is None:
        print(f"embcore kernels unavailable: {_error}", file=sys.stderr)
        return 1
    print(f"embcore kernels: {getattr(_lib, '_name', '?')}")
    return 0
