"""Launchers start host agents; the local one (the default) runs one agent on this host.

A launcher decides which ranks live on which host and starts one
``python -m meshbook.mesh.agent`` per host, writing the agent its configuration on stdin.
The stdin pipe stays open for the agent's whole life: when the controller dies, however it
dies, the pipe closes and the agent takes its ranks down with it.

Importing torch takes the agent more than a second on a small machine, so :func:`prewarm`
starts an agent ahead of time that imports torch and then waits for its configuration; the
next local :func:`~meshbook.start` takes it and only has to fork the ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Protocol

#: What a launcher runs, with ``python -m``, on each host (tests find agents and ranks by it).
AGENT_MODULE = "meshbook.mesh.agent"


@dataclass(frozen=True)
class HostPlan:
    host: int
    ranks: list[int]


class AgentHandle(Protocol):
    def alive(self) -> bool: ...

    def exit_reason(self) -> str: ...

    def terminate(self, timeout: float) -> None: ...


class Launcher(Protocol):
    def plan(self, world_size: int) -> list[HostPlan]: ...

    def launch(self, plans: list[HostPlan], configs: dict[int, dict[str, Any]]) -> list[AgentHandle]: ...


class AgentProcess:
    """A host agent running as a child process of this controller."""

    def __init__(self) -> None:
        package = sys.modules[__name__.partition(".")[0]]
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(package.__file__ or "")))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        args = [sys.executable, "-m", AGENT_MODULE]
        if threading.current_thread() is threading.main_thread():
            # PR_SET_PDEATHSIG follows the forking *thread*: only the main thread lives as
            # long as the process. The stdin pipe covers every other case.
            args += ["--parent", str(os.getpid())]
        # Until it is configured the agent logs here; then it moves the log into the runtime
        # directory, which it removes when this process is gone (the agent removes this too).
        fd, self.log = tempfile.mkstemp(prefix="meshbook-agent-", suffix=".log")
        self.logs = [self.log]
        try:
            self.proc = subprocess.Popen([*args, "--log", self.log], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=fd, start_new_session=True,
                                         env=env)
        finally:
            os.close(fd)

    def configure(self, config: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.logs.insert(0, os.path.join(config["rundir"], "agent.log"))
        self.proc.stdin.write((json.dumps({**config, "log": self.logs[0]}) + "\n").encode())
        self.proc.stdin.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_reason(self) -> str:
        code = self.proc.poll()
        what = "running" if code is None else (
            f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        return what + (f"; its log ends with:\n{tail}" if (tail := self._log_tail()) else "")

    def _log_tail(self) -> str:
        for path in self.logs:  # moved into the runtime directory once configured
            try:
                with open(path, errors="replace") as f:
                    return f.read()[-3000:].strip()
            except OSError:
                continue
        return ""

    def terminate(self, timeout: float = 5.0) -> None:
        """Close stdin (the agent kills its ranks and exits); force it after ``timeout``."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its ranks die with it (PR_SET_PDEATHSIG)
            self.proc.wait()
        try:
            os.unlink(self.log)  # the agent removes it, unless it could not clean up
        except OSError:
            pass


_standby: AgentProcess | None = None
_standby_lock = threading.Lock()


def prewarm() -> None:
    """Start a host agent now, so the next local ``start()`` need not wait for torch to import."""
    global _standby
    with _standby_lock:
        if _standby is None or not _standby.alive():
            _standby = AgentProcess()


def _take_standby() -> AgentProcess:
    global _standby
    with _standby_lock:
        agent, _standby = _standby, None
    if agent is not None and agent.alive():
        return agent
    if agent is not None:
        agent.terminate(0)
    return AgentProcess()


def discard_standby() -> None:
    """Stop the prewarmed agent, if any (at interpreter exit, say)."""
    global _standby
    with _standby_lock:
        agent, _standby = _standby, None
    if agent is not None:
        agent.terminate(2.0)


class LocalLauncher:
    """Every rank on this host, forked by one agent."""

    def plan(self, world_size: int) -> list[HostPlan]:
        return [HostPlan(0, list(range(world_size)))]

    def launch(self, plans: list[HostPlan], configs: dict[int, dict[str, Any]]) -> list[AgentHandle]:
        (plan,) = plans
        agent = _take_standby()
        agent.configure(configs[plan.host])
        return [agent]


LAUNCHERS: dict[str, type] = {"local": LocalLauncher}


def get_launcher(launcher: str | Launcher) -> Launcher:
    if not isinstance(launcher, str):
        return launcher
    try:
        return LAUNCHERS[launcher]()  # type: ignore[no-any-return]
    except KeyError:
        from ..protocol.errors import MeshError

        raise MeshError(f"unknown launcher {launcher!r}; available: {', '.join(LAUNCHERS)}") from None
