"""Meshes that outlive the kernel: ``keep=`` leases, ``%mesh list``, ``%mesh attach``, fencing.

Real kernels where the kernel's death is the point (SIGKILL, then a new kernel attaches);
the Python API where it is not (a controller that lets go of its mesh runs the same code as
a kernel exiting). Every kept mesh here is stopped, or its lease runs out, within its test.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import threading
import time

import psutil
import pytest
import torch
from jupyter_kernels import Kernel, wait_gone

import meshbook
from meshbook.mesh.controller.launch.kept import mesh_dir, parse_duration


def _mesh_file(mesh_id: str) -> str:
    return os.path.join(mesh_dir(), f"{mesh_id}.json")


@pytest.mark.parametrize("how", ["sigkill", "restart"])
def test_a_kept_mesh_survives_its_kernel_and_a_new_kernel_attaches_it(how: str) -> None:
    first, second, pids = Kernel(), None, []
    try:
        first.ok("import meshbook\n%load_ext meshbook\n%mesh start -n 2 --keep 10m")
        first.ok("%%mesh\nx = torch.full((2,), float(rank))\nmarker = f'rank {rank} kept'")
        mesh_id = first.value("meshbook.current().controller.lease.id")
        pids = first.mesh_pids()
        path = _mesh_file(mesh_id)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(mesh_dir()).st_mode) == 0o700
        if how == "sigkill":
            os.kill(first.pid, signal.SIGKILL)
            assert wait_gone([first.pid]) == []
            second = Kernel()
        else:
            first.manager.restart_kernel(now=False)  # the kernel exits cleanly (atexit runs)
            second = first
        assert all(psutil.pid_exists(p) for p in pids), "the kept agent and ranks died with the kernel"

        listed = second.ok("import meshbook\n%load_ext meshbook\n%mesh list").stream()
        assert "lease left" in listed and any(mesh_id in line and "localhost" in line
                                              for line in listed.splitlines()), listed
        assert second.value(f"[r.lease_left() > 0 for r in meshbook.list_meshes() if r.id == {mesh_id!r}]") == [True]
        refused = second.execute(f"%mesh stop {mesh_id}")  # not "no mesh named ... is running"
        assert refused.content["evalue"] == f"{mesh_id} is a kept mesh this kernel has not attached: " \
            f"%mesh attach {mesh_id}, then %mesh stop", refused.content
        attached = second.ok(f"%mesh attach {mesh_id}").stream()
        assert "attached" in attached and "2 ranks (world=2, cpu)" in attached, attached
        status = second.ok("%mesh status").stream()
        assert f"kept as {mesh_id}" in status, status
        # what the ranks' READY said, which the new kernel never heard: asked when it attached
        assert second.value("[(s.device, s.threads != '') for s in meshbook.current().status()]") == \
            [("cpu", True)] * 2
        out = second.ok("%%mesh --ordered\nprint(marker, x.sum().item())").stream()
        assert "rank 0 kept 0.0" in out and "rank 1 kept 2.0" in out, out
        assert sorted(second.value("[s.pid for s in meshbook.current().status()]")) == sorted(pids[1:])
        second.ok("%mesh stop")
        assert wait_gone(pids, 10.0) == []
        assert not os.path.exists(path), "the mesh file outlived the mesh"
    finally:
        for kernel in {first, second} - {None}:
            kernel.close()
        if pids and psutil.pid_exists(pids[0]):
            os.kill(pids[0], signal.SIGTERM)  # a failed test: end the kept agent it started
            wait_gone(pids, 10.0)


def _pushed_through_shared_memory(mesh: meshbook.Mesh) -> bool:
    """Did a big push reach every rank as a mapping of the notebook's memfd (not as frames)?"""
    mesh.push(big=torch.ones(1 << 20))
    mapped = mesh.run("any('meshbook-push' in line for line in open('/proc/self/maps'))").result()
    mesh.run("del big").result()
    return all(mapped.values())


