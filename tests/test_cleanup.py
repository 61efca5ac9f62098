"""Nothing a mesh started outlives it: not what its ranks start, however it detaches, and
not its files, however its kernel ends (real kernels through jupyter_client)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from jupyter_kernels import Kernel, wait_gone

import meshbook

#: On every rank: a plain child, a child in its own session, and a double-forked daemon in its
#: own session (its parent exits at once); their pids are the cell's `kids`.
DETACHING_CELL = """%%mesh
import os, subprocess
kids = [subprocess.Popen(["sleep", "300"]).pid,
        subprocess.Popen(["sleep", "300"], start_new_session=True).pid]
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.execvp("sleep", ["sleep", "300"])
    os.write(w, str(daemon).encode())
    os._exit(0)
kids.append(int(os.read(r, 20)))
"""


def files_gone(paths: list[str], timeout: float = 5.0) -> list[str]:
    """The paths still there after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in paths if os.path.exists(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["stop", "shutdown", "sigkill"])
def test_whatever_the_ranks_started_and_the_mesh_files_go_with_the_kernel(how: str) -> None:
    k = Kernel()
    try:
        k.ok("import meshbook\n%load_ext meshbook\n%mesh start -n 2")
        k.ok(DETACHING_CELL)
        kids = k.value("sorted(p for v in meshbook.current().pull('kids').values() for p in v)")
        assert len(kids) == 6 and wait_gone(kids, 0.5) == kids, "the sleeps are running"
        pids = k.mesh_pids()
        files = k.value("[meshbook.current().controller.rundir, *meshbook.current().controller.agents[0].logs]")
        assert os.path.isdir(files[0]) and os.path.isfile(files[1]), files
        started = time.monotonic()
        if how == "stop":
            k.ok("%mesh stop")
        elif how == "shutdown":
            k.manager.shutdown_kernel(now=False)
        else:
            os.kill(k.pid, signal.SIGKILL)
        assert wait_gone(kids + pids, 5.0) == [], f"outlived the {how}"
        assert files_gone(files, 5.0) == [], f"left behind by the {how}"
        assert time.monotonic() - started < 30  # generous: the point is that it happens at all
    finally:
        k.close()


def test_an_agent_that_dies_under_a_live_controller_is_explained_from_its_log() -> None:
    """The agent's log moved into the runtime directory; the controller still reads it. The
    mesh then stops for good on its own: its directory goes, and supervisors hear it."""
    class Pinger(meshbook.Actor):  # defined here: it travels to the ranks by value
        @meshbook.endpoint
        def ping(self) -> int:
            return 1

    mesh = meshbook.start(2)
    agent = mesh.controller.agents[0]
    heard: list[meshbook.SupervisionEvent] = []
    mesh.spawn("pinger", Pinger, supervisor=heard.append)
    try:
        assert agent.logs[0].startswith(mesh.controller.rundir) and not os.path.exists(agent.logs[1])
        with open(f"/proc/{agent.proc.pid}/fd/2", "a") as log:
            log.write("the agent's last words\n")
        running = mesh.run("import time\ntime.sleep(30)")
        os.kill(agent.proc.pid, signal.SIGKILL)
        with pytest.raises(meshbook.RemoteError) as info:
            running.result(timeout=30, echo=False)
        assert "ranks 0,1 died (host agent 0 died (killed by SIGKILL" in info.value.hint
        assert ("and the mesh with them: nothing is left to fork them again. %mesh restart (no ranks) starts "
                "the mesh again as it was started") in info.value.hint, info.value.hint  # not "restart 0,1"
        deadline = time.monotonic() + 10
        while (os.path.exists(mesh.controller.rundir) or not any(e.rank is None for e in heard)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "killed by SIGKILL; its log ends with:\nthe agent's last words" in mesh.controller.stop_reason
        assert not os.path.exists(mesh.controller.rundir), "the ended mesh was not stopped"
        assert [str(e) for e in heard if e.rank is None] == [
            f"actor 'pinger' on mesh '{mesh.name}' failed: its mesh stopped ({mesh.controller.stop_reason})"]
    finally:
        mesh.stop()
