"""Stuck ranks: stacks, hang diagnosis, recovery, restart (Python API, real gloo meshes)."""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import cloudpickle
import pytest

import meshbook
from meshbook import MeshError, RemoteError

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors below travel by value

SKIP_ALL_REDUCE = ("import time\nt = torch.ones(8)\nif rank == 1:\n    time.sleep(60)\n"
                   "else:\n    dist.all_reduce(t)\nt.sum().item()")


@pytest.fixture(scope="module")
def mesh() -> Iterator[meshbook.Mesh]:
    with meshbook.start(dims={"dp": 2, "tp": 2}) as m:
        yield m


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.05)


def in_all_reduce(mesh: meshbook.Mesh, ranks: list[int]) -> bool:
    snaps = mesh.snapshots(ranks)
    return all(s.pending for s in snaps.values())


def test_diagnosis_names_the_rank_that_never_joined_and_its_line(mesh: meshbook.Mesh) -> None:
    mesh.run("keep = rank * 100").result()
    run = mesh.run(SKIP_ALL_REDUCE)
    wait_until(lambda: in_all_reduce(mesh, [0, 2, 3]))
    (verdict,) = mesh.diagnose().verdict
    assert re.fullmatch(
        r"ranks 0,2,3 wait in all_reduce #\d+ \(\[8\] float\) at cell line 6 \(dist\.all_reduce\(t\)\); "
        r"rank 1 never reached it: at cell line 4 \(time\.sleep\(60\)\)", verdict), verdict
    stacks = mesh.stacks().render()
    assert "[0,2,3] cell line 6, in <module>\n            dist.all_reduce(t)" in stacks
    # a slice by coordinates, as a cell selects: dp=0 is ranks 0 and 1
    assert sorted(mesh.snapshots(where={"dp": 0})) == [0, 1]
    assert "rank 1 never reached it" in " ".join(mesh.diagnose(where={"dp": 0}).verdict)
    assert "[1]" in stacks and "time.sleep(60)" in stacks and "torch/distributed/distributed_c10d.py" in stacks

    # interrupt: rank 1 stops (Python), 0,2,3 stay blocked in C; recovery frees them all
    run.interrupt()
    wait_until(lambda: 1 not in run.pending, 10)
    assert run.pending == [0, 2, 3]
    started = time.monotonic()
    recovery = mesh.recover()
    assert time.monotonic() - started < 10  # target < 3 s; generous on a loaded machine
    assert recovery.restarted == [] and recovery.kept == [0, 1, 2, 3]
    with pytest.raises(RemoteError) as info:
        run.result(timeout=10, echo=False)
    assert set(info.value.failures) == {0, 1, 2, 3}
    vals = mesh.run("t = torch.ones(1); dist.all_reduce(t); (keep, t.item())").result()
    assert dict(vals) == {r: (r * 100, 4.0) for r in range(4)}


def test_restarting_the_absent_rank_frees_the_others_with_their_variables(mesh: meshbook.Mesh) -> None:
    mesh.run("keep = rank * 100").result()
    run = mesh.run(SKIP_ALL_REDUCE)
    wait_until(lambda: in_all_reduce(mesh, [0, 2, 3]))
    recovery = mesh.restart([1])
    assert recovery.restarted == [1] and recovery.kept == [0, 2, 3]
    assert ("rank 1 restarted: its variables are lost. Run the cells that set it up again there "
            "(%%mesh --ranks 1, or ranks=[1] in mesh.run); a cell that calls collectives") in recovery.render()
    with pytest.raises(RemoteError) as info:
        run.result(timeout=10, echo=False)
    assert info.value.failures[1].died == "SIGKILL"
    # Told why before rank 1 was killed: its closed connections said only gloo's "Connection
    # closed by peer" on the ranks that waited for it, reported as merely interrupted.
    assert recovery.aborted == [0, 2, 3] and recovery.interrupted == []
    assert {info.value.failures[r].type_name for r in (0, 2, 3)} == {"CollectiveAborted"}
    vals = mesh.run("t = torch.ones(1); dist.all_reduce(t); (globals().get('keep'), t.item())").result()
    assert dict(vals) == {0: (0, 4.0), 1: (None, 4.0), 2: (200, 4.0), 3: (300, 4.0)}
    assert mesh.status()[1].lost_namespace and not mesh.status()[0].lost_namespace


def test_mismatched_collectives_are_freed_without_restarting_anyone(mesh: meshbook.Mesh) -> None:
    code = ("t = torch.ones(4)\nif rank < 2:\n    dist.all_reduce(t)\nelse:\n"
            "    dist.broadcast(t, src=2)\n'done'")
    run = mesh.run(code)
    wait_until(lambda: in_all_reduce(mesh, [0, 1, 2, 3]))
    verdict = " ".join(mesh.diagnose().verdict)
    assert "ranks 0,1 wait in all_reduce" in verdict and "ranks 2,3 wait in broadcast" in verdict
    assert "instead" in verdict
    recovery = mesh.recover()
    assert recovery.restarted == []
    run.wait(10)
    assert run.done()
    assert mesh.run("t = torch.ones(1); dist.all_reduce(t); t.item()").result().unique() == 4.0