def test_the_lease_running_out_ends_the_agent_and_ranks_and_leaves_nothing() -> None:
    mesh = meshbook.start(2, keep="3s")
    agent = mesh.controller.agents[0]
    pids = [agent.proc.pid, *(s.pid for s in mesh.status())]
    path, log = _mesh_file(mesh.controller.lease.id), agent.log
    assert dict(mesh.run("rank").result()) == {0: 0, 1: 1}
    mesh.controller.stop("this process lets go of it", detach=True)  # as when the kernel exits
    assert all(psutil.pid_exists(p) for p in pids)
    agent.proc.wait(60)  # the lease (3 s after the last ping it answered) ran out
    assert wait_gone(pids, 10.0) == []
    assert not os.path.exists(path) and not os.path.exists(log)
    assert all(r.id != os.path.basename(path)[:-5] for r in meshbook.list_meshes())


#: Paths whose os.utime hangs until released (an audit hook: a hung network home directory).
_HUNG: dict[str, threading.Event] = {}


def _hang_utime(event: str, args: tuple) -> None:
    if event == "os.utime" and args and args[0] in _HUNG:
        _HUNG[args[0]].wait(120)


def test_a_hung_home_directory_stalls_the_lease_renewal_only() -> None:
    sys.addaudithook(_hang_utime)  # for the rest of this process: it only waits on _HUNG's paths
    mesh = meshbook.start(2, keep="10m")
    path = _mesh_file(mesh.controller.lease.id)
    try:
        _HUNG[path] = threading.Event()
        time.sleep(3.0)  # pings were answered: a renewal is under way, and hangs
        before = os.stat(path).st_mtime
        for _ in range(3):  # the receiver, which hears the pings, hears the ranks too
            assert dict(mesh.run("rank").result(timeout=10)) == {0: 0, 1: 1}
        assert os.stat(path).st_mtime == before
        _HUNG.pop(path).set()
        deadline = time.monotonic() + 10
        while os.stat(path).st_mtime == before:  # the renewal goes on
            assert time.monotonic() < deadline, "the lease was not renewed once the file system answered"
            time.sleep(0.1)
    finally:
        event = _HUNG.pop(path, None)
        if event is not None:
            event.set()
        mesh.stop()


def test_the_actors_a_kernel_spawned_are_handles_in_the_kernel_that_attaches() -> None:
    """The actors live on in the kept ranks: attaching gives their handles back, to the same
    instances, so a kernel restart does not orphan them."""

    class Counter(meshbook.Actor):
        def __init__(self, start: int) -> None:
            self.n = start

        @meshbook.endpoint
        def bump(self) -> int:
            self.n += 1
            return self.n

    first = meshbook.start(2, keep="10m", name="spawner")
    second = None
    try:
        counter = first.spawn("counter", Counter, 10)
        assert dict(counter.bump.call().result()) == {0: 11, 1: 11}
        first.narrow([1]).spawn("solo", Counter, 0)
        second = meshbook.attach(first.controller.lease.id, name="adopter")
        adopted = second.actors()
        assert sorted(adopted) == ["counter", "solo"] and adopted["solo"].ranks == [1]
        assert dict(adopted["counter"].bump.call().result()) == {0: 12, 1: 12}  # the same instances
        with pytest.raises(meshbook.MeshError, match="an actor named 'counter' already lives on this mesh"):
            second.spawn("counter", Counter, 0)
        second.kill([1])
        second.restart([1])
        with pytest.raises(meshbook.MeshError, match="constructor's arguments stayed there: spawn it again"):
            adopted["solo"].respawn()
    finally:
        (second or first).stop()


def test_an_actor_that_lost_a_rank_before_the_attach_says_so_in_the_kernel_that_attaches() -> None:
    """Its rank 1 died while no kernel drove the mesh: the adopted handle said "ok" on rank 0
    alone, calls went to rank 0 only, and respawn() said it had lost no rank."""

    class Counter(meshbook.Actor):
        @meshbook.endpoint
        def one(self) -> int:
            return 1

    first = meshbook.start(2, keep="10m", name="loser")
    second = None
    try:
        first.spawn("counter", Counter)
        first.kill([1])
        second = meshbook.attach(first.kept_id, name="finder")
        counter = second.actors()["counter"]
        assert counter.ranks == [0, 1] and counter.failed == "rank(s) 1 lost it while no kernel was attached"
        with pytest.raises(meshbook.MeshError, match=r"actor 'counter' failed: rank\(s\) 1 lost it while no kernel "
                                                     r"was attached\. .* spawn it again under another name"):
            counter.one.call()
    finally:
        (second or first).stop()


