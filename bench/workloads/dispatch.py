"""Dispatch: the round trip of a no-op to every rank, through the Python API and a notebook.

Python API: ``Mesh.run("pass").result()`` against ipyparallel's ``DirectView.apply_sync``
of a no-op function and a Monarch actor endpoint's ``call().get()``; each system is started
once per size and timed on a warm connection, back to back (every process awake), then
after a short idle gap before each call (every process asleep, as a notebook cell finds
them). The floor column runs meshbook's path in bare pyzmq (see ``peers/zmq_floor.py``), and
a second one the same path over Unix datagrams, without ZeroMQ's I/O threads
(``peers/unix_floor.py``): the way meshbook's lane goes on one host (``protocol/lane.py``).

Notebook: a ``pass`` cell timed as a frontend sees it (execute_request to execute_reply),
run locally and as ``%%mesh pass`` in one kernel, and as ``%%px pass`` in a kernel with an
ipyparallel cluster. Local and remote cells alternate, so what the machine's load does to
one it does to the other, and "adds" is the difference of the medians.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial

from ..harness import Context, Outcome
from ..peers import PEERS, cells, module, unix_floor, zmq_floor
from ..procs import reaped
from ..report import Check, Table, duration, latency, ratio
from ..timing import Budget, Sample, Samples, after_idle, clock, interleave, measure, median_of

TITLE = "Dispatch"
ORDER = 10

API = Budget(samples=2000, seconds=15)
API_QUICK = Budget(samples=300, seconds=2)
IDLE = Budget(samples=300, seconds=8)
IDLE_QUICK = Budget(samples=60, seconds=2)
CELLS = Budget(samples=1000, seconds=15)
CELLS_QUICK = Budget(samples=150, seconds=2)
#: How long everything sleeps before an "after idle" sample (a notebook waits far longer).
IDLE_GAP_S = 0.02

Latencies = dict[str, dict[int, "Samples | None"]]


#: The reference column: meshbook's processes and sockets without meshbook (see zmq_floor).
FLOOR = "floor"
#: The same without ZeroMQ (see unix_floor): what its I/O threads' hand-offs cost.
BARE = "floor without ZeroMQ"
FLOORS = {FLOOR: zmq_floor, BARE: unix_floor}


def api_latencies(ctx: Context, sizes: tuple[int, ...], budget: Budget,
                  idle: Budget | None = None) -> tuple[Latencies, Latencies]:
    """Each system's no-op round trip, and the floor's, per size (None where it failed):
    back to back, and (with an ``idle`` budget) after everything slept ``IDLE_GAP_S``."""
    hot: Latencies = {}
    cold: Latencies = {}
    for n in sizes:
        for name in [*ctx.systems(), *FLOORS]:
            got = ctx.attempt(f"dispatch: {name}, {n} ranks", partial(_api, name, n, budget, idle))
            hot.setdefault(name, {})[n], cold.setdefault(name, {})[n] = got or (None, None)
    return hot, cold


def _api(name: str, n: int, budget: Budget,
         idle: Budget | None) -> tuple[Samples, Samples | None]:
    start = partial(FLOORS[name].start, n) if name in FLOORS else partial(module(name).start, n)
    with reaped(f"{name} with {n} ranks", start, lambda handle: handle.close()) as handle:
        hot = measure(clock(handle.noop), budget)
        return hot, measure(after_idle(handle.noop, IDLE_GAP_S), idle) if idle else None


def api_table(title: str, found: Latencies, sizes: tuple[int, ...]) -> Table:
    peers = [p for p in PEERS if p in found]
    labels = {name: f"{name}: {FLOORS[name].DISPATCH}" if name in FLOORS else f"{name} `{module(name).DISPATCH}`"
              for name in found}
    table = Table(title, ["ranks", *(labels[name] for name in found),
                          *(f"{p} / meshbook" for p in peers), f"meshbook / {FLOOR}", f"meshbook / {BARE}",
                          f"{FLOOR} / {BARE}"])
    for n in sizes:
        ours, floor, bare = (median_of(found[name][n]) for name in ("meshbook", FLOOR, BARE))
        table.add(n, *(latency(s[n]) if s[n] else "failed" for s in found.values()),
                  *(ratio(median_of(found[p][n]), ours) for p in peers),
                  ratio(ours, floor), ratio(ours, bare), ratio(floor, bare))
    table.notes += [
        "median (p99) of the round trip; peer / meshbook above 1x: meshbook is faster",
        (f"{FLOOR}: meshbook's path (controller -> each rank -> controller, a receiver thread; the "
         f"host agent only supervises) in bare pyzmq over ipc, with nothing of meshbook: the way "
         f"meshbook's messages went before the lane, and still go where it cannot (a busy rank, "
         f"a big message)"),
        (f"{BARE}: the same processes and path over Unix datagram sockets, each read and written "
         f"by the thread that uses it: the way meshbook's lane goes (protocol/lane.py); ZeroMQ "
         f"adds an I/O thread at each end of every message (two more thread wake-ups), and "
         f"{FLOOR} / {BARE} is what that costs here; meshbook / a floor is what meshbook's own "
         f"work (signing, pickling, running the code, book-keeping, order) multiplies it by")]
    return table


def dispatch_checks(found: Latencies, n: int) -> list[Check]:
    ours = median_of(found.get("meshbook", {}).get(n))
    floor = median_of(found.get(FLOOR, {}).get(n))
    bare = median_of(found.get(BARE, {}).get(n))
    why = (f"the floor over Unix datagrams, the lane's way, takes {duration(bare)} on this machine "
           f"({duration(floor)} in bare pyzmq) and meshbook's own work adds {duration(ours - bare)} "
           f"to it; with {n} ranks, a host agent and the controller on {os.cpu_count()} cores, "
           f"every process's share of a round trip is time the others wait for"
           ) if ours and floor and bare else ""
    checks = [Check(f"meshbook dispatch on {n} ranks < 1 ms median (issue 2)",
                    duration(ours) if ours else "-", ours < 1e-3 if ours else None, why),
              Check(f"meshbook dispatch on {n} ranks <= 1.3x the bare-pyzmq floor (issue 26)",
                    ratio(ours, floor), ours <= 1.3 * floor if ours and floor else None, why)]
    for peer, factor, issue in (("ipyparallel", 5, ""), ("Monarch", 2, ""), ("Monarch", 3, " (issue 26)")):
        theirs = median_of(found.get(peer, {}).get(n))
        met = theirs / ours >= factor if ours and theirs else None
        needs = f"{factor}x needs {duration(theirs / factor)} or less; " if theirs else ""
        checks.append(Check(f"dispatch on {n} ranks >= {factor}x faster than {peer}{issue}",
                            ratio(theirs, ours), met, needs + why))
    return checks


def _cells(ctx: Context, sizes: tuple[int, ...], budget: Budget,
           after: Latencies) -> tuple[Table, list[Check]]:
    table = Table("A `pass` cell through a real kernel (execute_request to execute_reply)",
                  ["ranks", "local `pass`", "`%%mesh pass`", "meshbook adds", "`%%px pass`",
                   "ipyparallel adds", "`%%px` / `%%mesh`"])
    added_at_8: float | None = None
    for n in sizes:
        mine = ctx.attempt(f"dispatch: %%mesh cells, {n} ranks",
                           partial(_in_kernel, cells.meshbook_kernel, n, budget))
        theirs = None
        if "ipyparallel" in ctx.systems():
            theirs = ctx.attempt(f"dispatch: %%px cells, {n} engines",
                                 partial(_in_kernel, cells.ipyparallel_kernel, n, budget))
        local = mine["local"] if mine else None
        mesh = mine["%%mesh"] if mine else None
        px = theirs["%%px"] if theirs else None
        mesh_adds = mesh.median - local.median if mesh and local else None
        px_adds = px.median - theirs["local"].median if px and theirs else None
        if n == 8:
            added_at_8 = mesh_adds
        table.add(n, latency(local) if local else "failed", latency(mesh) if mesh else "failed",
                  duration(mesh_adds) if mesh_adds is not None else "-",
                  latency(px) if px else "failed",
                  duration(px_adds) if px_adds is not None else "-",
                  ratio(median_of(px), median_of(mesh)))
    table.notes.append("local and remote cells alternate in the same kernel; \"adds\" is the "
                       "difference of their medians")
    woken = median_of(after.get("meshbook", {}).get(8))
    floor = median_of(after.get(BARE, {}).get(8))
    why = (f"a cell comes after idle time, and a round trip that must first wake 8 ranks and "
           f"the controller takes {duration(woken)} through the Python API in this "
           f"run, and {duration(floor)} for the floor of the design (Unix datagrams, same path); "
           f"the kernel's own threads (IOPub) share the cores too") if woken and floor else ""
    added = duration(added_at_8) if added_at_8 is not None else "-"
    checks = [Check(f"`%%mesh pass` adds < {limit * 1e3:g} ms to a local cell on 8 ranks ({issue})", added,
                    added_at_8 < limit if added_at_8 is not None else None, why)
              for limit, issue in ((2e-3, "issue 3"), (1e-3, "issue 26"))]
    return table, checks


def _in_kernel(kernel: Callable[[int], AbstractContextManager[dict[str, Sample]]], n: int,
               budget: Budget) -> dict[str, Samples]:
    with kernel(n) as samples:
        return interleave(samples, budget)


def run(ctx: Context) -> Outcome:
    sizes = ctx.pick((1, 2, 4, 8), (2, 8))
    found, after = api_latencies(ctx, sizes, ctx.budget(API, API_QUICK),
                                 ctx.budget(IDLE, IDLE_QUICK))
    cell_table, cell_checks = _cells(ctx, ctx.pick((2, 4, 8), (2, 8)),
                                     ctx.budget(CELLS, CELLS_QUICK), after)
    api = api_table("No-op round trip to every rank, Python API, back to back", found, sizes)
    idle = api_table(f"The same after {IDLE_GAP_S * 1e3:.0f} ms idle (as every notebook cell "
                     f"meets it)", after, sizes)
    idle.notes.append("every process involved has gone to sleep: waking them is part of this "
                      "round trip (on a virtual machine, each wake-up of an idle core costs "
                      "tens of microseconds)")
    return Outcome([api, idle, cell_table], dispatch_checks(found, 8) + cell_checks)
