"""The mesh file's record of a kept mesh: what reaches, authenticates to and rebuilds it.

A :class:`MeshRecord` is plain data (JSON in ``~/.meshbook/meshes/<id>.json``, 0600 in a 0700
directory); :mod:`.kept` decides what to do with the records (list them, drop the ended ones,
take the next epoch), and a launcher's :meth:`~.base.Launcher.from_record` finds the mesh again
from one.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ...protocol import net
from ...protocol.errors import MeshError
from ...protocol.versions import mismatch, versions


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
    #: What its launcher needs to find it again (a Slurm job's id and directory).
    launcher_state: dict[str, Any] = field(default_factory=dict)
    #: The versions the mesh runs (protocol, meshbook, torch, Python): an attaching kernel
    #: must run the same.
    versions: dict[str, str] = field(default_factory=dict)
    job_state: str = ""  # a Slurm job's state when list_meshes() last asked Slurm
    #: Why the file cannot be used (it is listed, never deleted: only its agent knows whether
    #: the mesh still runs); empty for a sound record.
    problem: str = ""

    @property
    def path(self) -> str:
        return os.path.join(mesh_dir(), f"{self.id}.json")

    @property
    def job(self) -> str:
        return str(self.launcher_state.get("job", ""))

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
        used: unreadable, truncated, with fields of the wrong kind, or of other versions."""
        mesh_id = os.path.basename(path)[:-len(".json")]
        try:
            with open(path) as f:
                record = cls(**json.load(f))
            record.check()
        except (OSError, ValueError, TypeError) as exc:
            return cls.broken(mesh_id, f"its file {path} cannot be used ({type(exc).__name__}: {exc})")
        different = mismatch(versions(), record.versions, "this kernel", f"kept mesh {mesh_id}")
        if different:
            record.problem = different
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

    def drop(self) -> None:
        """Forget an ended mesh: its file and, for a Slurm job, the job's directory."""
        _remove(self.path)
        _remove(self.path + ".lock")
        if self.launcher_state.get("dir"):
            shutil.rmtree(self.launcher_state["dir"], ignore_errors=True)

    def __repr__(self) -> str:
        """Its row, never its keys: ``meshbook.list_meshes()`` in a cell prints it, and a
        notebook's outputs are saved and shared (the file itself is 0600 for them)."""
        row = self.row()
        del row["attached"]  # known to the listing, not to the record
        return "MeshRecord(" + ", ".join(f"{name.replace(' ', '_')}={value!r}" for name, value in row.items()) + \
            (f", problem={self.problem!r}" if self.problem else "") + ")"

    def row(self, attached_here: str = "") -> dict[str, Any]:
        """This mesh as a row of ``%mesh list`` (``attached_here``: its name in this process)."""
        if self.problem:
            return {"id": self.id, "name": self.name, "launcher": self.launcher, "hosts": "-", "ranks": "-",
                    "job": "-", "dims": "-", "age": "-", "lease left": "-", "attached": f"unusable: {self.problem}"}
        return {"id": self.id, "name": self.name, "launcher": self.launcher,
                "hosts": ",".join(h["name"] for h in self.hosts),
                "ranks": sum(len(h["ranks"]) for h in self.hosts),
                "job": f"{self.job} {self.job_state}".strip() if self.job else "-",
                "dims": ",".join(f"{k}={v}" for k, v in self.dims),
                "age": format_duration(time.time() - self.started),
                "lease left": format_duration(self.lease_left()),
                "attached": f"here, as {attached_here}" if attached_here else "-"}


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
