"""Training overhead: the same DDP loop under torchrun and on a meshbook mesh.

:func:`bench.ddp_loop.train` (an MLP, fixed seeds, 200 steps, gloo, 4 ranks, a log line
every 50 steps) runs as a ``torchrun`` script and through ``Mesh.apply`` on a fresh mesh,
alternately, so load that comes and goes hits both alike. Only the steps are timed, between
two barriers, and each step on its own. Both sides use the same number of threads per
rank, and nothing else runs meanwhile (the mesh is stopped while torchrun trains). The
losses of every rank and step must equal torchrun's exactly: meshbook runs the user's code,
it does not change it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, cast

from meshbook.mesh.controller.core.agents import free_port

from ..ddp_loop import train
from ..harness import Context, Outcome
from ..peers import running
from ..peers.meshbook_api import MeshbookHandle
from ..procs import reaped
from ..report import Check, Table, duration

TITLE = "Training overhead"
ORDER = 60

RANKS = 4
STEPS = 200
SEED = 0
SCRIPT = Path(__file__).resolve().parents[1] / "ddp_torchrun.py"

Results = list[dict[str, Any]]


def _threads() -> int:
    return max(1, (os.cpu_count() or 1) // RANKS)


def _torchrun() -> Results:
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}",
                   "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(SCRIPT),
                   out, str(STEPS), str(SEED), str(_threads())]
        env = dict(os.environ, OMP_NUM_THREADS=str(_threads()))

        def start() -> subprocess.Popen[str]:
            return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)

        def stop(proc: subprocess.Popen[str]) -> None:
            if proc.poll() is None:
                proc.terminate()  # torchrun stops its workers on SIGTERM
                proc.wait(30)

        with reaped("torchrun", start, stop) as proc:
            _, err = proc.communicate(timeout=600)
        if proc.returncode:
            raise RuntimeError(f"torchrun exited with {proc.returncode}: {err[-2000:]}")
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(RANKS)]


def _meshbook() -> Results:
    with running("meshbook", RANKS) as handle:
        mesh = cast(MeshbookHandle, handle).mesh
        values = mesh.apply(train, STEPS, SEED, _threads()).result(echo=False)
        return [values[r] for r in range(RANKS)]


def _steps_per_s(results: Results) -> float:
    return STEPS / max(r["seconds"] for r in results)


def _median_step(results: Results) -> float:
    return statistics.median(t for r in results for t in r["step_seconds"])


def _cpu_per_step(results: Results) -> float:
    """CPU seconds per step, summed over the ranks' processes (all their threads)."""
    return sum(r["cpu_seconds"] for r in results) / STEPS


def run(ctx: Context) -> Outcome:
    repeats = ctx.pick(5, 2)
    runs: dict[str, list[Results]] = {"torchrun": [], "meshbook": []}
    for i in range(repeats):
        for name, launch in (("torchrun", _torchrun), ("meshbook", _meshbook)):
            got = ctx.attempt(f"training: {name}, run {i + 1} of {repeats}", partial(launch))
            if got is not None:
                runs[name].append(got)
    reference = runs["torchrun"][0] if runs["torchrun"] else None
    table = Table(f"DDP training loop, {RANKS} ranks x {STEPS} steps (gloo, "
                  f"{_threads()} thread(s) per rank)",
                  ["launched by", "steps/s (whole runs)", "median step", "CPU per step",
                   "losses vs torchrun"])
    steps: dict[str, float] = {}
    for name, got in runs.items():
        if not got:
            table.add(name, "failed", "-", "-", "-")
            continue
        rates = sorted(_steps_per_s(r) for r in got)
        steps[name] = statistics.median(_median_step(r) for r in got)
        same = reference is not None and all(
            [x["losses"] for x in r] == [x["losses"] for x in reference] for r in got)
        table.add(name, f"{statistics.median(rates):.1f} ({rates[0]:.0f}-{rates[-1]:.0f})",
                  duration(steps[name]),
                  duration(statistics.median(_cpu_per_step(r) for r in got)),
                  f"identical ({RANKS} ranks x {STEPS} steps)" if same else "**differ**")
    overhead = steps["meshbook"] / steps["torchrun"] - 1 if len(steps) == 2 else None
    measured = f"{overhead:+.1%}" if overhead is not None else "-"
    table.notes += [
        (f"{repeats} alternating runs each: steps/s is their median (and range); the median "
         f"step (over every step of every rank and run) is what a burst of other load "
         f"disturbs least, so meshbook's overhead is taken from it: {measured}"),
        ("CPU per step: the ranks' processes, every thread included (the runtime's heartbeats "
         "and sampling too), summed over ranks; load from other processes barely moves it")]
    identical = "**differ**" not in {row[4] for row in table.rows} and len(steps) == 2
    checks = [Check("training overhead < 3% (4 ranks, 200 steps)", measured,
                    overhead < 0.03 if overhead is not None else None),
              Check("losses equal torchrun's exactly", "yes" if identical else "no",
                    identical if len(steps) == 2 else None)]
    return Outcome([table], checks)
