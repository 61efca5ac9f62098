"""The Slurm launcher: one agent per node of a job meshbook submits, or of an allocation the
user already holds, through Slurm's own CLIs (``sbatch``, ``srun``, ``squeue``, ``scancel``).

How the agents and the controller meet: compute nodes often cannot open connections to the
login node, so the agents *listen* and the controller dials them, as with ssh. A batch task
has no stdin of the controller's, and a command line is readable by every user of a node, so
the secrets go in a 0600 bootstrap file inside a 0700 per-job directory under the user's
home (the file system clusters share with their compute nodes). The agents are given only
its path, and each writes the line saying where it listens into that directory
(``listening-<task>``), which the controller polls, then dials. The directory goes when the
mesh stops; a kept mesh's (``keep=``, :mod:`.lease`: the agents' grace is the lease) goes at
the end of its batch script, since no controller may be left to remove it.

The job is watched with ``squeue -h -o`` format strings (``--json`` changed shape across
Slurm versions), every 5 s on a thread (slurmctld serves every user of the cluster): its
state, pending reason, nodes and time left. While it is pending the launcher prints "job 123
pending (Resources), position 2" as that changes; an interrupt then cancels the job. Once it
runs, its end (``scancel``, a node failure, the time limit) makes every agent handle dead
with "job 123 ended: TIMEOUT", which fails the running cell through the controller's usual
agent check; the kernel lives on.

Time limit: with ``on_time_limit`` code, the job is submitted with ``--signal=B:USR1@N``; the
batch script turns the signal into a file the watcher sees, and the code runs on every rank
(after the cell running then, if any: a rank runs one cell at a time). A warning that less
than 10 minutes are left is printed once, at the start of the next cell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...protocol.errors import MeshError
from ...protocol.remote import LISTENING
from .base import AGENT_MODULE, AgentHandle, HostPlan, LaunchContext, Launcher
from .network import Network
from .record import MeshRecord
from .ssh import default_address, plan_hosts

#: squeue's fields, in this order: state, reason, time left, nodes, node count.
SQUEUE_FORMAT = "%T|%r|%L|%N|%D"
#: States in which a job still holds (or waits for) its nodes.
#: What meshbook says when Slurm's commands do not answer (slurmctld busy or restarting): the
#: job counts as active, so a passing hiccup neither fails a cell nor forgets a kept mesh.
UNANSWERED = "UNANSWERED"
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING", "REQUEUED", UNANSWERED}
#: How long a COMPLETING job may take to show how it ended (TIMEOUT, CANCELLED, NODE_FAIL).
COMPLETING_WAIT_S = 30.0
#: How long a Slurm command may take to answer (slurmctld serves the whole cluster).
ANSWER_S = 60.0
#: Less time left than this: a warning in the next cell's output.
WARN_LEFT_S = 600.0
#: The file the batch script touches when Slurm signals the time limit (the watcher runs the
#: hook then); renamed once the hook ran to its end.
SIGNALLED = "time-limit"
#: The keys of ``--slurm`` (``key=value,...``); anything else goes in ``--sbatch``.
SPEC_KEYS = ("job", "nodes", "per-node", "gpus-per-node", "time", "partition")


@dataclass
class JobState:
    """What squeue (or scontrol, once squeue forgot the job) says of a job."""

    state: str
    reason: str = ""
    left: str = ""  # squeue's %L: "1:52:10", "2-00:00:00", "UNLIMITED"
    nodes: str = ""
    node_count: int = 0

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def left_s(self) -> float | None:
        """``left`` in seconds (None: unlimited or unknown)."""
        text = self.left
        days, _, clock = text.rpartition("-")
        try:
            parts = [int(p) for p in clock.split(":")]
            total = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
            return total + (int(days) * 86400 if days else 0)
        except ValueError:
            return None


def query(job: str) -> JobState | None:
    """The job's state from ``squeue -h -t all -j ID -o FORMAT`` (then ``scontrol show job``);
    None when Slurm answered that it no longer knows the job, :data:`UNANSWERED` when neither
    command answered."""
    answered, out = _ask(["squeue", "-h", "-t", "all", "-j", job, "-o", SQUEUE_FORMAT])
    line = out.strip().splitlines()[0] if out.strip() else ""
    if line.count("|") == 4:
        state, reason, left, nodes, count = line.split("|")
        return JobState(state, "" if reason == "None" else reason, left, nodes,
                        int(count) if count.isdigit() else 0)
    told, text = _ask(["scontrol", "-o", "show", "job", job])
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    if "JobState" in fields:
        return JobState(fields["JobState"], fields.get("Reason", ""))
    return None if answered or told else JobState(UNANSWERED, "Slurm's commands did not answer")


def queue_position(job: str) -> int | None:
    """Where the job stands among the pending jobs, by priority (1: next)."""
    pending = _cli(["squeue", "-h", "-t", "PENDING", "--sort=-p,i", "-o", "%i"], check=False).split()
    return pending.index(job) + 1 if job in pending else None


def _ask(argv: list[str]) -> tuple[bool, str]:
    """Run a Slurm query: (did Slurm answer, its output). "Invalid job id" is an answer."""
    done = _run(argv)
    if done is None:
        return False, ""
    return done.returncode == 0 or "Invalid job id" in done.stderr, done.stdout


def _cli(argv: list[str], check: bool = True) -> str:
    done = _run(argv)
    if done is None:
        if check:
            raise MeshError(f"`{' '.join(argv)}` did not answer in 60 s: is slurmctld up?")
        return ""
    if check and done.returncode != 0:
        raise MeshError(f"`{shlex.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _run(argv: list[str]) -> "subprocess.CompletedProcess[str] | None":
    """A Slurm command's outcome; None when it did not answer in 60 s."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=ANSWER_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise MeshError(f"`{argv[0]}` not found: run this where Slurm's commands are installed "
                        f"(a login node), or add them to PATH") from None
    except subprocess.TimeoutExpired:
        return None


