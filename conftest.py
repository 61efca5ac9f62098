"""Every test run proves that no meshbook process outlives it (tests and notebooks alike).

After each test: no mesh the test started is still running, and no host agent or rank
outlived its controller. After the session (nbval's kernels included): none at all. Each
check looks at the processes of its own run and worker: they inherit ``MESHBOOK_TEST_RUN``
(set here, once per pytest run) and ``PYTEST_XDIST_WORKER`` (``./dev test`` runs two workers;
CI runs the hosts and browser groups side by side), so a kept mesh between kernels in another
run or worker is none of this one's business. A process that carries neither counts as ours.

Ctrl-C raises KeyboardInterrupt in the test process whoever started it: a shell without job
control starts a background command with SIGINT ignored, and the tests that press Ctrl-C
would then wait for an interrupt that never comes.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Iterator

import psutil
import pytest

from meshbook.mesh.controller.api import planners
from meshbook.mesh.controller.core.controller import live_controllers
from meshbook.mesh.controller.launch import base, local


def pytest_configure(config: pytest.Config) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)


RUN = os.environ.setdefault("MESHBOOK_TEST_RUN", uuid.uuid4().hex)  # xdist's workers inherit it
WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def meshbook_processes() -> list[psutil.Process]:
    """Host agents and ranks (ranks are forks of an agent, so they share its command line), and
    planner zygotes and their planners (forks of a zygote); this worker's, under pytest-xdist."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if {base.AGENT_MODULE, planners.PLANNER_MODULE} & set(proc.info["cmdline"] or []) and _ours(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _ours(proc: psutil.Process) -> bool:
    """Started by this run's tests, under this worker (untagged or unreadable: counted, so
    that nothing is let off)."""
    try:
        env = proc.environ()
    except psutil.AccessDenied:
        return True
    return env.get("MESHBOOK_TEST_RUN", RUN) == RUN and env.get("PYTEST_XDIST_WORKER", WORKER) == WORKER


def orphans(timeout: float = 10.0) -> list[str]:
    """Meshbook processes whose controller (or agent) is gone, after ``timeout`` to exit.

    An agent's parent is its controller (this test process, or a kernel a test started); a
    rank's parent is its agent. When that parent dies the process is re-parented to init (or
    a subreaper): that is an orphan, the bug this check exists for.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for proc in meshbook_processes():
            try:
                parent = proc.parent()
                if parent is None or parent.pid == 1 or parent.status() == psutil.STATUS_ZOMBIE \
                        or parent.pid != _expected_parent(proc, parent):
                    found.append(f"{proc.pid} (parent {parent.pid if parent else None}): "
                                 f"{' '.join(proc.cmdline())}")
            except psutil.Error:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _expected_parent(proc: psutil.Process, parent: psutil.Process) -> int:
    """An agent started with ``--parent PID`` belongs to that controller; a rank (a fork of an
    agent, same command line) belongs to its agent, a planner to its zygote."""
    cmdline = proc.cmdline()
    if parent.cmdline() == cmdline:
        return parent.pid  # a rank under its agent, a planner under its zygote
    if "--parent" in cmdline:
        return int(cmdline[cmdline.index("--parent") + 1])
    return parent.pid  # started off the main thread: any live, non-init parent will do


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    meshes_before = {id(c) for c in live_controllers() if not c.stopped}
    yield
    leaked = [c for c in live_controllers() if not c.stopped and id(c) not in meshes_before]
    for ctl in leaked:
        ctl.stop("leaked by a test")
    assert not leaked, "the test left a mesh running; stop it (mesh.stop() or `with`)"
    left = orphans()
    assert not left, f"meshbook processes outlived their controller: {left}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for ctl in live_controllers():
        ctl.stop("test session over")
    local.discard_standby()
    planners.discard_zygote()
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    left = [p for p in meshbook_processes() if p.pid in mine or _ppid(p) == 1]
    gone, alive = psutil.wait_procs(left, timeout=10)
    orphaned = orphans(timeout=0)
    if alive or orphaned:
        session.exitstatus = 1
        print(f"\nFAILED: meshbook processes outlived the test run: "
              f"{[p.pid for p in alive] + orphaned}")


def _ppid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None