def test_actors_this_kernel_cannot_read_do_not_fail_the_attach(tmp_path, capsys) -> None:
    """An actor class only the ranks can import (its module gone from this kernel): the mesh
    is attached all the same, and the kernel says which actors it has no handle for."""
    (tmp_path / "only_on_ranks.py").write_text(
        "import meshbook\n\nclass Kept(meshbook.Actor):\n    @meshbook.endpoint\n    def one(self):\n"
        "        return 1\n")
    sys.path.insert(0, str(tmp_path))
    first = meshbook.start(2, keep="10m", name="unreadable")
    second = None
    try:
        import only_on_ranks

        first.run(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})").result()
        first.spawn("kept", only_on_ranks.Kept)
        sys.path.remove(str(tmp_path))
        del sys.modules["only_on_ranks"]
        second = meshbook.attach(first.controller.lease.id, name="reader")
        assert second.actors() == {}
        assert "the actors living on rank(s) 0,1 have no handle in this kernel" in capsys.readouterr().err
        assert dict(second.run("kept.one()").result()) == {0: 1, 1: 1}  # they live on, as variables
    finally:
        if str(tmp_path) in sys.path:
            sys.path.remove(str(tmp_path))
        sys.modules.pop("only_on_ranks", None)
        (second or first).stop()


def test_a_run_of_the_kernel_before_keeps_its_ranks_busy_in_the_kernel_that_attaches(tmp_path) -> None:
    """The ranks still run what the kernel before sent: they show busy, and a run sent now
    says it waits behind that, not that it is stuck in the other run's code."""
    first = meshbook.start(2, keep="10m", name="before")
    second = None
    go = tmp_path / "go"
    try:
        first.run(f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)")
        second = meshbook.attach(first.controller.lease.id, name="after")
        assert [s.state for s in second.status()] == ["busy", "busy"]
        run = second.run("rank")
        assert second.controller.queued_behind(run) == {0: "a run the kernel before this one sent",
                                                        1: "a run the kernel before this one sent"}
        go.touch()
        assert dict(run.result(timeout=60)) == {0: 0, 1: 1}
        assert [s.state for s in second.status()] == ["idle", "idle"]
    finally:
        (second or first).stop()


def test_attaching_again_in_the_same_kernel_lets_the_first_handle_go() -> None:
    """(Another kernel attaching fences the first off: test_a_kernel_attached_over_is_told_so...)
    This one drives it already: its first handle lets go, with the name, and says which drives it."""
    first = meshbook.start(2, keep="10m", name="first")
    second = None
    try:
        first.run("x = 40 + rank").result()
        first.controller.kill([1])
        first.restart([1])  # generation 1: the agent's store, as a new kernel finds it
        first.run("x = 40 + rank", ranks=[1]).result()
        assert _pushed_through_shared_memory(first), "a kept mesh's ranks are on this machine"
        other = meshbook.start(1, name="other")
        try:  # a name taken by another mesh: refused before the first handle lets go
            with pytest.raises(meshbook.MeshError, match="a mesh named 'other' is already running"):
                meshbook.attach(first.controller.lease.id, name="other")
        finally:
            other.stop()
        assert dict(first.run("x").result()) == {0: 40, 1: 41}
        second = meshbook.attach(first.controller.lease.id, name="second")
        assert [(s.state, s.generation) for s in second.status()] == [("idle", 1)] * 2
        assert _pushed_through_shared_memory(second), "and still are, seen from the kernel that attached it"
        assert dict(second.run("t = torch.ones(1); dist.all_reduce(t); x + t.item()").result()) == {0: 42, 1: 43}
        mesh_id = first.controller.lease.id
        let_go = ("this kernel let go of the mesh, which runs on: it was attached again in this kernel, as "
                  "'second': meshbook.mesh_named('second') drives it")
        with pytest.raises(meshbook.MeshError) as info:  # not "the mesh is stopped ... start a new one"
            first.run("x")
        assert str(info.value) == let_go
        assert dict(second.run("x").result()) == {0: 40, 1: 41}, "the first handle stopped nothing"
        third = meshbook.attach(second.controller.lease.id)  # under its name again: 'first' is free
        assert third.name == "first" and second.stopped and list(meshbook.meshes()) == ["first"]
        assert dict(third.run("x").result()) == {0: 40, 1: 41}
        second = third
        third.stop()  # an attached mesh's agent is waited for, as a started one's is
        assert mesh_id not in [r.id for r in meshbook.list_meshes()], "stopped, yet listed as kept"
    finally:
        (second or first).stop()


