"""The ``ssh`` launcher: one agent per host, started through the system ``ssh`` client.

The user's own client, so ``~/.ssh/config`` (ProxyJump, keys, an agent, ControlMaster) just
works. The secrets go over the session's stdin, never on a command line; the session stays
open, so the agent also learns of a dead controller when it closes. The agent listens and the
controller dials it (compute nodes often cannot open connections to a login node), directly at
the address the agent advertised, or through an ``ssh -L`` tunnel (``tunnel=True``) when the
hosts are only reachable through ssh. :class:`ListeningAgent` (an agent started as a process
that says where it listens) serves the kept local mesh too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from ...protocol import net
from ...protocol.errors import MeshError
from ...protocol.proc import owned_prefix, readable, runtime_base
from ...protocol.remote import LISTENING
from .base import AGENT_MODULE, AgentHandle, HostPlan, LaunchContext, Launcher
from .network import Network


def plan_hosts(world_size: int, hosts: int | None, per_host: int | None, what: str) -> list[HostPlan]:
    """Contiguous blocks of ranks, host by host (ranks 0-7 on the first of 8 per host)."""
    if per_host is None:
        if not hosts:
            raise MeshError(f"{what}: say how many ranks go on each host (per_host=8, --per-host 8)")
        per_host = math.ceil(world_size / hosts)
    if per_host < 1:
        raise MeshError(f"{what}: per_host={per_host}; give at least one rank per host")
    needed = math.ceil(world_size / per_host)
    if hosts is not None and needed != hosts:
        raise MeshError(f"{what}: {world_size} ranks at {per_host} per host need {needed} host(s), "
                        f"but {hosts} were given; change the number of ranks, per_host or the hosts")
    return [HostPlan(h, list(range(h * per_host, min(world_size, (h + 1) * per_host)))) for h in range(needed)]


class SSH(Launcher):
    """One agent per host, started through the system ``ssh`` client."""

    name = "ssh"
    relaunchable = True

    def __init__(self, hosts: Sequence[str], per_host: int | None = None, python: str | None = None,
                 ssh: str = "ssh", ssh_options: Sequence[str] = (), tunnel: bool = False,
                 suspect_s: float | None = None, lost_s: float | None = None) -> None:
        super().__init__(suspect_s, lost_s)
        if isinstance(hosts, str):
            hosts = [h for h in hosts.split(",") if h]
        if not hosts:
            raise MeshError("the ssh launcher needs hosts, e.g. SSH(['gpu1', 'gpu2']) or --hosts gpu1,gpu2")
        twice = sorted({h for h in hosts if list(hosts).count(h) > 1})
        if twice:
            raise MeshError(f"--hosts: {', '.join(twice)} is named twice: a host runs one agent for all its "
                            f"ranks; name it once and give the ranks per host with --per-host N (per_host=N)")
        self.hosts = list(hosts)
        self.per_host = per_host
        #: The Python on the hosts (default: the same path as this one, as on a shared install).
        self.python = python or sys.executable
        self.ssh = [ssh, "-T", "-o", "BatchMode=yes", *ssh_options]
        self.tunnel = tunnel

    def default_ranks(self) -> int | None:
        return len(self.hosts) * self.per_host if self.per_host else None

    def plan(self, world_size: int) -> list[HostPlan]:
        return plan_hosts(world_size, len(self.hosts), self.per_host, "ssh launcher")

    def launch(self, plans: list[HostPlan], ctx: LaunchContext, timeout: float) -> list[AgentHandle]:
        """Start every host's agent at once, then dial each as it says where it listens."""
        network = ctx.network
        assert network is not None
        boot = json.dumps(network.bootstrap(self.tunnel).to_dict()) + "\n"
        command = f"exec {shlex.quote(self.python)} -m {AGENT_MODULE} listen"
        agents: list[ListeningAgent] = []
        deadline = time.monotonic() + timeout
        try:
            for plan in plans:
                agents.append(ListeningAgent(self.hosts[plan.host], [*self.ssh, self.hosts[plan.host], command]))
                agents[-1].send(boot)
            for plan, agent in zip(plans, agents):
                self._dial(plan, agent, network, deadline)
        except BaseException:
            for agent in agents:
                agent.terminate(1.0)
            raise
        return list(agents)

    def replace_host(self, host: int, name: str) -> None:
        """Host ``host``'s agent starts on ``name`` from now on (its old host is lost)."""
        self.hosts[host] = name

    def relaunch(self, plan: HostPlan, ctx: LaunchContext, timeout: float) -> AgentHandle:
        """A new agent for a host whose agent was lost (the same host, or the one that now
        stands at its place in ``hosts``)."""
        return self.launch([plan], ctx, timeout)[0]

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--hosts", help="start the ranks on these hosts through ssh: gpu1,gpu2 "
                                            "(your ~/.ssh/config applies)")
        parser.add_argument("--tunnel", action="store_true",
                            help="--hosts: reach the agents through ssh tunnels (hosts reachable only by ssh)")

    option, companions = "hosts", ("tunnel",)

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> "SSH":
        return cls(args.hosts.split(","), per_host=args.per_host, python=args.python, tunnel=args.tunnel)

    def _dial(self, plan: HostPlan, agent: "ListeningAgent", network: Network, deadline: float) -> None:
        info = agent.wait_listening(deadline, self.python)
        address, port = info["addr"], info["port"]
        if self.tunnel:
            port = agent.open_tunnel([*self.ssh, "-o", "ExitOnForwardFailure=yes"], info["port"])
            address = "127.0.0.1"
        network.dial(plan.host, agent.name, plan.ranks, info, address, port)


