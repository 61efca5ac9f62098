"""Shared fixtures. Every test is followed by a check that it left no meshbook process."""

from __future__ import annotations

import os
import time
from typing import Iterator

import psutil
import pytest

import meshbook
from meshbook.mesh import controller as controller_module
from meshbook.mesh import launchers


def meshbook_processes() -> list[psutil.Process]:
    """Host agents and ranks (ranks are forks of an agent, so they share its command line)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if "meshbook.mesh.agent" in (proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def owned_pids() -> set[int]:
    """Processes of meshes that are still meant to be running (module fixtures, standby)."""
    pids: set[int] = set()
    for ctl in list(controller_module._LIVE):
        if ctl.stopped:
            continue
        pids.update(a.proc.pid for a in ctl.agents if hasattr(a, "proc"))
        pids.update(s.pid for s in ctl.ranks.values() if s.pid)
    standby = launchers._standby
    if standby is not None:
        pids.add(standby.proc.pid)
    return pids


def leftovers(timeout: float = 10.0) -> list[str]:
    """Meshbook processes not owned by a live mesh, after giving them ``timeout`` to exit."""
    deadline = time.monotonic() + timeout
    while True:
        owned = owned_pids()
        left = [p for p in meshbook_processes() if p.pid not in owned and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return [f"{p.pid}: {' '.join(p.cmdline())}" for p in left if p.is_running()]
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def no_orphans() -> Iterator[None]:
    yield
    left = leftovers()
    assert not left, f"meshbook processes outlived the test: {left}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for ctl in list(controller_module._LIVE):
        ctl.stop("test session over")
    launchers.discard_standby()
    left = [p for p in meshbook_processes() if p.pid != os.getpid()]
    gone, alive = psutil.wait_procs(left, timeout=10)
    if alive:
        session.exitstatus = 1
        print(f"\nFAILED: meshbook processes outlived the test run: {[p.pid for p in alive]}")


@pytest.fixture(scope="module")
def mesh4() -> Iterator[meshbook.Mesh]:
    """A 4-rank (dp=2, tp=2) gloo mesh shared by a module's tests."""
    mesh = meshbook.start(dims={"dp": 2, "tp": 2})
    yield mesh
    mesh.stop()


@pytest.fixture
def mesh2() -> Iterator[meshbook.Mesh]:
    """A fresh 2-rank mesh for a test that may break it."""
    mesh = meshbook.start(2)
    yield mesh
    mesh.stop()
