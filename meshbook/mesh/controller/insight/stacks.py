"""Where every rank is: stack snapshots, pending collectives, and one merged call tree.

A rank's control thread answers :func:`~meshbook.mesh.rank.ops.snapshot` while its main thread is busy (gloo and
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

from dataclasses import dataclass, field

from ...protocol.errors import Frame
from ...protocol.reports import RankSnapshot
from ...protocol.text import format_ranks


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
            if snap.frames and not snap.doing:  # meshbook's own work is said in one line below
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
            elif snap.doing:
                lines.append(f"[{rank}] in {snap.where()}")
            elif snap.busy and not snap.frames:
                native = snap.native.strip() or "no Python frame (in C code, e.g. importing)"
                lines.append(f"[{rank}] busy, stack from outside the rank:")
                lines.extend("      " + line for line in native.splitlines())
            for collective in snap.pending:
                lines.append(f"[{rank}] waits in {collective.describe()}")
        return _merge_same_lines(lines)

    def __repr__(self) -> str:
        return self.render()


def _render(node: _Node, depth: int, lines: list[str], home: str | None = None) -> None:
    """``home``: the cell the ranks run (the outermost frame in cell code above)."""
    for child in node.children.values():
        frame = child.frame
        assert frame is not None
        label = f"[{format_ranks(child.ranks)}]"
        indent = "  " * depth
        ran = home if home is not None or not frame.in_cell else frame.filename
        lines.append(f"{label} {indent}{frame.place(ran)}, in {frame.name}")
        if frame.line:
            lines.append(f"{' ' * len(label)} {indent}    {frame.line}")
        _render(child, depth + 1, lines, ran)


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