class ListeningAgent(AgentHandle):
    """An agent started as a process (through ssh, or detached on this machine for a kept mesh)
    that says where it listens; the session stays open for the agent's whole life."""

    def __init__(self, name: str, argv: list[str], same_host: bool = False) -> None:
        self.same_host = same_host
        self.name = name
        fd, self.log = tempfile.mkstemp(prefix=owned_prefix("meshbook-ssh"), suffix=".log", dir=runtime_base())
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=fd, start_new_session=True)
        finally:
            os.close(fd)
        self.tunnel: subprocess.Popen[bytes] | None = None
        self._said: list[str] = []

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()

    def wait_listening(self, deadline: float, python: str) -> dict[str, Any]:
        """The agent's address, from the line it prints once it listens."""
        assert self.proc.stdout is not None
        out = self.proc.stdout.fileno()
        buffered = b""
        while (left := deadline - time.monotonic()) > 0:
            if not readable(out, min(left, 0.5)):
                if self.proc.poll() is not None:
                    break
                continue
            chunk = os.read(out, 65536)
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                if text.startswith(LISTENING):
                    return json.loads(text[len(LISTENING):])
                self._said.append(text)
        self.terminate(2.0, keep_log=True)
        reason = self.exit_reason()
        self._remove_log()
        raise MeshError(f"could not start the agent on {self.name} through ssh "
                        f"({reason}). Check that `ssh {self.name}` works without a "
                        f"password prompt and that {python} there has meshbook installed (pass "
                        f"python='/path/to/python' or --python)")

    def open_tunnel(self, ssh: list[str], remote_port: int) -> int:
        """Forward a local port to the agent's port on its own loopback; returns the local port.

        The tunnel's session runs ``cat`` on the host, reading our end of a pipe: when this
        process ends, however it ends (a SIGKILLed kernel too), the pipe closes, ``cat`` ends,
        and the tunnel with it (``ssh -N`` would have run on for ever)."""
        port = net.free_port_in_range("127.0.0.1")
        self.tunnel = subprocess.Popen([*ssh, "-L", f"127.0.0.1:{port}:127.0.0.1:{remote_port}", self.name,
                                        "exec cat >/dev/null"],
                                       stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        return port

    def alive(self) -> bool:
        return self.proc.poll() is None and (self.tunnel is None or self.tunnel.poll() is None)

    def exit_reason(self) -> str:
        code = self.proc.poll()
        what = ("running" if code is None else
                f"the ssh session to {self.name} ended with exit code {code}")
        if self.tunnel is not None and self.tunnel.poll() is not None:
            what += f"; its ssh tunnel ended with exit code {self.tunnel.poll()}"
        try:
            with open(self.log, errors="replace") as f:
                tail = "\n".join([*self._said, f.read()]).strip()[-3000:]
        except OSError:
            tail = ""
        return what + (f"; its output ends with:\n{tail}" if tail else "")

    def terminate(self, timeout: float = 5.0, keep_log: bool = False) -> None:
        """Close the session's stdin (the agent stops its ranks and exits); force it after ``timeout``."""
        for proc in filter(None, (self.proc, self.tunnel)):
            try:
                if proc.stdin is not None:
                    proc.stdin.close()
            except OSError:
                pass
        for proc in filter(None, (self.proc, self.tunnel)):
            if proc is self.tunnel:
                proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if not keep_log:
            self._remove_log()

    def _remove_log(self) -> None:
        try:
            os.unlink(self.log)
        except OSError:
            pass


def default_address() -> str:
    """This machine's address on its default route (what other hosts most likely reach)."""
    try:
        return net.route_to("192.0.2.1")  # TEST-NET-1: only the routing table is asked
    except OSError:
        return "127.0.0.1"
