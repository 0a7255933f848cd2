"""W1-raw: W1 with every id replaced by a random 63-bit value, embcore's dynamic tables
against plain PyTorch with a Python dict and TorchRec's managed-collision EBC, side by side.

    .venv/bin/python benchmarks/studies/raw_ids.py --quick          # a smoke run
    .venv/bin/python benchmarks/studies/raw_ids.py --wait-idle 60   # the measurement

Each system runs in a fresh subprocess (run.py's ``run_system``: retries when other processes
took the CPUs), in stream mode (common.py): ``--fill`` untimed steps on new batches (default
``workloads.RAW_FILL``: a 50k map is full and evicts at every step by then), then every step a
new batch. Systems: embcore static W1 (``sys_embcore.py`` on the same stream of W1's ids), and at
each capacity (100k: every id fits; 50k: eviction every step) embcore raw (``sys_raw_embcore.py``,
LRU), plain PyTorch with a ``dict`` (FIFO ring) and with an ``OrderedDict`` LRU
(``sys_raw_plain.py``), and TorchRec MC-EBC (``sys_raw_torchrec.py``, peers' venv). Prints the
table and writes (or replaces) the ``w1-raw`` section of ``--out`` (benchmarks/RESULTS.md).
Subprocesses import embcore from this checkout (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # run.py, workloads.py
import run  # noqa: E402  (run_system, python_for, wait_idle, machine, git_state, save_section)
from workloads import RAW_FILL, get_workload  # noqa: E402

SECTION = "w1-raw"
STATIC = "embcore static"
# the targets: raw >= 0.8x static W1 where every id fits, 0.6x where it evicts every step (a
# capacity below 100k), >= 3x the best peer
TARGET_FITS, TARGET_EVICTS, TARGET_PEER = 0.8, 0.6, 3.0


def systems(capacities: list[int]) -> list[tuple]:
    """(label, script, optimizer, which python, capacity, script options) in running order."""
    out = [(STATIC, "sys_embcore.py", "adagrad", "main", None, [])]
    for cap in capacities:
        c = ["--capacity", str(cap)]
        out += [("embcore raw", "sys_raw_embcore.py", "adagrad", "main", cap,
                 c + ["--eviction", "lru"]),
                ("plain + dict", "sys_raw_plain.py", "adagrad", "main", cap,
                 c + ["--mapping", "dict"]),
                ("plain + OrderedDict LRU", "sys_raw_plain.py", "adagrad", "main", cap,
                 c + ["--mapping", "lru"]),
                ("TorchRec MC-EBC", "sys_raw_torchrec.py", "adagrad", "peers", cap, c)]
    return out


def is_peer(r: dict) -> bool:
    return not r["system"].startswith("embcore")


def ratio(a: dict, b: dict | None) -> str:
    ok = b is not None and a.get("status") == "ok" and b.get("status") == "ok"
    return f"{a['examples_per_s'] / b['examples_per_s']:.2f}x" if ok else "-"


def best_peer(results: list[dict], cap: int | None) -> dict | None:
    peers = [r for r in results if r.get("status") == "ok" and is_peer(r) and r["cap"] == cap]
    return max(peers, key=lambda r: r["examples_per_s"], default=None)


def table(results: list[dict]) -> list[str]:
    head = ("| system | capacity | map | examples/s | ms/step | vs embcore static | "
            "vs best peer (same capacity) | peak RSS MiB | resident ids | admitted / evicted "
            "per step | map bytes / resident id | other CPU load |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    static = next((r for r in results if r["system"] == STATIC), None)
    for r in results:
        cap = f"{r['cap']:,}" if r["cap"] else "static (100,000 rows)"
        if r.get("status") != "ok":
            why = f"{r.get('status')}: {r.get('error', '')}".replace("|", "/")[:160]
            out.append(f"| {r['system']} | {cap} | {r.get('mapping', '')} | {why} | "
                       + "| " * 7 + "|")
            continue
        moved = (f"{r['probe_admitted']:,} / {r['probe_evicted']:,}" if "probe_evicted" in r
                 else "-")
        per_id = f"{r['map_bytes_per_id']:.1f}" if "map_bytes_per_id" in r else "-"
        resident = f"{r['resident_ids']:,}" if "resident_ids" in r else "-"
        out.append(f"| {r['system']} | {cap} | {r.get('mapping', 'ids are rows')} | "
                   f"{run.fmt_num(r['examples_per_s'])} | {r['ms_per_step']:.2f} | "
                   f"{ratio(r, static)} | "
                   f"{ratio(r, best_peer(results, r['cap'])) if r['cap'] else '-'} | "
                   f"{r['peak_rss_mib']:,.0f} | {resident} | {moved} | {per_id} | "
                   f"{r.get('others_cpu', '?')}% |")
    return out


def targets(results: list[dict]) -> list[str]:
    static = next((r for r in results if r["system"] == STATIC and r.get("status") == "ok"),
                  None)
    lines = []
    for r in results:
        if r["system"] != "embcore raw" or r.get("status") != "ok":
            continue
        peer = best_peer(results, r["cap"])
        parts = []
        if static:
            x = r["examples_per_s"] / static["examples_per_s"]
            target = TARGET_FITS if r["cap"] >= 100_000 else TARGET_EVICTS
            parts.append(f"{x:.2f}x static (target >= {target}x: "
                         f"{'met' if x >= target else 'NOT met'})")
        if peer:
            x = r["examples_per_s"] / peer["examples_per_s"]
            parts.append(f"{x:.2f}x the best peer, {peer['system']} (target >= {TARGET_PEER}x: "
                         f"{'met' if x >= TARGET_PEER else 'NOT met'})")
        lines.append(f"capacity {r['cap']:,}: embcore raw = " + "; ".join(parts or ["-"]))
    return lines


def map_memory(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        if r.get("status") == "ok" and "map_bytes" in r:
            out.append(f"{r['system']} at {r['cap']:,}: {r['map_bytes'] / 2**20:.1f} MiB for "
                       f"{r['resident_ids']:,} resident ids = {r['map_bytes_per_id']:.1f} B/id")
    return out


def versions(results: list[dict]) -> str:
    seen: dict[str, dict] = {}
    for r in results:
        if r.get("status") == "ok":
            seen.setdefault(f"{r['venv']} venv", {}).update(r["versions"])
    return "; ".join(f"{k}: " + ", ".join(f"{n} {v}" for n, v in d.items())
                     for k, d in seen.items()) or "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="10 timed steps per loop instead of 30")
    p.add_argument("--capacities", type=int, nargs="+", default=[100_000, 50_000])
    p.add_argument("--fill", type=int, default=RAW_FILL,
                   help="untimed steps on new batches before timing (default %(default)s)")
    p.add_argument("--repeats", type=int, help="timed loops per system (default: common's 3)")
    p.add_argument("--warmup", type=int, help="warm-up steps after the fill (default: 3)")
    run.add_runner_options(p, timeout=1800)
    args = p.parse_args()
    started = time.time()
    command = "python benchmarks/studies/raw_ids.py " + " ".join(sys.argv[1:])
    # The subprocesses measure this checkout's embcore, not whatever the venv's install points at.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(run.ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    common = ["--fill", str(args.fill)]
    common += ["--repeats", str(args.repeats)] if args.repeats else []
    common += ["--warmup", str(args.warmup)] if args.warmup is not None else []
    mach = run.machine()
    load0 = os.getloadavg()
    print(f"machine: {mach}; load average {load0[0]:.2f}", flush=True)

    results = []
    for label, script, opt, kind, cap, options in systems(args.capacities):
        r = run.run_system((label, script, opt, kind, *options, *common), "W1", args)
        r.update(cap=cap, venv=kind)
        results.append(r)
        what = (f"{r['examples_per_s']:,.0f} ex/s  {r['ms_per_step']:.2f} ms/step  "
                f"rss {r['peak_rss_mib']:,.0f} MiB  fill {r.get('fill_s', '?')} s"
                + (f"  evicted/step {r['probe_evicted']:,}" if "probe_evicted" in r else "")
                if r.get("status") == "ok" else f"{r.get('status')} {r.get('error', '')}")
        print(f"{label:<24} {cap or '':>7} {what}", flush=True)

    lines, tgt, mem = table(results), targets(results), map_memory(results)
    print("\n".join(["", *lines, "", *tgt, "", *mem]))
    write_results(args, command, mach, load0, results, lines, tgt, mem, time.time() - started)


def write_results(args, command, mach, load0, results, lines, tgt, mem, elapsed) -> None:
    w = get_workload("W1", args.quick)
    notes = sorted({r["note"] for r in results if r.get("note")})
    load1 = os.getloadavg()
    md = [
        "## W1-raw: raw 63-bit ids",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- command: `{command}` ({elapsed / 60:.1f} min)",
        f"- machine: {mach['cpu']}, {mach['cores']} cores, {mach['ram_gib']} GiB RAM, no GPU; "
        f"torch threads 2 (OMP_NUM_THREADS=2) in every system",
        f"- load average at start {load0[0]:.2f}, at end {load1[0]:.2f}; `other CPU load` as in "
        f"the sections above (rows with a high value are not comparable)",
        f"- versions: {versions(results)}; embcore at commit {run.git_state()}",
        f"- protocol: W1's ids (26 tables, batch 4096, D 64, sum, exact Adagrad) through a fixed "
        f"random one-to-one map into [0, 2^63); a stream of new batches: {args.fill} untimed fill "
        f"steps + warm-up, then {w.steps} timed steps per loop, median of "
        f"{args.repeats or 3} loops, no batch reused. `embcore static` trains W1's own ids on "
        f"the same stream. `admitted / evicted per step`: ids that entered / left the maps "
        f"(all tables) in one untimed step after timing",
        "",
        *lines,
        "",
        "Targets:",
        "",
        *[f"- {t}" for t in tgt or ["(no embcore raw result)"]],
        "",
        "Map memory per resident id (embcore: every tensor of the tables' `VocabMap`s; plain: "
        "`sys.getsizeof` of the dicts and their int objects, an estimate; TorchRec: the MCH "
        "modules' buffers):",
        "",
        *[f"- {m}" for m in mem or ["-"]],
        "",
        *(["Notes:", "", *[f"- {n}" for n in notes], ""] if notes else []),
        "<details><summary>raw results</summary>", "", "```",
        *[json.dumps(r) for r in results], "```", "", "</details>", "",
    ]
    run.save_section(Path(args.out), SECTION, "\n".join(md))
    print(f"\nwrote the {SECTION} section of {args.out}")


if __name__ == "__main__":
    main()
