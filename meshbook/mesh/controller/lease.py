"""Meshes that outlive the kernel: ``keep=`` leases, the mesh file, listing and attaching.

A notebook kernel dies or restarts far more often than a loaded model should be lost, so a
mesh started with ``keep="8h"`` (``%mesh start -n 4 --keep 8h``) runs its agents the way an
agent on another host runs, even on this host: a *listening* agent (TCP + CurveZMQ on
127.0.0.1, admitting only the controller's Curve key) started in its own session, with no
parent-death signal and no watch on its stdin. Its grace before it stops its ranks is the
lease, renewed by every ping: the mesh ends ``keep`` after a controller was last heard.

The *mesh file* (``<runtime dir>/meshbook-meshes/<id>.json``, 0600 in a 0700 directory)
records how to reach and authenticate to the mesh: its id, launcher, hosts and addresses, the
mesh key and Curve keys, ranks, dims, the epoch, start time and lease. Its modification time is
when a controller last renewed the lease (the controller touches it when a ping is answered),
so "lease left" needs no process to ask. The agent removes it when the mesh stops or its lease
runs out; :func:`list_meshes` also drops files whose agent is gone.

:func:`attach` (``%mesh attach ID``) builds a new controller with the file's keys and the next
*epoch*, dials the agents and asks them for their ranks (pids, generations): the ranks still
hold their variables. Every message to an agent carries its sender's epoch, and an agent
refuses (and answers ``FENCED`` to) one older than the newest it has seen, so a kernel that
was attached over can no longer drive the mesh and its next cell says so. Without ``keep``,
nothing changes: the ranks die with the kernel.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..protocol import net
from ..protocol.errors import MeshError
from ..protocol.proc import pid_alive, runtime_base
from ..protocol.topology import Topology
from .controller import Controller, live_controllers
from .hosts import Network
from .launchers import AGENT_MODULE, HostPlan, Launcher
from .remote import RemoteLauncher, SshAgent

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(keep: str | float) -> float:
    """``8h``, ``30m``, ``1h30m``, ``90s``, ``2d`` or a number of seconds."""
    text = str(keep).strip().lower()
    if isinstance(keep, bool) or not (re.fullmatch(r"\d+(\.\d+)?", text) or
                                      re.fullmatch(r"(\d+(\.\d+)?[smhd])+", text)):
        raise MeshError(f"keep={keep!r}: give a duration such as 8h, 30m, 1h30m or 90s")
    seconds = sum(float(n) * _UNITS[unit or "s"] for n, unit in re.findall(r"(\d+(?:\.\d+)?)([smhd]?)", text))
    if seconds <= 0:
        raise MeshError(f"keep={keep!r}: the lease must be longer than 0 s")
    return seconds


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def mesh_dir() -> str:
    """Where mesh files live: private to this user."""
    path = os.path.join(runtime_base(), f"meshbook-meshes-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.lstat(path).st_uid != os.getuid() or not os.path.isdir(path) or os.path.islink(path):
        raise MeshError(f"{path} is not a directory of yours: remove it, then try again")
    os.chmod(path, 0o700)
    return path


@dataclass
class MeshRecord:
    """What a mesh file holds: enough to reach, authenticate to and rebuild a kept mesh."""

    id: str
    name: str
    launcher: str
    hosts: list[dict[str, Any]]  # per host: name, addr, port, pid, hostname, store_port, ranks
    key: str  # the mesh key (HMAC), hex
    server: dict[str, str]  # the Curve keys: the agents' server pair and the controller's pair
    controller: dict[str, str]
    dims: list[list[Any]]
    backend: str
    collective_timeout: float
    generation: int  # at start; attach asks the agents for each rank's
    epoch: int
    started: float  # time.time()
    lease_s: float

    @property
    def path(self) -> str:
        return os.path.join(mesh_dir(), f"{self.id}.json")

    def save(self) -> None:
        """Write atomically, 0600 (this also renews the file's time, i.e. the lease)."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: str) -> "MeshRecord":
        with open(path) as f:
            return cls(**json.load(f))

    def lease_left(self) -> float:
        try:
            renewed = os.stat(self.path).st_mtime
        except OSError:
            return 0.0
        return self.lease_s - (time.time() - renewed)

    def agents_alive(self) -> bool:
        return all(pid_alive(h["pid"]) for h in self.hosts)

    def row(self) -> dict[str, Any]:
        """This mesh as a row of ``%mesh list``."""
        here = next((c.name for c in live_controllers() if not c.stopped and
                     getattr(c.lease, "id", None) == self.id), "")
        return {"id": self.id, "name": self.name, "launcher": self.launcher,
                "hosts": ",".join(h["name"] for h in self.hosts),
                "ranks": sum(len(h["ranks"]) for h in self.hosts),
                "dims": ",".join(f"{k}={v}" for k, v in self.dims),
                "age": format_duration(time.time() - self.started),
                "lease left": format_duration(self.lease_left()),
                "attached": f"here, as {here}" if here else "-"}


class Lease:
    """A controller's hold on a kept mesh: renews the mesh file's time as pings are answered."""

    def __init__(self, record: MeshRecord) -> None:
        self.record = record
        self.id = record.id
        self._touched = 0.0

    def renewed(self) -> None:
        now = time.monotonic()
        if now - self._touched >= 0.5:
            self._touched = now
            try:
                os.utime(self.record.path)
            except OSError:
                pass  # the mesh ended (or was stopped from elsewhere)


class Keep(RemoteLauncher):
    """A mesh on this host whose agent outlives the kernel for ``lease_s`` (``keep=``)."""

    store_host = "127.0.0.1"

    def __init__(self, lease_s: float, name: str) -> None:
        super().__init__(None, None)
        self.lease_s = lease_s
        self.name = name
        self.id = secrets.token_hex(4)
        #: The Curve keys are new; the first controller has epoch 1 (each attach adds one).
        self.keys: tuple[net.Keys, net.Keys] | None = None
        self.epoch = 1
        self.listening: dict[str, Any] = {}

    @classmethod
    def for_launcher(cls, launcher: "str | Launcher", keep: str | float, name: str) -> "Keep":
        if launcher != "local":
            raise MeshError("keep= works with the local launcher for now: start the mesh on this "
                            "machine (no --hosts/--join) to keep it across kernel restarts")
        return cls(parse_duration(keep), name)

    def plan(self, world_size: int) -> list[HostPlan]:
        return [HostPlan(0, list(range(world_size)))]

    def launch(self, plans: list[HostPlan], network: Network, timeout: float) -> list[SshAgent]:
        """Start the agent detached (its own session; ``env -u SSH_CONNECTION`` so that it
        listens on loopback, not on the interface of the user's ssh session)."""
        (plan,) = plans
        agent = SshAgent("localhost", ["env", "-u", "SSH_CONNECTION", sys.executable, "-m", AGENT_MODULE,
                                       "listen"])
        boot = {**network.bootstrap(), "controller_hint": "127.0.0.1", "lease_s": self.lease_s,
                "mesh_file": os.path.join(mesh_dir(), f"{self.id}.json"), "log": agent.log}
        try:
            agent.send(json.dumps(boot) + "\n")
            self.listening = agent.wait_listening(time.monotonic() + timeout, sys.executable)
        except BaseException:
            agent.terminate(1.0)
            raise
        network.dial(plan.host, "localhost", plan.ranks, self.listening, self.listening["addr"],
                     self.listening["port"])
        return [agent]

    def relaunch(self, plan: HostPlan, network: Network, timeout: float) -> SshAgent:
        raise MeshError("the agent of this kept mesh is gone, and its ranks with it: stop the mesh "
                        "and start a new one (%mesh stop, %mesh start ... --keep ...)")

    def record(self, controller: Controller) -> Lease:
        """Write the mesh file now that the mesh runs; the controller holds its lease."""
        network = controller.network
        assert network is not None
        info = self.listening
        record = MeshRecord(
            id=self.id, name=controller.name, launcher="local",
            hosts=[{"name": "localhost", "addr": info["addr"], "port": info["port"], "pid": info["pid"],
                    "hostname": info["hostname"], "store_port": info["store_port"],
                    "ranks": controller.plans[0].ranks}],
            key=controller.wire.key.hex(), server=network.server.to_json(), controller=network.me.to_json(),
            dims=[list(d) for d in controller.topology.dims], backend=controller.backend,
            collective_timeout=controller.collective_timeout, generation=controller.generation,
            epoch=network.epoch, started=time.time(), lease_s=self.lease_s)
        record.save()
        return Lease(record)


class Attached(RemoteLauncher):
    """Dials the agents a mesh file names, with its keys and the next epoch."""

    store_host = "127.0.0.1"

    def __init__(self, record: MeshRecord) -> None:
        super().__init__(None, None)
        self.record = record
        self.keys = (net.Keys.from_json(record.server), net.Keys.from_json(record.controller))
        self.epoch = record.epoch

    def plan(self, world_size: int) -> list[HostPlan]:
        return [HostPlan(h, host["ranks"]) for h, host in enumerate(self.record.hosts)]

    def launch(self, plans: list[HostPlan], network: Network, timeout: float) -> list["LeasedAgent"]:
        for plan in plans:
            host = self.record.hosts[plan.host]
            network.dial(plan.host, host["name"], plan.ranks, host, host["addr"], host["port"])
        return [LeasedAgent(self.record.hosts[p.host]["pid"]) for p in plans]

    def relaunch(self, plan: HostPlan, network: Network, timeout: float) -> "LeasedAgent":
        raise MeshError("the agent of this attached mesh is gone, and its ranks with it: stop the "
                        "mesh and start a new one (%mesh stop, %mesh start ... --keep ...)")


class LeasedAgent:
    """A kept mesh's agent that another process started: known by its pid on this host."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def exit_reason(self) -> str:
        return f"its agent (pid {self.pid}) is gone"

    def terminate(self, timeout: float = 5.0) -> None:
        """Wait for the agent to exit (it was told to stop over its connection)."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)


def list_meshes() -> list[MeshRecord]:
    """The kept meshes this user can attach, oldest first (files of ended meshes are removed)."""
    records = []
    for entry in sorted(os.listdir(mesh_dir())):
        if not entry.endswith(".json"):
            continue
        path = os.path.join(mesh_dir(), entry)
        try:
            record = MeshRecord.load(path)
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours to read
        if record.agents_alive() and record.lease_left() > 0:
            records.append(record)
        else:
            _remove(path)
    return sorted(records, key=lambda r: r.started)


def attach(mesh_id: str, name_for: Callable[[str], str], timeout: float = 60.0) -> Controller:
    """A controller that took over the kept mesh ``mesh_id`` (see :func:`list_meshes`), named
    ``name_for(the name it was started with)``. Any other controller of it is fenced off."""
    record = next((r for r in list_meshes() if r.id == mesh_id), None)
    if record is None:
        ids = ", ".join(r.id for r in list_meshes()) or "none"
        raise MeshError(f"no kept mesh {mesh_id!r} (meshes that can be attached: {ids}); its lease "
                        f"may have run out. %mesh list (meshbook.list_meshes()) shows them")
    record.epoch += 1
    record.save()
    controller = Controller(Topology(tuple((k, v) for k, v in record.dims)), Attached(record), record.backend,
                            record.collective_timeout, name_for(record.name),
                            key=bytes.fromhex(record.key))
    controller.lease = Lease(record)
    controller.attach(timeout)
    return controller


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
