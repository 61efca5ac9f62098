"""Errors a user can cause or meet, each with a message that says what to do next.

Everything meshbook raises on purpose is a :class:`MeshError`. Failures that happened *on the
ranks* arrive as a :class:`RemoteError`, which carries one :class:`RankFailure` per failed rank
and prints them grouped: ranks whose tracebacks are identical are shown once, with their rank
list, so eight ranks failing the same way read like one failure.
"""

from __future__ import annotations

import operator
import os
import re
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Sequence

from .text import format_ranks, group_by_text, parse_size

#: meshbook's own files, and IPython's (the frame that runs a cell): not the user's frames.
_MESHBOOK = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_IPYTHON = os.sep + "IPython" + os.sep


class MeshError(Exception):
    """Base class of every error meshbook raises on purpose."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows of it in a notebook: the cell's own frames and the message, not
        meshbook's frames inside the call, nor what they called (contextlib's, say): the
        message says what to do, and they only bury it."""
        frames = []
        for frame in traceback.extract_tb(self.__traceback__):
            if frame.filename.startswith(_MESHBOOK):
                break
            if _IPYTHON not in frame.filename:
                frames.append(frame)
        lines = [line for text in traceback.format_list(frames) for line in text.rstrip("\n").splitlines()]
        return [*lines, f"{type(self).__name__}: {self}"]


class SelectionError(MeshError, ValueError):
    """A rank selection names a rank or a dimension the mesh does not have."""


class MeshStoppedError(MeshError):
    """The mesh was stopped (or its host agent died); start a new one."""


class MeshTimeout(MeshError, TimeoutError):
    """Waiting for a result took longer than the timeout; the ranks keep running."""


class SendError(MeshError):
    """A value could not be serialized for the wire; nothing was sent."""


class MissingNameError(MeshError, NameError):
    """A variable is not defined on some of the selected ranks; nothing was moved."""


class TooLargeError(MeshError):
    """A pull would move more bytes than its limit; nothing was moved."""


class ShapeError(MeshError, ValueError):
    """A tensor cannot be split or assembled as asked; nothing was sent."""


def check_seconds(value: Any, what: str, now: bool = False) -> float:
    """``value`` as a limit in seconds, or a :class:`MeshError` saying what to give: a limit
    of 0 s or less (or NaN, or not a number) would only fail later, and say less. ``now``: 0
    is a limit too (look, without waiting). Past threading's longest wait is no limit to give."""
    try:
        limit = float(value)
    except (TypeError, ValueError):
        limit = float("nan")  # refused below, as NaN fails every comparison
    least = 0 <= limit if now else 0 < limit
    if isinstance(value, bool) or not (least and limit <= threading.TIMEOUT_MAX):
        raise MeshError(f"{what}={value!r}: give a number of seconds {'0 or more' if now else 'above 0'}, "
                        f"e.g. 30 (None: no limit)")
    return limit


def check_bytes(value: Any, what: str) -> int:
    """``value`` as a number of bytes: a whole number above 0, or a size such as ``"512M"``
    or ``"8G"``; else a :class:`MeshError` saying so (a limit of 0 or less refuses everything,
    and a string compared with a number fails deep inside, with a ``TypeError``)."""
    given = value
    if isinstance(value, str):
        try:
            value = parse_size(value, what)
        except ValueError as exc:
            raise MeshError(str(exc)) from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 4e9
    nbytes = whole(value)
    if nbytes < 1:
        raise MeshError(f"{what}={given!r}: give a number of bytes above 0, or a size such as 512M or 8G")
    return nbytes


def whole(value: Any) -> int:
    """``value`` as a whole number (an int, numpy's too), or 0 where it is none (a bool, a
    float, text): what a count or a size must be."""
    if isinstance(value, bool):
        return 0
    try:
        return operator.index(value)
    except TypeError:
        return 0


class CellSyntaxError(MeshError):
    """The submitted code does not compile; it was caught before anything was sent.

    Not a ``SyntaxError`` subclass on purpose: IPython prints those with the magic's own
    frames, while this one renders as the cell line with a caret (``_render_traceback_``).
    """

    def __init__(self, msg: str, lineno: int | None, offset: int | None, text: str | None) -> None:
        super().__init__(f"{msg} (cell line {lineno}; nothing was sent to the ranks)")
        self.msg, self.lineno, self.offset, self.text = msg, lineno, offset, text

    def _render_traceback_(self) -> list[str]:
        lines = [f"  cell line {self.lineno}"]
        if self.text:
            text = self.text.rstrip("\n")
            indent = len(text) - len(text.lstrip())
            lines.append("    " + text.strip())
            if self.offset:
                lines.append("    " + " " * max(0, self.offset - 1 - indent) + "^")
        lines.append(f"SyntaxError: {self.msg} (nothing was sent to the ranks)")
        return lines


