"""Fan-out scaling: the no-op round trip as the ranks, and the hosts they live on, grow.

On one host (issue 2): the same measurement as :mod:`bench.workloads.dispatch` (Python API,
warm connection) on 8, 16 and 32 ranks, to show how each system's cost grows with the number
of ranks it must reach and hear back from. On a host with few cores, every rank's share of a
round trip is CPU time the others wait for, so growth here is mostly per-rank cost.

Across hosts (issue 16, "Fan-out scale"): 64, 256 and 1,024 ranks spread over 8, 32 and 128
host agents, each a separate process on its own loopback address, over meshbook's real network
path (one TCP + CurveZMQ connection per agent, a request once per host, one signed answer per
rank). 1,024 real ranks do not fit on a small machine, so the agents are stand-ins that
answer for their ranks themselves (see :mod:`bench.standin_host` for what they skip), driven
by the real controller. The CPU each side spends per round trip is measured too: on a real
cluster the agents run in parallel on their own hosts, here they share this machine's cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import psutil

from ..harness import Context, Outcome
from ..procs import reaped
from ..remote import StandInHosts
from ..report import Check, Table, duration, latency
from ..timing import Budget, Samples, clock, measure
from .dispatch import api_latencies, api_table

TITLE = "Fan-out scaling"
ORDER = 40

FULL = Budget(samples=1000, seconds=15)
QUICK = Budget(samples=100, seconds=2)
HOSTS = Budget(samples=1000, seconds=10)
HOSTS_QUICK = Budget(samples=50, seconds=1)

#: (ranks, agents): every rank count of issue 16 on every agent count it fills.
GRID = tuple((n, agents) for agents in (8, 32, 128) for n in (64, 256, 1024) if n >= agents)
GRID_QUICK = ((64, 8), (256, 32))
#: Issue 16: "1,024 ranks answer a no-op in under 50 ms", judged on the most agents.
TARGET = (1024, 128)
TARGET_S = 0.05
#: Issue 26, on the same grid point: the controller's CPU per round trip, and the round trip a
#: cluster would see (the controller's CPU, the slowest agent's, and a link's round trip).
CONTROLLER_CPU_S = 0.005
CLUSTER_S = 0.010


def run(ctx: Context) -> Outcome:
    hosts, checks = _across_hosts(ctx)
    return Outcome([_on_one_host(ctx), hosts], checks)


def _on_one_host(ctx: Context) -> Table:
    sizes = ctx.pick((8, 16, 32), (16,))
    found, _ = api_latencies(ctx, sizes, ctx.budget(FULL, QUICK))
    table = api_table("No-op round trip to every rank as ranks grow, Python API", found, sizes)
    for name, by_size in found.items():
        known = [(n, s.median) for n, s in by_size.items() if s]
        if len(known) >= 2:
            (n0, t0), (n1, t1) = known[0], known[-1]
            table.notes.append(f"{name}: +{(t1 - t0) / (n1 - n0) * 1e6:.0f} us per extra rank "
                               f"from {n0} to {n1} ranks")
    return table


@dataclass(frozen=True)
class Spread:
    """One grid point: the round trips, and the CPU seconds each side spent per round trip."""

    samples: Samples
    controller_cpu: float
    agents_cpu: float
    #: The busiest agent's CPU per round trip, and the quickest ping round trip of any link.
    slowest_agent_cpu: float
    link_rtt: float

    @property
    def cluster(self) -> float:
        """A modelled cluster round trip: the controller's CPU, then the slowest agent's (the
        agents work in parallel, each on its own host), and one link's round trip."""
        return self.controller_cpu + self.slowest_agent_cpu + self.link_rtt


