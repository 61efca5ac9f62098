"""``python -m bench``: run the workloads, print one table per question, write the report.

Every workload measures meshbook and its peers in the same run, one system at a time, and
prints its tables as it finishes. When every workload ran, the report (machine, versions,
date, load, the issues' targets checked against this run, all tables) goes to
``bench/RESULTS.md``; with ``--only``, pass ``--out`` to keep one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .harness import Context, Outcome, Workload, workloads
from .machine import CpuShare, machine, today, versions
from .procs import Leftovers
from .report import Check, duration

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"


def main(argv: list[str] | None = None) -> int:
    available = workloads()
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark meshbook side by side with ipyparallel and PyTorch Monarch.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repeats: minutes instead of half an hour")
    parser.add_argument("--only", metavar="NAMES",
                        help=f"comma-separated workloads: {','.join(w.name for w in available)}")
    parser.add_argument("--out", type=Path,
                        help=f"write the report here (default: {RESULTS.relative_to(ROOT)} when "
                             f"every workload runs)")
    args = parser.parse_args(argv)
    chosen = _choose(available, args.only, parser)
    out = args.out or (RESULTS if args.only is None else None)

    # Ranks, engines, procs and torchrun workers import the rank-side code of bench/ by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    ctx = Context(quick=args.quick)
    cpu = CpuShare()
    started = time.monotonic()
    sections = []
    for workload in chosen:
        ctx.log(f"== {workload.title}")
        before = len(ctx.failures)
        began = time.monotonic()
        try:
            outcome = workload.run(ctx)
        except Exception as exc:  # noqa: BLE001 - a broken workload must not lose the others
            ctx.failures.append(f"{workload.title} failed: {type(exc).__name__}: {exc}")
            ctx.log(f"FAILED {ctx.failures[-1]}")
            outcome = Outcome([])
        sections.append((workload, outcome, ctx.failures[before:], time.monotonic() - began))
        for table in outcome.tables:
            print(table.markdown() + "\n", flush=True)
    load, _ = cpu.describe()
    command = "python -m bench" + (" --quick" if args.quick else "") + \
        (f" --only {args.only}" if args.only else "")
    report = document(command, time.monotonic() - started, load, sections)
    checks = [c for _, outcome, _, _ in sections for c in outcome.checks]
    print("\n".join(_targets(checks)))
    if out is not None:
        out.write_text(report)
        print(f"\nreport written to {out}")
    if Leftovers.killed:
        print("processes outlived their system and were killed:\n  " + "\n  ".join(Leftovers.killed),
              file=sys.stderr)
    return 1 if Leftovers.killed else 0


def _choose(available: list[Workload], only: str | None,
            parser: argparse.ArgumentParser) -> list[Workload]:
    if only is None:
        return available
    names = {w.name: w for w in available}
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    return [names[n] for n in wanted]


def document(command: str, seconds: float, load: str,
             sections: list[tuple[Workload, Outcome, list[str], float]]) -> str:
    """The whole report as markdown."""
    version_line = ", ".join(f"{k} {v}" for k, v in versions().items())
    left = ("none: every process a system started was gone after it stopped"
            if not Leftovers.killed else
            "; ".join(Leftovers.killed) + " (killed by the harness after the system stopped)")
    lines = [
        "# meshbook benchmarks, side by side with ipyparallel and PyTorch Monarch", "",
        (f"Taken {today()} with `{command}` in {duration(seconds)}. Each workload runs every "
         "system on the same machine in the same run, one system at a time."), "",
        f"- Machine: {machine()}",
        f"- Versions: {version_line}",
        ("- Monarch runs in the same environment as the others: torchmonarch installs beside "
         "this torch without replacing it, and its actor runtime runs on CPU."),
        f"- Load: {load}",
        f"- Processes left behind: {left}", "",
        "## Targets", "", *_targets([c for _, o, _, _ in sections for c in o.checks]),
    ]
    for workload, outcome, failures, took in sections:
        lines += ["", f"## {workload.title}", "",
                  f"_{duration(took)}; `python -m bench --only {workload.name}` runs it alone._", ""]
        lines += [table.markdown() + "\n" for table in outcome.tables]
        lines += [f"- Not measured: {failure}" for failure in failures]
    return "\n".join(lines).rstrip() + "\n"


def _targets(checks: list[Check]) -> list[str]:
    if not checks:
        return ["(no targets checked in this run)"]
    lines = ["| target | this run | |", "|---|---|---|", *(c.markdown() for c in checks)]
    missed = [c for c in checks if c.met is False and c.why]
    if missed:
        lines += ["", "Why the missed ones were missed (from this run's own measurements):", ""]
        lines += [f"- {c.target}: {c.why}" for c in missed]
    return lines
