"""The fused CPU kernels' library: built on first use, loaded, its kernels bound; switched on or
off; the kernels' thread count (``threads``, ``single_threaded``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
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

from ..rules import DEFINES as RULE_DEFINES
from .args import (
    DOUBLE,
    HYPER,
    INT,
    INT64,
    STRING,
    Kernel,
    hyper_layout_errors,
    kernels,
    set_loader,
)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "kernels.cpp"  # the translation unit: it includes every header of CSRC
# The instruction set is this CPU's (-march=native: F16C's conversions, AVX-512, ...), or the one
# EMBCORE_NATIVE_ARCH names (e.g. x86-64: the portable paths, which tests check give the same bits).
ARCH = os.environ.get("EMBCORE_NATIVE_ARCH", "native")
# The kernels' parallel loops (csrc/pool.h): "own" (the library's own pool), or "omp" (OpenMP
# regions on the runtime torch loaded, libgomp.so.1, and so on torch's own worker threads).
POOL = os.environ.get("EMBCORE_NATIVE_POOL", "own")
if POOL not in ("own", "omp"):
    raise ValueError(f"EMBCORE_NATIVE_POOL={POOL!r}: expected 'own' or 'omp'")
FLAGS = ("-O3", f"-march={ARCH}", "-fno-math-errno",
         *(("-fopenmp",) if POOL == "omp" else ("-fopenmp-simd",)), "-pthread", "-std=c++17",
         "-shared", "-fPIC")
# The kernels' ABI version, its one source: the build passes it as -DEC_ABI_VERSION (the
# library's ec_abi_version() returns it) and _load refuses a library reporting another. Bumped
# when a kernel's arguments or EcHyper change (2: ec_sparse_update takes an EcHyper, 3: ec_vocab_*,
# 4: ec_copy_rows, 5: ec_vocab_step's spare rows, 6: ec_sparse_update's row strides,
# 7: ec_concat_dedup's id limits and steps, 8: ec_cache_step, ec_set_flags, ec_expand,
# 9: ec_cache_step's threads, 10: ec_will_need, 11: 16-bit rows in ec_lookup and ec_sparse_update,
# ec_round16, 12: ec_vocab_*'s compact maps: int32 or int64 slots (with fingerprints) and steps,
# no row_used, the rows held apart from the capacity; ec_vocab_grow), 13: ec_vocab_find_many,
# ec_vocab_step_many, 14: ec_vocab_find_many's shard rows, 15: ec_copy_rows_summed,
# 16: ec_sparse_update's overflow flags and count, 17: ec_sparse_update's rules numbered by
# kernels/rules.py, 18: ec_copy_rows_summed's versions, ec_cache_step's version, ec_row_versions,
# 19: the hot kernels' ``_packed`` entries (csrc/packed.h), 20: 8-bit rows in ec_sparse_update
# (its row_scales).
ABI_VERSION = 20
DEFINES = (f"-DEC_ABI_VERSION={ABI_VERSION}", *RULE_DEFINES,
           *(("-DEC_POOL_OMP",) if POOL == "omp" else ()))

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
            functions = [(kernel, kernel.signature(lib), kernel.packed_signature(lib))
                         for kernel in kernels()]
            if lib.ec_abi_version() != ABI_VERSION:
                raise OSError(f"stale kernel library (ABI version {lib.ec_abi_version()}, "
                              f"expected {ABI_VERSION})")
            mismatch = hyper_layout_errors(lib)
            if mismatch:
                raise OSError("Hyper and the kernels' EcHyper disagree: " + "; ".join(mismatch))
            for kernel, fn, packed in functions:
                kernel.bind(fn, packed)
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

def threads() -> int:
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




def main() -> int:
    """Builds the kernels now and says where they are (``python -m embcore kernels``)."""
    if _load() is None:
        print(f"embcore kernels unavailable: {_error}", file=sys.stderr)
        return 1
    print(f"embcore kernels: {getattr(_lib, '_name', '?')}")
    return 0
