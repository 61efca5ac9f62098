"""Meshes "across hosts" on one machine, for the workloads of issue 16.

Two ways, both over the real network path (TCP with CurveZMQ, one connection per host agent,
requests once per host):

* :class:`StandInHosts`: many hosts, each a stand-in agent (:mod:`bench.standin_host`) on its
  own loopback address, 127.0.0.2, 127.0.0.3, ..., that answers for its ranks itself. The
  launcher starts them and dials them as the ssh launcher does (same bootstrap on stdin,
  same ``LISTENING`` line, same :class:`~meshbook.mesh.controller.launch.ssh.ListeningAgent` handle).
  For the fan-out table only: 1,024 real ranks do not fit on a small machine.
* :func:`local_ssh`: ``meshbook.SSH`` with an ``ssh`` that runs the remote command on this
  machine, so real agents and real ranks run behind the network path exactly as on another
  host (minus the ssh session itself, which only carries the bootstrap).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

from meshbook import SSH
from meshbook.mesh.controller.launch.base import AgentHandle, HostPlan, LaunchContext, Launcher
from meshbook.mesh.controller.launch.ssh import ListeningAgent, plan_hosts

#: What a stand-in host runs (with this Python); ``bench`` is on PYTHONPATH (see bench.run).
STANDIN = "bench.standin_host"


def loopback(host: int) -> str:
    """Host ``host``'s own address: 127.0.0.2 for host 0 (127.0.0.1 is the controller's)."""
    n = host + 2
    return f"127.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"


class StandInHosts(Launcher):
    """``hosts`` stand-in agents, one per loopback address, dialled like ssh agents: a whole
    launcher in a few lines (see :class:`~meshbook.Launcher`)."""

    name = "stand-in"

    def __init__(self, hosts: int) -> None:
        super().__init__()
        self.hosts = hosts

    def plan(self, world_size: int) -> list[HostPlan]:
        return plan_hosts(world_size, self.hosts, None, "stand-in hosts")

    def launch(self, plans: list[HostPlan], ctx: LaunchContext, timeout: float) -> list[AgentHandle]:
        network = ctx.network
        assert network is not None
        boot = json.dumps(network.bootstrap().to_dict()) + "\n"
        agents: list[ListeningAgent] = []
        try:
            for plan in plans:
                agents.append(ListeningAgent(loopback(plan.host), [sys.executable, "-m", STANDIN,
                                                             loopback(plan.host)]))
                agents[-1].send(boot)
            deadline = time.monotonic() + timeout
            for plan, agent in zip(plans, agents):
                info = agent.wait_listening(deadline, sys.executable)
                network.dial(plan.host, agent.name, plan.ranks, info, info["addr"], info["port"])
        except BaseException:
            for agent in agents:
                agent.terminate(2.0)
            raise
        return list(agents)


#: An ``ssh`` for one machine: run the remote command (the last argument) here.
_LOCAL_SSH = '#!/usr/bin/env bash\nexec bash -c "${@: -1}"\n'


@contextmanager
def local_ssh(hosts: list[str]) -> Iterator[SSH]:
    """The ssh launcher on ``hosts``, every one of them this machine."""
    fd, path = tempfile.mkstemp(prefix="bench-ssh-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(_LOCAL_SSH)
        os.chmod(path, stat.S_IRWXU)
        yield SSH(hosts, ssh=path)
    finally:
        os.unlink(path)
