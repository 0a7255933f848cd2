"""Timings of the vocabulary maps (embcore/state/vocab/torch_map.py): ``find`` and ``train_step``.

    python benchmarks/studies/vocab_map.py [--threads N] [--repeats 7] [--device cpu] [--map native]

``--map native`` (the CPU default of the engine: a hash index stepped by the fused kernels) or
``torch`` (``VocabMap``: sorted ids and torch ops, the path of other devices).

- find: 1M random ids (half resident) in a map of 10M resident ids (capacity 10M).
- train_step: 4096 and 65536 distinct ids into a map of capacity 100k, half of them resident and
  half new: "free" (the map half full: the new ids take free rows), "evict" (the map full: each
  new id evicts one), "hits" (every id resident: no admission).
Prints the median of ``--repeats`` runs in ms (each train_step on a freshly loaded state) and the
bytes the map holds per resident id.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from embcore.state.vocab.native_map import NativeVocabMap
from embcore.state.vocab.torch_map import VocabMap

MAP = VocabMap  # set by --map


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats: int, device: torch.device, setup=None) -> float:
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        if setup is not None:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def state_bytes(m: VocabMap) -> int:
    """Bytes the map holds: every tensor of it (``VocabMap.nbytes``)."""
    return m.nbytes()


def distinct_ids(n: int, gen: torch.Generator) -> torch.Tensor:
    """(n,) distinct random int64 ids over the whole range, in random order."""
    ids = torch.unique(torch.randint(-(2**63), 2**63 - 1, (n + n // 50 + 16,), generator=gen))
    return ids[torch.randperm(ids.numel(), generator=gen)[:n]]


def bench_find(device: torch.device, repeats: int, gen: torch.Generator) -> None:
    n = 10_000_000
    ids = distinct_ids(n + 500_000, gen)
    m = MAP(n, device=device)
    t0 = time.perf_counter()
    m.train_step(ids[:n].sort().values.to(device))
    sync(device)
    build = (time.perf_counter() - t0) * 1e3
    query = torch.cat([ids[:500_000], ids[n:]])[torch.randperm(1_000_000, generator=gen)]
    query = query.to(device)
    ms = median_ms(lambda: m.find(query), repeats, device)
    print(f"find 1M ids in a map of 10M ids: {ms:8.2f} ms ({ms:.1f} ns per id); "
          f"building it (one train_step of 10M new ids): {build:.0f} ms; "
          f"{state_bytes(m) / m.n_resident:.1f} bytes per resident id")


def bench_step(device: torch.device, repeats: int, gen: torch.Generator) -> None:
    capacity = 100_000
    for u in (4096, 65536):
        for case in ("free", "evict", "hits"):
            resident = {"free": capacity // 2, "evict": capacity, "hits": capacity}[case]
            ids = distinct_ids(resident + u, gen)
            m = MAP(capacity, device=device)
            m.train_step(ids[:resident].sort().values.to(device))  # step 1: fill
            new = 0 if case == "hits" else u // 2
            step = torch.cat([ids[:u - new], ids[resident:resident + new]]).sort().values
            step = step.to(device)
            state = m.state_dict()
            ms = median_ms(lambda m=m, step=step: m.train_step(step), repeats, device,
                           setup=lambda m=m, state=state: m.load_state_dict(state))
            m.load_state_dict(state)
            _, new_ids, _ = m.train_step(step)
            assert new_ids.numel() == new and m.n_resident == min(capacity, resident + new)
            print(f"train_step {u:6d} ids, {case:5s} (map of {resident:6d} ids, {new:5d} "
                  f"admitted): {ms:8.2f} ms;  {state_bytes(m) / m.n_resident:.1f} bytes per "
                  f"resident id")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--map", default="native", choices=["native", "torch"])
    a = p.parse_args()
    MAP = NativeVocabMap if a.map == "native" else VocabMap
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}, "
          f"map {MAP.__name__}")
    g = torch.Generator().manual_seed(0)
    bench_find(dev, a.repeats, g)
    bench_step(dev, a.repeats, g)
