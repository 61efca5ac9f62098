"""Fan-out scaling: the no-op round trip of the dispatch table on more ranks than cores.

Same measurement as :mod:`bench.workloads.dispatch` (Python API, warm connection) on 8, 16
and 32 ranks of this one host, to show how each system's cost grows with the number of
ranks it must reach and hear back from. On a host with few cores, every rank's share of a
round trip is CPU time the others wait for, so growth here is mostly per-rank cost.
"""

from __future__ import annotations

from ..harness import Context, Outcome
from ..timing import Budget
from .dispatch import api_latencies, api_table

TITLE = "Fan-out scaling"
ORDER = 40

FULL = Budget(samples=1000, seconds=15)
QUICK = Budget(samples=100, seconds=2)


def run(ctx: Context) -> Outcome:
    sizes = ctx.pick((8, 16, 32), (16,))
    found, _ = api_latencies(ctx, sizes, ctx.budget(FULL, QUICK))
    table = api_table("No-op round trip to every rank as ranks grow, Python API", found, sizes)
    for name, by_size in found.items():
        known = [(n, s.median) for n, s in by_size.items() if s]
        if len(known) >= 2:
            (n0, t0), (n1, t1) = known[0], known[-1]
            table.notes.append(f"{name}: +{(t1 - t0) / (n1 - n0) * 1e6:.0f} us per extra rank "
                               f"from {n0} to {n1} ranks")
    return Outcome([table])
