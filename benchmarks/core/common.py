"""What every ``sys_*.py`` shares: arguments, the timed loop and the one-line JSON result.

A system module supplies ``build(workload, optimizer, grads, init) -> System`` where a System has
``prepare(batch) -> native inputs`` (done before timing), ``step(native)`` (lookup + backward with
the fixed upstream gradient + the optimizer update), ``tables() -> T x (N, D)`` and
``state_bytes() -> int`` (tables + optimizer slots).

Table dtype (``--dtype float32|float16|bfloat16``, default float32): with the default, ``build``
is called exactly as above. Otherwise it is called with one more keyword argument,
``dtype=torch.float16`` / ``torch.bfloat16`` (the tables' storage dtype; activations and the
upstream gradients stay float32); a ``build`` without a ``dtype`` parameter, or one that raises
``Unsupported``, gives a "not supported" result line (exit 0) instead of a run. Every result line
carries ``"dtype"``.

A step's timing: ``warmup`` steps, then ``repeats`` timed loops of ``workload.steps`` steps each,
cycling over ``NUM_BATCHES`` pre-generated batches; the result is the median loop's time per step.

Stream mode (``--fill F``, F >= 0; the default of the W1-raw scripts): every step trains on a new
batch of the workload's stream (``workloads.stream_batch``), none is reused: ``F`` untimed fill
steps, the warm-up steps, then the timed loops (each loop's batches prepared before it). A system
with dynamic tables may also offer ``resident_ids() -> T x (R_t,)`` (the raw ids its maps hold)
and ``map_bytes() -> int`` (the memory of its id -> row maps): the result then carries their
sizes and one more untimed step's admitted and evicted ids (``raw_stats``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (WORKLOADS, Batch, Workload, get_workload, initial_tables,  # noqa: E402
                       make_batches, stream_batch, upstream_grads)

THREADS = 2
LR = 0.01
ACC0 = 0.1            # initial accumulator value (all systems; FBGEMM's is overwritten to this)
NUM_BATCHES = 8
CHECK_STEPS = 3
torch.set_num_threads(THREADS)


class System(Protocol):
    def prepare(self, batch: Batch) -> Any: ...
    def step(self, native: Any) -> None: ...
    def tables(self) -> list[torch.Tensor]: ...
    def state_bytes(self) -> int: ...


Build = Callable[..., System]  # (workload, optimizer, grads, init[, dtype=...]) -> System

# --dtype: the tables' storage dtype; float32 (the default) calls build without a dtype argument
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
DEFAULT_DTYPE = "float32"


class Unsupported(Exception):
    """Raised by a system's ``build`` for a configuration it cannot run (e.g. a ``--dtype`` its
    library lacks on this device): the result line says "not supported" with this message."""


def argv_value(flag: str, default: str) -> str:
    """``flag``'s value in ``sys.argv`` without parsing (for the lines written before
    ``parse_args``, e.g. a peer that cannot be imported)."""
    if flag in sys.argv and sys.argv.index(flag) + 1 < len(sys.argv):
        return sys.argv[sys.argv.index(flag) + 1]
    return default


def take_option(flag: str, default: Any, kind: Callable[[str], Any] = int) -> Any:
    """A system script's own option ``flag VALUE``, removed from ``sys.argv`` before the shared
    ``parse_args`` sees it (so ``run.py`` can pass it through); ``default`` when absent."""
    if flag not in sys.argv:
        return default
    i = sys.argv.index(flag)
    if i + 1 >= len(sys.argv):
        raise SystemExit(f"{flag} needs a value")
    value = kind(sys.argv[i + 1])
    del sys.argv[i:i + 2]
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of threads, got {value}")
    return value


def parse_args(system: str, fill: int = -1) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"One benchmark run of {system}; prints one JSON line.")
    p.add_argument("--workload", required=True, choices=WORKLOADS)
    p.add_argument("--optimizer", default="adagrad", choices=["adagrad", "rowwise"])
    p.add_argument("--dtype", default=DEFAULT_DTYPE, choices=list(DTYPES),
                   help="the tables' storage dtype (default %(default)s); activations and "
                        "gradients stay float32; a system without it prints a 'not supported' "
                        "line")
    p.add_argument("--quick", action="store_true", help="smaller W2, fewer timed steps")
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--check", metavar="PATH",
                   help=f"no timing: {CHECK_STEPS} steps from the shared initial tables, then "
                        f"torch.save the tables to PATH")
    p.add_argument("--profile", action="store_true",
                   help="also print the top 10 ops by self CPU time of 3 steps (stderr)")
    p.add_argument("--threads", type=_positive, default=THREADS,
                   help="torch's intra-op threads (default %(default)s, as in run.py; set "
                        "OMP_NUM_THREADS to the same value for peers that read it)")
    p.add_argument("--fill", type=int, default=fill,
                   help="stream mode when >= 0: every step a new batch, after this many untimed "
                        "fill steps (default %(default)s; < 0: cycle over the pre-generated "
                        "batches)")
    return p.parse_args()


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
    else:
        for k, v in result.items():
            print(f"{k:>16}: {v}")


def not_installed(system: str, optimizer: str, workload: str, err: Exception) -> None:
    """The result line of a peer that cannot be imported; exits 0 so the run goes on."""
    print(json.dumps({"system": system, "optimizer": optimizer, "workload": workload,
                      "dtype": argv_value("--dtype", DEFAULT_DTYPE),
                      "status": "not installed", "error": f"{type(err).__name__}: {err}"}))
    sys.exit(0)


def not_supported(system: str, args: argparse.Namespace, why: str) -> None:
    """The result line of a system that cannot run this configuration; exits 0 so the run goes
    on."""
    print(json.dumps({"system": system, "optimizer": args.optimizer, "workload": args.workload,
                      "dtype": args.dtype, "status": "not supported", "error": why}))
    sys.exit(0)


def check_dtype(system: str, build: Build, args: argparse.Namespace) -> None:
    """A ``--dtype`` other than float32 for a ``build`` without a ``dtype`` parameter ends with a
    "not supported" line (before any batch is made)."""
    if args.dtype == DEFAULT_DTYPE:
        return
    try:
        params = inspect.signature(build).parameters
    except (TypeError, ValueError):
        params = {}
    if "dtype" not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        not_supported(system, args, f"{system} takes no --dtype (float32 tables only)")


def construct(system: str, build: Build, w: Workload, args: argparse.Namespace,
              grads: list[torch.Tensor], init: list[torch.Tensor] | None) -> System:
    """``build(w, optimizer, grads, init)``, plus ``dtype=`` when ``--dtype`` is not float32; a
    system that takes no dtype, or raises ``Unsupported``, ends with a "not supported" line."""
    if args.dtype == DEFAULT_DTYPE:
        return build(w, args.optimizer, grads, init)
    check_dtype(system, build, args)
    try:
        return build(w, args.optimizer, grads, init, dtype=DTYPES[args.dtype])
    except Unsupported as e:
        not_supported(system, args, str(e))


def peak_rss_mib() -> float:
    """This process's peak RSS. ``ru_maxrss`` survives exec, so a child forked from a big parent
    would report the parent's peak: prefer VmHWM, which belongs to the exec'd address space."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(ln for ln in f if ln.startswith("VmHWM:"))
        return int(hwm.split()[1]) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(system: str, build: Build, versions: dict[str, str], fill: int = -1,
         extra: dict | None = None) -> None:
    """Runs one system; ``fill``: the default of ``--fill`` (stream mode when >= 0); ``extra``:
    fields added to the result line (e.g. a W1-raw system's capacity)."""
    args = parse_args(system, fill)
    torch.set_num_threads(args.threads)
    check_dtype(system, build, args)
    if args.fill >= 0 and not args.check:
        return main_stream(system, build, versions, args, extra or {})
    w = get_workload(args.workload, args.quick)
    grads = upstream_grads(w)  # T x (B, D)
    batches = make_batches(w, NUM_BATCHES)
    if args.check:
        sysm = construct(system, build, w, args, grads, initial_tables(w))
        for b in batches[:CHECK_STEPS]:
            sysm.step(sysm.prepare(b))
        torch.save([t.detach().clone().contiguous() for t in sysm.tables()], args.check)
        emit({"system": system, "optimizer": args.optimizer, "workload": w.name,
              "dtype": args.dtype, "status": "checked", "path": args.check}, args.json)
        return
    t0 = time.perf_counter()
    sysm = construct(system, build, w, args, grads, None)
    natives = [sysm.prepare(b) for b in batches]
    build_s = time.perf_counter() - t0
    for i in range(args.warmup):
        sysm.step(natives[i % len(natives)])
    per_step = []
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for i in range(w.steps):
            sysm.step(natives[i % len(natives)])
        per_step.append((time.perf_counter() - t0) / w.steps)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / (
        args.repeats * w.steps)  # page faults per step: fresh pages for big temporaries
    if args.profile:
        profile(sysm, natives)
    emit(result(system, args, w, sysm, versions, per_step, build_s, faults), args.json)


