"""Live debugging on :class:`~meshbook.Mesh`: stacks, hang diagnosis, kill, restart, recover.

A mixin, so these read as ``mesh.stacks()``, ``mesh.diagnose()``, ``mesh.restart([1])``; the
work is done by :mod:`.stacks`, :mod:`.hangs`, :mod:`.recovery` and, on the ranks,
:mod:`meshbook.mesh.rank.ops`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Mapping, Sequence

from ...protocol import messages as msg
from ...protocol.cell import is_internal
from ...protocol.errors import MeshError
from ...protocol.reports import RankSnapshot
from ...protocol.text import format_ranks, restart_hint
from ...protocol.topology import DimSelector, Topology
from ...rank import ops
from ..core.controller import Controller
from ..core.run import Run
from ..insight.hangs import Diagnosis, diagnose
from ..insight.stacks import Stacks
from ..recovery.ladder import Recovery, recover

#: How long a rank's control thread gets to answer before py-spy dumps it from outside.
STACKS_TIMEOUT_S = 1.0

class DebugOps:
    """Debugging operations of a mesh view (mixed into :class:`~meshbook.Mesh`)."""

    controller: Controller

    if TYPE_CHECKING:  # the view's own (see .view.MeshView)
        @property
        def topology(self) -> Topology: ...

        def select(self, ranks: Sequence[int] | str | int | None = None,
                   where: Mapping[str, DimSelector] | None = None) -> list[int]: ...

    def snapshots(self, ranks: Sequence[int] | str | int | None = None, *,
                  where: Mapping[str, DimSelector] | None = None,
                  timeout: float = STACKS_TIMEOUT_S) -> dict[int, RankSnapshot]:
        """Each selected rank's stack and pending collectives, taken while it is busy."""
        ctl = self.controller
        chosen = self.select(ranks, where)
        out = {r: RankSnapshot(r, False, dead=ctl.ranks[r].cause or "dead") for r in ctl.dead(chosen)}
        live = [r for r in chosen if r not in out]
        if live:
            asked = ctl.call(ops.snapshot, ranks=live, what="stacks")
            asked.wait(timeout)
            # a rank busy with meshbook's own work (a step check) is in no code of yours: say what
            out.update({r: replace(s, doing=ctl.own_work(s.request)) if s.busy else s
                        for r, s in asked.values().items()})
            silent = [r for r in live if r not in out]
            if silent:  # the control thread cannot run (GIL held in C): dump from outside
                native = ctl.agent_op(msg.AgentOp.PYSPY, silent)
                assert native is not None
                native.wait(15)
                for rank in silent:
                    dump = str(native.values().get(rank, "no answer from py-spy"))
                    out[rank] = RankSnapshot(rank, True, native=_main_thread(dump))
        return dict(sorted(out.items()))

    def stacks(self, ranks: Sequence[int] | str | int | None = None, *,
               where: Mapping[str, DimSelector] | None = None) -> Stacks:
        """Every selected rank's Python stack, merged into one call tree."""
        return Stacks(self.snapshots(ranks, where=where))

    def diagnose(self, ranks: Sequence[int] | str | int | None = None, *,
                 where: Mapping[str, DimSelector] | None = None) -> Diagnosis:
        """Which ranks wait in which collective, who they wait for, and where the others are."""
        return diagnose(self.snapshots(ranks, where=where), self.topology, self.controller.nouns())

    def kill(self, ranks: Sequence[int] | str | int) -> None:
        """SIGKILL ranks (their variables are lost); ``restart`` brings them back. The dead
        among them are skipped; a :class:`MeshError` if every one is dead."""
        self.controller.kill(self.living(ranks, "kill"))

    def living(self, ranks: Sequence[int] | str | int | None, what: str) -> list[int]:
        """The live ranks of a selection to ``what`` (interrupt, kill); a :class:`MeshError`
        that says how to bring them back if every one is dead."""
        chosen = self.select(ranks)
        live = self.controller.live(chosen)
        if not live:
            text = format_ranks(chosen)
            raise MeshError(f"rank(s) {text} are dead: nothing to {what}; {restart_hint(chosen)} brings them back")
        return live

    def restart(self, ranks: Sequence[int] | str | int | None = None, timeout: float = 120.0,
                on: str | None = None) -> Recovery:
        """Re-fork ``ranks`` (by default every rank of this view: fresh namespaces) under the
        same rank ids and re-create the process group on all ranks; every other rank keeps its
        variables. Frees ranks stuck waiting for them.

        Ranks of a lost host get a new agent on that host, or on host ``on`` (ssh launcher)."""
        chosen = self.select(ranks)
        if on is not None:
            self.controller.agents.move(chosen, on)
        return recover(self.controller, chosen, timeout, f"mesh.restart() of rank(s) {format_ranks(chosen)}")

    def recover(self, timeout: float = 120.0) -> Recovery:
        """Free every stuck rank, restarting as few as possible (usually none), and
        re-create the process group on all ranks. See :mod:`meshbook.mesh.controller.recovery.ladder`."""
        return recover(self.controller, self.controller.dead(), timeout)

    def debug(self, rank: int) -> Run:
        """Post-mortem pdb on ``rank``'s last exception; prompts are answered by whoever
        renders the run (``result()`` asks on this process's stdin)."""
        (chosen,) = self.select([rank])
        if self.controller.dead([chosen]):  # not the mesh's advice to restart it: that brings no exception back
            raise MeshError(f"rank {chosen} is dead ({self.controller.ranks[chosen].cause or 'dead'}): its last "
                            f"exception died with it, and there is nothing to debug. {restart_hint([chosen])} "
                            f"brings the rank back, without its variables")
        return self.controller.call(ops.post_mortem, ranks=[chosen], what=f"post-mortem of rank {rank}",
                                    stdin=self.controller.stdin_probe())


def _main_thread(dump: str) -> str:
    """The main thread's frames from a py-spy dump, down to the user's code (the rank's own
    machinery below it says nothing useful)."""
    lines = dump.splitlines()
    start = next((i for i, line in enumerate(lines) if '"MainThread"' in line), None)
    if start is None:
        return dump
    out = [lines[start]]
    for line in lines[start + 1:]:
        if line.startswith("Thread ") or is_internal(_dumped_file(line)):
            break
        out.append(line)
    return "\n".join(out)


def _dumped_file(line: str) -> str:
    """The file of a py-spy frame line, ``    serve (meshbook/mesh/rank/worker.py:180)``."""
    return line.rpartition("(")[2].rpartition(":")[0]
