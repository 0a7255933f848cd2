"""The cache curve as a picture: hit rate and throughput against cache size, from cache.py's JSON.

    python benchmarks/studies/cache.py --json > w1.txt
    python benchmarks/studies/cache.py --workload W2 --quick --json > w2.txt
    python benchmarks/studies/plot_cache.py W1=w1.txt W2-quick=w2.txt \\
        --out benchmarks/studies/cache_curve.png

Each argument is ``LABEL=FILE``, FILE the output of ``cache.py --json`` (its last line is the
JSON list of runs). Left: the hit rate of each cached run against its cache size (share of the
rows); right: its throughput as a share of the same workload's in-memory run. One line per
workload and Zipf exponent. Needs matplotlib (``pip install -e ".[plot]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: str) -> list[dict]:
    """The runs of one ``cache.py --json`` output (its last line)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SystemExit(f"{path}: {e.strerror or e}")
    lines = [s for s in text.splitlines() if s.startswith("[")]
    if not lines:
        raise SystemExit(f"{path}: no JSON line (run cache.py with --json)")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=FILE, FILE from cache.py --json")
    ap.add_argument("--out", default="benchmarks/studies/cache_curve.png")
    args = ap.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    for spec in args.runs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"{spec!r}: expected LABEL=FILE")
        runs = load(path)
        for alpha in sorted({r["alpha"] for r in runs}):
            cached = sorted((r for r in runs if r["alpha"] == alpha and "fraction" in r),
                            key=lambda r: r["fraction"])
            if not cached:
                continue
            x = [100 * r["fraction"] for r in cached] + [100]
            name = f"{label}, Zipf {alpha}"
            ax_hit.plot(x, [100 * r["hit_rate"] for r in cached] + [100], marker="o", label=name)
            ax_speed.plot(x, [r["vs_memory"] for r in cached] + [1.0], marker="o", label=name)
    for ax, what in ((ax_hit, "hit rate (% of a step's distinct rows)"),
                     (ax_speed, "throughput / in-memory throughput")):
        ax.set_xscale("log")
        ax.set_xlabel("cache size (% of the rows)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_speed.axhline(0.5, color="grey", linestyle="--", linewidth=1)
    ax_speed.set_ylim(0, 1.05)
    ax_hit.set_ylim(0, 102)
    ax_hit.legend(fontsize=8)
    fig.suptitle("embcore: exact write-back cache over a slow tier (benchmarks/studies/cache.py)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
