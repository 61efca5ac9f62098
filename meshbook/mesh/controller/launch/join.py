"""The ``join`` launcher: hosts join by running one printed command, from any launcher.

It prints one short command for any external launcher (a torchrun-style script, a Kubernetes
Job, mpirun) to run on every host, with a one-time token in a private file or an environment
variable, and waits until that many hosts joined. The joining agents dial the controller: it
must be reachable from the hosts, as torchrun's rendezvous endpoint is.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, Callable

from ...protocol.config import TOKEN_ENV
from ...protocol.errors import MeshError
from ...protocol.remote import encode_token
from .base import AGENT_MODULE, AgentHandle, HostPlan, LaunchContext, Launcher
from .network import HostLink, Network, refuse_other_versions
from .ssh import default_address, plan_hosts


class Join(Launcher):
    """Hosts join by running one printed command (from any launcher) with a one-time token."""

    name = "join"

    def __init__(self, hosts: int | None = None, per_host: int | None = None, address: str | None = None,
                 token_dir: str | None = None, announce: Callable[[str], None] | None = None,
                 suspect_s: float | None = None, lost_s: float | None = None) -> None:
        super().__init__(suspect_s, lost_s)
        self.hosts, self.per_host = hosts, per_host
        #: The address the hosts dial (default: this machine's address on its default route).
        self.address = address
        #: Where the token file goes: the home directory is what cluster hosts usually share.
        self.token_dir = token_dir or os.path.join(os.path.expanduser("~"), ".meshbook")
        self.announce = announce or (lambda text: print(text, flush=True))
        self.token_path: str | None = None

    def default_ranks(self) -> int | None:
        return self.hosts * self.per_host if self.hosts and self.per_host else None

    def plan(self, world_size: int) -> list[HostPlan]:
        return plan_hosts(world_size, self.hosts, self.per_host, "join launcher")

    def launch(self, plans: list[HostPlan], ctx: LaunchContext, timeout: float) -> list[AgentHandle]:
        network = ctx.network
        assert network is not None
        address = self.address or default_address()
        token = encode_token(network.open_join(address, len(plans), timeout).to_dict())
        self.token_path = self._write_token(token)
        try:
            self.announce(self.instructions(len(plans)))
            joined = self._wait(network, len(plans), time.monotonic() + timeout)
        finally:
            network.spend_token()
            self._remove_token()
        for plan, agent in zip(plans, joined):
            network.adopt(plan.host, agent, plan.ranks)
        for agent in joined:  # adopted first: stopping the mesh then stops them all
            refuse_other_versions(agent.versions, f"the host agent that joined from {agent.hostname}")
        return [JoinedAgent(network.links[p.host]) for p in plans]

    def relaunch(self, plan: HostPlan, ctx: LaunchContext, timeout: float) -> AgentHandle:
        name = ctx.network.links[plan.host].name if ctx.network is not None else f"#{plan.host}"
        raise MeshError(f"host {name} joined from an external launcher, which meshbook cannot start "
                        f"again: stop this mesh and start a new one (%mesh stop, then %mesh start --join ...)")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--join", action="store_true",
                            help="print a command for any launcher to run on each host, and wait for them")
        parser.add_argument("--join-address", help="--join: the address the hosts dial (default: this "
                                                   "machine's address on its default route)")

    option, companions = "join", ("join_address",)

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> "Join":
        return cls(per_host=args.per_host, address=args.join_address)

    def instructions(self, hosts: int) -> str:
        command = f"python -m {AGENT_MODULE} join"
        return (f"Waiting for {hosts} host(s) to join. On each, run (with meshbook installed):\n"
                f"  {command} --token-file {self.token_path}\n"
                f"or, where that file is not shared, with the token in the environment:\n"
                f"  {TOKEN_ENV}=\"$(cat {self.token_path})\" {command}\n"
                f"The token is a secret (it admits hosts to this mesh until {hosts} joined): the file "
                f"is readable by you only, and is removed and revoked when the hosts have joined.")

    def _write_token(self, token: str) -> str:
        os.makedirs(self.token_dir, mode=0o700, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="join-", suffix=".token", dir=self.token_dir)  # mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return path

    def _remove_token(self) -> None:
        if self.token_path is not None:
            try:
                os.unlink(self.token_path)
            except OSError:
                pass

    @staticmethod
    def _wait(network: Network, hosts: int, deadline: float) -> list[Any]:
        with network.joined_changed:
            while len(network.joined) < hosts:
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(j.hostname for j in network.joined) or "none"
                    admitted, refused = network.allowlist.tally()
                    raise MeshError(f"only {len(network.joined)} of {hosts} host(s) joined in time "
                                    f"(joined: {names}; connections admitted: {admitted}, refused for a "
                                    f"key this mesh does not know, such as an old token: {refused}); pass "
                                    f"a larger timeout=, or check that the hosts can reach this machine")
                network.joined_changed.wait(min(left, 0.25))
            return sorted(network.joined, key=lambda j: (j.hostname, j.address))[:hosts]


class JoinedAgent(AgentHandle):
    """An agent some other launcher started: known only through its connection."""

    def __init__(self, link: HostLink) -> None:
        self.link = link

    def alive(self) -> bool:
        return True  # its liveness is its heartbeat (see hosts.py): a silent host is lost there

    def exit_reason(self) -> str:
        return f"{self.link.describe()} is {self.link.state}"

    def terminate(self, timeout: float = 5.0) -> None:
        """Nothing to do: the controller told it to stop over its connection."""
