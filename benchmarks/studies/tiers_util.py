"""Shared by the tables-beyond-memory benchmarks (cache.py, w4.py): memory and disk readings."""

from __future__ import annotations

# Criteo Kaggle's 26 categorical cardinalities (examples/criteo/generate.py has the same).
KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
          14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


def rss() -> str:
    """This process's anonymous and file-backed resident memory (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return (f"anonymous {fmt_bytes(out.get('RssAnon', 0))}, file-backed "
            f"{fmt_bytes(out.get('RssFile', 0))}, peak resident {fmt_bytes(out.get('VmHWM', 0))}")


def proc_io() -> dict[str, int]:
    """/proc/self/io: bytes this process made the storage layer read and write."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"
