"""What rank operations answer: a rank's stack snapshot and its place in each process group.

Built on a rank (:mod:`meshbook.mesh.rank.ops`), read by the controller (stacks, the hang
diagnosis, the step check): plain frozen data, so it travels in a pickle and means the same
on both ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import Frame, home_of
from .text import format_ranks


@dataclass(frozen=True)
class Collective:
    """A collective a rank has enqueued and not completed (from the flight recorder), or a
    point-to-point operation (the rank's own count: gloo's recorder leaves them out)."""

    op: str  # "all_reduce", "broadcast", ...
    seq: int  # sequence number within its process group
    group: str  # "default_pg", "mesh_tp", or a user group's name
    sizes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    #: The global ranks of its group, where the rank still had the group when asked.
    members: tuple[int, ...] = ()
    #: A point-to-point operation's (op "send" or "recv", numbered per peer and direction in
    #: its group): the global rank on the other end (None: a receive from any rank).
    peer: int | None = None

    @property
    def point_to_point(self) -> bool:
        return self.op in ("send", "recv")

    def same_call(self, other: "Collective") -> bool:
        """The same operation on the same shapes and dtypes: calls that pair as meant. (Rooted
        and uneven calls, a scatter's root or an uneven all_to_all, differ in shape from their
        peers' by design, and count as other calls; a root is not compared.)"""
        return (self.op, self.sizes, self.dtypes) == (other.op, other.sizes, other.dtypes)

    @property
    def dim(self) -> str | None:
        """The mesh dimension of a DeviceMesh group (``"tp"`` for ``mesh_tp``)."""
        return self.group[5:] if self.group.startswith("mesh_") else None

    def describe(self) -> str:
        """``all_reduce #3 over tp ([8] float)``, ``recv #2 from rank 1 ([8] float)``."""
        shapes = ", ".join(f"{list(s) if s else 'scalar'} {d.lower()}" for s, d in zip(self.sizes, self.dtypes))
        return f"{self.op} #{self.seq}{self._where()}" + (f" ({shapes})" if shapes else "")

    def _where(self) -> str:
        """Its group: a mesh dimension by name, a user's group (torch names it "undefined") by
        its members where known; a point-to-point operation by its peer."""
        over = f" over {self.dim}" if self.dim else ""
        if self.point_to_point:
            peer = f" {'to' if self.op == 'send' else 'from'} rank {self.peer}" if self.peer is not None else \
                " from any rank"
            return peer + over
        if self.dim or self.group == "default_pg":
            return over
        if self.group in ("undefined", ""):
            return f" in the group of ranks {format_ranks(sorted(self.members))}" if self.members else \
                " in a group of your own"
        return f" in group {self.group}"


@dataclass(frozen=True)
class RankSnapshot:
    """One rank at one moment: busy or idle, its stack, its pending collectives."""

    rank: int
    busy: bool
    request: int | None = None
    busy_s: float = 0.0
    frames: tuple[Frame, ...] = ()
    pending: tuple[Collective, ...] = ()
    native: str = ""  # a py-spy dump, when the control thread could not answer
    dead: str = ""  # why, when the rank is not running at all
    last: str = ""  # how its last user code ended, unless it runs user code ("stopped with KeyboardInterrupt at ...")
    last_request: int | None = None  # the request of that user code
    doing: str = ""  # what meshbook itself runs there, when busy with its own work ("the step check")
    knock_on: bool = False  # that last code failed because of another rank (see errors.knock_on)

    @property
    def user_frame(self) -> Frame | None:
        """Where the user's code is: the innermost frame in cell code, else the innermost
        outside torch (an actor's endpoint, a function the notebook applied), else the
        innermost."""
        frames = self.frames[::-1]
        return next((f for f in frames if f.in_cell), None) or next((f for f in frames if not f.in_torch),
                                                                    frames[0] if frames else None)

    def where(self) -> str:
        """``cell line 3 (time.sleep(30))`` — where this rank's own code is now."""
        if self.doing:
            return f"meshbook's {self.doing}"
        frame = self.user_frame
        if frame is None:
            return "somewhere outside Python" if self.busy else "idle"
        return frame.place(home_of(self.frames)) + (f" ({frame.line})" if frame.line else "")


@dataclass(frozen=True)
class GroupPosition:
    """How many collectives one rank has issued in one process group."""

    issued: int
    label: str  # "the default group", "group mesh_tp"


@dataclass(frozen=True)
class Positions:
    """One rank's place in every process group it belongs to."""

    rank: int
    groups: dict[str, GroupPosition] = field(default_factory=dict)
    initialized: bool = True  # False: the default group was destroyed
    #: Objects the ranks of a group keep as replicas (a DDP module, its optimizer), by name:
    #: those ranks, and a print of the object's numbers (``rank.groups.replica_prints``).
    replicas: dict[str, tuple[tuple[int, ...], tuple[float | None, ...]]] = field(default_factory=dict)