class Slurm(Launcher):
    """One agent per node of a Slurm job: submitted with ``sbatch``, or inside an allocation
    the user already has (``job=ID``, through ``srun --jobid``)."""

    name = "slurm"

    def __init__(self, nodes: int | None = None, per_node: int | None = None, *, job: str | int | None = None,
                 time: str | None = None, partition: str | None = None, gpus_per_node: int | None = None,
                 sbatch: str | Sequence[str] = (), python: str | None = None,
                 on_time_limit: str | None = None, signal_s: int = 300, workdir: str | None = None,
                 poll_s: float = 5.0, announce: Callable[[str], None] | None = None,
                 suspect_s: float | None = None, lost_s: float | None = None) -> None:
        super().__init__(suspect_s, lost_s)
        self.job_id = str(job) if job is not None else None
        if self.job_id is not None and (time or partition or gpus_per_node or sbatch):
            raise MeshError("job=ID runs inside an allocation you already have: its time, partition "
                            "and GPUs were set when you made it (drop time=, partition=, "
                            "gpus-per-node=, --sbatch)")
        self.nodes, self.per_node = nodes, per_node or gpus_per_node
        self.time, self.partition, self.gpus_per_node = time, partition, gpus_per_node
        self.sbatch = shlex.split(sbatch) if isinstance(sbatch, str) else list(sbatch)
        #: The Python on the nodes (default: the same path as this one, as on a shared install).
        self.python = python or sys.executable
        self.on_time_limit = on_time_limit
        self.signal_s = signal_s
        #: Where the per-job directories go: the home directory is what nodes usually share.
        self.workdir = workdir or os.path.join(os.path.expanduser("~"), ".meshbook")
        self.poll_s = poll_s
        self.announce = announce or (lambda text: print(text, flush=True))
        self.current: SlurmJob | None = None

    @classmethod
    def from_spec(cls, spec: str, **kw: Any) -> "Slurm":
        """``nodes=2,gpus-per-node=8,time=2:00:00,partition=gpu`` or ``job=123456``."""
        options: dict[str, Any] = {}
        for item in filter(None, spec.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key not in SPEC_KEYS or not value:
                raise MeshError(f"--slurm {spec!r}: {item!r} is not one of {', '.join(k + '=' for k in SPEC_KEYS)} "
                                f"(other sbatch options go in --sbatch \"--account=proj --qos=high\")")
            if key in ("nodes", "per-node", "gpus-per-node"):
                if not value.isdigit() or int(value) < 1:
                    raise MeshError(f"--slurm {key}={value}: give a positive whole number")
                options[key.replace("-", "_")] = int(value)
            else:
                options[key] = value
        per_node = kw.pop("per_node", None)  # --per-host, where the spec has no per-node=
        if per_node is not None:
            options.setdefault("per_node", per_node)
        return cls(**options, **kw)

    # -- planning ----------------------------------------------------------------------------

    def node_count(self) -> int | None:
        """The nodes: as asked, or those of the allocation (``job=ID``)."""
        if self.job_id is None or self.nodes is not None:
            return self.nodes
        state = query(self.job_id)
        if state is None or state.state != "RUNNING":
            raise MeshError(f"job {self.job_id} is {state.state if state else 'unknown to Slurm'}: "
                            f"job=ID needs an allocation that is running (see squeue -u $USER)")
        self.nodes = state.node_count
        return self.nodes

    def default_ranks(self) -> int | None:
        """The world size when none was given: nodes x ranks per node (GPUs per node, or 1)."""
        nodes = self.node_count()
        return nodes * (self.per_node or 1) if nodes else None

    def plan(self, world_size: int) -> list[HostPlan]:
        nodes = self.node_count()
        if nodes is None and self.per_node is None:
            raise MeshError("the Slurm launcher needs nodes=N (or per-node=K): --slurm nodes=2")
        return plan_hosts(world_size, nodes, self.per_node, "Slurm launcher")

    # -- launching ---------------------------------------------------------------------------

    def launch(self, plans: list[HostPlan], ctx: LaunchContext, timeout: float) -> list[AgentHandle]:
        """Submit (or step into) the job, wait while it is pending, then dial every node's agent
        (a kept mesh found again: dial the recorded agents, and watch its job again)."""
        network = ctx.network
        assert network is not None
        if self.record is not None:
            self.dial_recorded(plans, ctx)
            self.current = SlurmJob.resume(self, self.record.launcher_state["job"],
                                           self.record.launcher_state["dir"], len(plans), network)
            return [SlurmAgent(self.current, p.host) for p in plans]
        job = SlurmJob(self, len(plans), network)
        self.current = job
        try:
            job.start()
            job.wait_running()
            infos = job.infos = job.wait_listening(time.monotonic() + timeout)
            for plan, info in zip(plans, infos):
                network.dial(plan.host, info.get("hostname") or info["addr"], plan.ranks, info,
                             info["addr"], info["port"])
        except KeyboardInterrupt:
            job.close(5.0)
            what = (f"cancelled Slurm job {job.id or '(not submitted)'}" if job.submitted else
                    f"ended the srun step in your job {job.id} (the allocation is still yours)")
            raise MeshError(f"interrupted: {what}{' while it was pending' if job.was_pending else ''}") from None
        except BaseException:
            job.close(5.0)
            raise
        job.watch()
        return [SlurmAgent(job, plan.host) for plan in plans]

    def relaunch(self, plan: HostPlan, ctx: LaunchContext, timeout: float) -> AgentHandle:
        raise MeshError("a node of a Slurm job cannot be started again alone: stop this mesh and "
                        "start a new one (%mesh stop, then %mesh start --slurm ...)")

    def keep(self, lease_s: float, mesh_file: str) -> None:
        """The job's agents get ``lease_s`` as their grace and the mesh file's path in their
        bootstrap; the mesh file names the job (``to_record``)."""
        if self.job_id is not None:
            raise MeshError("keep= with --slurm job=ID is not supported yet: the agents' srun step "
                            "belongs to this kernel; keep a job meshbook submits (--slurm nodes=N)")
        self.lease_s, self.mesh_file, self.epoch = lease_s, mesh_file, 1

    def to_record(self) -> dict[str, Any]:
        job = self.current
        assert job is not None
        # The hook too: the job was submitted to signal it, and a kernel that attaches the
        # mesh later is the one that must run it; and how early, which its watcher also goes by
        # where the signal's file never comes (``_step_near_limit``).
        return {"job": job.id or "", "dir": job.dir, "on_time_limit": self.on_time_limit,
                "signal_s": self.signal_s}

    @classmethod
    def from_record(cls, record: MeshRecord) -> "Launcher":
        state = record.launcher_state
        launcher = cls(workdir=os.path.dirname(state["dir"]), on_time_limit=state.get("on_time_limit"),
                       signal_s=state.get("signal_s", 300))
        launcher.find_again(record)
        return launcher

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--slurm", help="start the ranks in a Slurm job, one agent per node: nodes=2,"
                                            "gpus-per-node=8,time=2:00:00,partition=gpu (sbatch), or job=ID "
                                            "(srun inside an allocation you have)")
        parser.add_argument("--sbatch", help='--slurm: more sbatch options, e.g. "--account=proj --qos=high" '
                                             '(one alone: --sbatch=--account=proj)')
        parser.add_argument("--on-time-limit", help='--slurm: code every rank runs when Slurm signals the '
                                                    'time limit is near, e.g. "save()"')

    option, companions = "slurm", ("sbatch", "on_time_limit")

    @classmethod
    def from_options(cls, args: argparse.Namespace) -> "Slurm":
        return cls.from_spec(args.slurm, sbatch=args.sbatch or (), per_node=args.per_host, python=args.python,
                             on_time_limit=args.on_time_limit)

    def watch(self, mesh: Any) -> None:
        """Called with the started mesh: warn in the next cell when time runs short, and run
        ``on_time_limit`` on the ranks when Slurm signals the job."""
        job = self.current
        if job is not None:  # this mesh's job: a later mesh from this launcher has its own
            job.mesh = mesh
            mesh.controller.add_run_listener(lambda run: job.warn_once())

    def job(self) -> "JobInfo | None":
        """The job of the running mesh: id, state, nodes, time left (None before launch)."""
        return self.current.describe() if self.current is not None else None


