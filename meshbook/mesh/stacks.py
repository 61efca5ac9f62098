"""Where every rank is: stack snapshots, pending collectives, and one merged call tree.

A rank's control thread answers :func:`snapshot` while its main thread is busy (gloo and
NCCL release the GIL while they wait), so a rank stuck in a collective still reports its
Python stack and, from torch's Flight Recorder, the collectives it has enqueued but not
completed (operation, sequence number, process group, tensor sizes). A rank whose control
thread cannot answer (C code holding the GIL) is dumped by py-spy from its host agent instead.

:class:`Stacks` merges the snapshots into one call tree: ranks that share a frame are shown
once, with their rank list, and cell frames read ``cell line N`` with the cell's source::

    [0-3] cell line 8, in <module>
              train(steps=10)
    [0,2,3]   cell line 4, in train
                  dist.all_reduce(loss)
    [0,2,3]     torch/distributed/distributed_c10d.py:2950, in all_reduce
    [1]       cell line 3, in train
                  time.sleep(30)
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .cell import stack_frames
from .errors import Frame, format_ranks

if TYPE_CHECKING:
    from .worker import Worker


@dataclass(frozen=True)
class Collective:
    """A collective a rank has enqueued and not completed (from the Flight Recorder)."""

    op: str  # "all_reduce", "broadcast", ...
    seq: int  # sequence number within its process group
    group: str  # "default_pg", "mesh_tp", or a user group's name
    sizes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()

    @property
    def dim(self) -> str | None:
        """The mesh dimension of a DeviceMesh group (``"tp"`` for ``mesh_tp``)."""
        return self.group[5:] if self.group.startswith("mesh_") else None

    def describe(self) -> str:
        where = f" over {self.dim}" if self.dim else ("" if self.group == "default_pg" else f" in group {self.group}")
        shapes = ", ".join(f"{list(s)} {d.lower()}" for s, d in zip(self.sizes, self.dtypes))
        return f"{self.op} #{self.seq}{where}" + (f" ({shapes})" if shapes else "")


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
    last: str = ""  # how its last request ended, when idle ("stopped with KeyboardInterrupt at ...")

    @property
    def cell_frame(self) -> Frame | None:
        """The innermost frame in cell code (where the user's code is)."""
        return next((f for f in reversed(self.frames) if f.in_cell), None)

    def where(self) -> str:
        """``cell line 3 (time.sleep(30))`` — where this rank's own code is now."""
        frame = self.cell_frame or (self.frames[-1] if self.frames else None)
        if frame is None:
            return "somewhere outside Python" if self.busy else "idle"
        return frame.where + (f" ({frame.line})" if frame.line else "")


# -- rank side (runs on a rank's control thread) --------------------------------------------


def snapshot(worker: "Worker") -> RankSnapshot:
    busy = worker.request is not None
    frames = stack_frames(worker.main_frame()) if busy else ()
    busy_s = time.monotonic() - worker.started_at if busy else 0.0
    return RankSnapshot(worker.rank, busy, worker.request, busy_s, frames, pending_collectives(),
                        last="" if busy else worker.last_outcome)


def pending_collectives() -> tuple[Collective, ...]:
    """Collectives enqueued but not completed, per torch's Flight Recorder (cheap: ~1 ms)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    try:
        trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json())
    except Exception:
        return ()  # no Flight Recorder in this torch build, or no process group yet
    out = []
    for entry in trace.get("entries", []):
        if entry.get("retired") or entry.get("is_p2p"):
            continue
        group = entry.get("process_group", ["", ""])
        out.append(Collective(
            op=str(entry.get("profiling_name", "?")).split(":")[-1],
            seq=int(entry.get("collective_seq_id", 0)),
            group=group[1] if len(group) > 1 and group[1] else str(group[0]),
            sizes=tuple(tuple(s) for s in entry.get("input_sizes", [])),
            dtypes=tuple(entry.get("input_dtypes", []))))
    return tuple(out)


# -- controller side ------------------------------------------------------------------------


@dataclass
class _Node:
    frame: Frame | None
    ranks: set[int] = field(default_factory=set)
    children: dict[tuple[str, int, str], "_Node"] = field(default_factory=dict)


class Stacks:
    """Every rank's stack, merged into one call tree (``repr`` shows it)."""

    def __init__(self, snapshots: dict[int, RankSnapshot]) -> None:
        self.snapshots = snapshots

    def __getitem__(self, rank: int) -> RankSnapshot:
        return self.snapshots[rank]

    def render(self) -> str:
        root = _Node(None)
        lines: list[str] = []
        for rank, snap in sorted(self.snapshots.items()):
            if snap.frames:
                node = root
                for frame in snap.frames:
                    key = (frame.filename, frame.lineno, frame.name)
                    node = node.children.setdefault(key, _Node(frame))
                    node.ranks.add(rank)
        _render(root, 0, lines)
        idle = [r for r, s in sorted(self.snapshots.items()) if not s.busy and not s.dead]
        if idle:
            lines.append(f"[{format_ranks(idle)}] idle")
        for rank, snap in sorted(self.snapshots.items()):
            if snap.dead:
                lines.append(f"[{rank}] not running: {snap.dead}")
            elif snap.busy and not snap.frames:
                native = snap.native.strip() or "no Python frame (in C code, e.g. importing)"
                lines.append(f"[{rank}] busy, stack from outside the rank:")
                lines.extend("      " + line for line in native.splitlines())
            for collective in snap.pending:
                lines.append(f"[{rank}] waits in {collective.describe()}")
        return _merge_same_lines(lines)

    def __repr__(self) -> str:
        return self.render()


def _render(node: _Node, depth: int, lines: list[str]) -> None:
    for child in node.children.values():
        frame = child.frame
        assert frame is not None
        label = f"[{format_ranks(child.ranks)}]"
        indent = "  " * depth
        lines.append(f"{label} {indent}{frame.where}, in {frame.name}")
        if frame.line:
            lines.append(f"{' ' * len(label)} {indent}    {frame.line}")
        _render(child, depth + 1, lines)


def _merge_same_lines(lines: list[str]) -> str:
    """``[0] waits in X`` and ``[2] waits in X`` -> ``[0,2] waits in X`` (first place kept)."""
    merged: dict[str, list[int]] = {}
    order: list[str] = []
    for line in lines:
        if line.startswith("[") and "] waits in " in line:
            rank_text, rest = line[1:].split("] ", 1)
            if rest not in merged:
                merged[rest] = []
                order.append(rest)
            merged[rest].extend(int(r) for r in rank_text.split(","))
        else:
            order.append("\0" + line)
    return "\n".join(f"[{format_ranks(merged[o])}] {o}" if not o.startswith("\0") else o[1:]
                     for o in order)
