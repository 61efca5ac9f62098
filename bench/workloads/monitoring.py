"""Monitoring overhead: a training loop's steps/s with the dashboard open, closed, and with
the ranks' straggler sampling paused.

Every rank always sends heartbeats and samples where its main thread is (five times a second,
see :mod:`meshbook.mesh.rank.sampling`); the dashboard adds a thread in the controller that redraws
twice a second. One 4-rank mesh runs :func:`bench.ddp_loop.train` in three settings, taken in
turn (closed, open, sampling paused, closed, ...) so load that comes and goes hits all alike:

* **closed**: no dashboard (heartbeats and sampling on: meshbook as it always runs);
* **open**: a :class:`meshbook.widgets.Dashboard` refreshing in this process. It runs here
  without a frontend, so its comm messages go nowhere; everything else (reading heartbeats,
  scoring, rendering the HTML) is the cost a notebook pays;
* **sampling paused**: no dashboard, and the ranks' samplers switched off, to show what
  sampling itself costs.

On a shared machine the run-to-run noise of steps/s is often larger than the 1% the target
allows, so the second table measures the monitoring's CPU directly: one sample on a rank's
control thread, and one dashboard refresh in the controller, each times how often it happens.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from functools import partial
from typing import Any

import meshbook
from meshbook.mesh.rank.sampling import SAMPLE_GAP_S, classify
from meshbook.mesh.rank.worker import TICK_S
from meshbook.widgets import Dashboard
from meshbook.widgets.dashboard import REFRESH_S

from ..ddp_loop import train
from ..harness import Context, Outcome
from ..report import Check, Table, duration

TITLE = "Monitoring overhead"
ORDER = 65

RANKS = 4
SEED = 0
SETTINGS = ("closed", "open", "sampling paused")


def _threads() -> int:
    return max(1, (os.cpu_count() or 1) // RANKS)


def _set_sampling(worker: Any, enabled: bool) -> None:
    worker.sampler.enabled = enabled


def _sample_cost(worker: Any, repeats: int) -> float:
    """CPU seconds one sample of the main thread takes on this rank's control thread (taken
    while the main thread trains; thread CPU time leaves out waiting for the GIL)."""
    frame = worker.main_frame() or sys._getframe()
    started = time.thread_time()
    for _ in range(repeats):
        classify(frame)
    return (time.thread_time() - started) / repeats


def _refresh_cost(mesh: meshbook.Mesh, repeats: int) -> float:
    """Seconds one dashboard refresh takes in the controller."""
    dashboard = Dashboard(mesh, refresh=3600)  # its own thread stays asleep meanwhile
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            dashboard.refresh()
        return (time.perf_counter() - started) / repeats
    finally:
        dashboard.close()


def _cost_while_training(mesh: meshbook.Mesh) -> Any:
    training = mesh.apply(train, 400, SEED, _threads(), log_every=401)
    time.sleep(1.0)  # well inside the loop: the main thread's stack is a training step's
    costs = mesh.call(_sample_cost, 5000, control=True).result(echo=False)
    training.result(echo=False)
    return costs


def _steps_per_s(mesh: meshbook.Mesh, steps: int) -> float:
    results = mesh.apply(train, steps, SEED, _threads(), log_every=steps + 1).result(echo=False)
    return steps / max(r["seconds"] for r in results.values())


def _one(mesh: meshbook.Mesh, setting: str, steps: int) -> float:
    dashboard = Dashboard(mesh) if setting == "open" else None
    mesh.call(_set_sampling, setting != "sampling paused", control=True).result(echo=False)
    try:
        return _steps_per_s(mesh, steps)
    finally:
        if dashboard is not None:
            dashboard.close()
        mesh.call(_set_sampling, True, control=True).result(echo=False)


def run(ctx: Context) -> Outcome:
    steps, repeats = ctx.pick((600, 7), (150, 3))
    rates: dict[str, list[float]] = {s: [] for s in SETTINGS}
    sample_cost = None
    with meshbook.start(RANKS) as mesh:
        ctx.attempt("monitoring: warm-up", partial(_steps_per_s, mesh, 20))
        for i in range(repeats):
            for setting in SETTINGS:
                got = ctx.attempt(f"monitoring: dashboard {setting}, run {i + 1} of {repeats}",
                                  partial(_one, mesh, setting, steps))
                if got is not None:
                    rates[setting].append(got)
        costs = ctx.attempt("monitoring: cost of one sample", partial(_cost_while_training, mesh))
        if costs is not None:
            sample_cost = statistics.median(costs.values())
        refresh_cost = ctx.attempt("monitoring: cost of one dashboard refresh",
                                   partial(_refresh_cost, mesh, 200))
    medians = {s: statistics.median(r) for s, r in rates.items() if r}
    table = Table(f"DDP training loop, {RANKS} ranks x {steps} steps (gloo, {_threads()} "
                  f"thread(s) per rank): steps/s by monitoring setting",
                  ["setting", "steps/s (median)", "runs", "spread", "vs closed"])
    for setting in SETTINGS:
        got = rates[setting]
        if not got:
            table.add(setting, "failed", 0, "-", "-")
            continue
        spread = f"{min(got):.1f}-{max(got):.1f}"
        versus = f"{medians[setting] / medians['closed'] - 1:+.1%}" if "closed" in medians else "-"
        table.add(setting, f"{medians[setting]:.1f}", len(got), spread, versus)
    table.notes.append("settings taken in turn; 'vs closed' is the change in steps/s (negative: "
                       "slower). The spread shows the noise of this machine.")
    tables = [table]
    sampling_share = sample_cost / max(SAMPLE_GAP_S, TICK_S) if sample_cost is not None else None
    refresh_share = refresh_cost / REFRESH_S if refresh_cost is not None else None
    cpu = Table("CPU the monitoring takes, measured directly",
                ["what", "each", "how often", "share of one core"])
    # the control loop wakes every TICK_S, so a rank samples at most that often
    cpu.add("one sample, on each rank's control thread",
            duration(sample_cost) if sample_cost is not None else "failed",
            f"{1 / max(SAMPLE_GAP_S, TICK_S):.0f}/s",
            f"{sampling_share:.3%}" if sampling_share is not None else "-")
    cpu.add("one dashboard refresh, in the controller",
            duration(refresh_cost) if refresh_cost is not None else "failed",
            f"{1 / REFRESH_S:.0f}/s", f"{refresh_share:.2%}" if refresh_share is not None else "-")
    tables.append(cpu)
    checks = []
    if {"open", "closed"} <= medians.keys():
        change = medians["open"] / medians["closed"] - 1
        closed = rates["closed"]
        noise = (max(closed) - min(closed)) / medians["closed"]
        # A difference inside the noise says nothing either way: then the CPU check decides.
        checks.append(Check("dashboard open vs closed: < 1% slowdown of a training loop",
                            f"{change:+.1%} steps/s (run-to-run noise {noise:.0%})",
                            change > -0.01 if noise < 0.01 else None))
    if sampling_share is not None and refresh_share is not None:
        checks.append(Check("monitoring CPU < 1% of a core (per rank; in the controller)",
                            f"{sampling_share:.3%}; {refresh_share:.2%}",
                            sampling_share < 0.01 and refresh_share < 0.01))
    return Outcome(tables, checks)
