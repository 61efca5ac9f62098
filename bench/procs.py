"""Process hygiene and memory: every process a system starts is found, measured and reaped.

:class:`Leftovers` snapshots the processes a system started (every descendant of this
process that was not there before it started) while it still runs, so engines that move to
their own session or are re-parented on the way out are still known by pid. After the
system's own stop, each of those pids gets a grace period to exit; the stragglers are killed
by pid (never by name: the machine may run other people's meshes) and counted, so a
benchmark that leaves processes behind says so in the report instead of hiding it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar, TypeVar

import psutil

T = TypeVar("T")

#: How long a system's processes get to exit on their own after it was stopped.
EXIT_GRACE_S = 15.0


def descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


def uss(pid: int) -> int:
    """Unique set size: memory that only this process holds (freed when it exits)."""
    return int(psutil.Process(pid).memory_full_info().uss)


class Leftovers:
    """Processes started since construction; :meth:`reap` makes sure they are gone."""

    #: pids killed by the harness because they outlived their system, over the whole run.
    killed: ClassVar[list[str]] = []

    def __init__(self, what: str) -> None:
        self.what = what
        self._before = set(descendants())
        self._seen: dict[int, psutil.Process] = {}

    def snapshot(self) -> list[int]:
        """Record the processes started so far (call while the system still runs)."""
        for pid, proc in descendants().items():
            if pid not in self._before:
                self._seen.setdefault(pid, proc)
        return sorted(self._seen)

    def reap(self) -> None:
        """Wait for every recorded process to exit; kill and count the ones that do not."""
        self.snapshot()
        procs = [p for p in self._seen.values() if p.pid != os.getpid()]
        _, alive = psutil.wait_procs(procs, timeout=EXIT_GRACE_S)
        for proc in alive:
            try:
                Leftovers.killed.append(f"{self.what}: pid {proc.pid} ({' '.join(proc.cmdline()[:4])})")
                proc.kill()
            except psutil.Error:
                continue
        psutil.wait_procs(alive, timeout=5)


def wait_quiet(pid: int, timeout: float = 60.0, settle: float = 0.5) -> None:
    """Wait until process ``pid`` stops using CPU (done importing, now blocked on input)."""
    proc = psutil.Process(pid)
    deadline = time.monotonic() + timeout
    last = sum(proc.cpu_times()[:2])
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = sum(proc.cpu_times()[:2])
        if now - last < 0.01:
            return
        last = now


@contextmanager
def reaped(what: str, start: Callable[[], T], stop: Callable[[T], None]) -> Iterator[T]:
    """``start()`` something; on the way out ``stop()`` it and reap every process it started,
    also when ``start`` itself failed half-way."""
    leftovers = Leftovers(what)
    started: list[T] = []
    try:
        started.append(start())
        yield started[0]
    finally:
        leftovers.snapshot()
        try:
            if started:
                stop(started[0])
        finally:
            leftovers.reap()


_TORCH_PROCESS = """
import os, sys, torch
if {forked}:
    child = os.fork()
    if child == 0:
        sys.stdin.read()
        os._exit(0)
    print(child, flush=True)
    sys.stdin.read()
    os.waitpid(child, 0)
else:
    print(os.getpid(), flush=True)
    sys.stdin.read()
"""


def torch_baseline(forked: bool, settle: float = 1.0) -> int:
    """USS of an idle process that imported torch, or (``forked``) of a fork of one: what a
    rank holds before a system adds anything, for ranks started either way."""
    proc = subprocess.Popen([sys.executable, "-c", _TORCH_PROCESS.format(forked=forked)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
        time.sleep(settle)
        return uss(pid)
    finally:
        proc.communicate("", timeout=30)
