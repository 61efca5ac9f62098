"""Hang diagnosis: which ranks wait in which collective, and who they wait for.

From one :class:`~meshbook.mesh.protocol.reports.RankSnapshot` per rank, :func:`diagnose` groups the
ranks waiting in the same collective (same process group, sequence number and operation),
works out from the mesh's dimensions which ranks belong to that collective's group, and says in
plain words what each missing member is doing instead::

    ranks 0,2,3 wait in all_reduce #7 ([8] float) at cell line 5 (dist.all_reduce(t));
    rank 1 never reached it: it is at cell line 3 (time.sleep(30))

The same snapshots, merged into a call tree, follow the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ...protocol.reports import Collective, RankSnapshot
from ...protocol.text import agree, agreed, group_by_text, ranks_text
from ...protocol.topology import Topology
from .stacks import Stacks


@dataclass
class Diagnosis:
    verdict: list[str]
    stacks: Stacks
    #: Some rank waits in a collective that a member of its group has not joined (it cannot
    #: complete as things are), where a long collective every member is in may yet complete.
    blocked: bool = False

    @property
    def snapshots(self) -> dict[int, RankSnapshot]:
        return self.stacks.snapshots

    def render(self) -> str:
        return "\n".join(self.verdict) + "\n\nStacks:\n" + self.stacks.render()

    def __repr__(self) -> str:
        return self.render()


def diagnose(snapshots: dict[int, RankSnapshot], topology: Topology,
             nouns: Mapping[int, str] | None = None) -> Diagnosis:
    """``nouns``: what the user calls each request the ranks run ("cell" where unknown)."""
    waiting = {r: s.pending[-1] for r, s in snapshots.items() if s.pending}
    groups: dict[tuple[str, int, str], list[int]] = {}
    for rank, collective in sorted(waiting.items()):
        groups.setdefault((collective.group, collective.seq, collective.op), []).append(rank)
    explained = [_explain(ranks, waiting, snapshots, topology, nouns or {}) for ranks in groups.values()]
    verdict = [line for line, _ in explained]
    if not verdict:
        busy = [r for r, s in snapshots.items() if s.busy]
        if busy:
            places = group_by_text({r: snapshots[r].where() for r in busy})
            verdict.append("no rank waits in a collective; busy: " + "; ".join(
                f"{ranks_text(r)} at {where}" for r, where in places))
        else:
            verdict.append("every rank is idle")
    return Diagnosis(verdict, Stacks(snapshots), blocked=any(blocked for _, blocked in explained))


def _explain(ranks: list[int], waiting: dict[int, Collective],
             snapshots: dict[int, RankSnapshot], topology: Topology,
             nouns: Mapping[int, str]) -> tuple[str, bool]:
    """The verdict's line for ``ranks`` waiting in one collective, and whether a member of its
    group is missing from it."""
    collective = waiting[ranks[0]]
    places = {snapshots[r].where() for r in ranks}
    at = f" at {places.pop()}" if len(places) == 1 else ""
    line = f"{ranks_text(ranks)} {agree('waits', ranks)} in {collective.describe()}{at}"
    members = group_members(collective, ranks[0], topology)
    if members is None:
        return line + " (a group meshbook does not know the members of)", False
    request = snapshots[ranks[0]].request
    noun = nouns.get(request, "cell") if request is not None else "cell"
    absent = {r: _absence(r, waiting, snapshots, request, noun) for r in members if r not in ranks}
    if not absent:
        return line + "; every member of its group is there: it should complete", False
    return line + "; " + "; ".join(f"{ranks_text(r)} {agreed(why, r)}" for r, why in group_by_text(absent)), True


def _absence(rank: int, waiting: dict[int, Collective], snapshots: dict[int, RankSnapshot],
             request: int | None, noun: str) -> str:
    """Why ``rank`` is not in the collective the ranks running ``request`` (a ``noun``) wait in."""
    snap = snapshots.get(rank)
    if snap is None:
        return "did not answer"
    if snap.dead:
        return f"is dead ({snap.dead})"
    if rank in waiting:
        return f"waits in {waiting[rank].describe()} instead"
    here = snap.last_request == request  # its last user code was that cell
    ended = (f"{snap.last} before joining it" if here and snap.last.startswith("stopped")
             else f"finished the {noun} without joining it")
    if snap.busy and snap.doing and here:  # held for the step check after it
        return f"{ended} (now at meshbook's {snap.doing})"
    if snap.busy:
        return f"never reached it: at {snap.where()}"
    # Not in this run at all: only a later one can join, and its collectives then pair with
    # this one's (a wrong value, which the controller tells as CollectiveMispaired).
    return f"{ended} (idle)" if here else f"took no part in this {noun} (idle)"


def group_members(collective: Collective, rank: int, topology: Topology) -> list[int] | None:
    """Ranks of ``collective``'s process group, seen from ``rank`` (None if unknown)."""
    if collective.members:  # as the rank found it (a group of its own: a stand-in DeviceMesh's)
        return list(collective.members)
    if collective.group == "default_pg":
        return list(range(topology.world_size))
    if collective.dim in topology.names:
        coords = topology.coords(rank)
        return topology.where(**{d: i for d, i in coords.items() if d != collective.dim})
    return None

