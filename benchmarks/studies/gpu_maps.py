"""GPU: raw-id maps and tables beyond device memory, against the same tables held in HBM.

    PYTHONPATH=. python benchmarks/studies/gpu_maps.py                 # every part below
    PYTHONPATH=. python benchmarks/studies/gpu_maps.py --parts rates   # the map's rates only
    PYTHONPATH=. python benchmarks/studies/gpu_maps.py --smoke         # no GPU: tiny sizes on the
                                                                       # CPU, the kernels in
                                                                       # Triton's interpreter

Parts (``--parts``):

- ``rates``: the device map's index (state/vocab/device_hash.py) and its whole training step
  (state/vocab/device_map.py), in ids a second: ``find`` of 1M ids drawn from the resident ones, at
  load factors 0.25 and 0.5 (the index holds at least 2 slots a row, so a full map is at most
  0.5); ``insert`` of 1M fresh ids into an empty index; a training step of 64k distinct ids, half
  new, on a full LRU map of 4M rows (``train_step_async``: nothing read back). Beside them, a
  Python dict on the host (plain PyTorch plus a dict: ids copied to the host, looked up one by
  one, the rows copied back). HierarchicalKV's published figures for the same operations
  (find 2.5-3.9 B keys/s, insert_or_assign 0.66-1.09 B/s, insert_and_evict 0.51 B/s) are the
  anchors.
- ``raw``: W1's shape (26 tables x 100k x D64, batch 4096, Adagrad) with static tables and with
  raw-id tables (LRU, ids drawn from twice the capacity): examples a second, and the host
  synchronisations a step makes (``torch.cuda.set_sync_debug_mode``).
- ``budget``: W2's shape (8 x 1M x D128, bags of 20, batch 2048, Adagrad) with Zipf ids (alpha
  1.05), all in HBM and under a ``memory_budget`` of 10% of the tables and slots (the rest in
  pinned host memory).

Each figure is the mean over ``--steps`` steps after ``--warmup``, CUDA-synchronised around the
loop; the device is named in the output. Tables are freed between parts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is first imported
    import os
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
import embcore as ec  # noqa: E402
from embcore.kernels import gpu  # noqa: E402
from embcore.state.vocab.device_hash import DeviceHash  # noqa: E402
from embcore.state.vocab.device_map import DeviceVocabMap  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, steps: int, warmup: int) -> float:
    """Seconds per call of ``fn``, the mean over ``steps`` after ``warmup``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / steps


def _syncs(fn, device: torch.device) -> int | None:
    """The host synchronisations one call of ``fn`` makes (CUDA's sync debug mode), or None on
    the CPU."""
    if device.type != "cuda":
        fn()
        return None
    _sync(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)


