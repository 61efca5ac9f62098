"""Data movement: a tensor pushed to every rank and pulled back from every rank, in GB/s.

What is timed, per system and rank count, on one started system, for 16 MiB and 256 MiB of
float32:

* push: meshbook's ``Mesh.push(t=tensor)`` (returns once every rank stored it), against
  ipyparallel's ``DirectView.push({"t": tensor}, block=True)`` and Monarch's actor call
  (see ``peers/``);
* pull: ``Mesh.pull("t")`` (every rank's value, as tensors in this process), against
  ``DirectView.pull("t", block=True)`` and the Monarch endpoint's result.

GB/s counts the bytes that reach their destination: the tensor once per rank. The issue's
targets: at least 3x ipyparallel's throughput, pushing to 8 local ranks taking less than
3x as long as pushing to one (meshbook serializes a pushed value once and local ranks map it
from shared memory, instead of receiving one copy each), and pulling 256 MiB from each of 8
local ranks at 5 GB/s or more (each rank writes its value into shared memory the notebook maps).
"""

from __future__ import annotations

from functools import partial

from ..harness import Context, Outcome
from ..peers import PEERS, module, running
from ..report import Check, Table, duration, mib, ratio, throughput
from ..timing import Budget, Samples, clock, measure, median_of

TITLE = "Data movement"
ORDER = 30

SIZES = (16 << 20, 256 << 20)
FULL = Budget(samples=30, seconds=10, warmup=1, min_samples=3)
QUICK = Budget(samples=5, seconds=2, warmup=1, min_samples=3)
OPS = ("push", "pull")

#: (system, ranks) -> (op, bytes) -> samples; None where the system failed.
Found = dict[tuple[str, int], "dict[tuple[str, int], Samples] | None"]


def _measure(name: str, n: int, budget: Budget) -> dict[tuple[str, int], Samples]:
    import torch

    out = {}
    with running(name, n) as handle:
        for size in SIZES:
            tensor = torch.randn(size // 4)
            out["push", size] = measure(clock(partial(handle.push, tensor)), budget)
            out["pull", size] = measure(clock(handle.pull), budget)  # what push left there
    return out


def _table(op: str, found: Found, systems: list[str], ranks: tuple[int, ...]) -> Table:
    peers = [p for p in PEERS if p in systems]
    api = {name: module(name).DATA_API for name in systems}
    table = Table(f"{op.capitalize()}: one float32 tensor, every rank",
                  ["ranks", "size", *(f"{name} `{api[name]}`" for name in systems),
                   *(f"meshbook / {p}" for p in peers)])
    for n in ranks:
        for size in SIZES:
            medians = {name: _median(found, name, n, op, size) for name in systems}
            cells = [f"{throughput(size * n, m)} ({duration(m)})" if m else "failed"
                     for m in medians.values()]
            table.add(n, mib(size), *cells,
                      *(ratio(medians[p], medians["meshbook"]) for p in peers))
    table.notes.append("GB/s counts the tensor once per rank; median time in brackets; "
                       "ratios are throughput meshbook / peer (above 1x meshbook is faster)")
    return table


def _median(found: Found, name: str, n: int, op: str, size: int) -> float | None:
    samples = found.get((name, n))
    return median_of(samples.get((op, size))) if samples else None


def _checks(found: Found, ranks: tuple[int, ...]) -> list[Check]:
    checks = []
    for op in OPS:
        ratios = [(theirs / ours, n, size) for n in ranks for size in SIZES
                  if (ours := _median(found, "meshbook", n, op, size))
                  and (theirs := _median(found, "ipyparallel", n, op, size))]
        worst = min(ratios, default=None)
        checks.append(Check(
            f"{op} >= 3x ipyparallel's GB/s at every size and rank count (issue 6)",
            f"worst {worst[0]:.2g}x ({mib(worst[2])}, {worst[1]} ranks)" if worst else "-",
            worst[0] >= 3 if worst else None))
    for size in SIZES:
        one, eight = (_median(found, "meshbook", n, "push", size) for n in (1, 8))
        checks.append(Check(f"push of {mib(size)} to 8 local ranks < 3x push to 1 (issue 6)",
                            f"{eight / one:.2g}x" if one and eight else "-",
                            eight / one < 3 if one and eight else None))
    size = SIZES[-1]
    pull = _median(found, "meshbook", 8, "pull", size)
    rate = size * 8 / pull / 1e9 if pull else None
    checks.append(Check(f"pull of {mib(size)} from 8 local ranks >= 5 GB/s (issue 26: shared memory back)",
                        f"{rate:.3g} GB/s" if rate else "-", rate >= 5 if rate else None))
    return checks


def run(ctx: Context) -> Outcome:
    ranks = ctx.pick((1, 4, 8), (1, 8))
    budget = ctx.budget(FULL, QUICK)
    systems = ctx.systems()
    found: Found = {(name, n): ctx.attempt(f"data: {name}, {n} ranks",
                                           partial(_measure, name, n, budget))
                    for n in ranks for name in systems}
    return Outcome([_table(op, found, systems, ranks) for op in OPS], _checks(found, ranks))