def test_a_recovery_names_what_still_holds_the_old_groups() -> None:
    """As a step check that re-creates the groups does: the recovery said only that 'DDP and
    FSDP modules' must be re-created, and the next step failed with a per-rank 'Group <...> is
    not registered'. parallelize's step is told with what it made, to make again by it."""
    from functools import partial

    from bench import models
    from meshbook import Layout

    with meshbook.start(2) as mesh:
        mesh.run("net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))").result()
        mesh.parallelize(partial(models.mlp, dim=8, layers=2), Layout(dp_shard=2))
        run = mesh.run("import time\nt = torch.ones(8)\nif rank == 1:\n    time.sleep(60)\ndist.all_reduce(t)")
        wait_until(lambda: in_all_reduce(mesh, [0]))
        said = mesh.recover().render()
        assert said.endswith(
            "\n[0,1] bound to the old groups, re-create: net = DDP(net.module) (it broadcasts rank 0's weights); "
            "step, and the model and optimizer made with it, by mesh.parallelize(...) again (%mesh parallelize), "
            "which builds the three anew (load a checkpoint to keep the weights)"), said
        with pytest.raises(RemoteError):
            run.result(timeout=10, echo=False)


def test_stacks_of_a_rank_spinning_in_pure_python(mesh: meshbook.Mesh) -> None:
    run = mesh.run("import time\nend = time.time() + 60\nwhile time.time() < end:\n    pass", ranks=[2])
    wait_until(lambda: mesh.snapshots([2])[2].busy)
    snap = mesh.snapshots([2])[2]
    assert snap.user_frame is not None and snap.user_frame.in_cell and snap.user_frame.lineno in (3, 4)
    mesh.interrupt([2])
    with pytest.raises(RemoteError, match="KeyboardInterrupt"):
        run.result(timeout=10, echo=False)


def test_rank_holding_the_gil_in_c_is_dumped_from_outside(mesh: meshbook.Mesh) -> None:
    # PyDLL keeps the GIL during the call, so the rank's control thread cannot answer.
    run = mesh.run("import ctypes, time\ntime.sleep(0.2)\nctypes.PyDLL(None).sleep(4)", ranks=[3])
    time.sleep(0.8)
    snap = mesh.snapshots([3])[3]
    assert snap.busy and not snap.frames
    assert snap.native.strip()  # py-spy's dump, or the reason it could not take one
    assert "\x1b[" not in snap.native, "py-spy's colours came as raw escape codes"
    run.result(timeout=30, echo=False)


def test_restart_without_ranks_restarts_every_rank_of_the_view() -> None:
    """As %mesh restart does with no ranks (it raised a TypeError: ranks was required)."""
    with meshbook.start(2) as fresh:
        fresh.run("x = 1").result()
        assert fresh.restart().restarted == [0, 1]
        assert fresh.run("'x' in globals()").result().unique() is False


def test_dead_rank_is_shown_as_such_and_restart_brings_it_back(mesh: meshbook.Mesh) -> None:
    with pytest.raises(RemoteError, match="rank 2 died: SIGKILL"):
        mesh.run("import os\nos.kill(os.getpid(), 9)", ranks=[2]).result(timeout=30)
    assert mesh.snapshots([2])[2].dead == "SIGKILL"
    assert "[2] not running: SIGKILL" in mesh.stacks().render()
    # A collective on the live ranks, as the degraded mesh's error suggests: the default group
    # holds rank 2, so rank 0, left waiting (gloo tells only rank 2's neighbours), is freed and
    # told that rank 2 is dead. It was told the calls did not match, and that ranks 1 and 3,
    # which made the same call and failed it, computed something wrong from it.
    with pytest.raises(RemoteError) as info:
        mesh.run("t = torch.ones(1)\ndist.all_reduce(t)", ranks=[0, 1, 3]).result(timeout=60, echo=False)
    aborted = info.value.failures[0]
    assert aborted.type_name == "CollectiveAborted", aborted
    assert "rank 2 of its group is dead (SIGKILL), so it could never complete. Restart it with mesh.restart([2]) " \
           "(%mesh restart 2)" in aborted.message
    told = f"{info.value}\n{info.value.hint}"
    assert "do not match" not in told and "computed from it is wrong" not in told, told
    with pytest.raises(MeshError, match=r"rank 2 is dead \(SIGKILL\): its last exception died with it"):
        mesh.debug(2)
    recovery = mesh.restart([2])
    assert recovery.restarted == [2]
    assert mesh.run("rank").result()[2] == 2


def test_a_slice_waiting_for_a_dead_rank_is_freed_though_no_rank_of_it_finished() -> None:
    """Rank 0 alone in an all_reduce of the default group, rank 2 dead: no rank of the cell
    finishes (gloo tells only rank 2's neighbours; NCCL tells none), so nothing used to look,
    and it waited out the collective timeout. On a degraded mesh every run is looked at."""
    with meshbook.start(4) as degraded:
        with pytest.raises(RemoteError):
            degraded.run("import os\nos.kill(os.getpid(), 9)", ranks=[2]).result(timeout=30, echo=False)
        _, failures = failed_within(degraded, "t = torch.ones(1)\ndist.all_reduce(t)", 30, ranks=[0])
        assert failures[0].type_name == "CollectiveAborted", failures[0]
        assert "rank 2 of its group is dead (SIGKILL)" in failures[0].message, failures[0].message
        # Its group broke with that abort: the next collective fails at once with gloo's bare
        # "Connection closed by peer", and the error says which rank is the cause.
        with pytest.raises(RemoteError) as info:
            degraded.run("dist.all_reduce(t)", ranks=[0]).result(timeout=30, echo=False)
        assert "rank 2 is dead (SIGKILL): a collective over a group that holds it cannot complete. " \
               "mesh.restart([2]) (%mesh restart 2) brings it back" in info.value.hint, (info.value, info.value.hint)


