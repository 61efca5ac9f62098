"""Memory: what each idle rank holds beyond ``import torch``, and each system's total.

Every system is started with torch imported and a gloo process group joined on each rank
(as in the startup workload), left idle for a moment, and measured by unique set size
(USS: the memory only that process holds, freed when it exits; shared library text and
pages shared with a parent are not in it).

"Beyond ``import torch``" subtracts what a rank holds before the system adds anything: the
USS of a fresh ``python -c "import torch"`` for systems whose ranks are fresh interpreters
(ipyparallel engines, Monarch procs), and of a fork of such a process for meshbook, whose
ranks are forks of a host agent that imported torch once. "Helpers" are every other
process the system started (meshbook's host agent, ipyparallel's controller and nannies).
"""

from __future__ import annotations

import time
from functools import partial

from ..harness import Context, Outcome
from ..peers import module, running
from ..procs import descendants, torch_baseline, uss
from ..report import Table, mib, ratio

TITLE = "Memory"
ORDER = 50

RANKS = 4
IDLE_S = 2.0


def _measure(name: str, n: int) -> tuple[list[int], list[int]]:
    """USS of each rank, and of each helper process."""
    before = set(descendants())
    with running(name, n, dist=True) as handle:
        handle.noop()
        time.sleep(IDLE_S)
        ranks = handle.pids()
        helpers = [pid for pid in descendants() if pid not in before and pid not in ranks]
        return [uss(pid) for pid in ranks], [uss(pid) for pid in helpers]


def run(ctx: Context) -> Outcome:
    baselines = {forked: torch_baseline(forked) for forked in (False, True)}
    found = {name: ctx.attempt(f"memory: {name}, {RANKS} ranks", partial(_measure, name, RANKS))
             for name in ctx.systems()}
    table = Table(f"Unique memory (USS) of {RANKS} idle ranks with torch.distributed initialised",
                  ["system", "per rank", "per rank beyond `import torch`", "helper processes",
                   f"total for {RANKS} ranks", "total / meshbook"])
    ours = sum(map(sum, found["meshbook"])) if found.get("meshbook") else None
    for name, got in found.items():
        if got is None:
            table.add(name, *["failed"] * 5)
            continue
        ranks, helpers = got
        per_rank = sorted(ranks)[len(ranks) // 2]
        beyond = per_rank - baselines[module(name).RANKS_FORKED]
        total = sum(ranks) + sum(helpers)
        table.add(name, mib(per_rank), mib(beyond), f"{mib(sum(helpers))} ({len(helpers)})",
                  mib(total), ratio(total, ours))
    table.notes += [
        (f"torch alone: a fresh `python -c \"import torch\"` holds {mib(baselines[False])}, "
         f"a fork of one {mib(baselines[True])}; per rank is the median over ranks"),
        "total / meshbook above 1x: the peer needs that many times meshbook's memory"]
    return Outcome([table])
