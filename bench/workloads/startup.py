"""Startup: from nothing to every rank answering a first request with torch.distributed up.

What is timed, per system, from the call that starts it to the first no-op answered by every
rank (torch imported and a gloo process group joined on each):

* meshbook: ``meshbook.start(n)``, cold (the host agent imports torch now) and prewarmed
  (``meshbook.prewarm()`` ran beforehand and its standby agent finished importing torch,
  as ``%load_ext meshbook`` arranges in a notebook);
* ipyparallel: ``Cluster(n=n).start_and_connect_sync()``, then a gloo init on every engine;
* Monarch: ``this_host().spawn_procs(...)``, an actor on each proc, then a gloo init call.

Each system is started and stopped once untimed first, so every one of them finds the
interpreter, torch and its own code in the page cache.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from functools import partial

from meshbook.mesh import prewarm
from meshbook.mesh.controller.launch import local

from ..harness import Context, Outcome
from ..peers import PEERS, running
from ..procs import descendants, wait_quiet
from ..report import Check, Table, duration, latency, ratio
from ..timing import Samples, median_of

TITLE = "Startup"
ORDER = 20

COLD, PREWARMED = "meshbook", "meshbook prewarmed"


def _once(name: str, n: int, prewarmed: bool = False) -> float:
    if name == "meshbook":
        local.discard_standby()
        if prewarmed:
            _prewarm_and_settle()
    started = time.perf_counter()
    with running(name, n, dist=True) as handle:
        handle.noop()
        return time.perf_counter() - started


def _prewarm_and_settle() -> None:
    """``meshbook.prewarm()``, then wait until the standby agent has imported torch."""
    before = set(descendants())
    prewarm()
    for pid, proc in descendants().items():
        if pid not in before and "meshbook.mesh.agent" in proc.cmdline():
            wait_quiet(pid)


def _torch_import() -> float:
    """Seconds a fresh interpreter takes to ``import torch``: no local start can beat it."""
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    return float(done.stdout)


def _repeat(name: str, n: int, repeats: int, prewarmed: bool = False) -> Samples:
    return Samples(tuple(_once(name, n, prewarmed) for _ in range(repeats)))


def run(ctx: Context) -> Outcome:
    sizes = ctx.pick((1, 2, 4, 8), (2, 8))
    repeats = ctx.pick(5, 1)
    systems = ctx.systems()
    for name in systems:
        ctx.attempt(f"startup: {name} warm-up", partial(_once, name, 1))
    columns = [COLD, PREWARMED, *(p for p in PEERS if p in systems)]
    found: dict[str, dict[int, Samples | None]] = {c: {} for c in columns}
    for n in sizes:
        for column in columns:
            name = "meshbook" if column == PREWARMED else column
            found[column][n] = ctx.attempt(
                f"startup: {column}, {n} ranks",
                partial(_repeat, name, n, repeats, column == PREWARMED))
    peers = [p for p in PEERS if p in systems]
    table = Table("From nothing to every rank answering, torch.distributed initialised",
                  ["ranks", "meshbook `start(n)`", "after `prewarm()`",
                   *(f"{p}" for p in peers), *(f"{p} / meshbook" for p in peers)])
    for n in sizes:
        table.add(n, *(latency(found[c][n]) if found[c][n] else "failed" for c in columns),
                  *(ratio(median_of(found[p][n]), median_of(found[COLD][n])) for p in peers))
    torch_s = statistics.median(_torch_import() for _ in range(repeats))
    table.notes += [
        f"median (p99) of {repeats} start(s) per cell; ratios compare with meshbook cold",
        (f"importing torch alone takes {duration(torch_s)} in a fresh interpreter here: "
         f"meshbook's host agent pays it once, ipyparallel's engines and Monarch's procs each "
         f"pay it (sharing the cores)")]
    cold, warm = median_of(found[COLD].get(8)), median_of(found[PREWARMED].get(8))
    why = (f"importing torch alone takes {duration(torch_s)} here, and the rest of a start "
           f"(fork 8 ranks, join gloo, answer) takes {duration(warm)}, as the prewarmed start "
           f"shows") if warm else ""
    checks = [Check(f"{label} for 8 ranks < 1.5 s (issues 2, 4)",
                    duration(m) if m else "-", m < 1.5 if m else None, why)
              for label, m in (("cold `meshbook.start(8)` to first result", cold),
                               ("prewarmed `meshbook.start(8)` to first result", warm))]
    return Outcome([table], checks)
