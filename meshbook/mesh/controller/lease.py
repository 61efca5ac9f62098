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
runs out; :func:`list_meshes` also drops files whose agent is gone. A Slurm mesh can be kept
too (:class:`KeptSlurm`): its file names the job, whose state in squeue (a pid tells only on
this host) says whether its agents live, and an attached controller watches the job again.

:func:`attach` (``%mesh attach ID``) builds a new controller with the file's keys and the next
*epoch*, dials the agents and asks them for their ranks (pids, generations): the ranks still
hold their variables. Every message to an agent carries its sender's epoch, and an agent
refuses (and answers ``FENCED`` to) one older than the newest it has seen, so a kernel that
was attached over can no longer drive the mesh and its next cell says so. Without ``keep``,
nothing changes: the ranks die with the kernel.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..protocol import net
from ..protocol.backends import Backend
from ..protocol.errors import MeshError
from ..protocol.proc import pid_alive
from ..protocol.topology import Topology
from .controller import Controller, live_controllers
from .hosts import Network
from .launchers import AGENT_MODULE, HostPlan, Launcher
from .remote import RemoteLauncher, SshAgent
from .slurm import ACTIVE, Slurm, SlurmAgent, SlurmJob, query

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: A mesh whose lease ran out this long ago is surely over (its agent ended itself).
LEASE_MARGIN_S = 60.0


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
    """Where mesh files live: ``~/.meshbook/meshes``, 0700. In the home directory, which no
    other user can write (a name in the shared temp directory could be taken first by anyone,
    denying --keep for good), and which a cluster's nodes share (a kept Slurm mesh's agents
    remove its file when it ends)."""
    path = os.path.join(os.path.expanduser("~"), ".meshbook", "meshes")
    try:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except FileExistsError:
            pass  # something else is there: said below
        info = os.lstat(path)
    except OSError as exc:
        raise MeshError(f"cannot make {path} for the kept meshes' files: {exc.strerror}; "
                        f"check the home directory ($HOME)") from None
    if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode):
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
    job: str = ""  # a Slurm job's id (its agents live while it runs), and its per-job directory
    job_dir: str = ""
    job_state: str = ""  # the job's state when list_meshes() last asked Slurm
    #: Why the file cannot be used (it is listed, never deleted: only its agent knows whether
    #: the mesh still runs); empty for a sound record.
    problem: str = ""

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
        """The record in ``path``; a record saying what is wrong (``problem``) when it cannot be
        used: unreadable, truncated, or with fields of the wrong kind."""
        mesh_id = os.path.basename(path)[:-len(".json")]
        try:
            with open(path) as f:
                record = cls(**json.load(f))
            record.check()
        except (OSError, ValueError, TypeError) as exc:
            return cls.broken(mesh_id, f"its file {path} cannot be used ({type(exc).__name__}: {exc})")
        return record

    @classmethod
    def broken(cls, mesh_id: str, problem: str) -> "MeshRecord":
        return cls(mesh_id, "?", "?", [], "", {}, {}, [], "", 0.0, 0, 0, 0.0, 0.0, problem=problem)

    def check(self) -> None:
        """ValueError/TypeError if a field is not what a mesh file holds."""
        bytes.fromhex(self.key)
        for host in self.hosts:
            for name in ("pid", "port", "store_port"):
                if not isinstance(host[name], int):
                    raise TypeError(f"host {host.get('name')!r}: {name} {host[name]!r} is not a number")
            if not all(isinstance(r, int) for r in host["ranks"]):
                raise TypeError(f"host {host.get('name')!r}: its ranks are not numbers")
        net.Keys.from_json(self.server)
        net.Keys.from_json(self.controller)
        if not isinstance(self.epoch, int) or not isinstance(self.lease_s, (int, float)):
            raise TypeError("epoch or lease_s is not a number")

    def lease_left(self) -> float:
        try:
            renewed = os.stat(self.path).st_mtime
        except OSError:
            return 0.0
        return self.lease_s - (time.time() - renewed)

    def ended(self) -> bool:
        """Is the mesh surely over? Its lease ran out (the agent ends itself then; a margin for
        the last renewal), or Slurm says its job ended. Nothing else decides it: a pid may mean
        another process, or none on this host, and only the agent removes a live mesh's file."""
        if self.problem:
            return False
        if self.job:
            state = query(self.job)
            self.job_state = state.state if state is not None else "gone"
            if self.job_state not in ACTIVE:
                return True
        return self.lease_left() < -LEASE_MARGIN_S

    def drop(self) -> None:
        """Forget an ended mesh: its file and, for a Slurm job, the job's directory."""
        _remove(self.path)
        _remove(self.path + ".lock")
        if self.job_dir:
            shutil.rmtree(self.job_dir, ignore_errors=True)

    def row(self) -> dict[str, Any]:
        """This mesh as a row of ``%mesh list``."""
        if self.problem:
            return {"id": self.id, "name": "-", "launcher": "-", "hosts": "-", "ranks": "-", "job": "-",
                    "dims": "-", "age": "-", "lease left": "-", "attached": f"unusable: {self.problem}"}
        here = next((c.name for c in live_controllers() if not c.stopped and
                     getattr(c.lease, "id", None) == self.id), "")
        return {"id": self.id, "name": self.name, "launcher": self.launcher,
                "hosts": ",".join(h["name"] for h in self.hosts),
                "ranks": sum(len(h["ranks"]) for h in self.hosts),
                "job": f"{self.job} {self.job_state}".strip() if self.job else "-",
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

    relaunchable = False

    def __init__(self, lease_s: float, name: str) -> None:
        super().__init__(None, None)
        self.lease_s = lease_s
        self.name = name
        self.id = secrets.token_hex(4)
        #: The Curve keys are new; the first controller has epoch 1 (each attach adds one).
        self.keys: tuple[net.Keys, net.Keys] | None = None
        self.epoch = 1
        self.listening: dict[str, Any] = {}

    @property
    def launcher(self) -> Launcher:
        return self

    @classmethod
    def for_launcher(cls, launcher: "str | Launcher", keep: str | float, name: str) -> "Keep | KeptSlurm":
        """How to keep a mesh of ``launcher``: the .launcher to start it with, and .record()."""
        mesh_dir()  # where its file will go must be usable before an agent is started for it
        if isinstance(launcher, Slurm):
            return KeptSlurm(launcher, parse_duration(keep))
        if launcher != "local":
            raise MeshError("keep= works with the local and Slurm launchers for now: start the mesh on "
                            "this machine (no --hosts/--join) or with --slurm to keep it across kernel restarts")
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
        return write_record(controller, self.id, "local", [("localhost", self.listening)], self.lease_s)


class KeptSlurm:
    """A Slurm mesh kept: its agents' grace is the lease (``lease_s`` in their bootstrap), and
    the mesh file names the job, whose state (not a pid) says whether the agents still live."""

    def __init__(self, launcher: Slurm, lease_s: float) -> None:
        if launcher.job_id is not None:
            raise MeshError("keep= with --slurm job=ID is not supported yet: the agents' srun step "
                            "belongs to this kernel; keep a job meshbook submits (--slurm nodes=N)")
        self.launcher, self.lease_s, self.id = launcher, lease_s, secrets.token_hex(4)
        launcher.kept = {"lease_s": lease_s, "mesh_file": os.path.join(mesh_dir(), f"{self.id}.json")}
        launcher.epoch = 1

    def record(self, controller: Controller) -> Lease:
        job = self.launcher.current
        assert job is not None
        hosts = [(info.get("hostname") or info["addr"], info) for info in job.infos]
        return write_record(controller, self.id, "slurm", hosts, self.lease_s, job.id or "", job.dir)


def write_record(controller: Controller, mesh_id: str, launcher: str, hosts: list[tuple[str, dict[str, Any]]],
                 lease_s: float, job: str = "", job_dir: str = "") -> Lease:
    """Write the mesh file of a started kept mesh (``hosts``: each one's name and LISTENING
    line, in host order); the controller holds its lease."""
    network = controller.network
    assert network is not None
    record = MeshRecord(
        id=mesh_id, name=controller.name, launcher=launcher,
        hosts=[{"name": name, "addr": info["addr"], "port": info["port"], "pid": info["pid"],
                "hostname": info["hostname"], "store_port": info["store_port"], "ranks": plan.ranks}
               for (name, info), plan in zip(hosts, controller.plans)],
        key=controller.wire.key.hex(), server=network.server.to_json(), controller=network.me.to_json(),
        dims=[list(d) for d in controller.topology.dims],
        backend=controller.chosen.torch if controller.chosen is not None else controller.backend,
        collective_timeout=controller.collective_timeout, generation=controller.generation,
        epoch=network.epoch, started=time.time(), lease_s=lease_s, job=job, job_dir=job_dir)
    record.save()
    return Lease(record)


class Attached(RemoteLauncher):
    """Dials the agents a mesh file names, with its keys and the next epoch."""

    relaunchable = False

    def __init__(self, record: MeshRecord) -> None:
        super().__init__(None, None)
        self.record = record
        self.keys = (net.Keys.from_json(record.server), net.Keys.from_json(record.controller))
        self.epoch = record.epoch
        self.current: SlurmJob | None = None  # an attached Slurm mesh's job

    def plan(self, world_size: int) -> list[HostPlan]:
        return [HostPlan(h, host["ranks"]) for h, host in enumerate(self.record.hosts)]

    def launch(self, plans: list[HostPlan], network: Network, timeout: float) -> "list[LeasedAgent | SlurmAgent]":
        """Dial the agents; a Slurm mesh's job is watched again (its end fails the cell)."""
        for plan in plans:
            host = self.record.hosts[plan.host]
            network.dial(plan.host, host["name"], plan.ranks, host, host["addr"], host["port"])
        if self.record.job:
            self.current = SlurmJob.resume(self.record.job, self.record.job_dir, len(plans), network)
            return [SlurmAgent(self.current, p.host) for p in plans]
        return [LeasedAgent(self.record.hosts[p.host]["pid"]) for p in plans]

    def job(self) -> Any:
        """An attached Slurm mesh's job (as :meth:`Slurm.job`); None for a local one."""
        return self.current.describe() if self.current is not None else None

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
    """The kept meshes this user can attach, oldest first, with files that cannot be used (each
    saying why). The files of meshes that are surely over (see ``MeshRecord.ended``) are removed."""
    records = []
    directory = mesh_dir()
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(".json"):
            continue  # a file being written (*.tmp), or not a mesh file
        record = MeshRecord.load(os.path.join(directory, entry))
        if record.ended():
            record.drop()
        else:
            records.append(record)
    return sorted(records, key=lambda r: r.started)


def attach(mesh_id: str, name_for: Callable[[str], str], timeout: float = 60.0) -> Controller:
    """A controller that took over the kept mesh ``mesh_id`` (see :func:`list_meshes`), named
    ``name_for(the name it was started with)``. Any other controller of it is fenced off."""
    record = next((r for r in list_meshes() if r.id == mesh_id), None)
    if record is None:
        ids = ", ".join(r.id for r in list_meshes()) or "none"
        raise MeshError(f"no kept mesh {mesh_id!r} (meshes that can be attached: {ids}); its lease "
                        f"may have run out. %mesh list (meshbook.list_meshes()) shows them")
    if record.problem:
        raise MeshError(f"kept mesh {mesh_id}: {record.problem}. The mesh may still run (its agent "
                        f"removes the file when it ends); it cannot be attached without a sound file")
    record = _next_epoch(record)
    controller = Controller(Topology(tuple((k, v) for k, v in record.dims)), Attached(record), record.backend,
                            record.collective_timeout, name_for(record.name),
                            key=bytes.fromhex(record.key))
    controller.chosen = Backend(record.backend, "cuda" if "cuda" in record.backend else "cpu")
    controller.lease = Lease(record)
    controller.attach(timeout)
    return controller


def _next_epoch(record: MeshRecord) -> MeshRecord:
    """Take the next epoch, under a lock on the mesh file: two kernels attaching at the same
    moment get two epochs, and the agents fence off the older (on a file system without locks,
    the agents' own rule still lets one controller per epoch through)."""
    with open(record.path + ".lock", "a") as handle:  # not the file itself: saving replaces it
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            fresh = MeshRecord.load(record.path)
            if fresh.problem:
                raise MeshError(f"kept mesh {record.id}: {fresh.problem}")
            fresh.epoch += 1
            fresh.save()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    return fresh


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
