"""Every system side by side on a quiet machine and beside a neighbour process.

    .venv/bin/python benchmarks/studies/contention.py --quick --workloads W1 W2

For each workload and system (run.py's list, each in a fresh process, 2 threads) it
runs three conditions back to back, so that drift of this shared machine touches all three alike:

- quiet: nothing else started;
- busy: ``neighbour.py busy``, one other process keeping a core busy;
- loader: ``neighbour.py loader``, a data-loader process pair producing the next batches.

Neighbours run in this driver's session, as a data loader forked by the training job would
(with ``sched_autogroup_enabled``, Linux shares the CPUs fairly between sessions first: a
neighbour in another session caps any system at about one core of the two).

It writes the ``contention`` section of benchmarks/RESULTS.md: each system's throughput in each
condition, the ratio to its own quiet speed, and embcore's ratio to the best peer under the same
condition. ``other CPU`` is the CPU other processes (the neighbour included) used during a run.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent  # neighbour.py
sys.path.insert(0, str(HERE.parent / "core"))  # run.py
import run  # noqa: E402

CONDITIONS = ("quiet", "busy", "loader")


def start_neighbour(kind: str) -> subprocess.Popen | None:
    if kind == "quiet":
        return None
    # its own process group (killed as one), in this session: Linux's autogroup shares the
    # CPUs fairly between sessions, so a neighbour in another session would cap every system
    # at one core whatever its threads do; in one session the scheduler shares them by thread
    p = subprocess.Popen([sys.executable, str(HERE / "neighbour.py"), kind],
                         stdout=subprocess.PIPE, text=True, process_group=0)
    line = p.stdout.readline()  # waits for "ready" (the loader imports torch first)
    if line.strip() != "ready":
        p.kill()
        raise RuntimeError(f"neighbour {kind!r} did not start: {line!r}")
    time.sleep(0.5)
    return p


def stop_neighbour(p: subprocess.Popen | None) -> None:
    if p is None:
        return
    import os
    import signal
    os.killpg(p.pid, signal.SIGKILL)  # the loader's worker process too
    p.wait()


def run_condition(sysdef: tuple, workload: str, kind: str, args: argparse.Namespace) -> dict:
    p = start_neighbour(kind)
    try:
        r = run.run_system(sysdef, workload, args)
    finally:
        stop_neighbour(p)
    r["condition"] = kind
    return r


def table(results: list[dict]) -> list[str]:
    head = ("| workload | system | optimizer | quiet ex/s | busy ex/s | busy / quiet | "
            "loader ex/s | loader / quiet | vs best peer: quiet | busy | loader | other CPU "
            "(quiet / busy / loader) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    ok = {(r["workload"], r["system"], r["optimizer"], r["condition"]): r for r in results
          if r.get("status") == "ok"}

    def speed(w, s, o, c):
        r = ok.get((w, s, o, c))
        return r["examples_per_s"] if r else None

    keys = list(dict.fromkeys((r["workload"], r["system"], r["optimizer"]) for r in results))
    for w, s, o in keys:
        q, b, ld = (speed(w, s, o, c) for c in CONDITIONS)
        cells = [run.fmt_num(x) if x else "failed" for x in (q, b, ld)]
        ratio = [f"{x / q:.2f}" if x and q else "-" for x in (b, ld)]
        vs = []
        for c, x in zip(CONDITIONS, (q, b, ld)):
            peers = [speed(w, p, o, c) for (w2, p, o2) in keys
                     if w2 == w and o2 == o and p != "embcore"]
            peers = [p for p in peers if p]
            vs.append(f"{x / max(peers):.2f}x" if s == "embcore" and x and peers else "")
        load = " / ".join(str(ok[(w, s, o, c)].get("others_cpu", "?")) + "%"
                          if (w, s, o, c) in ok else "-" for c in CONDITIONS)
        out.append(f"| {w} | {s} | {run.OPT_NAME[o]} | {cells[0]} | {cells[1]} | {ratio[0]} | "
                   f"{cells[2]} | {ratio[1]} | {' | '.join(vs)} | {load} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="W2 with 8 x 200k rows, short loops")
    p.add_argument("--workloads", nargs="+", default=["W1", "W2"], choices=run.WORKLOADS)
    p.add_argument("--systems", nargs="+", default=None,
                   help="only these systems (labels as in the table, e.g. embcore 'FBGEMM TBE')")
    run.add_runner_options(p, timeout=900)
    args = p.parse_args()
    labels = sorted({s[0] for s in run.SYSTEMS})
    unknown = sorted(set(args.systems or []) - set(labels))
    if unknown:
        p.error(f"--systems: unknown {unknown}; choose among {labels}")
    args.retries = 0  # a neighbour is the point here: never re-run a disturbed system
    args.wait_idle = 0
    started = time.time()
    command = "python benchmarks/studies/contention.py " + " ".join(sys.argv[1:])
    mach = run.machine()
    results = []
    for w in args.workloads:
        for sysdef in run.SYSTEMS:
            if args.systems and sysdef[0] not in args.systems:
                continue
            for kind in CONDITIONS:
                r = run_condition(sysdef, w, kind, args)
                results.append(r)
                what = (f"{r['examples_per_s']:,.0f} ex/s (other CPU {r['others_cpu']}%)"
                        if r.get("status") == "ok" else f"{r.get('status')} {r.get('error', '')}")
                print(f"{w:<4} {sysdef[0]:<14} {run.OPT_NAME[sysdef[2]]:<16} {kind:<6} {what}",
                      flush=True)
    lines = table(results)
    print("\n".join([""] + lines))
    md = [
        "## Contention run",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- command: `{command}` ({(time.time() - started) / 60:.1f} min)",
        f"- machine: {mach['cpu']}, {mach['cores']} cores, {mach['ram_gib']} GiB RAM; torch "
        f"threads 2 in every system; embcore at commit {run.git_state()}; "
        f"versions: {run.versions(results)}",
        "- conditions, run back to back per system: quiet; busy (`neighbour.py busy`: one "
        "process spinning on a core); loader (`neighbour.py loader`: a DataLoader worker "
        "producing W1-sized batches for its parent as fast as it can); neighbours in the "
        "benchmark's own session (one autogroup)",
        "",
        *lines,
        "",
        "<details><summary>raw results</summary>", "", "```",
        *[run.json.dumps(r) for r in results], "```", "", "</details>", "",
    ]
    run.save_section(Path(args.out), "contention", "\n".join(md))
    print(f"\nwrote the contention section of {args.out}")


if __name__ == "__main__":
    main()
