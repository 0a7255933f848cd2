"""Single-thread memory floors of one W2 step: what reading its rows costs one core.

    python benchmarks/studies/floor.py [--quick]

Writes one W2 batch's ids (the 8 tables stacked, bag order) and their distinct rows to a
temporary directory, compiles ``floor.c`` with the C compiler on PATH and runs it on one thread:
the best of 7 timings of reading every id's row in bag order (any lookup's reads), reading each
distinct row once in row order, and reading and writing each distinct row once in row order (an
update's rows, without forming its gradient). A system whose step runs on one core (beside a
busy process) cannot take less than the first plus the third; FBGEMM's CPU step runs on about
one thread. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent  # floor.c
sys.path.insert(0, str(HERE.parent / "core"))  # workloads.py
from workloads import get_workload, make_batches  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="W2 with 8 x 200k rows")
    args = p.parse_args()
    w = get_workload("W2", args.quick)
    batch = make_batches(w, 1)[0]
    ids = torch.cat([x + t * w.rows for t, x in enumerate(batch.ids)])  # (nnz,) bag order
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("floor.py needs a C compiler (cc, gcc or clang) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        exe, ids_file, uq_file = Path(tmp) / "floor", Path(tmp) / "ids", Path(tmp) / "unique"
        subprocess.run([cc, "-O3", "-march=native", "-o", str(exe), str(HERE / "floor.c")],
                       check=True)
        ids.numpy().tofile(ids_file)
        ids.unique().numpy().tofile(uq_file)
        out = subprocess.run([str(exe), str(ids_file), str(uq_file), str(w.rows * w.tables),
                              str(w.dim)], check=True, capture_output=True, text=True).stdout
    result = {"workload": w.name, **json.loads(out)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
