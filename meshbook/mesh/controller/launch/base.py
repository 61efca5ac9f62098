"""The launcher contract: how a mesh's host agents are started, watched, kept and found again.

A launcher is one way to put host agents (``python -m meshbook.mesh.agent``) where the ranks
should run: this machine (``local``), hosts reached by the system ``ssh`` (``ssh``), hosts that
run a printed command from any launcher (``join``), a Slurm job (``slurm``). Each is a subclass
of :class:`Launcher` registered under the entry-point group ``meshbook.launchers`` (see
:mod:`meshbook.mesh.controller.launch`), so a site adds its own (a Kubernetes launcher, say)
from its own package, without patching meshbook:

* ``plan`` which ranks go on which host (refusing a layout before anything is built), and
  ``default_ranks`` when none are asked for;
* ``launch`` the agents and hand back an :class:`AgentHandle` each: an agent on this machine
  reads its configuration on stdin; one on another host is reached over a link of the
  :class:`~.network.Network` in the :class:`LaunchContext` (it listens and the controller dials
  it, or it dials in), and reports its address, store port and GPU count;
* ``relaunch``/``replace_host`` a lost host (by default a launcher cannot, and says so);
* ``watch`` the mesh once it runs, and describe its ``job`` (a Slurm job's state and time left);
* keep a mesh past the kernel: ``keep`` it (its agents then listen, detached, for ``lease_s``
  after a controller was last heard), describe it in ``to_record`` for the mesh file, and
  ``from_record`` build the launcher that finds its agents again (``%mesh attach``); a
  handle's ``let_go`` stops what watches an agent once its mesh is detached;
* ``add_arguments``/``from_args``: the options ``%mesh start`` gets from it.
"""

from __future__ import annotations

import abc
import argparse
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ...protocol.bodies import AgentConfig
from ...protocol.errors import MeshError
from ...protocol.proc import exited
from .network import Network
from .record import MeshRecord

#: What a launcher runs, with ``python -m``, on each host (tests find agents and ranks by it).
AGENT_MODULE = "meshbook.mesh.agent"


@dataclass(frozen=True)
class HostPlan:
    """The ranks one host runs (``host``: its index in the mesh, 0 keeps the store)."""

    host: int
    ranks: list[int]


class AgentHandle(abc.ABC):
    """One host agent, as its launcher knows it."""

    #: Does it run on this machine (its ranks can map this process's shared memory)?
    same_host: bool = False
    #: The GPUs its ranks see, as the agent counted them (an agent on another host says so on
    #: its link, which the controller reads instead).
    gpus: int = 0
    #: How long after its agent ended :meth:`alive` may take to say so (a batch job's state is
    #: polled). An agent that says it stopped on its own is reported with :meth:`exit_reason`
    #: (it knows more: "job 12 ended: CANCELLED") if that comes in time (:meth:`told_since`).
    notice_s: float = 0.0

    def told_since(self, since: float) -> bool:
        """Has the launcher had its say on an agent that stopped at ``since`` (``time.monotonic()``)?
        By default once ``notice_s`` passed; a launcher that polls says so once a poll begun
        after ``since`` is done (a busy batch system answers late, not wrongly)."""
        return time.monotonic() - since >= self.notice_s

    def configure(self, config: AgentConfig) -> None:
        """Hand an agent on this host its configuration (its stdin). An agent on another host
        gets it over its link (the ``CONFIGURE`` operation) instead."""
        raise MeshError(f"{type(self).__name__} is configured over its link, not by its launcher")

    @abc.abstractmethod
    def alive(self) -> bool:
        """As far as its launcher can tell (a remote agent's liveness is its heartbeat)."""

    @abc.abstractmethod
    def exit_reason(self) -> str:
        """Why it is gone, in words, with what it said last (its log's end)."""

    @abc.abstractmethod
    def terminate(self, timeout: float) -> None:
        """End it: it stops its ranks and exits (forced after ``timeout``)."""

    def let_go(self) -> None:
        """This process no longer drives it (a kept mesh detached: another kernel attached it,
        or this one ends), and it runs on: stop what watches it here. By default nothing does."""