def rates(args, device: torch.device) -> None:
    n = args.ids
    gen = torch.Generator().manual_seed(0)
    print(f"\n[rates] {n:,} ids a call")
    for load in (0.25, 0.5):
        cap = int(n / load / 2)  # slots = 2 x capacity (a power of two at least)
        owner = torch.randint(-2**62, 2**62, (cap,), generator=gen).to(device)
        index = DeviceHash(cap, owner)
        held = int(index.slots * load)
        take = torch.zeros(cap, dtype=torch.bool, device=device)
        take[:held] = True
        index.rebuild(take)
        queries = owner[torch.randint(0, held, (n,), generator=gen).to(device)]
        s = _timed(lambda: index.find(queries), device, args.steps, args.warmup)
        print(f"  find, load {load}: {n / s / 1e9:.3f} B ids/s ({s * 1e3:.3f} ms)")
    keys = torch.randint(-2**62, 2**62, (n,), generator=gen).unique().to(device)
    index = DeviceHash(keys.numel(), keys)
    places = torch.arange(keys.numel(), device=device)
    every = torch.ones(keys.numel(), dtype=torch.bool, device=device)

    def insert() -> None:
        index.slot.zero_()
        index.filled = 0
        index.insert(keys, places, every)

    s = _timed(insert, device, args.steps, args.warmup)
    print(f"  insert into an empty index (and its clearing): {keys.numel() / s / 1e9:.3f} B "
          f"ids/s ({s * 1e3:.3f} ms)")

    rows, u = args.map_rows, args.step_ids
    m = DeviceVocabMap(rows, eviction="lru", device=device)
    fill = torch.arange(rows, device=device) * 7 + 1
    for part in fill.split(max(u, 1)):
        m.train_step_async(part)
    m.confirm()
    fresh = [0]

    def step() -> None:
        k = fresh[0]
        fresh[0] += 1
        old = fill[torch.randint(0, rows, (u // 2,), generator=gen).to(device)]
        new = (torch.arange(u // 2, device=device) + k * u) * 7 + 2  # never seen
        m.train_step_async(torch.cat([old, new]).unique())

    s = _timed(step, device, args.steps, args.warmup)
    m.confirm()
    print(f"  training step of {u:,} ids, half new, full LRU map of {rows:,} rows: "
          f"{u / s / 1e6:.1f} M ids/s ({s * 1e3:.3f} ms; syncs a step: "
          f"{_syncs(step, device)})")

    table = dict(zip(fill.cpu().tolist(), range(rows)))
    q = fill[torch.randint(0, rows, (min(n, 200_000),), generator=gen).to(device)]

    def by_dict() -> torch.Tensor:
        ids = q.cpu().tolist()
        return torch.tensor([table.get(i, -1) for i in ids]).to(device)

    s = _timed(by_dict, device, max(2, args.steps // 5), 1)
    print(f"  plain PyTorch + a dict (find): {q.numel() / s / 1e6:.2f} M ids/s")


def _zipf(rng: np.random.Generator, n: int, size: int) -> torch.Tensor:
    r = rng.zipf(1.05, size=size * 3)
    r = r[r <= n][:size]
    while r.size < size:
        r = np.concatenate([r, rng.zipf(1.05, size=size)[:size - r.size]])
        r = r[r <= n]
    return torch.from_numpy((r[:size] - 1).astype(np.int64))


def _loop(emb, batches, grads, args, device) -> tuple[float, int | None]:
    k = [0]

    def step() -> None:
        emb.enqueue(batches[k[0] % len(batches)])
        emb.dequeue()
        emb.apply_gradients(grads)
        k[0] += 1

    s = _timed(step, device, args.steps, args.warmup)
    return s, _syncs(step, device)


def raw(args, device: torch.device) -> None:
    t, v, d, b = (3, 500, 8, 64) if args.smoke else (26, 100_000, 64, 4096)
    print(f"\n[raw] {t} tables x {v:,} x D{d}, batch {b}, Adagrad")
    for dynamic in (False, True):
        dyn = ec.DynamicVocabulary(eviction="lru") if dynamic else None
        fc = {f"f{i}": ec.FeatureConfig(table=ec.TableConfig(
            vocabulary_size=v, dim=d, name=f"t{i}", dynamic=dyn)) for i in range(t)}
        emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.01), device=device)
        gen = torch.Generator().manual_seed(0)
        space = 2 * v if dynamic else v
        batches = [{f"f{i}": (torch.randint(0, space, (b,), generator=gen)
                              * (1_000_003 if dynamic else 1)).to(device) for i in range(t)}
                   for _ in range(6)]
        grads = {f"f{i}": torch.randn(b, d, device=device) for i in range(t)}
        s, syncs = _loop(emb, batches, grads, args, device)
        kind = "raw ids (LRU, ids from twice the capacity)" if dynamic else "static"
        print(f"  {kind}: {b / s:,.0f} ex/s ({s * 1e3:.2f} ms a step; syncs a step: {syncs})")
        del emb
        if device.type == "cuda":
            torch.cuda.empty_cache()


def budget(args, device: torch.device) -> None:
    t, v, d, b, bag = (2, 2000, 64, 16, 4) if args.smoke else (8, 1_000_000, 128, 2048, 20)
    state = t * v * d * 4 * 2  # rows and Adagrad's accumulators
    print(f"\n[budget] {t} tables x {v:,} x D{d}, bags of {bag}, batch {b}, Zipf 1.05, Adagrad")
    rng = np.random.default_rng(0)
    offsets = torch.arange(0, b * bag + 1, bag, device=device)
    batches = [{f"f{i}": torch.nested.nested_tensor_from_jagged(
        _zipf(rng, v, b * bag).to(device), offsets) for i in range(t)} for _ in range(6)]
    grads = {f"f{i}": torch.randn(b, d, device=device) for i in range(t)}
    for cap in (None, state // 10):
        fc = {f"f{i}": ec.FeatureConfig(table=ec.TableConfig(vocabulary_size=v, dim=d,
                                                             name=f"t{i}")) for i in range(t)}
        kw = {} if cap is None else {"memory_budget": cap, "offload_dir": tempfile.mkdtemp()}
        emb = ec.Embedding(fc, ec.Adagrad(learning_rate=0.01), device=device, **kw)
        s, syncs = _loop(emb, batches, grads, args, device)
        kind = "all in fast memory" if cap is None else f"budget {cap:,} bytes (10%)"
        print(f"  {kind}: {b / s:,.0f} ex/s ({s * 1e3:.2f} ms a step; syncs a step: {syncs})")
        del emb
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["rates", "raw", "budget"],
                   choices=["rates", "raw", "budget"])
    p.add_argument("--ids", type=int, default=1 << 20)
    p.add_argument("--map-rows", type=int, default=4 << 20)
    p.add_argument("--step-ids", type=int, default=1 << 16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--smoke", action="store_true",
                   help="no GPU: tiny sizes on the CPU, the kernels in Triton's interpreter")
    args = p.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        args.ids, args.map_rows, args.step_ids, args.steps, args.warmup = 256, 512, 64, 2, 1
        if not gpu.available():
            print(f"triton does not load: {gpu.error()}")
            return 1
        gpu.force_on_cpu(True)
    elif not torch.cuda.is_available():
        print("no CUDA GPU here (--smoke runs tiny sizes on the CPU)")
        return 1
    else:
        device = torch.device("cuda")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    print(f"device: {name}; torch {torch.__version__}; embcore {ec.__version__}")
    for part in args.parts:
        {"rates": rates, "raw": raw, "budget": budget}[part](args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
