"""The bodies of the controller's handshakes with a host agent, as dataclasses.

A host agent learns everything it needs from two bodies:

* :class:`Bootstrap`, before any link exists: how to meet the controller (a listening agent's
  Curve keys, a joining one's token; what a kept mesh's agent needs to outlive its kernel).
  On the ssh session's stdin, in a 0600 file (a batch job), or in a join token;
* :class:`AgentConfig`, once it is reached: which ranks it forks into which mesh, backend and
  generation. A JSON line on stdin for the agent on this host, the ``CONFIGURE`` operation
  over the link for another.

Both carry the versions their sender runs (:mod:`.versions`), and both are plain JSON-able
data (``to_dict``/``from_dict``): a body of one version never needs the other's classes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .versions import versions


@dataclass
class AgentConfig:
    """What a host agent is told before it forks its ranks."""

    host: int  # its index in the mesh (host 0 keeps the store of a mesh across hosts)
    hosts: int
    ranks: list[int]
    dims: list[list[Any]]  # [name, size] per mesh dimension
    backend: str  # torch's backend string, chosen by the controller for every rank
    device_type: str  # "cpu" or "cuda"
    listen_addr: str  # the address whose interface gloo/NCCL listen on
    collective_timeout: float
    generation: int = 0
    master_port: int = 0  # torchrun's MASTER_PORT for scripts that read it
    #: This host's agent only: the mesh key, the runtime directory and the controller's
    #: sockets there, its log, and the environment its ranks start with (the notebook's).
    key: str = ""
    rundir: str = ""
    cmd_addr: str = ""
    events_addr: str = ""
    log: str = ""
    env: dict[str, str] | None = None
    #: Another host's agent only: where the ranks meet (host 0's agent serves it).
    store: list[Any] | None = None
    serve_store: bool = False
    versions: dict[str, str] = field(default_factory=versions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AgentConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Bootstrap:
    """What an agent on another host (or a kept mesh's) needs to meet its controller."""

    key: str  # the mesh key (HMAC), hex
    server_public: str  # the Curve server pair the agent listens with (join: the server's key)
    server_secret: str = ""
    controller_public: str = ""  # the only key a listening agent admits
    lost_s: float = 15.0  # how long it may go without hearing its controller
    tunnel: bool = False  # listen on loopback, reached through ``ssh -L``
    env: dict[str, str] = field(default_factory=dict)  # variables the user named for the ranks
    controller_hint: str = ""  # the controller's address, for the agent's route to it
    #: A kept mesh: the agent outlives its kernel for ``lease_s`` after it was last heard, and
    #: removes the mesh file (and its log) when it ends.
    lease_s: float | None = None
    mesh_file: str = ""
    log: str = ""
    #: A joining agent: where the controller listens, the one-time join key pair, how long the
    #: controller waits.
    controller: list[Any] | None = None
    join: dict[str, str] | None = None
    timeout: float = 120.0
    versions: dict[str, str] = field(default_factory=versions)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, "", {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Bootstrap":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