@dataclass
class LaunchContext:
    """What a launch gets from the controller."""

    #: The links to agents on other hosts (their keys, the allowlist, where joiners dial).
    network: Network | None = None
    #: The environment of an agent on this host (the notebook's as it is at ``start()``).
    env: dict[str, str] = field(default_factory=dict)


class Launcher(abc.ABC):
    """One way to start a mesh's host agents (see the module's doc)."""

    #: Its name: in the registry, ``start(launcher=NAME)``, the mesh file.
    name: ClassVar[str] = ""
    #: Can it start a lost host's agent again (``%mesh restart`` of its ranks)?
    relaunchable: ClassVar[bool] = False

    def __init__(self, suspect_s: float | None = None, lost_s: float | None = None) -> None:
        """``suspect_s``/``lost_s``: how long a host may be silent before it is suspect, and
        lost (defaults: ``MESHBOOK_HOST_SUSPECT_S``/``MESHBOOK_HOST_LOST_S``, 5 and 15 s)."""
        from ...protocol import config

        self.suspect_s = float(suspect_s if suspect_s is not None else config.host_suspect_s())
        self.lost_s = float(lost_s if lost_s is not None else config.host_lost_s())
        if not 0 < self.suspect_s <= self.lost_s:
            raise MeshError(f"host liveness: suspect after {self.suspect_s:g} s and lost after "
                            f"{self.lost_s:g} s; give 0 < suspect_s <= lost_s")
        #: A kept mesh (``keep``): how long its agents outlive a silent controller, and where
        #: its mesh file goes; None: the agents end with the controller.
        self.lease_s: float | None = None
        self.mesh_file = ""
        #: The Curve keys and epoch of a mesh found again (``from_record``); None: new ones.
        self.keys: Any = None
        self.epoch = 0
        #: The mesh file's record when this launcher finds a kept mesh again (attach).
        self.record: MeshRecord | None = None

    @property
    def remote(self) -> bool:
        """Are its agents reached over links (any host), rather than a pipe on this one?"""
        return True

    # -- planning ----------------------------------------------------------------------------

    @abc.abstractmethod
    def plan(self, world_size: int) -> list[HostPlan]:
        """Which ranks go on which host; a ``MeshError`` for a layout that cannot be."""

    def default_ranks(self) -> int | None:
        """The world size when none is given: hosts x ranks per host, when both are known."""
        return None

    def plans_for(self, world_size: int) -> list[HostPlan]:
        """The plan of a new mesh, or the hosts of a kept mesh found again."""
        if self.record is not None:
            return [HostPlan(h, list(host["ranks"])) for h, host in enumerate(self.record.hosts)]
        return self.plan(world_size)

    # -- starting ----------------------------------------------------------------------------

    @abc.abstractmethod
    def launch(self, plans: list[HostPlan], ctx: LaunchContext, timeout: float) -> list[AgentHandle]:
        """Start an agent per plan (or find a kept mesh's again); for remote agents, leave a
        link to each in ``ctx.network``. Ends whatever it started if it fails."""

    def relaunch(self, plan: HostPlan, ctx: LaunchContext, timeout: float) -> AgentHandle:
        """A new agent for a host whose agent is gone (``%mesh restart`` of its ranks)."""
        raise MeshError(f"a mesh started with the {self.name} launcher cannot start a host's agent again: "
                        f"stop this mesh and start a new one (%mesh stop, then %mesh start ...)")

    def replace_host(self, host: int, name: str) -> None:
        """Host ``host``'s agent starts on ``name`` from now on (its old host is lost)."""
        raise MeshError(f"a mesh started with the {self.name} launcher cannot move a host elsewhere")

    # -- watching ----------------------------------------------------------------------------

    def watch(self, mesh: Any) -> None:
        """Called with the started (or attached) mesh."""

    def job(self) -> Any:
        """What the mesh runs in, when that is news (a Slurm job); None otherwise."""
        return None

    # -- keeping -----------------------------------------------------------------------------

    def keep(self, lease_s: float, mesh_file: str) -> None:
        """Start the mesh's agents so that they outlive this process by ``lease_s`` after it
        was last heard, removing ``mesh_file`` when they end."""
        raise MeshError(f"the {self.name} launcher cannot keep a mesh past its kernel: start it on this "
                        f"machine (no --hosts/--join) or with --slurm to keep it across kernel restarts")

    def to_record(self) -> dict[str, Any]:
        """What the mesh file needs, besides what every kept mesh records, to find the mesh
        again (a Slurm job's id and directory)."""
        return {}

    @classmethod
    def from_record(cls, record: MeshRecord) -> "Launcher":
        """A launcher that finds the kept mesh of ``record`` again: it dials the agents there,
        with the record's keys and its next epoch."""
        launcher = cls.__new__(cls)
        Launcher.__init__(launcher)
        launcher.find_again(record)
        return launcher

    def find_again(self, record: MeshRecord) -> None:
        """Dial the agents of ``record``'s kept mesh, with its keys and its next epoch, instead
        of launching any (for a ``from_record`` that makes its launcher with options of its own)."""
        from ...protocol.net import Keys

        self.keys = (Keys.from_json(record.server), Keys.from_json(record.controller))
        self.epoch = record.epoch
        self.record = record

    def dial_recorded(self, plans: list[HostPlan], ctx: LaunchContext, same_host: bool = False) -> list[AgentHandle]:
        """``launch`` of a launcher made by ``from_record``: connect to the recorded agents
        (``same_host``: they run on this machine)."""
        assert self.record is not None and ctx.network is not None
        for plan in plans:
            host = self.record.hosts[plan.host]
            ctx.network.dial(plan.host, host["name"], plan.ranks, {**host, "versions": self.record.versions},
                             host["addr"], host["port"])
        return [RecordedAgent(self.record.hosts[p.host]["pid"], ctx.network.links[p.host], same_host) for p in plans]

    # -- the %mesh start face ----------------------------------------------------------------

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add this launcher's own ``%mesh start`` options (``--per-host`` and ``--python``,
        which several share, are :func:`shared_arguments`)."""

    #: The ``%mesh start`` option (its dest) that asks for this launcher, and those that only
    #: go with it: :meth:`from_args` refuses the latter without the former.
    option: ClassVar[str | None] = None
    companions: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Launcher | None":
        """This launcher, when ``%mesh start``'s options ask for it (:attr:`option`, then
        :meth:`from_options`); None otherwise."""
        if cls.option is None or not getattr(args, cls.option, None):
            for flag in cls.companions:
                if getattr(args, flag, None) not in (None, False, ()):
                    raise MeshError(f"--{flag.replace('_', '-')} goes with --{cls.option}")
            return None
        return cls.from_options(args)

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> "Launcher":
        """This launcher, from ``%mesh start``'s options (its :attr:`option` is given)."""
        raise NotImplementedError(f"the {cls.name} launcher names an option but cannot be made from it")


def shared_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``%mesh start`` that several launchers take: declared once."""
    parser.add_argument("--per-host", type=int, help="ranks per host (default: ranks / hosts)")
    parser.add_argument("--python", help="the Python on the hosts (default: this kernel's path)")


class RecordedAgent(AgentHandle):
    """A kept mesh's agent that another process started, found again through its mesh file:
    known by its link (and its pid, on this machine)."""

    def __init__(self, pid: int, link: Any, same_host: bool = False) -> None:
        self.pid, self.link, self.same_host = pid, link, same_host

    def alive(self) -> bool:
        return self.link.state not in ("lost", "stopped")

    def exit_reason(self) -> str:
        return f"its agent (pid {self.pid}) is {self.link.state}"

    def terminate(self, timeout: float) -> None:
        """It was told to stop over its link (and ends its ranks itself). On this machine,
        wait for it to be gone, as for an agent this process started: the mesh is over (and
        its file, which the agent removes, gone from %mesh list) once stop() returns."""
        deadline = time.monotonic() + timeout
        while self.same_host and not exited(self.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