def test_a_run_the_old_kernel_left_busy_keeps_its_number_to_itself(tmp_path) -> None:
    """Ranks tell requests apart by number. A kernel attaching a kept mesh numbers past the
    old kernel's requests: a run the old kernel left busy sends its output and result under
    its own number, which none of the new kernel's runs may take."""
    from meshbook.mesh.protocol.events import Output

    gate = tmp_path / "gate"
    first = meshbook.start(1, keep="10m", name="first")
    second = None
    try:
        for _ in range(3):
            first.run("pass").result()
        busy = first.run(f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)\n"
                         f"print('the old kernel asked for this')")
        first.controller.stop("this process lets go of it", detach=True)  # as when the kernel exits
        second = meshbook.attach(first.controller.lease.id, name="second")
        # Queued behind the busy run; counting from 1 again, one of them would share its number.
        runs = [second.run("print('new'); 7") for _ in range(busy.id + 2)]
        gate.touch()
        for run in runs:
            assert dict(run.result()) == {0: 7}
            texts = [e.text for e in run.events() if isinstance(e, Output)]
            assert texts == ["new\n"], texts
    finally:
        (second or first).stop()


def test_a_cell_the_old_kernel_sent_that_fails_is_step_checked(tmp_path) -> None:
    """A run of the kernel before fails on rank 1 after the new kernel attached, while rank 0
    waits in its all_reduce until the collective times out. The new kernel never sent it, yet
    its failure is checked like one of its own: the groups are re-created (the counts differ,
    and gloo's timeout broke them) and the new kernel's next collective is right."""
    gate = tmp_path / "gate"
    first = meshbook.start(2, keep="10m", name="first", collective_timeout=3)
    second = None
    try:
        first.run(f"import os, time\nif rank == 1:\n    while not os.path.exists({str(gate)!r}): time.sleep(0.05)\n"
                  f"    raise ValueError('the old kernel sent this')\nt = torch.ones(1)\ndist.all_reduce(t)")
        first.controller.stop("this process lets go of it", detach=True)  # as when the kernel exits
        second = meshbook.attach(first.controller.lease.id, name="second")
        gate.touch()
        deadline = time.monotonic() + 30
        # Rank 1's answer comes before its snapshot does: once this says it failed, the check it
        # started is ahead of anything sent now (without it, rank 1 held back the next cell).
        while "ValueError" not in second.diagnose().snapshots[1].last:
            assert time.monotonic() < deadline, "rank 1 never failed the old kernel's cell"
            time.sleep(0.1)
        check = "x = torch.tensor([10.0 * (rank + 1)]); dist.all_reduce(x); x.item()"
        assert dict(second.run(check).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}
    finally:
        (second or first).stop()


def test_what_a_kernel_sent_just_before_it_let_go_still_runs() -> None:
    """The kernel exits right after its last cells were sent, while the controller's receiver
    thread is busy (here: handing on a run's late output, as a loaded machine keeps it from
    running). The cells waited in the outbox it forwards, and the stop ended it first: the
    ranks never ran them. Now the kernel lets go once every agent took all it sent."""
    first = meshbook.start(2, keep="10m", name="first")
    second = None
    busy = threading.Event()

    def slow_hand_on(_: object) -> None:  # on the receiver thread
        busy.set()
        while not first.controller.stopped:
            time.sleep(0.01)
        time.sleep(0.2)

    try:
        late = first.run("import time; time.sleep(0.3); print('late')")
        late.on_late_output = slow_hand_on
        late.let_go()
        assert busy.wait(30)
        for i in range(1, 31):
            first.run(f"x = {i}")
        first.controller.stop("this process lets go of it", detach=True)  # as when the kernel exits
        second = meshbook.attach(first.controller.lease.id, name="second")
        assert dict(second.run("x").result(timeout=60, echo=False)) == {0: 30, 1: 30}
    finally:
        (second or first).stop()


