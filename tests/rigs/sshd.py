"""A real OpenSSH server on every namespace-host, and the client config to reach them.

Why a real sshd: the ``ssh`` launcher uses the system ``ssh`` client so that users' own
configs (ProxyJump, keys, agents) work; only a real server shows what a remote command
really gets (a login environment, no terminal, its own PATH, stdin as the only private
channel). Each host's sshd listens on the host's address inside its namespace, so a command
run through it sees that host's network and hostname.

Everything lives in a private (0700) directory of the rig: a host key per host, one client
key (key authentication only, as root), ``authorized_keys``, ``known_hosts`` (new host keys
accepted, then pinned) and :attr:`Sshd.ssh_config`, a client config with one ``Host`` alias
per host (``h1`` -> its address). A launcher under test is given ``ssh -F ssh_config``.
Each sshd sets the host's ``XDG_RUNTIME_DIR`` and ``TMPDIR`` in its sessions (``SetEnv``),
because the hosts share one filesystem, and the test run's tags (conftest.py's leak checks go
by them). The project's Python is reached through ssh by its absolute path
(``sys.executable``): the filesystem is shared, a login PATH does not hold it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from rigs import Rig
from rigs.netns import Host, Hosts, RigError, kill_pids, sh

# sshd refuses to start without its privilege separation directory (a fixed path).
PRIVSEP_DIR = Path("/run/sshd")


def missing() -> str | None:
    """Why the sshd rig cannot run here, or ``None``."""
    for tool in ("sshd", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"`{tool}` is not installed (apt-get install openssh-server openssh-client)"
    return None


class Sshd(Rig):
    """One sshd per host of ``hosts``; a context manager that stops each by pid on exit."""

    def __init__(self, hosts: Hosts, user: str = "root") -> None:
        self.hosts = hosts
        self.user = user
        self.dir = hosts.dir / "ssh"
        self.ssh_config = self.dir / "ssh_config"
        self.key = self.dir / "id_ed25519"
        self.daemons: list[subprocess.Popen[Any]] = []

    @property
    def aliases(self) -> list[str]:
        """The ``Host`` names of :attr:`ssh_config`, one per host (``["h1", "h2"]``)."""
        return [host.name for host in self.hosts]

    def open(self) -> None:
        self.dir.mkdir(mode=0o700)
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)  # shared with any system sshd: kept
        keygen(self.key)
        shutil.copy(self.key.with_suffix(".pub"), self.dir / "authorized_keys")
        self.ssh_config.write_text(self.client_config())
        self.daemons = [self.start(host) for host in self.hosts]
        for host, daemon in zip(self.hosts, self.daemons):
            wait_accepting(host, daemon, self.dir / f"sshd-{host.name}.log")

    def close(self) -> None:
        """Stop each sshd and every session it started (by pid, sessions first)."""
        running = [d for d in self.daemons if d.poll() is None]
        sessions = [child.pid for d in running for child in descendants(d.pid)]
        kill_pids(sessions + [d.pid for d in running])
        for daemon in self.daemons:
            daemon.wait(timeout=5)

    def start(self, host: Host) -> subprocess.Popen[Any]:
        keygen(self.dir / f"host-{host.name}")
        config = self.dir / f"sshd-{host.name}.conf"
        config.write_text(self.server_config(host))
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"  # absolute: sshd re-executes itself
        log = open(self.dir / f"sshd-{host.name}.log", "w")
        with log:
            return self.hosts.popen(host, [sshd, "-D", "-e", "-f", str(config)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def server_config(self, host: Host) -> str:
        # and the test run's tags (see conftest.py), which sshd would not pass on
        tags = {k: os.environ[k] for k in ("MESHBOOK_TEST_RUN", "PYTEST_XDIST_WORKER") if k in os.environ}
        env = " ".join(f"{k}={v}" for k, v in {**host.env(), **tags}.items())
        return "\n".join([
            f"ListenAddress {host.addr}", "Port 22",
            f"HostKey {self.dir / f'host-{host.name}'}",
            f"PidFile {self.dir / f'sshd-{host.name}.pid'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes no",  # the rig's keys live under the shared temp directory
            f"SetEnv {env}", "LogLevel ERROR", "",
        ])

    def client_config(self) -> str:
        lines = []
        for host in self.hosts:
            lines += [f"Host {host.name}", f"  HostName {host.addr}"]
        lines += ["Host *", f"  User {self.user}", f"  IdentityFile {self.key}",
                  "  IdentitiesOnly yes", f"  UserKnownHostsFile {self.dir / 'known_hosts'}",
                  "  GlobalKnownHostsFile /dev/null", "  StrictHostKeyChecking accept-new",
                  "  BatchMode yes", "  ConnectTimeout 10", "  LogLevel ERROR", ""]
        return "\n".join(lines)

    def command(self, alias: str, remote: str) -> list[str]:
        """The ``ssh`` command line a launcher would run to reach ``alias``."""
        return ["ssh", "-F", str(self.ssh_config), alias, remote]

    def run(self, alias: str, remote: str, timeout: float = 60,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run ``remote`` on ``alias`` through ssh from the root namespace; output as text."""
        return subprocess.run(self.command(alias, remote), capture_output=True, text=True,
                              timeout=timeout, **kw)


def keygen(path: Path) -> None:
    sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "meshbook-rig", "-f", str(path)])


def wait_accepting(host: Host, daemon: subprocess.Popen[Any], log: Path,
                   timeout: float = 20) -> None:
    """Until ``host``'s sshd greets a connection on its address (or says why it did not)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise RigError(f"sshd on {host.name} exited ({daemon.returncode}): "
                           f"{log.read_text().strip()}")
        try:
            with socket.create_connection((host.addr, 22), timeout=1) as conn:
                if conn.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RigError(f"sshd on {host.name} did not accept within {timeout} s: "
                   f"{log.read_text().strip()}")


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