def test_collective_timeout_fails_a_forgotten_hang_on_its_own() -> None:
    with meshbook.start(2, collective_timeout=3) as small:
        run = small.run("import time\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\n"
                        "else:\n    time.sleep(20)", ranks=[0, 1])
        deadline = time.monotonic() + 20
        while 0 in run.pending:
            assert time.monotonic() < deadline, "the hung collective never timed out"
            time.sleep(0.1)
        failure = run.exception().failures[0]  # type: ignore[union-attr]
        assert "Timed out" in failure.message or "timeout" in failure.message.lower()
        small.interrupt([1])
        run.wait(10)


def test_ranks_waiting_on_peers_that_finished_the_cell_are_freed_at_once(mesh: meshbook.Mesh) -> None:
    """Ranks 0,2,3 fail before the all_reduce rank 1 then waits in: it could only pair with a
    later cell's collective, or wait out the 300 s timeout (torchrun ends such a job in
    seconds). It is freed within a second or two, keeping its variables, and says why once."""
    mesh.run("kept = rank").result()
    run, failures = failed_within(mesh, "x = torch.ones(2)\nif rank != 1:\n    raise ValueError('boom')\n"
                                        "dist.all_reduce(x)", 10)
    assert {r: f.type_name for r, f in failures.items()} == {0: "ValueError", 1: "CollectiveAborted",
                                                            2: "ValueError", 3: "ValueError"}
    assert failures[1].message.startswith("meshbook aborted its all_reduce")
    assert "ranks 0,2,3 failed the cell without joining it" in failures[1].message
    report = run.step_report()
    assert "re-created the process groups" in report and report.count("re-created the process groups") == 1
    assert dict(mesh.run("kept").result()) == {0: 0, 1: 1, 2: 2, 3: 3}
    total = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result()
    assert set(total.values()) == {4.0}


def failed_within(mesh: meshbook.Mesh, code: str, seconds: float,
                  ranks: list[int] | None = None) -> tuple[meshbook.Run, dict[int, Any]]:
    """``code``'s run, which fails, and its failures by rank, once it ended within ``seconds``."""
    started = time.monotonic()
    run = mesh.run(code, ranks=ranks)
    with pytest.raises(RemoteError) as info:
        run.result(timeout=60, echo=False)
    assert time.monotonic() - started < seconds
    return run, info.value.failures


