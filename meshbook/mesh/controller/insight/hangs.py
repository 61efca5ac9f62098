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

from collections.abc import Callable
from dataclasses import dataclass, field
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
    #: The ranks that wait only for ranks that wait too (two that each ``recv`` from the other):
    #: none can go on, however long they wait.
    deadlocked: list[int] = field(default_factory=list)

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
    groups: dict[tuple[str, int, str, int | None], list[int]] = {}
    for rank, collective in sorted(waiting.items()):
        groups.setdefault((collective.group, collective.seq, collective.op, collective.peer), []).append(rank)
    explained = [_explain(ranks, waiting, snapshots, topology, nouns or {}) for ranks in groups.values()]
    cycle = deadlocked({r: missing_members(r, waiting, topology) or [] for r in waiting})
    verdict = [line for line, _ in explained]
    if not verdict:
        busy = [r for r, s in snapshots.items() if s.busy]
        if busy:
            places = group_by_text({r: snapshots[r].where() for r in busy})
            verdict.append("no rank waits in a collective; busy: " + "; ".join(
                f"{ranks_text(r)} at {where}" for r, where in places))
        else:
            verdict.append("every rank is idle")
    return Diagnosis(verdict, Stacks(snapshots), blocked=any(blocked for _, blocked in explained),
                     deadlocked=sorted(cycle))


def _explain(ranks: list[int], waiting: dict[int, Collective],
             snapshots: dict[int, RankSnapshot], topology: Topology,
             nouns: Mapping[int, str]) -> tuple[str, bool]:
    """The verdict's line for ``ranks`` waiting in one collective, and whether a member of its
    group is missing from it."""
    collective = waiting[ranks[0]]
    places = {snapshots[r].where() for r in ranks}
    at = f" at {places.pop()}" if len(places) == 1 else ""
    line = f"{ranks_text(ranks)} {agree('waits', ranks)} in {collective.describe()}{at}"
    missing = missing_members(ranks[0], waiting, topology)
    if missing is None:
        unknown = "it may take any rank's send" if collective.point_to_point else \
            "a group meshbook does not know the members of"
        return line + f" ({unknown})", False
    request = snapshots[ranks[0]].request
    noun = nouns.get(request, "cell") if request is not None else "cell"
    absent = {r: _absence(r, waiting, snapshots, request, noun) for r in missing}
    if not absent:
        there = f"rank {collective.peer} is at the other end" if collective.point_to_point else \
            "every member of its group is there"
        return line + f"; {there}: it should complete", False
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


def missing_members(rank: int, waiting: Mapping[int, Collective], topology: Topology) -> list[int] | None:
    """The members of the operation ``rank`` waits in (``waiting[rank]``) that are not in it
    (None: its members are unknown): a collective's members waiting in another one, or in none;
    a point-to-point operation's peer, unless it waits in the matching one."""
    collective = waiting[rank]
    members = group_members(collective, rank, topology)
    if members is None:
        return None
    return [m for m in members if m != rank and not _joins(waiting.get(m), collective, rank)]


def deadlocked(missing: Mapping[int, list[int]], gone: Callable[[int], bool] = lambda rank: False) -> set[int]:
    """The ranks that wait for members (``missing``: each waiting rank's) that all wait too, for
    members that all wait...: none of them can go on. A member that went on is ``gone`` (it
    will never come); any other member not waiting could still come."""
    stuck = {rank for rank, members in missing.items() if members}
    while True:
        free = {r for r in stuck if any(m not in stuck and not gone(m) for m in missing[r])}
        if not free:
            return stuck
        stuck -= free


def _joins(theirs: Collective | None, collective: Collective, rank: int) -> bool:
    """Does a member waiting in ``theirs`` take part in ``rank``'s ``collective``?"""
    if theirs is None:
        return False
    if collective.point_to_point:  # the other end: the other direction, towards this rank
        return (theirs.point_to_point and theirs.op != collective.op and theirs.peer in (rank, None)
                and theirs.group == collective.group)
    return (theirs.group, theirs.seq, theirs.op) == (collective.group, collective.seq, collective.op)


def group_members(collective: Collective, rank: int, topology: Topology) -> list[int] | None:
    """Ranks of ``collective``'s process group, seen from ``rank`` (None if unknown); of a
    point-to-point operation, the two ends."""
    if collective.point_to_point:
        return None if collective.peer is None else sorted({rank, collective.peer})
    if collective.members:  # as the rank found it (a group of its own: a stand-in DeviceMesh's)
        return list(collective.members)
    if collective.group == "default_pg":
        return list(range(topology.world_size))
    if collective.dim in topology.names:
        coords = topology.coords(rank)
        return topology.where(**{d: i for d, i in coords.items() if d != collective.dim})
    return None