#: File names of submitted code start with this, so their frames are recognised as cell code
#: (``<mesh cell 3>``: the cell the notebook numbers 3, see ``cell.cell_filename``).
CELL_PREFIX = "<mesh cell "


@dataclass(frozen=True)
class Frame:
    """One traceback frame, with the submitted code's own line numbers."""

    filename: str
    lineno: int
    name: str
    line: str
    in_cell: bool = False
    #: How many more times the same frame followed it (a runaway recursion), left out.
    repeated: int = 0

    @property
    def where(self) -> str:
        """``cell line 3``, or a library file shortened to its package path."""
        return f"cell line {self.lineno}" if self.in_cell else f"{short_path(self.filename)}:{self.lineno}"

    def place(self, home: str | None = None) -> str:
        """:attr:`where`, naming the frame's cell when it is another than ``home``, the cell
        that ran (a function an earlier cell defined), as IPython does: ``cell [3] line 12``.
        Without, "cell line 12" read as a line of the cell in front of the reader."""
        if self.in_cell and home is not None and self.filename != home:
            return f"cell [{self.filename[len(CELL_PREFIX):-1]}] line {self.lineno}"
        return self.where

    @property
    def in_torch(self) -> bool:
        return short_path(self.filename).startswith("torch/")

    def format(self, home: str | None = None) -> str:
        text = f"  {self.place(home)}, in {self.name}"
        text += f"\n    {self.line}" if self.line else ""
        return text + (f"\n  [Previous line repeated {self.repeated} more times]" if self.repeated else "")


def home_of(frames: Sequence[Frame]) -> str | None:
    """The file of the cell that ran: the outermost of ``frames`` in cell code."""
    return next((f.filename for f in frames if f.in_cell), None)


def short_path(filename: str) -> str:
    """``/.../site-packages/torch/distributed/x.py`` -> ``torch/distributed/x.py``."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


#: What a collective's error says when its process group is broken for good: a gloo timeout
#: closes the connections (every later collective fails with "Connection closed by peer", or
#: gloo's bare "Application timeout caused pair closure"), and NCCL aborts its communicator.
#: The counts may still agree; the groups must be re-created.
BROKEN_GROUP = re.compile(r"gloo.*(timed out|connection closed|connection reset|pair closure)|nccl.*(timeout|abort)"
                          r"|application timeout caused pair closure", re.IGNORECASE | re.DOTALL)


#: Errors a rank gets from another rank's doing: its collective aborted (the other never
#: joined), paired wrong, or the interrupt that stopped them all.
KNOCK_ON_TYPES = ("CollectiveAborted", "CollectiveMispaired", "KeyboardInterrupt")


def knock_on(failure: "RankFailure") -> bool:
    """Did ``failure`` come from another rank (see :data:`KNOCK_ON_TYPES`; a broken group: a
    peer that crashed or timed out)? Where a cell failed on several ranks, the one to look at
    first is one whose own code raised."""
    return failure.type_name in KNOCK_ON_TYPES or broke_its_group(failure)


def blame_order(failure: "RankFailure") -> tuple[bool, bool, bool]:
    """Where ``failure`` goes among a run's failures, the one to look at first in front: a
    death, the rank's own error, meshbook's abort, a broken group's bare error."""
    return failure.died is None, knock_on(failure), broke_its_group(failure)


def broke_its_group(failure: "RankFailure") -> bool:
    """Does ``failure`` say its process group broke (:data:`BROKEN_GROUP`), in its message or
    in an exception it was raised from or while handling (a Ctrl-C that landed as gloo timed
    out; ``raise StepFailed(...) from e`` in the user's code)? A rank that died says nothing."""
    return not failure.died and bool(BROKEN_GROUP.search(failure.message) or BROKEN_GROUP.search(failure.detail))


def stale_names(stale: Sequence[tuple[str, str]]) -> str:
    """``fs (FSDP2 module), net (DDP module)``: what holds the old process groups, by name."""
    return ", ".join(f"{name} ({kind})" for name, kind in stale)