def test_a_rank_that_finished_cleanly_without_joining_frees_the_others(mesh: meshbook.Mesh) -> None:
    run = mesh.run("t = torch.ones(2)\nif rank != 1:\n    dist.all_reduce(t)\n'done'")
    with pytest.raises(RemoteError) as info:
        run.result(timeout=60, echo=False)
    failures = info.value.failures
    assert sorted(failures) == [0, 2, 3] and info.value.partial[1] == "done"
    assert all("rank 1 finished the cell without joining it" in f.message for f in failures.values())
    run.step_report()
    assert set(mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {4.0}


def test_a_rank_that_left_a_device_mesh_of_the_cell_s_own_frees_the_others(mesh: meshbook.Mesh) -> None:
    """The mesh has no dimensions; the cell lays out its own 2 x 2 DeviceMesh. Rank 3 finishes
    without the all_reduce over its own tp group: rank 2 is freed as fast as over the mesh's
    own groups (the group's members come from the rank, not from a dimension of the mesh)."""
    mesh.run("from torch.distributed.device_mesh import init_device_mesh\n"
             "own = init_device_mesh('cpu', (2, 2), mesh_dim_names=('rows', 'cols'))").result()
    run, failures = failed_within(mesh, "t = torch.ones(2)\nif rank != 3:\n"
                                        "    dist.all_reduce(t, group=own.get_group('cols'))\n'done'", 20)
    assert sorted(failures) == [2] and failures[2].type_name == "CollectiveAborted"
    assert "rank 3 finished the cell without joining it" in failures[2].message
    run.step_report()
    assert set(mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {4.0}


def test_a_ctrl_c_while_a_cell_is_sent_stops_it_on_every_rank_and_leaves_none_waiting(mesh: meshbook.Mesh) -> None:
    """The Ctrl-C lands while the cell is booked and sent (here: from a run listener, which
    submit calls then). Raised there, it left the cell sent to some ranks only, and those
    waited in its all_reduce for the others for good. It is held until every rank has the
    cell, then stops it everywhere."""
    import signal

    fired: list[int] = []

    def ctrl_c(run: meshbook.Run) -> None:
        if not fired:
            fired.append(run.id)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    mesh.controller.add_run_listener(ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            mesh.run("import time\ntime.sleep(0.5)\nt = torch.ones(1)\ndist.all_reduce(t)")
    finally:
        mesh.controller.remove_run_listener(ctrl_c)
    (stopped,) = [r for r in mesh.controller.book.runs.values() if r.id == fired[0]] or [None]
    if stopped is not None:  # still booked: it ends, interrupted on every rank it reached
        with pytest.raises(RemoteError):
            stopped.result(timeout=60, echo=False)
        stopped.step_report()
    total = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result(timeout=60, echo=False)
    assert set(total.values()) == {4.0}


def hint_until_timeout(mesh: meshbook.Mesh, run: meshbook.Run, capsys) -> str:
    """What following ``run`` for 8 s prints (hints after 2 s), as run.result() and cells do;
    the hint once."""
    from meshbook.mesh import EventRenderer, FollowOptions, follow

    with pytest.raises(meshbook.MeshTimeout):
        follow(run, mesh, EventRenderer(run), FollowOptions(timeout=8, stuck_hint=2.0))
    note = capsys.readouterr().err
    assert note.count("wait in a collective (for over") == 1, "the hint was repeated"
    return note


def test_ranks_waiting_in_a_send_or_recv_on_a_peer_that_finished_are_freed(mesh: meshbook.Mesh) -> None:
    """gloo's flight recorder leaves point-to-point operations out: a rank waiting for a
    pipeline stage that failed looked idle to the hang diagnosis, and waited out the 300 s
    collective timeout. Rank 0 waits on an ``irecv``'s work (as a pipeline schedule does),
    rank 2 in a blocking ``recv``: both are freed, each told which peer left and how."""
    run, failures = failed_within(mesh, "x = torch.ones(3)\nif rank == 0:\n    dist.irecv(x, 1).wait()\n"
                                        "elif rank == 1:\n    raise ValueError('stage failed')\n"
                                        "elif rank == 2:\n    dist.recv(x, 3)", 20)
    assert {r: f.type_name for r, f in failures.items()} == {0: "CollectiveAborted", 1: "ValueError",
                                                            2: "CollectiveAborted"}
    assert failures[0].message.startswith("meshbook aborted its recv #1 from rank 1 ([3] float): rank 1 failed "
                                          "the cell without joining it"), failures[0].message
    assert failures[2].message.startswith("meshbook aborted its recv #1 from rank 3 ([3] float): rank 3 "
                                          "finished the cell without joining it"), failures[2].message
    run.step_report()
    assert set(mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {4.0}


HAND_WRITTEN_PIPELINE = """from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

class Stage(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls, self.fail_at = torch.nn.Linear(16, 16), 0, None
    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError(f"stage {rank} got a bad micro-batch")
        return torch.relu(self.lin(x))

mod = Stage()
schedule = ScheduleGPipe(PipelineStage(mod, rank, world_size, torch.device("cpu")), n_microbatches=4,
                         loss_fn=lambda out, target: ((out - target) ** 2).mean())
"""


def test_a_hand_written_pipeline_whose_stage_fails_mid_step_frees_the_stages_after_it(mesh: meshbook.Mesh) -> None:
    """Stage 1 raises at its third micro-batch: stage 2 waits on the work of a receive from it
    while its own sends to stage 3 are open too. The diagnosis took the open send for what
    stage 2 waits in ("stage 3 is at the other end: it should complete"), and stages 2 and 3
    waited out the 300 s collective timeout. The headline names stage 1's own error."""
    mesh.run(HAND_WRITTEN_PIPELINE).result()
    step = ("mod.calls, mod.fail_at = 0, 3 if rank == 1 else None\nx = torch.ones(8, 16)\n"
            "schedule.step(x) if rank == 0 else schedule.step(target=x) if rank == 3 else schedule.step()")
    run, failures = failed_within(mesh, step, 20)
    assert sorted(failures) == [0, 1, 2, 3] and "stage 1 got a bad micro-batch" in failures[1].detail
    # Each stage is told that the schedule is spent (its next step failed, "Expecting 4 losses but got 5")
    assert all(f.detail.endswith("(for parallelize's step: mesh.parallelize(...) again)") for f in failures.values())
    assert str(run.exception()).startswith("4 ranks failed; first: [1] RuntimeError: [Stage 1] failed to run forward")
    run.step_report()
    assert set(mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {4.0}


def test_a_deadlock_is_freed_only_once_two_looks_found_it_alike() -> None:
    """The ranks' snapshots are taken a moment apart: rank 0 caught in all_reduce #5 and rank 1,
    snapped once #5 completed, in #6 seem to wait on each other. Under load that passed for a
    deadlock and an interrupted plan's measuring was aborted; a real one looks the same twice."""
    from types import SimpleNamespace

    from meshbook.mesh.controller.recovery.watch import confirmed_deadlock
    from meshbook.mesh.protocol.reports import Collective

    run = SimpleNamespace(deadlock_seen={})
    skewed = {0: Collective("all_reduce", 5, "default_pg"), 1: Collective("all_reduce", 6, "default_pg")}
    moved_on = {0: Collective("all_reduce", 7, "default_pg"), 1: Collective("all_reduce", 8, "default_pg")}
    assert confirmed_deadlock(run, skewed, {0, 1}) == set()  # first look: not yet
    assert confirmed_deadlock(run, moved_on, {0, 1}) == set()  # they went on: it was the skew
    assert confirmed_deadlock(run, moved_on, {0, 1}) == {0, 1}  # the same twice: a deadlock
    assert confirmed_deadlock(run, moved_on, set()) == set() and run.deadlock_seen == {}


def test_a_send_recv_deadlock_is_diagnosed_and_one_interrupt_frees_it(mesh: meshbook.Mesh, capsys) -> None:
    """Each rank receives from its neighbour first: no rank ever sends. The hint says it is a
    deadlock (it said a rank of the group had not joined), the diagnosis names each pair, and
    one interrupt ends it (gloo does not stop for an interrupt: before, it took a second one,
    a recovery)."""
    run = mesh.run("x = torch.ones(3)\ndist.recv(x, rank ^ 1)\ndist.send(x, rank ^ 1)")
    note = hint_until_timeout(mesh, run, capsys)
    assert ("ranks 0-3 wait in a collective (for over 2 s), each for another that waits too (a deadlock): none "
            "can go on, and only the collective timeout ends their calls") in note, note
    assert ("rank 0 waits in recv #1 from rank 1 ([3] float) at cell line 2 (dist.recv(x, rank ^ 1)); "
            "rank 1 waits in recv #1 from rank 0 ([3] float) instead") in note, note
    assert mesh.diagnose().deadlocked == [0, 1, 2, 3]
    run.interrupt()
    with pytest.raises(RemoteError) as info:
        run.result(timeout=60, echo=False)
    failures = info.value.failures
    assert {f.type_name for f in failures.values()} == {"CollectiveAborted"} and sorted(failures) == [0, 1, 2, 3]
    assert failures[3].message == ("interrupted: meshbook aborted its recv #1 from rank 2 ([3] float): rank 2 "
                                   "waits in recv #1 from rank 3 ([3] float), and would never join it")
    run.step_report()
    assert set(mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {4.0}


def test_a_send_and_its_recv_pair_in_the_diagnosis() -> None:
    """Ranks waiting at both ends of one point-to-point transfer are not told as missing each
    other; a receive from any rank has no known peer."""
    from meshbook.mesh.controller.insight.hangs import diagnose
    from meshbook.mesh.protocol.errors import Frame
    from meshbook.mesh.protocol.reports import Collective, RankSnapshot
    from meshbook.mesh.protocol.topology import Topology

    def waiting_in(rank: int, collective: Collective) -> RankSnapshot:
        return RankSnapshot(rank, True, 1, frames=(Frame("<cell 1>", 2, "<module>", "", in_cell=True),),
                            pending=(collective,))

    diagnosis = diagnose({0: waiting_in(0, Collective("send", 2, "default_pg", peer=1)),
                          1: waiting_in(1, Collective("recv", 2, "default_pg", peer=0)),
                          2: waiting_in(2, Collective("recv", 1, "default_pg"))}, Topology.create(3))
    assert diagnosis.verdict == [
        "rank 0 waits in send #2 to rank 1 at cell line 2; rank 1 is at the other end: it should complete",
        "rank 1 waits in recv #2 from rank 0 at cell line 2; rank 0 is at the other end: it should complete",
        "rank 2 waits in recv #1 from any rank at cell line 2 (it may take any rank's send)"]
    assert not diagnosis.blocked


def test_a_hang_is_explained_while_no_rank_has_finished(mesh: meshbook.Mesh, capsys) -> None:
    run = mesh.run(SKIP_ALL_REDUCE)  # rank 1 sleeps 60 s: no rank finishes for a minute
    note = hint_until_timeout(mesh, run, capsys)
    assert "ranks 0,2,3 wait in a collective (for over 2 s) while rank 1 is elsewhere." in note
    assert "rank 1 never reached it: at cell line 4 (time.sleep(60))" in note
    mesh.restart([1])
    assert run.done()


def test_a_slice_waiting_for_ranks_outside_it_is_explained(mesh: meshbook.Mesh, capsys) -> None:
    """Every rank of the run waits, so the heartbeats alone show no rank elsewhere: the
    diagnosis says who is missing, ranks outside the run."""
    run = mesh.run("dist.barrier()", ranks=[0, 1])
    note = hint_until_timeout(mesh, run, capsys)
    assert ("ranks 0,1 wait in a collective (for over 2 s) that a rank of its group has not joined: without it, "
            "only the collective timeout ends the call (Ctrl-C, or run.interrupt(), stops it).") in note
    assert "ranks 2,3 took no part in this cell (idle)" in note
    mesh.recover()
    with pytest.raises(RemoteError) as info:  # the recovery's reason, not gloo's "connection closed"
        run.result(echo=False)
    assert {f.type_name for f in info.value.failures.values()} == {"CollectiveAborted"}, info.value.failures
    assert info.value.failures[0].message == ("meshbook aborted the collective it waited in, to free the ranks "
                                              "(mesh.recover()); the process group was re-created")
    assert set(mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {4.0}


def test_a_run_waiting_behind_earlier_work_says_so_and_an_interrupt_drops_it_there(mesh: meshbook.Mesh,
                                                                                   capsys) -> None:
    """A run queued behind a slice's long run says what it waits for there (nothing else would
    say why it has not started), the cell status shows those ranks queued, and a Ctrl-C drops
    it there, explained as such: the earlier work runs on untouched."""
    import signal

    from meshbook.mesh import EventRenderer, FollowOptions, follow
    from meshbook.widgets.cell_status import rank_rows

    earlier = mesh.run("import time\ntime.sleep(6)\n'earlier'", ranks=[0, 1])
    run = mesh.run("rank")
    deadline = time.monotonic() + 30
    while len(run.values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    rows = rank_rows(mesh, run)
    assert [(r["state"], r["elapsed"], r["straggler"]) for r in rows[:2]] == [("queued", 0.0, False)] * 2, rows
    assert [r["state"] for r in rows[2:]] == ["done", "done"], rows
    ctrl_c = threading.Timer(1.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    ctrl_c.start()
    try:
        with pytest.raises(RemoteError) as info:
            follow(run, mesh, EventRenderer(run), FollowOptions(timeout=60, grace=1.0))
    finally:
        ctrl_c.cancel()
    note = capsys.readouterr().err
    assert ("rank(s) 0,1 still run run('import time'): run('rank') starts there once that ends "
            "(mesh.interrupt('0,1') stops it; run.interrupt() drops this run instead).") in note, note
    assert ("rank(s) 0,1 have not started run('rank'): they drop it once the work they run ends "
            "(mesh.interrupt('0,1') stops it).") in note, note
    assert "did not stop" not in note, "no rank is blocked: a second interrupt is not asked for"
    assert {r: f.type_name for r, f in info.value.failures.items()} == {0: "KeyboardInterrupt", 1: "KeyboardInterrupt"}
    assert dict(info.value.partial) == {2: 2, 3: 3}
    assert dict(earlier.result(echo=False)) == {0: "earlier", 1: "earlier"}


def test_a_queued_run_that_times_out_says_it_has_not_started_there(mesh: meshbook.Mesh) -> None:
    """Its timeout quoted the earlier work's line as if the run were at it."""
    earlier = mesh.run("import time\ntime.sleep(4)\n'earlier'", ranks=[0, 1])
    run = mesh.run("import time\ntime.sleep(5 if rank == 3 else 0)\nrank")
    with pytest.raises(meshbook.MeshTimeout) as info:
        run.result(timeout=1.5)
    text = str(info.value)
    assert text.startswith("run('import time') is still running on rank(s) 3 after 1.5 s. run('import time') has "
                           "not started on rank(s) 0,1 after 1.5 s: rank(s) 0,1 still run run('import time') "
                           "(mesh.interrupt('0,1') stops it). The ranks keep running as they are:"), text
    assert dict(earlier.result(echo=False)) == {0: "earlier", 1: "earlier"}
    assert dict(run.result(echo=False)) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_a_rank_that_ran_earlier_work_first_shows_the_time_it_ran_this_run(mesh: meshbook.Mesh) -> None:
    """Once a queued rank starts, its cell status counts from then (its heartbeat says when),
    not from when the run was sent: the time it waited would make it a straggler."""
    from meshbook.widgets.cell_status import rank_rows

    mesh.run("import time\ntime.sleep(3)", ranks=[0, 1])
    run = mesh.run("import time\ntime.sleep(1.0 if rank > 1 else 6)")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ranks 0,1 on this run for a second, by their heartbeats
        beats = {s.rank: s.metrics for s in mesh.status()}
        if all(beats[r].get("request") == run.id and beats[r].get("busy_s", 0) > 1.0 for r in (0, 1)):
            break
        time.sleep(0.1)
    rows = rank_rows(mesh, run)
    waited = time.monotonic() - run.submitted_at
    assert [r["state"] for r in rows] == ["running", "running", "done", "done"], rows
    assert all(r["elapsed"] < waited - 1.5 and not r["straggler"] for r in rows[:2]), (waited, rows)
    run.result(echo=False)


@pytest.mark.parametrize("interrupt_at", [None, 0.3])
def test_following_a_run_queued_behind_earlier_work_never_spins(mesh: meshbook.Mesh, capsys,
                                                                interrupt_at: float | None) -> None:
    """Waiting behind earlier work is no hang (its clock starts again) and an interrupt before
    the queued note is due says it instead: either way the wait sleeps, it does not spin
    (counted in the renderer's turns, a spin makes thousands)."""
    import signal

    from meshbook.mesh import EventRenderer, FollowOptions, follow

    class Counting(EventRenderer):
        turns = 0

        def feed(self, events: list[Any]) -> None:
            Counting.turns += 1
            super().feed(events)

    mesh.run("import time\ntime.sleep(5)", ranks=[0, 1])
    run = mesh.run("rank")
    if interrupt_at is not None:
        ctrl_c = threading.Timer(interrupt_at, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        ctrl_c.start()
    try:
        follow(run, mesh, Counting(run), FollowOptions(timeout=60, hang_hint=1.0, grace=1.0))
    except RemoteError:
        assert interrupt_at is not None
    note = capsys.readouterr().err
    assert Counting.turns < 200, f"{Counting.turns} turns in about 5 s"
    assert "after the others finished" not in note, note
    mesh.run("pass").result(echo=False)


def test_recover_interrupts_a_rank_running_python_where_it_killed_it(mesh: meshbook.Mesh) -> None:
    mesh.run("keep = rank").result()
    run = mesh.run("import time\nif rank == 1:\n    time.sleep(60)\nt = torch.ones(1)\ndist.all_reduce(t)")
    wait_until(lambda: all(mesh.snapshots([r])[r].pending for r in (0, 2, 3)))
    recovery = mesh.recover()
    assert (recovery.restarted, recovery.interrupted, recovery.aborted) == ([], [1], [0, 2, 3])
    assert "rank 1 was interrupted (no process restarted)." in recovery.render()
    with pytest.raises(RemoteError) as info:
        run.result(echo=False)
    assert info.value.failures[1].type_name == "KeyboardInterrupt"
    assert dict(mesh.run("keep").result()) == {0: 0, 1: 1, 2: 2, 3: 3}  # nobody lost a variable


def test_recover_leaves_a_group_whose_async_collective_a_peer_never_joined(mesh: meshbook.Mesh) -> None:
    """Ranks 0-2 issued an ``async_op`` all_reduce that rank 3 never joins, and sleep with it
    pending. Leaving that group must not wait for it: gloo's destroy waits for pending work until
    the collective timeout, while the ranks that joined the new group gave up on the slow one
    and the recovery re-forked it. Every rank keeps its variables; the pending work fails."""
    mesh.run("keep = rank").result()
    run = mesh.run("import time\nt = torch.ones(1)\nif rank != 3:\n    work = dist.all_reduce(t, async_op=True)\n"
                   "time.sleep(60)")
    wait_until(lambda: all(mesh.snapshots([r])[r].pending for r in (0, 1, 2)) and mesh.snapshots([3])[3].busy)
    recovery = mesh.recover()
    assert (recovery.restarted, recovery.interrupted, recovery.aborted) == ([], [3], [0, 1, 2]), recovery.render()
    with pytest.raises(RemoteError):
        run.result(echo=False)
    assert dict(mesh.run("keep").result()) == {0: 0, 1: 1, 2: 2, 3: 3}  # nobody lost a variable
    failed = mesh.run("try:\n    work.wait()\nexcept RuntimeError:\n    failed = True\nfailed", ranks=[0, 1, 2])
    assert dict(failed.result(echo=False)) == {0: True, 1: True, 2: True}
    total = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result(timeout=60, echo=False)
    assert set(total.values()) == {4.0}


def test_a_server_of_the_users_in_a_rank_keeps_its_clients_when_the_groups_are_re_created(mesh: meshbook.Mesh) -> None:
    """Only a rank with work pending on its old groups shuts down the connections on its
    listening ports as it leaves them (it cannot tell a group's from a server of the user's):
    a server on rank 0 serves on across the re-creation that a restart of rank 1 makes."""
    served = mesh.run("import socket\nserver = socket.create_server(('127.0.0.1', 0))\nserver.getsockname()[1]",
                      ranks=[0]).result(echo=False)
    with socket.create_connection(("127.0.0.1", dict(served)[0]), timeout=60) as client:
        mesh.run("conn, _ = server.accept()", ranks=[0]).result(echo=False)
        mesh.restart([1])
        mesh.run("conn.sendall(b'still here')\nconn.close()\nserver.close()", ranks=[0]).result(echo=False)
        assert client.recv(64) == b"still here"


def test_a_rank_slow_to_leave_its_interrupt_is_told_as_interrupted_not_aborted(mesh: meshbook.Mesh) -> None:
    """How a rank stopped is read from how its run ended, not from how soon it stopped: rank 1
    cleans up for 0.6 s after the Ctrl-C, longer than a recovery waits before it aborts the
    collectives of ranks still busy (its sockets are shut too, harmless in Python). It stopped
    on the interrupt all the same, and the others on the abort."""
    mesh.run("keep = rank").result()
    run = mesh.run("import time\nif rank == 1:\n    try:\n        time.sleep(60)\n    except KeyboardInterrupt:\n"
                   "        time.sleep(0.6)\n        raise\nt = torch.ones(1)\ndist.all_reduce(t)")
    wait_until(lambda: all(mesh.snapshots([r])[r].pending for r in (0, 2, 3)))
    recovery = mesh.recover()
    assert (recovery.restarted, recovery.interrupted, recovery.aborted) == ([], [1], [0, 2, 3]), recovery.render()
    with pytest.raises(RemoteError) as info:
        run.result(echo=False)
    assert {r: f.type_name for r, f in info.value.failures.items()} == {
        0: "CollectiveAborted", 1: "KeyboardInterrupt", 2: "CollectiveAborted", 3: "CollectiveAborted"}
    assert dict(mesh.run("keep").result()) == {0: 0, 1: 1, 2: 2, 3: 3}  # nobody lost a variable


def test_a_second_interrupt_stops_the_cleanup_of_the_first_and_keeps_the_variables(mesh: meshbook.Mesh,
                                                                                    tmp_path: Path) -> None:
    """A rank that catches the first Ctrl-C to save a checkpoint, for longer than the user
    waits: the second (recover) interrupts it again, and it takes 0.6 s more to leave (so the
    recovery shuts its sockets as well). It stopped on the interrupt, and is told so."""
    mesh.run("keep = rank").result()
    cleaning = tmp_path / "cleaning"
    run = mesh.run(f"import time, pathlib\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
                   f"    pathlib.Path({str(cleaning)!r}).touch()\n    t = time.time()\n    try:\n"
                   f"        while time.time() - t < 60:\n            pass\n    finally:\n"
                   f"        time.sleep(0.6)", ranks=[1])
    wait_until(lambda: mesh.snapshots([1])[1].busy)
    run.interrupt()
    wait_until(cleaning.exists)  # in the cleanup, in Python
    recovery = mesh.recover()
    assert (recovery.restarted, recovery.interrupted, recovery.aborted) == ([], [1], []), recovery.render()
    with pytest.raises(RemoteError) as info:
        run.result(echo=False)
    assert info.value.failures[1].type_name == "KeyboardInterrupt"
    assert dict(mesh.run("keep").result()) == {0: 0, 1: 1, 2: 2, 3: 3}  # nobody lost a variable


def test_waiting_on_stuck_ranks_after_explaining_does_not_spin(mesh: meshbook.Mesh) -> None:
    from meshbook.mesh import EventRenderer, FollowOptions, follow

    run = mesh.run(SKIP_ALL_REDUCE)  # rank 1 is busy elsewhere: nobody is freed on their own
    rescue = threading.Timer(3.0, mesh.restart, args=([1],))  # frees them after 3 s
    rescue.start()
    before = time.thread_time()  # CPU of this (the rendering) thread only
    with pytest.raises(RemoteError):
        follow(run, mesh, EventRenderer(run), FollowOptions(hang_hint=0.5))
    assert time.thread_time() - before < 1.0, "the render loop spun while it waited"
    rescue.join()  # the restart re-creates the process group after the cell ended: let it finish


def test_a_request_sent_while_a_rank_is_re_forked_reaches_the_new_process(mesh: meshbook.Mesh,
                                                                          monkeypatch) -> None:
    controller = mesh.controller
    old_pid = mesh.run("import os\nos.getpid()", ranks=[3]).result()[3]
    mesh.kill([3])
    respawn, early = controller.respawn, []

    def respawn_then_ask(*args, **kwargs) -> None:  # asks before the new process can listen
        respawn(*args, **kwargs)
        early.append(mesh.run("import os\nos.getpid()", ranks=[3]))

    monkeypatch.setattr(controller, "respawn", respawn_then_ask)
    mesh.restart([3])
    new_pid = early[0].result(timeout=60)[3]
    assert new_pid != old_pid and new_pid == controller.ranks[3].pid


SCRIPT = '''
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, even where the
import meshbook                                          # test runs with SIGINT ignored (a background job)
mesh = meshbook.start(4)
run = mesh.run(CODE)
print("submitted", flush=True)
try:
    run.result()
except meshbook.RemoteError as error:
    print("FAILED\\n" + str(error), flush=True)
print("next:", sorted(mesh.run("t = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()").result().values()), flush=True)
mesh.stop()
'''


def test_run_result_in_a_script_explains_the_hang_and_escalates_interrupts_as_a_cell_does() -> None:
    """A script's ``run.result()`` is followed like a ``%%mesh`` cell: the hang is explained on
    its own, a first Ctrl-C that cannot stop a rank is explained, a second frees the ranks."""
    import os
    import signal
    import subprocess
    import sys

    code = SKIP_ALL_REDUCE.replace("    time.sleep(60)", "    import signal\n    signal.pthread_sigmask("
                                   "signal.SIG_BLOCK, [signal.SIGINT])\n    time.sleep(60)")  # ignores a SIGINT
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = subprocess.Popen([sys.executable, "-c", f"CODE = {code!r}\n{SCRIPT}"], cwd=root, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(script.stderr.readline, "")), daemon=True)
    reader.start()

    def wait_for(text: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while text not in "".join(err):
            assert time.monotonic() < deadline and script.poll() is None, f"never said {text!r}: {''.join(err)}"
            time.sleep(0.1)

    try:
        wait_for("rank 1 never reached it: at cell line 6 (time.sleep(60))", 90)  # the hint, unasked
        script.send_signal(signal.SIGINT)  # rank 1 blocks SIGINT: it cannot stop
        wait_for("did not stop within 3 s of the interrupt", 30)
        assert "Interrupt again to free them" in "".join(err)
        script.send_signal(signal.SIGINT)
        out, _ = script.communicate(timeout=120)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == 0, "".join(err)
    assert "FAILED" in out and "rank 1 restarted: its variables are lost" in out, out
    assert "ranks 0,2,3 kept their variables" in out, out
    assert "next: [4.0, 4.0, 4.0, 4.0]" in out, "the mesh is usable again"


class Reducer(meshbook.Actor):
    @meshbook.endpoint
    def reduce(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)


class Caller(meshbook.Actor):
    @meshbook.endpoint
    def fire(self, target: Any) -> str:
        target.slice(rank=0).reduce.call_one()  # not waited for
        return "sent"


def test_recovery_frees_a_rank_stuck_in_an_endpoint_another_ranks_actor_called() -> None:
    """Rank 0 of mesh b hangs in an all_reduce of an endpoint that an actor on mesh a called:
    no book of b's controller has that call, yet recover() asks the ranks what they run, and
    aborts the collective (it saw rank 0 idle, never aborted it, and timed out)."""
    with meshbook.start(1, name="caller") as a, meshbook.start(2, name="target") as b:
        target = b.spawn("target", Reducer)
        assert a.spawn("caller", Caller).fire.call_one(target).result(timeout=60) == "sent"
        wait_until(lambda: b.snapshots([0])[0].pending)  # rank 0 waits in its all_reduce
        recovery = b.recover(timeout=30)
        assert recovery.restarted == [] and recovery.aborted == [0]
        assert dict(target.reduce.call().result(timeout=60)) == {0: 2.0, 1: 2.0}
