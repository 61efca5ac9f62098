"""A real Slurm on the namespace-hosts: slurmctld on the login node, one slurmd per host.

Why a real Slurm: the Slurm launcher is only as good as its reading of what ``sbatch``,
``srun``, ``squeue -h -o`` and ``scancel`` really do (pending reasons, time limits, a
cancelled job's state), and those differ across versions; a fake would encode our guesses.

The layout, as on a cluster: ``munged`` and ``slurmctld`` run in the root namespace (the
login node; slurmctld is reached at :attr:`Hosts.controller_addr`), and each host runs
``slurmd -N <host>`` inside its namespace, registered with ``NodeAddr`` = the host's address,
so every node has its own address and a job step's processes live in that host's network.
Because each namespace has its own ports, every slurmd uses the default port; slurmctld takes
a free port of the root namespace. Nothing touches the machine's own Slurm or munge: the
config, the munge key, socket and logs, the state and spool directories all live in the
rig's directory (``SLURM_CONF`` and ``AuthInfo=socket=`` point the CLIs there: use
:attr:`Slurm.env`). A ``TaskProlog`` gives every task its host's ``TMPDIR`` and
``XDG_RUNTIME_DIR`` (the hosts share one filesystem), as sites do for node-local storage.

Slurm's daemons talk both ways: slurmd registers with slurmctld, and job steps call
``srun`` back. So this rig does not survive :meth:`Hosts.block_new_connections_to_controller`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from rigs import Rig
from rigs.netns import Hosts, RigError, kill_pids, namespace_pids

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIS = ("sinfo", "sbatch", "srun", "squeue", "scancel", "salloc", "scontrol")


def missing() -> str | None:
    """Why the Slurm rig cannot run here, or ``None``."""
    for tool in DAEMONS[:3] + CLIS:
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is not installed (apt-get install slurm-wlm munge)"
    return None


class Slurm(Rig):
    """A Slurm cluster whose nodes are the hosts of ``hosts`` (node names = host names).

    A context manager: on entry, every daemon is started and the nodes are idle; on exit,
    jobs are cancelled, every daemon and job step is stopped by pid and the state removed.
    Run the Slurm CLIs with :attr:`env` (or :meth:`run`).
    """

    def __init__(self, hosts: Hosts, cpus: int = 2) -> None:
        self.hosts = hosts
        self.cpus = cpus
        self.dir = hosts.dir / "slurm"
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.jobs = self.dir / "jobs"
        self.daemons: list[subprocess.Popen[Any]] = []

    @property
    def env(self) -> dict[str, str]:
        """The environment for ``sinfo``/``sbatch``/``srun``/... to use this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    @property
    def nodes(self) -> list[str]:
        return [host.name for host in self.hosts]

    def open(self) -> None:
        self.dir.mkdir(mode=0o700)
        self.jobs.mkdir()
        self.start_munge()
        self.write_config(free_port(self.hosts.controller_addr))
        self.start_controller()
        for host in self.hosts:
            self.daemons.append(self.hosts.popen(
                host, [daemon("slurmd"), "-D", "-N", host.name, "-f", str(self.conf)],
                env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        self.wait_idle()

    def close(self) -> None:
        """Cancel the jobs, stop slurmd and the job steps, slurmctld, munged; remove state."""
        controller_up = len(self.daemons) > 1 and self.daemons[1].poll() is None
        if controller_up and (jobs := self.job_ids()):
            self.run(["scancel", "--full", *jobs], check=False)
        kill_pids([d.pid for d in reversed(self.daemons) if d.poll() is None] + self.steps())
        for proc in self.daemons:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def steps(self) -> list[int]:
        """slurmstepd processes in this rig's namespaces (daemons of their own, not children)."""
        pids = [pid for host in self.hosts for pid in namespace_pids(host.ns)]
        return [pid for pid in pids if process_name(pid) == "slurmstepd"]

    # -- daemons ---------------------------------------------------------------------------

    def start_munge(self) -> None:
        """munged with a fresh key and its own socket, pid, log and seed: never the system's."""
        munge = self.munge_socket.parent
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self.daemons.append(subprocess.Popen(
            [daemon("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
             f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        wait_for(lambda: self.munge_socket.exists(), "munged to open its socket", 10,
                 munge / "munged.log", self.daemons[-1])

    def start_controller(self) -> None:
        """slurmctld in the root namespace (``daemons[1]``, after munged)."""
        (self.dir / "state").mkdir()
        self.daemons.append(subprocess.Popen(
            [daemon("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=self.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True))
        wait_for(lambda: self.run(["scontrol", "ping"], check=False).stdout.count("UP") > 0,
                 "slurmctld to answer", 30, self.dir / "slurmctld.log", self.daemons[-1])

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node registered and is idle (a node's first registration takes ~1 s)."""
        def idle() -> bool:
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            return states[1::2] == ["idle"] * len(self.hosts)
        wait_for(idle, "the nodes to be idle", timeout, self.dir / "slurmd-h1.log")

    def write_config(self, port: int) -> None:
        for host in self.hosts:
            (self.dir / f"spool-{host.name}").mkdir()
        prolog = self.dir / "task_prolog"
        prolog.write_text("#!/bin/sh\n# each task gets its host's own directories\n"
                          f'echo "export TMPDIR={self.hosts.dir}/$SLURMD_NODENAME/tmp"\n'
                          f'echo "export XDG_RUNTIME_DIR={self.hosts.dir}/$SLURMD_NODENAME/run"\n')
        prolog.chmod(0o755)
        controller = socket.gethostname().split(".")[0]  # slurmctld checks it is this host
        d = self.dir
        lines = [
            f"ClusterName=mb{self.hosts.tag}", f"SlurmctldHost={controller}"
            f"({self.hosts.controller_addr})", f"SlurmctldPort={port}", "SlurmdPort=6818",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}", f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool-%n'}", f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd-%n.pid'}", f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd-%n.log'}", f"TaskProlog={prolog}",
            f"PlugStackConfig={d / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
            "ReturnToService=2", "KillWait=2", "InactiveLimit=0",
        ]
        lines += [f"NodeName={h.name} NodeAddr={h.addr} NodeHostName={h.name} "
                  f"CPUs={self.cpus} State=UNKNOWN" for h in self.hosts]
        lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        (d / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join(lines) + "\n")

    # -- using it --------------------------------------------------------------------------

    def run(self, argv: list[str], timeout: float = 60, check: bool = True,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """A Slurm CLI run from the login node (the root namespace) against this cluster, in
        the rig's ``jobs`` directory (where ``sbatch`` leaves ``slurm-JOB.out`` by default)."""
        kw.setdefault("cwd", self.jobs)
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise RigError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def job_ids(self) -> list[str]:
        return self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()


def daemon(name: str) -> str:
    """An absolute path (slurmd and munged are in sbin, which a test's PATH may lack)."""
    return shutil.which(name) or f"/usr/sbin/{name}"


def free_port(addr: str) -> int:
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return ""


def wait_for(ready: Any, what: str, timeout: float, log: Path,
             proc: subprocess.Popen[Any] | None = None) -> None:
    """Poll ``ready()`` until true; fail with the daemon's log when it exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc is not None and proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise RigError(f"timed out or died waiting for {what}; {log.name}:\n{tail}")
        time.sleep(0.2)