def _cpu(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _spread(n: int, agents: int, budget: Budget) -> Spread:
    import meshbook

    start = partial(meshbook.start, n, launcher=StandInHosts(agents))
    with reaped(f"{n} ranks on {agents} stand-in agents", start, lambda mesh: mesh.stop()) as mesh:
        me = psutil.Process()
        standins = [psutil.Process(agent.proc.pid) for agent in mesh.controller.agents]
        mine, theirs = _cpu([me]), [_cpu([p]) for p in standins]
        samples = measure(clock(lambda: mesh.run("pass").result()), budget)
        trips = budget.warmup + len(samples)
        spent = [_cpu([p]) - before for p, before in zip(standins, theirs)]
        network = mesh.controller.network
        rtts = [link.rtt for link in network.links.values() if link.rtt is not None] if network else []
        return Spread(samples, (_cpu([me]) - mine) / trips, sum(spent) / trips, max(spent) / trips,
                      min(rtts, default=float("nan")))


def _across_hosts(ctx: Context) -> tuple[Table, list[Check]]:
    grid = ctx.pick(GRID, GRID_QUICK)
    budget = ctx.budget(HOSTS, HOSTS_QUICK)
    found = {point: ctx.attempt(f"fan-out: {point[0]} ranks on {point[1]} agents",
                                partial(_spread, *point, budget)) for point in grid}
    table = Table("No-op round trip to every rank as hosts grow: one agent per host, TCP + Curve",
                  ["agents", "ranks", "ranks per agent", "meshbook `Mesh.run(\"pass\")`",
                   "controller CPU per round trip", "agents' CPU per round trip (all agents)",
                   "slowest agent's CPU", "modelled cluster round trip"])
    for (n, agents), got in found.items():
        table.add(agents, n, n // agents, latency(got.samples) if got else "failed",
                  *((duration(got.controller_cpu), duration(got.agents_cpu), duration(got.slowest_agent_cpu),
                     duration(got.cluster)) if got else ("-",) * 4))
    cores = os.cpu_count()
    table.notes += [
        ("median (p99) of the round trip through the real controller and its network path: a "
         "request once per agent over its own Curve TCP connection (ZAP admits the controller's "
         "key only), the agent checking its ranks' signed RESULTs and sending them up as one "
         "bundle, signed once"),
        ("modelled cluster round trip: the controller's CPU per round trip, plus the slowest "
         "agent's (on a cluster each agent works on its own host, in parallel with the others), "
         "plus one link's round trip (the quickest ping any link measured in this run, over "
         "loopback: a cluster's network adds its own)"),
        ("agents: stand-ins (bench/standin_host.py), one process per host, each listening on "
         "its own 127.0.0.N with meshbook's own link code; each answers for its ranks itself. "
         "Skipped: the agent's ipc hop to real rank processes and back (each rank checking and "
         "running the request, then signing its answer in its own process), and the ranks' "
         "heartbeats"),
        (f"CPU: this process (caller and receiver threads), and all agents together, per round "
         f"trip. On a cluster each agent's share runs on its own host in parallel; here every "
         f"agent shares this machine's {cores} cores with the controller, so with many agents "
         f"the round trip is mostly the time {cores} cores take to wake and run every agent in "
         f"turn"),
        *_growth(found)]
    return table, [_check(found, cores), *_checks_26(found.get(TARGET))]


def _growth(found: dict[tuple[int, int], Spread | None]) -> list[str]:
    """How the median grows with ranks (agents fixed) and with agents (ranks fixed)."""
    median = {point: got.samples.median for point, got in found.items() if got}
    notes = []
    for agents in sorted({a for _, a in median}):
        ranks = sorted(n for n, a in median if a == agents)
        if len(ranks) >= 2:
            n0, n1 = ranks[0], ranks[-1]
            notes.append(f"on {agents} agents: +{(median[n1, agents] - median[n0, agents]) / (n1 - n0) * 1e6:.0f} "
                         f"us per extra rank from {n0} to {n1} ranks")
    for n in sorted({n for n, _ in median}):
        agents = sorted(a for m, a in median if m == n)
        if len(agents) >= 2:
            a0, a1 = agents[0], agents[-1]
            notes.append(f"{n} ranks: +{(median[n, a1] - median[n, a0]) / (a1 - a0) * 1e6:.0f} "
                         f"us per extra agent from {a0} to {a1} agents")
    return notes


def _check(found: dict[tuple[int, int], Spread | None], cores: int | None) -> Check:
    n, agents = TARGET
    target = f"{n:,} ranks on {agents} agents answer a no-op in < {duration(TARGET_S)} median (issue 16)"
    got = found.get(TARGET)
    if got is None:
        return Check(target, "-", None)
    why = (f"the controller spends {duration(got.controller_cpu)} of CPU per round trip and the "
           f"{agents} agents {duration(got.agents_cpu)} together, all on this machine's {cores} "
           f"cores; on a cluster the agents' share runs in parallel, one host each")
    return Check(target, duration(got.samples.median), got.samples.median < TARGET_S, why)


def _checks_26(got: Spread | None) -> list[Check]:
    n, agents = TARGET
    where = f"{n:,} ranks on {agents} agents"
    cpu = f"{where}: controller CPU per round trip <= {duration(CONTROLLER_CPU_S)} (issue 26)"
    cluster = (f"{where}: modelled cluster round trip (controller CPU + slowest agent + link round trip) "
               f"<= {duration(CLUSTER_S)} (issue 26)")
    if got is None:
        return [Check(cpu, "-", None), Check(cluster, "-", None)]
    parts = (f"{duration(got.controller_cpu)} controller + {duration(got.slowest_agent_cpu)} slowest agent + "
             f"{duration(got.link_rtt)} link")
    why = (f"the controller's CPU alone is {duration(got.controller_cpu)}: it still takes each host's bundle "
           f"(a ZeroMQ receive, the link's order, one HMAC, unpickling it, booking its group) and sends "
           f"each host its request, about {got.controller_cpu / agents * 1e6:.0f} us per host, with "
           f"{agents} agent processes sharing this machine's cores")
    return [Check(cpu, duration(got.controller_cpu), got.controller_cpu <= CONTROLLER_CPU_S, why),
            Check(cluster, f"{duration(got.cluster)} ({parts})", got.cluster <= CLUSTER_S, why)]
