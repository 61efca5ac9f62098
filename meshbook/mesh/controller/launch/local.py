"""The ``local`` launcher (the default): every rank on this machine, forked by one agent.

The agent is this process's child, ``python -m meshbook.mesh.agent``, and reads its
configuration on stdin. The pipe stays open for the agent's whole life: when the controller
dies, however it dies, the pipe closes and the agent takes its ranks down with it. A kept mesh
(``keep``) instead runs its agent detached, listening on loopback, as an agent on another host
listens (see :mod:`.kept`).

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
import time
from dataclasses import replace
from typing import Any, Mapping

from ...protocol.bodies import AgentConfig
from ...protocol.errors import MeshError
from ...protocol.proc import readable
from ...protocol.remote import AGENT_READY
from .base import AGENT_MODULE, AgentHandle, HostPlan, LaunchContext, Launcher
from .ssh import ListeningAgent

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


class AgentProcess(AgentHandle):
    """A host agent running as a child process of this controller."""

    same_host = True

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
            if readable(out, min(left, 0.25)):
                *lines, buffered = (buffered + os.read(out, 4096)).split(b"\n")
                for line in lines:
                    if line.startswith(AGENT_READY.encode()):
                        self.ready = json.loads(line[len(AGENT_READY):])
        return self.ready

    @property
    def gpus(self) -> int:  # type: ignore[override]
        return int((self.ready or {}).get("gpus", 0))

    def configure(self, config: AgentConfig) -> None:
        """Its configuration, on its stdin: it logs into the runtime directory from now on."""
        assert self.proc.stdin is not None
        self.logs.insert(0, os.path.join(config.rundir, "agent.log"))
        config = replace(config, log=self.logs[0], env=self.env)
        self.proc.stdin.write((json.dumps(config.to_dict()) + "\n").encode())
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


class LocalLauncher(Launcher):
    """Every rank on this host, forked by one agent."""

    name = "local"
    relaunchable = True

    @property
    def remote(self) -> bool:
        return self.lease_s is not None or self.record is not None  # a kept mesh's agent listens

    def plan(self, world_size: int) -> list[HostPlan]:
        return [HostPlan(0, list(range(world_size)))]

    def launch(self, plans: list[HostPlan], ctx: LaunchContext, timeout: float) -> list[AgentHandle]:
        """The agent, ready (torch imported, GPUs counted) but not configured yet: the
        controller decides the backend from its GPU count first. A kept mesh's agent listens
        on loopback, detached; an attached one is dialled where its mesh file says."""
        if self.record is not None:
            return self.dial_recorded(plans, ctx, same_host=True)
        if self.lease_s is not None:
            return [self._start_kept(plans[0], ctx, timeout)]
        agent = _take_standby(ctx.env)
        try:
            agent.wait_ready(timeout)
        except BaseException:
            agent.terminate(1.0)
            raise
        return [agent]

    def relaunch(self, plan: HostPlan, ctx: LaunchContext, timeout: float) -> AgentHandle:
        if self.remote:
            raise MeshError("the agent of this kept mesh is gone, and its ranks with it: stop the mesh "
                            "and start a new one (%mesh stop, %mesh start ... --keep ...)")
        return super().relaunch(plan, ctx, timeout)

    def keep(self, lease_s: float, mesh_file: str) -> None:
        self.lease_s, self.mesh_file = lease_s, mesh_file
        self.epoch = 1  # each attach adds one

    def _start_kept(self, plan: HostPlan, ctx: LaunchContext, timeout: float) -> AgentHandle:
        """Start the agent detached (its own session; ``env -u SSH_CONNECTION`` so that it
        listens on loopback, not on the interface of the user's ssh session)."""
        network = ctx.network
        assert network is not None
        agent = ListeningAgent("localhost", ["env", "-u", "SSH_CONNECTION", sys.executable, "-m", AGENT_MODULE,
                                             "listen"], same_host=True)
        boot = network.bootstrap(controller_hint="127.0.0.1", lease_s=self.lease_s, mesh_file=self.mesh_file,
                                 log=agent.log)
        try:
            agent.send(json.dumps(boot.to_dict()) + "\n")
            info = agent.wait_listening(time.monotonic() + timeout, sys.executable)
        except BaseException:
            agent.terminate(1.0)
            raise
        network.dial(plan.host, "localhost", plan.ranks, info, info["addr"], info["port"])
        return agent
