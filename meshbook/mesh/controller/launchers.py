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
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

from ..protocol.errors import MeshError
from ..protocol.remote import AGENT_READY

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

    def launch(self, plans: list[HostPlan], env: dict[str, str], timeout: float) -> list["AgentProcess"]: ...


#: Variables an agent reads when it starts (its GPU count, its interpreter and torch's import):
#: a standby agent started before one of them changed in the notebook is replaced by a new one.
FRESH_AGENT_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES",
                         "ROCR_VISIBLE_DEVICES", "PYTORCH_NVML_BASED_CUDA_CHECK", "LD_PRELOAD",
                         "LD_LIBRARY_PATH", "TORCH_LOGS", "TORCH_CPP_LOG_LEVEL")


def agent_environment(extra: Mapping[str, str] = {}) -> dict[str, str]:  # noqa: B006 - never mutated
    """The environment of an agent on this host, and so of its ranks: this process's as it is
    now (as a subprocess started now would have it), with ``extra`` on top and this package
    importable."""
    package = sys.modules[__name__.partition(".")[0]]
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(package.__file__ or "")))
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _fresh_enough(agent_env: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """Can an agent started with ``agent_env`` serve ranks that need ``env``?"""
    return all(agent_env.get(name) == env.get(name) for name in FRESH_AGENT_VARIABLES) and \
        all(agent_env.get(name) == env.get(name) for name in {*agent_env, *env} if name.startswith("PYTHON"))


class AgentProcess:
    """A host agent running as a child process of this controller."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = env = env if env is not None else agent_environment()
        #: What the agent said once ready (its GPU count), see :meth:`wait_ready`.
        self.ready: dict[str, Any] | None = None
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
                                         stdout=subprocess.PIPE, stderr=fd, start_new_session=True,
                                         env=env)
        finally:
            os.close(fd)

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Wait until the agent has imported torch and counted its GPUs; what it said."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        out, buffered = self.proc.stdout.fileno(), b""
        while self.ready is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive():
                raise MeshError(f"the host agent did not start within {timeout:g} s ({self.exit_reason()}). "
                                f"Pass a larger timeout= if the machine is slow")
            if select.select([out], [], [], min(left, 0.25))[0]:
                *lines, buffered = (buffered + os.read(out, 4096)).split(b"\n")
                for line in lines:
                    if line.startswith(AGENT_READY.encode()):
                        self.ready = json.loads(line[len(AGENT_READY):])
        return self.ready

    @property
    def gpus(self) -> int:
        return int((self.ready or {}).get("gpus", 0))

    def configure(self, config: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.logs.insert(0, os.path.join(config["rundir"], "agent.log"))
        self.proc.stdin.write((json.dumps({**config, "log": self.logs[0], "env": self.env}) + "\n").encode())
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
        if self.proc.stdout is not None:
            self.proc.stdout.close()
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


def _take_standby(env: dict[str, str]) -> AgentProcess:
    """The prewarmed agent, if it started with what ``env`` needs; else a new one."""
    global _standby
    with _standby_lock:
        agent, _standby = _standby, None
    if agent is not None and agent.alive() and _fresh_enough(agent.env, env):
        agent.env = env  # the rest it takes from its configuration, before forking the ranks
        return agent
    if agent is not None:
        agent.terminate(0)
    return AgentProcess(env)


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

    def launch(self, plans: list[HostPlan], env: dict[str, str], timeout: float) -> list[AgentProcess]:
        """The agent, ready (torch imported, GPUs counted) but not configured yet: the
        controller decides the backend from its GPU count first."""
        agent = _take_standby(env)
        try:
            agent.wait_ready(timeout)
        except BaseException:
            agent.terminate(1.0)
            raise
        return [agent]


LAUNCHERS: dict[str, type] = {"local": LocalLauncher}


def get_launcher(launcher: str | Launcher) -> Launcher:
    if not isinstance(launcher, str):
        return launcher
    try:
        return LAUNCHERS[launcher]()  # type: ignore[no-any-return]
    except KeyError:
        raise MeshError(f"unknown launcher {launcher!r}; available: {', '.join(LAUNCHERS)}") from None
