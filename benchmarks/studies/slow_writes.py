"""Two write paths of a slow tier under heavy misses: rows written back in place, or appended.

    python benchmarks/studies/slow_writes.py [--rows 8000000] [--misses 54400] [--steps 200]
        [--spare 0.5] [--dir DIR] [--json]

The miss traffic of full-size W2 behind a cache of 10% of its rows (8 x 1M records of 1 KiB: a
row of 128 float32 and its Adagrad accumulator; 54.4k rows read and 54.4k written back a step
at Zipf 1.05, benchmarks/RESULTS.md), replayed on one file without the engine, each path from a
fully written file and the same random rows:

- ``in place``: today's slow tier (``state/tier/cache.py``'s mapped records): a step reads its
  missed records and writes its evicted ones back where they live, each write dirtying the
  4 KiB page around its record.
- ``log``: a log-structured tier: every record lives at the place its last write put it (an
  index of row -> place); a step reads its missed records there (through the mapping) and
  appends its evicted ones at the log's head, sequentially (whole pages, by ``pwrite``). The file holds ``spare`` more room than the
  rows; when the head reaches a segment still holding live records, a cleaner first moves those
  to the head (greedy: the oldest segment), the write amplification of a log.

Every step is timed; the figures are the median of the second half of the steps (the dirty
pages have passed the kernel's limits by then: the steady state a long run meets), with the
device's sectors written during the run (/proc/diskstats: every process on the machine). The
file (rows x (1 + spare) KiB, its blocks allocated first: a disk without room for it is an error
before anything runs) is deleted at the end, its dirty pages with it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RECORD = 1024  # bytes: a W2 row (128 float32) and its Adagrad accumulator, one record
SEGMENT = 4096  # records a log segment holds (4 MiB): the cleaner's unit


def disk_sectors() -> int | None:
    """Sectors written so far to the machine's disks (whole devices: vd*, sd*, xvd*, nvme*n*;
    every process's writes), None where /proc/diskstats cannot be read."""
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        f = line.split()
        if len(f) > 9 and re.fullmatch(r"(?:[sv]d|xvd)[a-z]+|nvme\d+n\d+", f[2]):
            total += int(f[9])
    return total


def dirty_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Dirty:"):
            return int(line.split()[1])
    return -1


def fill(mm: np.ndarray, rows: int) -> None:
    """Writes every row's record (its number in its first 8 bytes), in blocks."""
    block = 1 << 16
    for a in range(0, rows, block):
        b = min(rows, a + block)
        data = np.zeros((b - a, RECORD), dtype=np.uint8)
        data[:, :8] = np.arange(a, b, dtype=np.int64).view(np.uint8).reshape(-1, 8)
        mm[a:b] = data


