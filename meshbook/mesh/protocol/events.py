"""What a run produces, as the controller hands it to whoever renders it.

The controller turns each message from a rank into one of these events and adds it to the
:class:`~meshbook.mesh.controller.core.run.Run` it belongs to; renderers (a script's
``Run.result()``, the ``%%mesh`` cell) read them in arrival order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from .errors import RankFailure


@dataclass(frozen=True)
class Output:
    rank: int
    stream: str  # "stdout" or "stderr"
    text: str


@dataclass(frozen=True)
class Display:
    rank: int
    data: dict[str, Any]


@dataclass(frozen=True)
class Result:
    rank: int
    value: Any
    duration: float


@dataclass(frozen=True)
class Results:
    """Several ranks' results at once (an agent's bundle, :mod:`.bundle`): booked as one
    event, with no object per rank. :meth:`Run.events` hands them out one :class:`Result`
    per rank; renderers take the group as it is."""

    ranks: tuple[int, ...]
    values: tuple[Any, ...]
    durations: tuple[float, ...]

    def each(self) -> list[Result]:
        return [Result(r, v, d) for r, v, d in zip(self.ranks, self.values, self.durations)]

    def only(self, keep: Callable[[int], bool]) -> "Results | None":
        """The part of the group from the ranks ``keep`` says yes to (None: no part)."""
        chosen = [i for i, r in enumerate(self.ranks) if keep(r)]
        if len(chosen) == len(self.ranks):
            return self
        if not chosen:
            return None
        return Results(tuple(self.ranks[i] for i in chosen), tuple(self.values[i] for i in chosen),
                       tuple(self.durations[i] for i in chosen))


@dataclass(frozen=True)
class Error:
    rank: int
    failure: RankFailure
    duration: float


@dataclass(frozen=True)
class InputRequest:
    """A rank's debugger asks for a line of input (``prompt`` reads ``(Pdb rank 2)``); its
    answer names ``question`` (the rank's count of its questions), so one that comes late,
    after its question was given up, is never taken for the next one's. ``before`` is what the
    debugger printed since its last prompt, shown right above this one when it is asked."""

    rank: int
    prompt: str
    question: int = 0
    before: str = ""


@dataclass(frozen=True)
class DebugEnd:
    """A rank's debugger session ended (continue or quit): the next rank may be served."""

    rank: int


Event = Union[Output, Display, Result, Results, Error, InputRequest, DebugEnd]