@dataclass(frozen=True)
class JobInfo:
    """What ``mesh.job()`` and ``%mesh status`` show of a mesh's Slurm job."""

    job: str
    state: str  # RUNNING, or "job 123 ended: TIMEOUT"
    reason: str
    nodes: str  # h[1-2]
    left: str  # "1:52:10" (squeue's %L; empty once ended)
    submitted: bool  # meshbook submitted it (and cancels it on stop); False: the user's allocation

    def __str__(self) -> str:
        return (f"Slurm job {self.job}: {self.state}" + (f" on {self.nodes}" if self.nodes else "")
                + (f", {self.left} left" if self.left else ""))


class SlurmJob:
    """One Slurm job (or step in a user's allocation) running a mesh's agents, and its watcher."""

    def __init__(self, launcher: Slurm, nodes: int, network: Network, job_dir: str | None = None) -> None:
        self.launcher = launcher
        self.nodes = nodes
        self.network = network
        self.id = launcher.job_id
        self.submitted = launcher.job_id is None  # ours to cancel
        os.makedirs(launcher.workdir, mode=0o700, exist_ok=True)
        self.dir = job_dir or tempfile.mkdtemp(prefix="slurm-", dir=launcher.workdir)  # 0700
        self.infos: list[dict[str, Any]] = []  # each node's LISTENING line, in task order
        self.step: subprocess.Popen[bytes] | None = None  # srun, for job=ID
        self.state = JobState("PENDING")
        self.ended: str | None = None  # "job 123 ended: TIMEOUT"
        self.looked_at = 0.0  # when the watcher's last finished look began (time.monotonic())
        self.was_pending = False
        self.listening = False  # every agent listened: stopping them ends the job
        self.warned = False
        self.hook_ran = False
        self.mesh: Any = None
        self.handles = nodes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def resume(cls, launcher: Slurm, job_id: str, job_dir: str, nodes: int, network: Network) -> "SlurmJob":
        """The job of a kept mesh that another kernel submitted (``attach``): watched as ours
        (its time-limit hook run by this kernel), and ended (then cancelled if need be) when
        the mesh is stopped."""
        job = cls(launcher, nodes, network, job_dir)
        job.id, job.listening = job_id, True
        job.refresh()
        job.watch()
        return job

    # -- start-up ----------------------------------------------------------------------------

    def start(self) -> None:
        kept = {"lease_s": self.launcher.lease_s, "mesh_file": self.launcher.mesh_file} \
            if self.launcher.lease_s is not None else {}
        boot = self.network.bootstrap(False, controller_hint=default_address(), **kept).to_dict()
        path = os.path.join(self.dir, "bootstrap.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(boot, f)
        agent = [self.launcher.python, "-m", AGENT_MODULE, "listen", "--bootstrap-file", path,
                 "--announce-dir", self.dir]
        if self.submitted:
            self._submit(agent)
        else:
            self._step_into(agent)

    def _submit(self, agent: list[str]) -> None:
        """``sbatch`` a script that runs one agent per node with ``srun``."""
        opts = self.launcher
        script = os.path.join(self.dir, "job.sh")
        signal_line = (f"trap 'touch {shlex.quote(os.path.join(self.dir, SIGNALLED))}' USR1\n"
                       if opts.on_time_limit else "")
        with open(script, "w") as f:
            f.write("#!/bin/bash\n# a meshbook mesh: one host agent per node\n"
                    "unset SSH_CONNECTION  # the agents advertise the route to the controller\n"
                    f"{signal_line}"
                    f"srun --ntasks-per-node=1 --ntasks={self.nodes} {shlex.join(agent)} &\n"
                    "step=$!\n"
                    "while kill -0 $step 2>/dev/null; do wait $step; done  # a trapped signal ends a wait\n"
                    # a kept mesh's agents end when its lease runs out, with no controller to clean up
                    + (f"rm -rf {shlex.quote(self.dir)}\n" if opts.lease_s is not None else ""))
        argv = ["sbatch", "--parsable", f"--nodes={self.nodes}", "--ntasks-per-node=1",
                "--job-name=meshbook", f"--chdir={self.dir}", f"--output={self.dir}/slurm-%j.out"]
        argv += [f"--time={opts.time}"] * bool(opts.time) + [f"--partition={opts.partition}"] * bool(opts.partition)
        argv += [f"--gpus-per-node={opts.gpus_per_node}"] * bool(opts.gpus_per_node)
        argv += [f"--signal=B:USR1@{opts.signal_s}"] * bool(opts.on_time_limit)
        self.id = _cli([*argv, *opts.sbatch, script]).strip().split(";")[0]
        opts.announce(f"submitted Slurm job {self.id}")

    def _step_into(self, agent: list[str]) -> None:
        """``srun --jobid`` one agent per node of the user's running allocation."""
        assert self.id is not None
        log = open(os.path.join(self.dir, "srun.out"), "wb")
        env = {k: v for k, v in os.environ.items() if k != "SSH_CONNECTION"}
        with log:
            self.step = subprocess.Popen(
                ["srun", f"--jobid={self.id}", f"--nodes={self.nodes}", f"--ntasks={self.nodes}",
                 "--ntasks-per-node=1", "--overlap", f"--chdir={self.dir}", *agent],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)

    def wait_running(self) -> None:
        """Until the job runs; show its pending reason and position as they change."""
        shown = None
        while True:
            state = self.refresh()
            if state.state == "RUNNING":
                return
            if not state.active:
                raise MeshError(f"Slurm job {self.id} ended before it started: {state.state}"
                                f"{f' ({state.reason})' if state.reason else ''}{self.output_tail()}")
            self.was_pending = True
            line = (f"job {self.id} {state.state.lower()}" + (f" ({state.reason})" if state.reason else "")
                    + (f", position {p}" if (p := queue_position(self.id or "")) else ""))
            if line != shown:
                self.launcher.announce(line)
                shown = line
            time.sleep(self.launcher.poll_s)

    def wait_listening(self, deadline: float) -> list[dict[str, Any]]:
        """Each task's LISTENING line, in task order (task i is host i)."""
        names = [f"listening-{i}" for i in range(self.nodes)]
        while True:
            found = [n for n in names if os.path.exists(os.path.join(self.dir, n))]
            if len(found) == len(names):
                self.listening = True
                return [self._read_listening(n) for n in names]
            if self.step is not None and self.step.poll() is not None:
                raise MeshError(f"srun in job {self.id} ended with exit code {self.step.returncode} before "
                                f"every agent listened{self.output_tail()}")
            state = self.refresh()
            if not state.active:
                raise MeshError(f"Slurm job {self.id} ended while its agents started: {state.state}"
                                f"{self.output_tail()}")
            if time.monotonic() > deadline:
                raise MeshError(f"only {len(found)} of {self.nodes} agents of Slurm job {self.id} started "
                                f"in time; check that {self.launcher.python} on the nodes has meshbook "
                                f"installed (python=, --python) or pass a larger timeout={self.output_tail()}")
            time.sleep(0.2)

    def _read_listening(self, name: str) -> dict[str, Any]:
        with open(os.path.join(self.dir, name)) as f:
            line = f.read().strip()
        return json.loads(line[len(LISTENING):])

    def output_tail(self) -> str:
        """The end of the job's (or srun's) output, for an error message."""
        logs = [os.path.join(self.dir, n) for n in os.listdir(self.dir) if n.endswith(".out")] \
            if os.path.isdir(self.dir) else []
        text = ""
        for log in logs:
            with open(log, errors="replace") as f:
                text += f.read()
        return f"; its output ends with:\n{text.strip()[-3000:]}" if text.strip() else ""

    # -- watching ----------------------------------------------------------------------------

    def refresh(self) -> JobState:
        state = query(self.id or "")
        self.state = state or JobState("UNKNOWN (no longer known to Slurm)")
        return self.state

    def watch(self) -> None:
        self._thread = threading.Thread(target=self._watch, name=f"slurm-job-{self.id}", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        completing = None  # since when the job is COMPLETING: its final state comes once its
        while not self._stop.wait(self.launcher.poll_s):  # processes are gone (KillWait)
            began = time.monotonic()
            state = self.refresh()
            if state.state == "COMPLETING":
                completing = completing or time.monotonic()
            if not state.active or completing and time.monotonic() - completing > COMPLETING_WAIT_S:
                self.ended = f"job {self.id} ended: {state.state}" + (f" ({state.reason})" if state.reason else "")
            elif self.step is not None and self.step.poll() is not None:
                self.ended = f"the srun step of job {self.id} ended (exit code {self.step.returncode})"
            if self.ended is not None or not completing:  # an agent's death may be reported now
                self.looked_at = began
            if self.ended is not None:
                return
            if os.path.exists(os.path.join(self.dir, SIGNALLED)) or self._step_near_limit(state):
                self._start_hook()

    def _step_near_limit(self, state: JobState) -> bool:
        """In a user's allocation there is no batch script to signal: go by the time left."""
        left = state.left_s()
        return self.step is not None and left is not None and left <= self.launcher.signal_s

    def _start_hook(self) -> None:
        """``on_time_limit`` on every rank, once, on a thread of its own: the watcher looks on
        meanwhile, so ranks that die under the hook are told, and fail its run."""
        if self.hook_ran or not self.launcher.on_time_limit or self.mesh is None or self._stop.is_set():
            return
        self.hook_ran = True
        threading.Thread(target=self._run_hook, name=f"slurm-job-{self.id}-hook", daemon=True).start()

    def _run_hook(self) -> None:
        code = self.launcher.on_time_limit
        self.launcher.announce(f"job {self.id}: Slurm signalled the time limit ({self.state.left} left): "
                               f"running on_time_limit on every rank")
        try:
            self.mesh.run(code).result()
            self.launcher.announce(f"job {self.id}: on_time_limit done")
        except Exception as exc:  # the job is ending anyway: say why the checkpoint failed
            self.launcher.announce(f"job {self.id}: on_time_limit failed: {exc}")
        # Run to its end: a kernel that attaches this (kept) mesh later must not run it again.
        # One that died before this line, mid-hook, leaves it to the next; so does one that let
        # go of the mesh meanwhile (its run failed for that: the next kernel runs it).
        if not self._stop.is_set():
            with contextlib.suppress(OSError):
                os.replace(os.path.join(self.dir, SIGNALLED), os.path.join(self.dir, SIGNALLED + "-handled"))

    def warn_once(self) -> None:
        left = self.state.left_s()
        if not self.warned and left is not None and left < WARN_LEFT_S and self.ended is None:
            self.warned = True
            print(f"meshbook: Slurm job {self.id} has {self.state.left} left (time limit); "
                  f"save what you need", file=sys.stderr, flush=True)

    def describe(self) -> "JobInfo":
        s = self.state
        return JobInfo(self.id or "", self.ended or s.state, s.reason, s.nodes,
                       s.left if s.active and not self.ended else "", self.submitted)

    # -- ending ------------------------------------------------------------------------------

    def release(self, timeout: float) -> None:
        """One agent handle let go; the last one ends the job."""
        self.handles -= 1
        if self.handles <= 0:
            self.close(timeout)

    def stop_watching(self, timeout: float | None) -> None:
        """Stop the watcher, waiting up to ``timeout`` for it (None: not at all)."""
        self._stop.set()
        if timeout is not None and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def close(self, timeout: float) -> None:
        """Stop watching; end the srun step or cancel the job we submitted; remove the directory."""
        self.stop_watching(timeout)
        if self.step is not None:
            _end(self.step, timeout)
        elif self.id is not None:
            self._cancel(timeout)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _cancel(self, timeout: float) -> None:
        """A job whose agents were told to stop completes by itself: give it ``timeout``; cancel
        it otherwise (at once if it never got that far), and wait until Slurm lets it go."""
        if not (self.listening and self._wait_inactive(timeout)):
            _cli(["scancel", self.id or ""], check=False)
            self._wait_inactive(timeout)

    def _wait_inactive(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (state := query(self.id or "")) is not None and state.active:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True


def _end(proc: subprocess.Popen[bytes], timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # srun passes SIGTERM to the step's tasks
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SlurmAgent(AgentHandle):
    """A node's agent in a Slurm job: alive while the job (or srun step) runs."""

    def __init__(self, job: SlurmJob, host: int) -> None:
        self.job = job
        self.host = host
        self.released = False
        self.notice_s = 2 * job.launcher.poll_s  # squeue is asked every poll_s

    def alive(self) -> bool:
        return self.job.ended is None

    def told_since(self, since: float) -> bool:
        """Once the watcher looked at the job after the agent stopped and found it running or
        ended (squeue is asked every ``poll_s`` and answers late when slurmctld is busy: a
        notice of twice that lost the job's end under load), or Slurm did not answer in time."""
        return self.job.looked_at >= since or time.monotonic() - since >= self.notice_s + ANSWER_S

    def exit_reason(self) -> str:
        return self.job.ended or "running"

    def terminate(self, timeout: float = 5.0) -> None:
        if not self.released:
            self.released = True
            self.job.release(timeout)

    def let_go(self) -> None:
        """The job runs on for whoever attaches the mesh: its watcher here would still run the
        time-limit hook on a mesh this process no longer drives. Not waited for: a watcher
        stuck in a slow squeue would hold the detach (at kernel exit too)."""
        self.job.stop_watching(None)
