"""A mesh's host agents: started by its launcher, configured, started again, stopped.

The launcher (:mod:`..launch`) plans the hosts and starts (or finds again) an agent per host;
here each agent gets its :class:`~meshbook.mesh.protocol.bodies.AgentConfig` once every
agent has said how many GPUs its ranks see, because the backend is one for the whole mesh
(:func:`~meshbook.mesh.protocol.backends.choose`). An agent on this host reads its configuration
on stdin; one on another host gets it over its link (the ``CONFIGURE`` operation). A host whose
agent is gone is started again by its launcher, where it can (``%mesh restart`` of its ranks).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

from ...protocol import messages as msg
from ...protocol import wire
from ...protocol.backends import LOCAL, Backend, HostGpus, choose
from ...protocol.bodies import AgentConfig
from ...protocol.errors import MeshError
from ...protocol.topology import Topology
from ..launch.base import AgentHandle, HostPlan, LaunchContext, Launcher
from ..launch.local import agent_environment
from ..launch.network import Network
from .transport import Transport


class Agents:
    """The agents of one mesh, one per host of its plan."""

    def __init__(self, launcher: Launcher, plans: list[HostPlan], topology: Topology, signer: wire.Wire,
                 transport: Transport, backend: str, collective_timeout: float, env: dict[str, str]) -> None:
        self.launcher = launcher
        #: Which ranks go on which host (``launcher.plans_for``).
        self.plans = plans
        self.host_of = {r: p.host for p in self.plans for r in p.ranks}
        self.topology = topology
        self.signer = signer
        self.transport = transport
        #: The backend asked for (``auto``...), and the one chosen from the agents' GPU counts.
        self.backend = backend
        self.chosen: Backend | None = None
        self.collective_timeout = collective_timeout
        #: Variables the user named for the ranks (``start(env=...)``): other hosts get only these.
        self.env = env
        #: What the user should know about how the mesh started (printed by ``start()``).
        self.notes: list[str] = []
        self.handles: list[AgentHandle] = []
        #: Hosts whose agent is being started again: its old agent's end is no news.
        self.relaunching: set[int] = set()
        self.master_port = free_port()  # what a pasted torchrun script reads as MASTER_PORT

    @property
    def remote(self) -> bool:
        return self.launcher.remote

    def __getitem__(self, host: int) -> AgentHandle:
        return self.handles[host]

    def __iter__(self) -> Iterator[AgentHandle]:
        return iter(list(self.handles))

    def __len__(self) -> int:
        return len(self.handles)

    def context(self) -> LaunchContext:
        """What a launch gets: the links (made on first need, with a kept mesh's keys and
        epoch when it is found again), and this host's environment for a local agent."""
        if self.remote and self.transport.network is None:
            launcher = self.launcher
            network = Network(self.transport.ctx, self.signer.key, launcher.suspect_s, launcher.lost_s,
                              launcher.keys, launcher.epoch, self.env)
            self.transport.use_network(network)
        return LaunchContext(self.transport.network, agent_environment(self.env))

    # -- starting ------------------------------------------------------------------------------

    def launch(self, timeout: float) -> None:
        """Start an agent per host, choose the backend from their GPU counts, configure each."""
        ctx = self.context()
        self.handles = list(self.launcher.launch(self.plans, ctx, timeout))
        if not self.remote:
            self._choose([HostGpus(LOCAL, h.gpus, len(p.ranks)) for p, h in zip(self.plans, self.handles)])
            for plan, handle in zip(self.plans, self.handles):
                handle.configure(self.local_config(plan))
            return
        links = self.network.links
        self._choose([HostGpus(links[p.host].name, links[p.host].gpus, len(p.ranks)) for p in self.plans])
        for plan in self.plans:
            self.configure(plan, 0)

    def attach(self, timeout: float) -> None:
        """Dial the agents of a kept mesh found again (its launcher came from its mesh file)."""
        self.handles = list(self.launcher.launch(self.plans, self.context(), timeout))

    def _choose(self, hosts: list[HostGpus]) -> None:
        """One backend for the whole mesh, from every agent's GPU count (see protocol/backends.py)."""
        self.chosen = choose(self.backend, hosts)
        if self.chosen.note:
            self.notes.append(self.chosen.note)

    def local_config(self, plan: HostPlan) -> AgentConfig:
        """This host's agent's configuration (stdin): it forks ranks that talk to us over ipc."""
        assert self.chosen is not None
        return AgentConfig(plan.host, len(self.plans), plan.ranks, [list(d) for d in self.topology.dims],
                           self.chosen.torch, self.chosen.device_type, "127.0.0.1", self.collective_timeout,
                           master_port=self.master_port, key=self.signer.key.hex(), rundir=self.transport.rundir,
                           cmd_addr=self.transport.cmd_address, events_addr=self.transport.events_address)

    def configure(self, plan: HostPlan, generation: int) -> None:
        """Send a remote agent its configuration: it forks its ranks into ``generation``. Host
        0's agent keeps the store (at the address it advertised, on the port it reserved), and
        each host's ranks listen on the interface its agent advertised."""
        assert self.chosen is not None
        link, store = self.network.links[plan.host], self.store_addr
        assert store is not None
        config = AgentConfig(plan.host, len(self.plans), plan.ranks, [list(d) for d in self.topology.dims],
                             self.chosen.torch, self.chosen.device_type, link.address, self.collective_timeout,
                             generation=generation, master_port=store[1], store=list(store),
                             serve_store=plan.host == 0)
        frames = self.signer.pack({msg.KIND: msg.OP, msg.ID: None, msg.RANKS: plan.ranks},
                                  {"op": msg.AgentOp.CONFIGURE, "config": config.to_dict()})
        self.transport.send_to_agents(frames, [plan.host])

    @property
    def network(self) -> Network:
        network = self.transport.network
        assert network is not None, "a mesh on this host only has no links"
        return network

    @property
    def store_addr(self) -> tuple[str, int] | None:
        """Where the ranks of a mesh across hosts meet: host 0's agent keeps the store (None:
        a file store on this host)."""
        network = self.transport.network
        if network is None or 0 not in network.links:
            return None
        first = network.links[0]
        return first.address, first.store_port

    # -- hosts lost and started again ------------------------------------------------------------

    def gone(self) -> list[tuple[int, AgentHandle]]:
        """Agents that are gone (their process ended, their job ended), not being started again."""
        return [(host, handle) for host, handle in enumerate(self.handles)
                if host not in self.relaunching and not handle.alive()]

    def hosts_gone(self, ranks: list[int]) -> list[int]:
        """The hosts of ``ranks`` whose agent is gone (lost, or its process ended)."""
        network = self.transport.network
        if network is None:
            return []
        hosts = sorted({self.host_of[r] for r in ranks})
        handles = self.handles  # stop() swaps in an empty list (an abort's thread may ask meanwhile)
        return [h for h in hosts if network.links[h].state in ("lost", "stopped")
                or (h < len(handles) and not handles[h].alive())]

    def lost_addresses(self) -> list[str]:
        """The addresses of the hosts whose agent is gone (:meth:`hosts_gone`): a rank freed
        from a collective, or leaving its groups with work pending on them, shuts its
        connections to these too. Nothing else ends them where a host went silent (no FIN came)."""
        return self.addresses(self.hosts_gone(list(self.host_of)))

    def addresses(self, hosts: list[int]) -> list[str]:
        """The addresses ``hosts``' agents advertised (their ranks' connections come from there)."""
        network = self.transport.network
        if network is None:
            return []
        return sorted({network.links[h].address for h in hosts if h in network.links})

    def move(self, ranks: list[int], host_name: str) -> None:
        """Start the agent of the lost host of ``ranks`` on ``host_name`` at the next restart."""
        gone = self.hosts_gone(ranks)
        if len(gone) != 1:
            raise MeshError(f"restart ... on {host_name!r}: give the ranks of exactly one lost host "
                            f"(lost hosts of these ranks: {len(gone)})")
        self.launcher.replace_host(gone[0], host_name)

    def relaunch(self, host: int, generation: int, timeout: float = 120.0) -> None:
        """Start a new agent for a host whose agent is gone; the other hosts' ranks keep their
        variables."""
        plan = self.plans[host]
        self.relaunching.add(host)
        try:
            self.handles[host].terminate(1.0)
            self.handles[host] = self.launcher.relaunch(plan, self.context(), timeout)
        finally:
            self.relaunching.discard(host)
        link = self.network.links[host]
        if self.chosen is not None and self.chosen.device_type == "cuda" and link.gpus < len(plan.ranks):
            raise MeshError(f"host {link.name} has {link.gpus} GPU(s) for {len(plan.ranks)} rank(s), and this "
                            f"mesh runs NCCL (a GPU per rank): restart them on a host with enough GPUs "
                            f"(%mesh restart ... --on HOST)")
        self.configure(plan, generation)

    def report(self) -> str:
        """Why agents that are gone went, for a start that timed out."""
        return "".join(f"(host agent {i}: {a.exit_reason()}) " for i, a in enumerate(self.handles) if not a.alive())

    # -- ending ----------------------------------------------------------------------------------

    def stop(self, detach: bool) -> None:
        """Stop every agent (its ranks with it); ``detach``: leave a kept mesh's running. Called
        once the receiver thread is gone: this thread owns the links then."""
        handles, self.handles = self.handles, []
        if detach:
            if self.transport.network is not None:
                self.transport.network.hand_over(self.signer, 5.0)
            for handle in handles:
                handle.let_go()
            return
        if self.transport.network is not None:
            self.transport.network.stop_agents(self.signer, 5.0)
        for handle in handles:
            handle.terminate(5.0)

    @property
    def same_host(self) -> bool:
        """Does every agent run on this machine (its ranks can map this process's memory)?"""
        return bool(self.handles) and all(h.same_host for h in self.handles)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])