def test_ranks_held_by_the_old_kernels_step_check_are_let_go(tmp_path) -> None:
    """The kernel exited while its step check held the ranks (rank 1 failed at once; rank 0
    reaches the check 3 s later): the verdict only it could give never came, and every cell of
    the kernel that attached waited behind the hold for ever. The attach lets the old check's
    holds go; the ranks hold back until a check of the new kernel's, which the first cell that
    does not run there starts."""
    first = meshbook.start(2, keep="10m", name="first")
    second = None
    try:
        failed = first.run("import time\nif rank == 1:\n    raise ValueError('x')\ntime.sleep(3)")
        deadline = time.monotonic() + 30
        while 1 not in failed.failed_ranks():
            assert time.monotonic() < deadline, "rank 1 never failed"
            time.sleep(0.02)
        first.controller.stop("this process lets go of it", detach=True)  # as when the kernel exits
        second = meshbook.attach(first.controller.lease.id, name="second")
        check = "x = torch.tensor([10.0 * (rank + 1)]); dist.all_reduce(x); x.item()"
        with pytest.raises(meshbook.RemoteError, match="was in a step check of the kernel before this one"):
            second.run(check).result(timeout=60, echo=False)
        assert dict(second.run(check).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}
    finally:
        (second or first).stop()


def test_keep_takes_durations_and_says_what_it_wants() -> None:
    assert parse_duration("8h") == 8 * 3600 and parse_duration("1h30m") == 5400 and parse_duration(90) == 90
    for bad in ("soon", "8x", "0", "-1"):
        with pytest.raises(meshbook.MeshError, match="keep="):
            parse_duration(bad)
    with pytest.raises(meshbook.MeshError, match="the ssh launcher cannot keep a mesh past its kernel"):
        meshbook.start(2, keep="1h", launcher=meshbook.SSH(["gpu1"]))
    with pytest.raises(meshbook.MeshError, match="%mesh list"):
        meshbook.attach("nosuchmesh")


def test_a_kernel_attached_over_is_told_so_in_its_next_cell() -> None:
    first, second = Kernel(), Kernel()
    agent = None
    try:
        first.ok("import meshbook\n%load_ext meshbook\n%mesh start -n 2 --keep 10m")
        first.ok("%%mesh\nx = rank")
        mesh_id = first.value("meshbook.current().controller.lease.id")
        agent = first.value("meshbook.current().controller.agents[0].proc.pid")
        second.ok(f"import meshbook\n%load_ext meshbook\n%mesh attach {mesh_id}")
        reply = first.execute("%%mesh\nx")
        assert reply.status == "error", reply.content
        assert "attached by another kernel" in reply.error_text + reply.stream("stderr"), reply.error_text
        assert f"%mesh attach {mesh_id}" in first.execute("%%mesh\nx").content["evalue"]
        assert "[1] 1" in str(second.ok("%%mesh\nx").of_type("execute_result"))
        second.ok("%mesh stop")
        assert wait_gone([agent], 10.0) == []
        # not "take it back here with %mesh attach": there is nothing left to attach
        assert "has ended since (stopped there, or its lease ran out)" in first.execute("%%mesh\nx").content["evalue"]
    finally:
        for kernel in (first, second):
            kernel.close()
        if agent is not None and psutil.pid_exists(agent):
            os.kill(agent, signal.SIGTERM)  # a failed test: end the kept agent it started
            wait_gone([agent], 10.0)


