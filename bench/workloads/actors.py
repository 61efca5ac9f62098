"""Actors: endpoint call latency from the notebook process, and tensors sent actor to actor.

Side by side with PyTorch Monarch's actor endpoints, in the same run:

* latency: one no-op endpoint ``call`` answered by every actor of a mesh of 1, 4 and 8
  (meshbook ``handle.noop.call().result()``, Monarch ``actors.noop.call().get()``);
* actor to actor: two meshes of one process each; the source actor gets a handle on the
  sink actor as an endpoint argument and calls ``sink.load`` with a 16 or 256 MiB float32
  tensor, timing each call inside the source (the notebook is not involved). ``load`` copies
  the tensor into a resident buffer, as ``load_state_dict`` does with weights. GB/s counts the
  tensor once per call.

The issues' targets: latency at least 2x Monarch's at each size (issue 18), then 3x, and a
call to every actor no slower than ``mesh.run("pass")`` on the same ranks (issue 26); actor to
actor at least 2 GB/s and faster than Monarch.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from ..harness import Context, Outcome
from ..procs import reaped
from ..report import Check, Table, duration, latency, mib, ratio, throughput
from ..timing import Budget, Samples, clock, interleave, measure, median_of

TITLE = "Actors"
ORDER = 45

FULL = Budget(samples=1000, seconds=10)
QUICK = Budget(samples=100, seconds=2)
SIZES = (16 << 20, 256 << 20)
SYSTEMS = ("meshbook", "Monarch")


def _meshbook_latency(n: int, budget: Budget) -> Samples:
    import meshbook

    from ..peers.actor_side import Ping

    with reaped(f"meshbook actors on {n}", lambda: meshbook.start(n, name="bench"), lambda m: m.stop()) as mesh:
        ping = mesh.spawn("ping", Ping)
        # In turn, call and run, so load that comes and goes lands on both alike.
        got = interleave({"call": clock(lambda: ping.noop.call().result()),
                          "run": clock(lambda: mesh.run("pass").result())}, budget)
        RUN_ON_SAME_RANKS[n] = got["run"]
        return got["call"]


def _monarch_latency(n: int, budget: Budget) -> Samples:
    from monarch.actor import this_host

    from ..peers.monarch_actors import Ping

    with reaped(f"Monarch actors on {n}", lambda: this_host().spawn_procs(per_host={"procs": n}),
                lambda procs: procs.stop().get()) as procs:
        ping = procs.spawn("ping", Ping)
        return measure(clock(lambda: ping.noop.call().get()), budget)


def _meshbook_transfer(times: int) -> dict[int, list[float]]:
    import meshbook

    from ..peers.actor_side import Sink, Source

    with reaped("meshbook source", lambda: meshbook.start(1, name="source"), lambda m: m.stop()) as a, \
            reaped("meshbook sink", lambda: meshbook.start(1, name="sink"), lambda m: m.stop()) as b:
        sink, source = b.spawn("sink", Sink), a.spawn("source", Source)
        return {size: source.send.call_one(sink, size, times).result() for size in SIZES}


def _monarch_transfer(times: int) -> dict[int, list[float]]:
    from monarch.actor import this_host

    from ..peers.monarch_actors import Sink, Source

    def procs() -> Any:
        return this_host().spawn_procs(per_host={"procs": 1})

    with reaped("Monarch source", procs, lambda p: p.stop().get()) as a, \
            reaped("Monarch sink", procs, lambda p: p.stop().get()) as b:
        sink, source = b.spawn("sink", Sink), a.spawn("source", Source)
        return {size: source.send.call_one(sink, size, times).get() for size in SIZES}


LATENCY: dict[str, Callable[[int, Budget], Samples]] = {"meshbook": _meshbook_latency, "Monarch": _monarch_latency}
#: ``mesh.run("pass")`` on the ranks of each meshbook latency row, timed in turn with its calls.
RUN_ON_SAME_RANKS: dict[int, Samples] = {}
TRANSFER: dict[str, Callable[[int], dict[int, list[float]]]] = {"meshbook": _meshbook_transfer,
                                                               "Monarch": _monarch_transfer}


def run(ctx: Context) -> Outcome:
    systems = [s for s in ctx.systems() if s in SYSTEMS]
    sizes = ctx.pick((1, 4, 8), (1, 8))
    budget = ctx.budget(FULL, QUICK)
    RUN_ON_SAME_RANKS.clear()  # an earlier run's, or a failed row's, must not show
    lat = {(name, n): ctx.attempt(f"actors: {name} latency, {n} actors", partial(LATENCY[name], n, budget))
           for n in sizes for name in systems}
    times = ctx.pick(20, 5)
    moved = {name: ctx.attempt(f"actors: {name} actor to actor", partial(TRANSFER[name], times))
             for name in systems}
    return Outcome([_latency_table(lat, systems, sizes), _transfer_table(moved, systems)],
                   _checks(lat, moved, sizes))


def _latency_table(lat: dict[tuple[str, int], Samples | None], systems: list[str], sizes: tuple[int, ...]) -> Table:
    table = Table("Endpoint call to every actor, from the notebook process",
                  ["actors", *systems, *(["Monarch / meshbook"] if "Monarch" in systems else []),
                   'meshbook `mesh.run("pass")`, same ranks'])
    for n in sizes:
        cells = [latency(s) if (s := lat.get((name, n))) else "failed" for name in systems]
        extra = [ratio(median_of(lat.get(("Monarch", n))), median_of(lat.get(("meshbook", n))))] \
            if "Monarch" in systems else []
        run = RUN_ON_SAME_RANKS.get(n)
        table.add(n, *cells, *extra, latency(run) if run else "-")
    table.notes.append("median round trip (p99); above 1x meshbook is faster; the last column is a no-op "
                       "cell's round trip on the same mesh, timed in turn with its endpoint calls")
    return table


def _median(seconds: list[float] | None) -> float | None:
    return sorted(seconds)[len(seconds) // 2] if seconds else None


def _transfer_table(moved: dict[str, dict[int, list[float]] | None], systems: list[str]) -> Table:
    table = Table("A tensor sent actor to actor (two meshes of one process, same host)",
                  ["size", *systems, *(["meshbook / Monarch"] if "Monarch" in systems else [])])
    for size in SIZES:
        medians = {name: _median((moved.get(name) or {}).get(size)) for name in systems}
        cells = [f"{throughput(size, m)} ({duration(m)})" if m else "failed" for m in medians.values()]
        extra = [ratio(medians.get("Monarch"), medians.get("meshbook"))] if "Monarch" in systems else []
        table.add(mib(size), *cells, *extra)
    table.notes.append("median of the calls timed inside the source actor; the sink copies the tensor into "
                       "a resident buffer; above 1x meshbook is faster")
    return table


def _checks(lat: dict[tuple[str, int], Samples | None], moved: dict[str, dict[int, list[float]] | None],
            sizes: tuple[int, ...]) -> list[Check]:
    checks = []
    ratios = [(theirs / ours, n) for n in sizes if (ours := median_of(lat.get(("meshbook", n))))
              and (theirs := median_of(lat.get(("Monarch", n))))]
    worst = min(ratios, default=None)
    checks.append(Check("endpoint call latency >= 2x faster than Monarch's at 1/4/8 actors (issue 18)",
                        f"worst {worst[0]:.2g}x ({worst[1]} actors)" if worst else "-",
                        worst[0] >= 2 if worst else None))
    checks.append(Check("endpoint call latency >= 3x faster than Monarch's at 1/4/8 actors (issue 26)",
                        f"worst {worst[0]:.2g}x ({worst[1]} actors)" if worst else "-",
                        worst[0] >= 3 if worst else None))
    call, run = median_of(lat.get(("meshbook", sizes[-1]))), median_of(RUN_ON_SAME_RANKS.get(sizes[-1]))
    checks.append(Check(f'endpoint call on {sizes[-1]} actors no slower than mesh.run("pass") on the same ranks '
                        f"(issue 26)", f"{duration(call)} vs {duration(run)}" if call and run else "-",
                        call <= run if call and run else None))
    for size in SIZES:
        ours = _median((moved.get("meshbook") or {}).get(size))
        theirs = _median((moved.get("Monarch") or {}).get(size))
        shown = [throughput(size, t) if t else "-" for t in (ours, theirs)]
        checks.append(Check(f"actor-to-actor {mib(size)} >= 2 GB/s and faster than Monarch (issue 18)",
                            f"{shown[0]} vs {shown[1]}",
                            (size / ours >= 2e9 and (theirs is None or ours < theirs)) if ours else None))
    return checks
