"""W1-raw cross-check: embcore's dynamic tables (LRU) and plain PyTorch with a Python mapping
(sys_raw_plain.py) train the same stream steps of raw ids, the plain peer's new rows initialized
with embcore's ``initial_values`` (the same function of the table's seed and the id); their id ->
row maps and their rows must agree.

    .venv/bin/python benchmarks/systems/check_raw.py [--capacity 100000] [--mapping dict|lru]
                                                     [--tables 3] [--steps 3]

Why they can agree: both give new ids (ascending) the lowest free rows first. With eviction, the
OrderedDict LRU (``--mapping lru``) evicts in embcore's order too when its ``exact_lru_order`` is
on (set here; off in the benchmark, where a step's hits leave before its new ids): a step's ids
then sit at the end in ascending order, so ``popitem(last=False)`` yields the smallest (last use,
id), embcore's victim order (``--capacity 5000 --mapping lru --steps 10`` evicts from the fourth
step on). The ``dict`` mapping's FIFO ring agrees only while nothing is evicted.
W1's shape (100k ids per table, batch 4096, D 64) with fewer tables; prints one line per table
and exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "core")]  # the sys_raw_* scripts; common, workloads
ARGV = sys.argv[1:]  # before the sys_raw_* imports take their options out of sys.argv
import common  # noqa: E402
import sys_raw_embcore  # noqa: E402
import sys_raw_plain  # noqa: E402
import torch  # noqa: E402
from workloads import Workload, stream_batch, upstream_grads  # noqa: E402

from embcore.state.vocab.vocabulary import initial_values  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--mapping", default="dict", choices=["dict", "lru"])
    p.add_argument("--tables", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(ARGV)
    w = Workload("W1", args.tables, 100_000, 64, 4096, 1, "sum", args.steps)
    grads = upstream_grads(w)
    sys_raw_embcore.CAPACITY = sys_raw_plain.CAPACITY = args.capacity  # the scripts' options
    sys_raw_embcore.EVICTION, sys_raw_plain.MAPPING = "lru", args.mapping
    emb = sys_raw_embcore.RawEmbcoreSystem(w, "adagrad", grads, None)
    plain = sys_raw_plain.RawPlainSystem(w, "adagrad", grads, None)
    plain.exact_lru_order = True
    dyn = {d.name: d for stack in (r.stack for r in emb.emb._store if r.maps)
           for d in stack.members}  # {table name: DynamicRows} (the tables stack)

    def embcore_init(t: int, ids: list[int]) -> torch.Tensor:
        d = dyn[f"t{t}"]
        return initial_values(d.table, d.name, d.seed, torch.tensor(ids, dtype=torch.int64))

    plain.initial_values = embcore_init
    for i in range(args.steps):
        b = stream_batch(w, i)
        emb.step(emb.prepare(b))
        plain.step(plain.prepare(b))
    print(f"capacity {plain.cap}, plain mapping {type(plain.maps[0]).__name__}")
    bad = False
    for t, (cfg, table) in enumerate(zip(emb.configs, emb.tables())):
        ids, rows = emb.emb.vocabulary(cfg)  # (R,) ascending, (R,)
        items = sorted(plain.maps[t].items())
        p_ids = torch.tensor([k for k, _ in items], dtype=torch.int64)
        p_rows = torch.tensor([r for _, r in items], dtype=torch.int64)
        same_map = torch.equal(ids, p_ids) and torch.equal(rows, p_rows)
        diff = (table[rows] - plain.tables()[t].detach()[p_rows]).abs().max().item()
        ok = same_map and diff < 1e-5
        bad |= not ok
        print(f"table t{t}: {ids.numel()} resident ids, same id -> row map: {same_map}, "
              f"max |diff| of their rows after {args.steps} steps = {diff:.2e} "
              f"{'OK' if ok else 'MISMATCH'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    torch.set_num_threads(common.THREADS)
    main()
