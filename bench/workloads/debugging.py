"""Stuck ranks: time to a usable mesh after a hung collective, and time to take stacks.

The peers have no equivalent (ipyparallel and Monarch show no stacks of busy workers, and
their interrupts do not reach work blocked in a collective), so the alternative a user has is
to restart the whole job: the "restart everything" column times exactly that with meshbook
itself (stop, then ``start(n)`` from nothing), for scale.

* **Recovery**: ranks 0, 2, 3, ... wait in an ``all_reduce`` that rank 1 never joins. Timed
  from ``mesh.recover()`` (what the notebook's second interrupt calls) until a fresh
  ``all_reduce`` has completed on every rank, and the same with ``mesh.restart([1])``.
* **Stacks**: every rank busy (half in a collective, half in Python); ``mesh.stacks()``.
"""

from __future__ import annotations

import time

import meshbook

from ..harness import Context, Outcome
from ..report import Check, Table, duration
from ..timing import Budget, Samples, clock, measure

TITLE = "Stuck ranks: recovery and stacks"
ORDER = 70

HANG = ("import time\nt = torch.ones(8)\nif rank == 1:\n    time.sleep(0.2)\n"
        "else:\n    dist.all_reduce(t)")
BUSY = ("import time\nt = torch.ones(8)\nif rank % 2:\n    end = time.time() + 30\n"
        "    while time.time() < end:\n        pass\nelse:\n    dist.all_reduce(t)")
CHECK = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


def _hang(mesh: meshbook.Mesh) -> meshbook.Run:
    run = mesh.run(HANG)
    waiting = [r for r in mesh.ranks if r != 1]
    deadline = time.monotonic() + 30
    while not all(s.pending for s in mesh.snapshots(waiting).values()):
        if time.monotonic() > deadline:
            raise RuntimeError("the ranks never reached the hung all_reduce")
        time.sleep(0.02)
    return run


def _time_to_usable(mesh: meshbook.Mesh, free: str) -> float:
    run = _hang(mesh)
    started = time.perf_counter()
    mesh.recover() if free == "recover" else mesh.restart([1])
    mesh.run(CHECK).result(timeout=60, echo=False)
    took = time.perf_counter() - started
    run.wait(10)
    return took


def _restart_everything(mesh: meshbook.Mesh) -> tuple[meshbook.Mesh, float]:
    started = time.perf_counter()
    n = mesh.world_size
    mesh.stop()
    fresh = meshbook.start(n)
    fresh.run(CHECK).result(timeout=60, echo=False)
    return fresh, time.perf_counter() - started


def _stacks(mesh: meshbook.Mesh, budget: Budget) -> Samples:
    run = mesh.run(BUSY)
    time.sleep(1.0)
    try:
        return measure(clock(mesh.stacks), budget)
    finally:
        mesh.recover()
        run.wait(30)


def run(ctx: Context) -> Outcome:
    sizes = ctx.pick((4, 8), (4,))
    repeats = ctx.pick(3, 1)
    table = Table("Hung all_reduce (rank 1 never joins): time until every rank completed a "
                  "fresh all_reduce", ["ranks", "mesh.recover() (2nd interrupt)",
                                       "mesh.restart([1])", "restart everything"])
    stacks = Table("mesh.stacks() with every rank busy (half in a collective, half in Python)",
                   ["ranks", "stacks"])
    worst_recovery = worst_stacks = on_eight = None
    for n in sizes:
        mesh = meshbook.start(n)
        try:
            found = {}
            for how in ("recover", "restart"):
                got = [ctx.attempt(f"debugging: {how} on {n} ranks, try {i + 1}",
                                   lambda how=how: _time_to_usable(mesh, how)) for i in range(repeats)]
                found[how] = min((g for g in got if g is not None), default=None)
            taken = ctx.attempt(f"debugging: stacks on {n} ranks",
                                lambda: _stacks(mesh, ctx.budget(Budget(30, 10), Budget(5, 3))))
            restarted = ctx.attempt(f"debugging: restart everything, {n} ranks",
                                    lambda: _restart_everything(mesh))
            if restarted:
                mesh = restarted[0]
        finally:
            mesh.stop()
        table.add(n, *(duration(found[h]) if found[h] else "-" for h in ("recover", "restart")),
                  duration(restarted[1]) if restarted else "-")
        stacks.add(n, f"{duration(taken.median)} (p99 {duration(taken.p99)})" if taken else "-")
        if found["recover"] is not None:
            worst_recovery = max(worst_recovery or 0.0, found["recover"])
            on_eight = found["recover"] if n == 8 else on_eight
        if taken is not None:
            worst_stacks = max(worst_stacks or 0.0, taken.median)
    table.notes.append("best of the tries; recover() keeps every namespace here (rank 1 is idle, "
                       "so closing its connections frees the others); restart([1]) loses rank 1's")
    checks = [
        Check(f"recovery from a hung collective < 3 s ({', '.join(map(str, sizes))} ranks)",
              duration(worst_recovery) if worst_recovery else "-",
              None if worst_recovery is None else worst_recovery < 3.0),
        Check("recovery from a hung collective on 8 ranks <= 0.5 s (issue 26)",
              duration(on_eight) if on_eight else "-", None if on_eight is None else on_eight <= 0.5),
        Check("%mesh stacks on busy ranks < 300 ms",
              duration(worst_stacks) if worst_stacks else "-",
              None if worst_stacks is None else worst_stacks < 0.3),
    ]
    return Outcome([table, stacks], checks)