def draws(rows: int, misses: int, steps: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per step: the distinct rows read (missed) and the distinct rows written back (evicted)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        out.append((rng.choice(rows, misses, replace=False),
                    rng.choice(rows, misses, replace=False)))
    return out


def in_place(mm: np.ndarray, steps: list[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    times = []
    for read, evict in steps:
        t0 = time.perf_counter()
        got = mm[np.sort(read)]  # the missed records
        rows = np.sort(evict)
        got[:, :8] = rows.view(np.uint8).reshape(-1, 8)  # the evicted records' new values
        mm[rows] = got  # written back where they live
        times.append(time.perf_counter() - t0)
    return times


class Log:
    """A log of records over ``mm`` (``places`` records): ``where[row]`` its place, ``owner[place]``
    the row there (-1: free or stale), the head moving forward segment by segment."""

    def __init__(self, mm: np.ndarray, fd: int, rows: int, places: int) -> None:
        self.mm, self.fd, self.rows = mm, fd, rows
        self.segments = places // SEGMENT
        self.where = np.arange(rows, dtype=np.int64)  # filled in order: row r at place r
        self.owner = np.full(self.segments * SEGMENT, -1, dtype=np.int64)
        self.owner[:rows] = np.arange(rows)
        self.head = -(-rows // SEGMENT) * SEGMENT  # the first free segment's first place
        self.moved = 0  # records the cleaner moved

    def _clean(self, seg: int) -> None:
        """Moves the live records of segment ``seg`` (the one the head enters) to the head."""
        a = seg * SEGMENT
        live = np.nonzero(self.owner[a:a + SEGMENT] >= 0)[0]
        if live.size == 0:
            return
        rows = self.owner[a + live]
        data = self.mm[a + live]
        self.owner[a + live] = -1
        self._append(rows, data, clean=False)
        self.moved += rows.size

    def _append(self, rows: np.ndarray, data: np.ndarray, clean: bool = True) -> None:
        n, at = rows.size, 0
        while at < n:
            place = self.head % (self.segments * SEGMENT)
            if clean and place % SEGMENT == 0:  # entering a segment: its live records first
                self._clean(place // SEGMENT)
                place = self.head % (self.segments * SEGMENT)
            k = min(n - at, SEGMENT - place % SEGMENT)
            # sequential, by a write: whole pages, none read first (a store into the mapping
            # would fault each page in from the disk first where the mapping is MADV_RANDOM)
            os.pwrite(self.fd, memoryview(np.ascontiguousarray(data[at:at + k])),
                      place * RECORD)
            old = self.where[rows[at:at + k]]
            self.owner[old] = -1
            self.where[rows[at:at + k]] = np.arange(place, place + k)
            self.owner[place:place + k] = rows[at:at + k]
            self.head += k
            at += k

    def step(self, read: np.ndarray, evict: np.ndarray) -> None:
        places = self.where[read]
        got = self.mm[np.sort(places)]  # the missed records, wherever they are
        rows = np.sort(evict)
        got[:, :8] = rows.view(np.uint8).reshape(-1, 8)  # the evicted records' new values
        self._append(rows, got)

    def check(self, rows: np.ndarray) -> bool:
        """Whether each of ``rows`` is found where the index says, its own record there."""
        got = self.mm[self.where[rows]][:, :8].copy().view(np.int64).reshape(-1)
        return bool(np.array_equal(got, rows)) and bool(
            np.array_equal(self.owner[self.where[rows]], rows))


def log_path(mm: np.ndarray, fd: int, rows: int, places: int,
             steps: list[tuple[np.ndarray, np.ndarray]]) -> tuple[list[float], int]:
    log = Log(mm, fd, rows, places)
    times = []
    for read, evict in steps:
        t0 = time.perf_counter()
        log.step(read, evict)
        times.append(time.perf_counter() - t0)
    sample = np.random.default_rng(1).choice(rows, min(rows, 100_000), replace=False)
    if not log.check(sample):
        raise SystemExit("log: a row's record is not where the index says")
    return times, log.moved


def run(name: str, rows: int, places: int, steps: list[tuple[np.ndarray, np.ndarray]],
        directory: str | None, advise_random: bool) -> dict:
    with tempfile.TemporaryDirectory(dir=directory, prefix="ec-slow-writes-") as d:
        path = Path(d) / "records.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:  # the blocks first: a full disk is an OSError here, not a SIGBUS in a store later
            os.posix_fallocate(fd, 0, places * RECORD)
        except OSError as e:
            os.close(fd)
            raise SystemExit(f"slow_writes: cannot hold {places * RECORD / 2**30:.1f} GiB in "
                             f"{d}: {e}") from None
        mapping = mmap.mmap(fd, places * RECORD)
        if advise_random:  # as the engine's slow tier asks (ops/memory.py's advise_random)
            mapping.madvise(mmap.MADV_RANDOM)
        mm = np.frombuffer(mapping, dtype=np.uint8).reshape(places, RECORD)
        t0 = time.perf_counter()
        fill(mm, rows)
        os.sync()  # (the fill's own pages out of the way)
        setup = time.perf_counter() - t0
        before = disk_sectors()
        t0 = time.perf_counter()
        if name == "in place":
            times, moved = in_place(mm, steps), 0
            sample = np.random.default_rng(1).choice(rows, min(rows, 100_000), replace=False)
            got = mm[sample][:, :8].copy().view(np.int64).reshape(-1)
            if not np.array_equal(got, sample):
                raise SystemExit("in place: a row's record is not its own")
        else:
            times, moved = log_path(mm, fd, rows, places, steps)
        wall = time.perf_counter() - t0
        after = disk_sectors()
        dirty = dirty_kib()
        del mm
        mapping.close()
        os.close(fd)
    misses = steps[0][0].size
    half = times[len(times) // 2:]
    step_s = statistics.median(half)
    records = misses * len(steps) + moved
    return {"path": name, "advise_random": advise_random, "rows": rows, "places": places, "misses": misses,
            "steps": len(steps), "setup_s": round(setup, 1), "wall_s": round(wall, 1),
            "step_ms_median_second_half": round(step_s * 1e3, 1),
            "step_ms_first": round(times[0] * 1e3, 1),
            "rows_per_s": round(misses / step_s),
            "records_written": records, "cleaner_moved": moved,
            "write_amplification_records": round(records / (misses * len(steps)), 2),
            "disk_mib_written": None if before is None or after is None
            else round((after - before) * 512 / 2**20),
            "dirty_mib_at_end": round(dirty / 1024)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8_000_000, help="records (W2: 8 x 1M)")
    p.add_argument("--misses", type=int, default=54_400, help="rows read and written a step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--spare", type=float, default=0.5,
                   help="the log's room beyond the rows, as a share of them")
    p.add_argument("--paths", nargs="+", default=["in place", "log"],
                   choices=["in place", "log"])
    p.add_argument("--dir", default=None, help="where the file goes (default: the temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--advise-random", action="store_true",
                   help="madvise(MADV_RANDOM) on the mapping, as the engine's slow tier does")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if a.misses > a.rows:
        raise SystemExit("--misses must be at most --rows")
    steps = draws(a.rows, a.misses, a.steps, a.seed)
    places = -(-int(a.rows * (1 + a.spare)) // SEGMENT) * SEGMENT
    for name in a.paths:
        r = run(name, a.rows, a.rows if name == "in place" else places, steps, a.dir,
                a.advise_random)
        print(json.dumps(r) if a.json else
              f"{name}: {r['step_ms_median_second_half']} ms a step (first "
              f"{r['step_ms_first']}), {r['rows_per_s']:,} rows/s read and written, "
              f"{r['write_amplification_records']}x records written, disk "
              f"{r['disk_mib_written']} MiB in {r['wall_s']} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