def result(system: str, args: argparse.Namespace, w: Workload, sysm: System,
           versions: dict[str, str], per_step: list[float], build_s: float, faults: float,
           **fields: Any) -> dict:
    """The JSON result line of a timed run (``fields``: more entries; a ``note`` among them is
    joined to the workload's)."""
    s = statistics.median(per_step)
    note = "; ".join(n for n in (w.note, fields.pop("note", "")) if n)
    return {"system": system, "optimizer": args.optimizer, "workload": w.name,
            "dtype": args.dtype, "status": "ok",
            "tables": w.tables, "rows": w.rows, "dim": w.dim, "batch": w.batch, "bag": w.bag,
            "combiner": w.combiner, "steps": w.steps, "repeats": args.repeats,
            "ms_per_step": s * 1e3, "examples_per_s": w.batch / s,
            "repeat_ms": [round(x * 1e3, 4) for x in per_step], "build_s": round(build_s, 2),
            "minor_faults_per_step": round(faults),
            "peak_rss_mib": round(peak_rss_mib(), 1), "state_bytes": sysm.state_bytes(),
            **fields, "threads": torch.get_num_threads(), "note": note,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         **versions}}


def main_stream(system: str, build: Build, versions: dict[str, str], args: argparse.Namespace,
                extra: dict) -> None:
    """``main`` in stream mode: every step a new batch (batch i of ``workloads.stream_batch``)."""
    w = get_workload(args.workload, args.quick)
    grads = upstream_grads(w)  # T x (B, D)
    t0 = time.perf_counter()
    sysm = construct(system, build, w, args, grads, None)
    build_s = time.perf_counter() - t0
    i = 0
    t0 = time.perf_counter()
    for _ in range(args.fill + args.warmup):  # untimed: each batch prepared just before its step
        sysm.step(sysm.prepare(stream_batch(w, i)))
        i += 1
    fill_s = time.perf_counter() - t0
    per_step, faults = [], 0
    for _ in range(args.repeats):
        natives = [sysm.prepare(stream_batch(w, i + k)) for k in range(w.steps)]
        i += w.steps
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for native in natives:
            sysm.step(native)
        per_step.append((time.perf_counter() - t0) / w.steps)
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        del natives
    if args.profile:
        profile(sysm, [sysm.prepare(stream_batch(w, i + k)) for k in range(3)])
        i += 3
    stats = raw_stats(sysm, sysm.prepare(stream_batch(w, i)))
    emit(result(system, args, w, sysm, versions, per_step, build_s,
                faults / (args.repeats * w.steps), stream=True, fill_steps=args.fill,
                fill_s=round(fill_s, 1), **extra, **stats), args.json)


def raw_stats(sysm: System, native: Any) -> dict:
    """A system with id -> row maps: its resident ids (summed over tables), the maps' memory
    per resident id, and the ids one more (untimed) step admitted and evicted."""
    if not hasattr(sysm, "resident_ids"):
        sysm.step(native)
        return {}
    before = sysm.resident_ids()  # T x (R_t,)
    sysm.step(native)
    after = sysm.resident_ids()
    out = {"resident_ids": sum(a.numel() for a in after),
           "probe_admitted": sum(int((~torch.isin(a, b)).sum()) for a, b in zip(after, before)),
           "probe_evicted": sum(int((~torch.isin(b, a)).sum()) for a, b in zip(after, before))}
    if hasattr(sysm, "map_bytes"):
        nbytes = sysm.map_bytes()
        out.update(map_bytes=nbytes, map_bytes_per_id=round(nbytes / max(out["resident_ids"], 1),
                                                            1))
    return out


def profile(sysm: System, natives: list) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(3):
            sysm.step(natives[i % len(natives)])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10),
          file=sys.stderr)
