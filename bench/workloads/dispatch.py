"""Dispatch: the round trip of a no-op to every rank, through the Python API and a notebook.

Python API: ``Mesh.run("pass").result()`` against ipyparallel's ``DirectView.apply_sync``
of a no-op function and a Monarch actor endpoint's ``call().get()``; each system is started
once per size and timed on a warm connection.

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
from ..peers import PEERS, cells, module, running, zmq_floor
from ..procs import reaped
from ..report import Check, Table, duration, latency, ratio
from ..timing import Budget, Sample, Samples, clock, interleave, measure, median_of

TITLE = "Dispatch"
ORDER = 10

API = Budget(samples=2000, seconds=15)
API_QUICK = Budget(samples=300, seconds=2)
CELLS = Budget(samples=1000, seconds=15)
CELLS_QUICK = Budget(samples=150, seconds=2)

Latencies = dict[str, dict[int, "Samples | None"]]


#: The reference column: meshbook's processes and sockets without meshbook (see zmq_floor).
FLOOR = "floor"


def api_latencies(ctx: Context, sizes: tuple[int, ...], budget: Budget) -> Latencies:
    """Each system's no-op round trip, and the floor's, per size (None where it failed)."""
    out: Latencies = {}
    for n in sizes:
        for name in ctx.systems():
            out.setdefault(name, {})[n] = ctx.attempt(
                f"dispatch: {name}, {n} ranks", partial(_api, name, n, budget))
        out.setdefault(FLOOR, {})[n] = ctx.attempt(
            f"dispatch: {FLOOR}, {n} ranks", partial(_floor, n, budget))
    return out


def _api(name: str, n: int, budget: Budget) -> Samples:
    with running(name, n) as handle:
        return measure(clock(handle.noop), budget)


def _floor(n: int, budget: Budget) -> Samples:
    with reaped(f"{FLOOR} with {n} ranks", partial(zmq_floor.start, n),
                zmq_floor.FloorHandle.close) as handle:
        return measure(clock(handle.noop), budget)


def api_table(title: str, found: Latencies, sizes: tuple[int, ...]) -> Table:
    peers = [p for p in PEERS if p in found]
    labels = {name: f"{name} `{module(name).DISPATCH}`" for name in found if name != FLOOR}
    labels[FLOOR] = f"{FLOOR}: {zmq_floor.DISPATCH}"
    table = Table(title, ["ranks", *(labels[name] for name in found),
                          *(f"{p} / meshbook" for p in peers), f"meshbook / {FLOOR}"])
    for n in sizes:
        ours = median_of(found["meshbook"][n])
        table.add(n, *(latency(s[n]) if s[n] else "failed" for s in found.values()),
                  *(ratio(median_of(found[p][n]), ours) for p in peers),
                  ratio(ours, median_of(found[FLOOR][n])))
    table.notes += [
        "median (p99) of the round trip; peer / meshbook above 1x: meshbook is faster",
        (f"{FLOOR}: meshbook's path (controller -> host agent -> ranks -> controller over "
         f"ipc, a receiver thread) in bare pyzmq with nothing of meshbook; meshbook / {FLOOR} "
         f"is what meshbook's own work (signing, pickling, running the code, book-keeping) "
         f"multiplies it by")]
    return table


def dispatch_checks(found: Latencies, n: int) -> list[Check]:
    ours = median_of(found.get("meshbook", {}).get(n))
    floor = median_of(found.get(FLOOR, {}).get(n))
    why = (f"the floor, meshbook's path in bare pyzmq, takes {duration(floor)} on this machine "
           f"and meshbook's own work adds {duration(ours - floor)}; with {n} ranks, a host agent "
           f"and the controller on {os.cpu_count()} cores, every process's share of a round "
           f"trip is time the others wait for") if ours and floor else ""
    checks = [Check(f"meshbook dispatch on {n} ranks < 1 ms median (issue 2)",
                    duration(ours) if ours else "-", ours < 1e-3 if ours else None, why)]
    for peer, factor in (("ipyparallel", 5), ("Monarch", 2)):
        theirs = median_of(found.get(peer, {}).get(n))
        met = theirs / ours >= factor if ours and theirs else None
        needs = f"{factor}x needs {duration(theirs / factor)} or less; " if theirs else ""
        checks.append(Check(f"dispatch on {n} ranks >= {factor}x faster than {peer}",
                            ratio(theirs, ours), met, needs + why))
    return checks


def _cells(ctx: Context, sizes: tuple[int, ...], budget: Budget,
           api: Latencies) -> tuple[Table, list[Check]]:
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
    through_api = median_of(api.get("meshbook", {}).get(8))
    why = (f"the same round trip through the Python API takes {duration(through_api)} in this "
           f"run; in a kernel, the cell's dispatch also shares the cores with the kernel's own "
           f"threads (IOPub) and the frontend") if through_api else ""
    check = Check("`%%mesh pass` adds < 2 ms to a local cell on 8 ranks (issue 3)",
                  duration(added_at_8) if added_at_8 is not None else "-",
                  added_at_8 < 2e-3 if added_at_8 is not None else None, why)
    return table, [check]


def _in_kernel(kernel: Callable[[int], AbstractContextManager[dict[str, Sample]]], n: int,
               budget: Budget) -> dict[str, Samples]:
    with kernel(n) as samples:
        return interleave(samples, budget)


def run(ctx: Context) -> Outcome:
    sizes = ctx.pick((1, 2, 4, 8), (2, 8))
    found = api_latencies(ctx, sizes, ctx.budget(API, API_QUICK))
    cell_table, cell_checks = _cells(ctx, ctx.pick((2, 4, 8), (2, 8)),
                                     ctx.budget(CELLS, CELLS_QUICK), found)
    api = api_table("No-op round trip to every rank, Python API", found, sizes)
    return Outcome([api, cell_table], dispatch_checks(found, 8) + cell_checks)