def remaking(stale: Sequence[tuple[str, str]]) -> str:
    """How to re-create each of what holds the old process groups (``rank.groups``'
    ``stale_objects``: name and kind): each kind is made again its own way."""
    hints = []
    for name, kind in stale:
        if kind == "DDP module":
            hints.append(f"{name} = DDP({name}.module) (it broadcasts rank 0's weights)")
        elif kind == "parallelize step":
            hints.append(f"{name}, and the model and optimizer made with it, by mesh.parallelize(...) again "
                         f"(%mesh parallelize), which builds the three anew (load a checkpoint to keep the weights)")
        elif kind in ("FSDP2 module", "FSDP module"):
            hints.append(f"{name}, an {kind}, by building it anew and sharding that on `device_mesh` (a module "
                         f"is sharded once; the old one's local shards, p.to_local(), still hold its weights to "
                         f"copy in, or load a checkpoint)")
        else:
            hints.append(f"{name}, a {kind}, with new_group / init_device_mesh (or use `device_mesh`)")
    return "; ".join(hints)


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: exception type, message and the user-facing frames."""

    rank: int
    type_name: str
    message: str
    frames: tuple[Frame, ...] = ()
    #: Set when the rank process itself died (e.g. ``"SIGKILL"``), not just the code.
    died: str | None = None
    #: Extra text that belongs to the failure (a crash dump, a hint).
    detail: str = ""

    @property
    def headline(self) -> str:
        """``ValueError: bad batch``; a message torch begins with a blank line and indents, with its text."""
        message = self.message.lstrip()
        return f"{self.type_name}: {message}" if message else self.type_name

    def body(self) -> str:
        """The rank-independent part: identical bodies are grouped across ranks."""
        parts = []
        if self.frames:
            parts.append("Traceback (most recent call last):")
            home = home_of(self.frames)
            parts.extend(f.format(home) for f in self.frames)
        parts.append(self.headline)
        if self.detail:
            parts.append(self.detail)
        return "\n".join(parts)


#: The peer a transport's error names ("Connection closed by peer [127.0.0.1]:57034"): each rank
#: names its own peer's port, so ranks failing alike would each be a group of their own.
#: An IPv4 or IPv6 address in brackets and a port, nothing shorter: "x[3]:1" in a user's own
#: message must still tell ranks apart.
_PEER = re.compile(r"\[(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*)\]:\d+")


def _alike(text: str) -> str:
    """``text`` with the peers' addresses left out: what ranks that failed alike share."""
    return _PEER.sub("[peer]", text)


@dataclass(eq=False)
class RemoteError(MeshError):
    """Code failed on one or more ranks.

    ``failures`` maps rank -> :class:`RankFailure`; ``partial`` holds the results of the ranks
    that did succeed (a :class:`~meshbook.RankValues`), so nothing computed is lost.
    """

    failures: dict[int, RankFailure]
    partial: Any = None
    hint: str = ""
    #: How the caller keeps the finished ranks' values, where it can (a ``%%mesh`` cell's
    #: ``--out NAME``): said after them.
    keeps: str = ""
    groups: list[tuple[list[int], str]] = field(init=False)

    def __post_init__(self) -> None:
        super().__init__()
        # Deaths first, then failures of the ranks' own code, then meshbook's word on the others
        # (a collective it aborted says whom it waited for): a rank that died or raised is what
        # its peers' failures follow from, so the headline names the cause, not gloo's echo of it
        # ("Connection closed by peer ... typically caused by a remote worker crashing").
        self.groups = sorted(group_by_text({r: _alike(f.body()) for r, f in self.failures.items()}),
                             key=lambda group: blame_order(self.failures[group[0][0]]))

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)

    def __str__(self) -> str:
        total = len(self.failures)
        head = f"{total} rank{'s' if total != 1 else ''} failed"
        first = self.failures[self.groups[0][0][0]]
        lines = [f"{head}; first: [{format_ranks(self.groups[0][0])}] {first.headline}"]
        return "\n".join(lines + ([self.hint] if self.hint else []))

    @property
    def __notes__(self) -> list[str]:
        """What Python prints after the message of one that is not caught (a script's): each
        rank's report, which the message only sums up. (A notebook shows :meth:`render`.)"""
        return [self.render(hint=False)]

    def render(self, hint: bool = True) -> str:
        """The full grouped report: each distinct failure once, headed by its ranks; then the
        ranks that finished, whose values are not lost (and the hint, unless ``hint`` is False)."""
        out = []
        for ranks, _ in self.groups:
            failure = self.failures[ranks[0]]
            alike = len({self.failures[r].body() for r in ranks}) > 1  # told with the peers' addresses left out
            out.append(f"[{format_ranks(ranks)}] {_alike(failure.headline) if alike else failure.headline}")
            home = home_of(failure.frames)
            out.extend("  " + line for f in failure.frames for line in f.format(home).splitlines())
            out.extend("  " + line for line in (_alike(failure.detail) if alike else failure.detail).splitlines())
        if self.partial:
            noun = "its value is" if len(self.partial) == 1 else "their values are"
            out.append(f"[{format_ranks(sorted(self.partial))}] finished: {noun} this error's .partial"
                       + (f" ({self.keeps})" if self.keeps else ""))
        if self.hint and hint:
            out.append(self.hint)
        return "\n".join(out)

    def summary_lines(self) -> list[str]:
        """One line per group: ``[1,3] ZeroDivisionError: division by zero``."""
        return [f"[{format_ranks(r)}] {self.failures[r[0]].headline}" for r, _ in self.groups]

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing our controller-side frames, which would only
        # show meshbook internals; the remote frames are what the user needs.
        return self.render().splitlines()

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemoteError, (self.failures, self.partial, self.hint))