def test_two_kernels_attaching_at_the_same_instant_leave_one_driving() -> None:
    """Each attach takes its own epoch (under a lock on the mesh file), and the agent answers
    one controller per epoch: the other is fenced, and its cell says so."""
    mesh = meshbook.start(2, keep="10m")
    mesh_id, agent = mesh.controller.lease.id, mesh.controller.agents[0].proc.pid
    mesh.controller.stop("this process lets go of it", detach=True)
    kernels = [Kernel(), Kernel()]
    try:
        for kernel in kernels:
            kernel.ok("import meshbook\n%load_ext meshbook")
        sent = [kernel.submit(f"%mesh attach {mesh_id}") for kernel in kernels]
        attached = [kernel.wait(msg_id, at, timeout=90) for kernel, (msg_id, at) in zip(kernels, sent)]
        cells = [kernel.execute("%%mesh\nrank", timeout=60) for kernel in kernels]
        driving = [k for k, reply in zip(kernels, cells) if reply.status == "ok"]
        assert len(driving) == 1, [reply.error_text or reply.content.get("evalue") for reply in cells]
        loser = next(i for i, reply in enumerate(cells) if reply.status != "ok")
        said = " ".join(str(r.content.get("evalue", "")) + r.error_text for r in (attached[loser], cells[loser]))
        assert "attached by another kernel" in said, said
        assert "[1] 1" in str(driving[0].ok("%%mesh\nrank").of_type("execute_result"))
        driving[0].ok("%mesh stop")
        assert wait_gone([agent], 10.0) == []
    finally:
        for kernel in kernels:
            kernel.close()
        if psutil.pid_exists(agent):
            os.kill(agent, signal.SIGTERM)
            wait_gone([agent], 10.0)


def test_mesh_files_that_cannot_be_used_are_listed_with_why_and_kept(tmp_path, monkeypatch) -> None:
    """A broken mesh file is never taken for an ended mesh (only its agent knows), and says
    what is wrong with it; nor does a pid that is not running decide anything."""
    monkeypatch.setenv("HOME", str(tmp_path))
    directory = mesh_dir()
    assert directory == str(tmp_path / ".meshbook" / "meshes")
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    mesh = meshbook.start(2, keep="10m")
    try:
        good = mesh.controller.lease.id
        record = json.load(open(_mesh_file(good)))
        json.dump({**record, "hosts": [{**record["hosts"][0], "pid": 999999999}]}, open(_mesh_file(good), "w"))
        json.dump({**record, "id": "badpid", "hosts": [{**record["hosts"][0], "pid": "x"}]},
                  open(_mesh_file("badpid"), "w"))
        json.dump({**record, "id": "badkey", "key": "not hex"}, open(_mesh_file("badkey"), "w"))
        open(_mesh_file("cut"), "w").write(json.dumps(record)[:40])
        listed = {r.id: r for r in meshbook.list_meshes()}
        assert set(listed) == {good, "badpid", "badkey", "cut"}, "a file was dropped that only its agent may drop"
        assert not listed[good].problem, "a pid that is not running here decides nothing"
        shown = repr(meshbook.list_meshes())  # what a cell prints, and a saved notebook keeps
        assert f"id={good!r}" in shown and "ranks=2" in shown
        secrets = [record["key"], *record["server"].values(), *record["controller"].values()]
        assert not [s for s in secrets if s in shown], "the mesh's keys were printed"
        assert "pid 'x' is not a number" in listed["badpid"].problem
        assert "ValueError" in listed["badkey"].problem and "JSONDecodeError" in listed["cut"].problem
        for broken in ("badkey", "cut"):
            with pytest.raises(meshbook.MeshError, match=f"kept mesh {broken}: its file .* cannot be used"):
                meshbook.attach(broken)
        assert listed["cut"].row()["attached"].startswith("unusable: its file")
        with pytest.raises(meshbook.MeshError, match=rf"\(meshes that can be attached: {good}\)"):
            meshbook.attach("nosuch")  # not the files that cannot be
    finally:
        mesh.stop()
    assert not os.path.exists(_mesh_file(good))


def test_a_mesh_directory_someone_else_made_is_refused_before_anything_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".meshbook").mkdir()
    (tmp_path / ".meshbook" / "meshes").write_text("not a directory")
    before = {p.pid for p in psutil.process_iter()}
    with pytest.raises(meshbook.MeshError, match="is not a directory of yours"):
        meshbook.start(2, keep="10m")
    started = [p for p in psutil.process_iter()
               if p.pid not in before and "meshbook.mesh.agent" in " ".join(p.cmdline())]
    assert [p for p in started if "listen" in p.cmdline()] == [], "a refused start left an agent running"
