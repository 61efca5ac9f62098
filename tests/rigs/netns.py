"""Network namespaces as hosts: a small cluster on one machine, with real network paths.

Why namespaces: a mesh across hosts must be tested over a real network (its own addresses,
routes, a firewall, cuts, latency), and a CI machine has one host. Each :class:`Host` is a
network namespace with its own ``eth0`` (one end of a veth pair), a private address and its
own loopback; the other ends are ports of a bridge in the root namespace, which holds
:attr:`Hosts.controller_addr` and plays the login node the notebook runs on.

What the namespaces share with the machine, and how the rig makes up for it:

- The filesystem, so ``ipc://`` paths and temp files would collide across hosts: every host
  gets its own ``XDG_RUNTIME_DIR`` and ``TMPDIR`` (:meth:`Host.env`).
- The hostname: :meth:`Hosts.popen` runs each command in its own UTS namespace named after
  the host, so ``gethostname()`` says ``h1``. As on many real machines (Debian's default
  ``/etc/hosts``), a host's own name resolves to ``127.0.1.1`` inside it, not to its address:
  code that advertises ``gethostname()`` to peers fails here as it would there. The other
  hosts' names and ``controller`` resolve to their addresses inside the namespaces (the
  host's own ``hosts`` file is bind-mounted on ``/etc/hosts`` in a private mount namespace);
  the root namespace resolves none of them. There is no DNS on the hosts: their
  ``/etc/resolv.conf`` names no server, so a name not in their hosts file fails at once
  (the machine's resolver is unreachable from the namespaces, and would cost a timeout).
- ``/sys``: commands enter the network namespace with ``nsenter --net``, not ``ip netns
  exec``, which remounts ``/sys`` and so hides the cgroup mounts that slurmd needs. The
  namespace's interfaces are seen through netlink (``ip``, ``getifaddrs``), not
  ``/sys/class/net``.
- Process ids: the rig kills what it started by pid, then whatever is still inside its
  namespaces (``ip netns pids``): never by name, other test runs share the machine.

Names and the subnet are unique per run (derived from the pid, probed against the routes in
use), so concurrent test runs cannot collide. Interface names stay within Linux's 15 chars.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from rigs import Rig

# 10.176.0.0/12 holds 4,096 /24s; a run takes the first free one from a pid-derived start.
RIG_RANGE = ipaddress.ip_network("10.176.0.0/12")
_instances = itertools.count()


class RigError(RuntimeError):
    """A rig could not be set up or a command run in it failed (the message says which)."""


def missing() -> str | None:
    """Why network namespaces cannot be made here, or ``None``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nsenter", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 util-linux hostname)"
    probe = f"mb-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` does not work here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def firewall_missing() -> str | None:
    """Why :meth:`Hosts.block_new_connections_to_controller` cannot work here, or ``None``."""
    return None if shutil.which("iptables") else "`iptables` is not installed (apt-get install iptables)"


def delay_missing() -> str | None:
    """Why :meth:`Hosts.delay` cannot work here (a kernel built without netem), or ``None``."""
    return _qdisc_missing(["netem", "delay", "1ms"], "CONFIG_NET_SCH_NETEM")


def rate_missing() -> str | None:
    """Why :meth:`Hosts.limit_rate` cannot work here (a kernel built without tbf), or ``None``."""
    return _qdisc_missing([*_TBF, "8mbit"], "CONFIG_NET_SCH_TBF")


#: A token bucket: 64 KiB bursts, packets wait up to a second (TCP then slows to the rate).
_TBF = ["tbf", "burst", "64kb", "latency", "1s", "rate"]


def _qdisc_missing(qdisc: list[str], config: str) -> str | None:
    probe = f"mb-probe-{os.getpid()}"
    sh(["ip", "netns", "add", probe])
    try:
        tried = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc],
                               capture_output=True, text=True)
    finally:
        quiet(["ip", "netns", "del", probe])
    return None if tried.returncode == 0 else \
        f"this kernel has no {qdisc[0]} qdisc ({config}): {tried.stderr.strip()}"


def sh(argv: Sequence[str], timeout: float = 30) -> str:
    """Run a setup command in the root namespace; its stdout, or :class:`RigError` saying why."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RigError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def base36(number: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        number, digit = divmod(number, 36)
        out = digits[digit] + out
        if number == 0:
            return out


@dataclass
class Host:
    """One namespace-host: ``name`` is its hostname (``h1``), ``ns`` its namespace, ``addr``
    its address on the bridge, ``veth`` the root namespace's end of its link (inside, the
    link is ``eth0``), ``root`` its own directory (runtime and temp directories live there)."""

    name: str
    ns: str
    addr: str
    veth: str
    root: Path

    @property
    def runtime_dir(self) -> Path:
        return self.root / "run"

    @property
    def tmpdir(self) -> Path:
        return self.root / "tmp"

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    @property
    def resolv_conf(self) -> Path:
        return self.root / "resolv.conf"

    def env(self) -> dict[str, str]:
        """What a process on this host must see instead of the machine's shared directories."""
        return {"XDG_RUNTIME_DIR": str(self.runtime_dir), "TMPDIR": str(self.tmpdir)}


class Hosts(Rig):
    """``n`` namespace-hosts on a bridge; a context manager that removes all of it on exit.

    ``hosts.controller_addr`` is the root namespace's address on the bridge (where a
    controller in the test process is reached from the hosts); ``hosts["h1"]`` or
    ``hosts[0]`` a :class:`Host`. Commands go through :meth:`popen` / :meth:`run`; faults
    through :meth:`link_down`, :meth:`block_new_connections_to_controller` and :meth:`delay`.
    """

    def __init__(self, n: int = 2, prefix: str = "h") -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"Hosts(n={n}): between 1 and 200 hosts fit in the rig's /24")
        self.tag = base36(os.getpid()) + base36(next(_instances) % 36)
        self.bridge = f"mbr{self.tag}"
        self.subnet = free_subnet(os.getpid() + 977 * int(self.tag[-1], 36))
        self.controller_addr = str(self.subnet[1])
        self.hosts: list[Host] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self.undo = contextlib.ExitStack()
        self.dir = Path(tempfile.mkdtemp(prefix=f"meshbook-rig-{self.tag}-"))
        self.undo.callback(shutil.rmtree, self.dir, ignore_errors=True)
        self.names = [f"{prefix}{i}" for i in range(1, n + 1)]

    # -- setup and teardown ---------------------------------------------------------------

    def open(self) -> None:
        atexit.register(self.close)  # the last resort: an interpreter exiting mid-test
        exit_on_sigterm()
        self.add_bridge()
        for index, name in enumerate(self.names):
            self.hosts.append(self.add_host(index, name))
        for host in self.hosts:
            self.write_hosts_file(host)

    def close(self) -> None:
        """Kill every process the rig started, then undo every change it made (reverse order)."""
        atexit.unregister(self.close)
        self.kill_all()
        self.undo.close()

    def add_bridge(self) -> None:
        sh(["ip", "link", "add", "name", self.bridge, "type", "bridge"])
        self.undo.callback(quiet, ["ip", "link", "del", self.bridge])
        sh(["ip", "addr", "add", f"{self.controller_addr}/{self.subnet.prefixlen}",
            "dev", self.bridge])
        sh(["ip", "link", "set", self.bridge, "up"])

    def add_host(self, index: int, name: str) -> Host:
        """A namespace, its veth pair to the bridge (``eth0`` inside), its address and routes."""
        host = Host(name=name, ns=f"mb-{self.tag}-{name}", addr=str(self.subnet[index + 2]),
                    veth=f"mbv{self.tag}{base36(index)}", root=self.dir / name)
        sh(["ip", "netns", "add", host.ns])
        self.undo.callback(self.remove_namespace, host.ns)
        peer = f"mbp{self.tag}{base36(index)}"
        sh(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer])
        self.undo.callback(quiet, ["ip", "link", "del", host.veth])
        sh(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        sh(["ip", "link", "set", peer, "netns", host.ns])
        inside = ["ip", "-n", host.ns]
        sh([*inside, "link", "set", peer, "name", "eth0"])
        sh([*inside, "addr", "add", f"{host.addr}/{self.subnet.prefixlen}", "dev", "eth0"])
        sh([*inside, "link", "set", "lo", "up"])
        sh([*inside, "link", "set", "eth0", "up"])
        sh([*inside, "route", "add", "default", "via", self.controller_addr])
        for directory in (host.runtime_dir, host.tmpdir):
            directory.mkdir(parents=True, mode=0o700)
        return host

    def write_hosts_file(self, host: Host) -> None:
        """``/etc/hosts`` as the host sees it: its own name on 127.0.1.1, like Debian's."""
        lines = ["127.0.0.1 localhost", f"127.0.1.1 {host.name}",
                 f"{self.controller_addr} controller"]
        lines += [f"{other.addr} {other.name}" for other in self.hosts if other is not host]
        host.hosts_file.write_text("\n".join(lines) + "\n")
        host.resolv_conf.write_text("# no DNS on the rig's hosts: names come from /etc/hosts\n")

    def remove_namespace(self, ns: str) -> None:
        """Kill what is still inside (started through ssh or Slurm, say), then delete it."""
        kill_pids(namespace_pids(ns))
        quiet(["ip", "netns", "del", ns])

    def kill_all(self) -> None:
        """Every process :meth:`popen` started, by pid, then anything left in the namespaces."""
        kill_pids([p.pid for p in self.procs if p.poll() is None])
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        for host in self.hosts:
            kill_pids(namespace_pids(host.ns))

    # -- using the hosts ------------------------------------------------------------------

    def __getitem__(self, key: int | str) -> Host:
        if isinstance(key, int):
            return self.hosts[key]
        for host in self.hosts:
            if host.name == key:
                return host
        raise KeyError(f"no host {key!r}; the rig has {[h.name for h in self.hosts]}")

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def host(self, host: Host | str) -> Host:
        return host if isinstance(host, Host) else self[host]

    def command(self, host: Host | str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on ``host``: in its network namespace, with its hostname and its
        ``/etc/hosts`` and ``/etc/resolv.conf`` (in UTS and mount namespaces of its own; ``exec`` all the way down, so
        the pid :meth:`popen` returns is ``argv``'s)."""
        host = self.host(host)
        return ["nsenter", f"--net=/run/netns/{host.ns}", "unshare", "--uts", "--mount",
                "sh", "-c", 'mount --bind "$1" /etc/hosts && mount --bind "$2" /etc/resolv.conf '
                '&& hostname "$0" && shift 2 && exec "$@"',
                host.name, str(host.hosts_file), str(host.resolv_conf), *argv]

    def popen(self, host: Host | str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``host``; the rig kills it (by pid) on exit if still running.

        The process sees the test's environment plus the host's own directories
        (:meth:`Host.env`); ``env=`` adds to that. It runs in its own session so a Ctrl-C
        in the terminal reaches the test, whose cleanup then stops it in order.
        """
        host = self.host(host)
        env = {**os.environ, **host.env(), **(kw.pop("env", None) or {})}
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(host, argv), env=env, **kw)
        self.procs.append(proc)
        return proc

    def run(self, host: Host | str, argv: Sequence[str], timeout: float = 60,
            check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``host`` to the end; output captured as text, failure raised."""
        proc = self.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_pids([proc.pid])
            out, err = proc.communicate()
            raise RigError(f"{' '.join(argv)} on {self.host(host).name} ran past {timeout} s: "
                           f"{err.strip()}")
        done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and done.returncode != 0:
            raise RigError(f"{' '.join(argv)} on {self.host(host).name} failed "
                           f"({done.returncode}): {err.strip()}")
        return done

    # -- faults ---------------------------------------------------------------------------

    def link_down(self, host: Host | str) -> None:
        """Cut ``host`` off the network (its link set down on the bridge side)."""
        sh(["ip", "link", "set", self.host(host).veth, "down"])

    def link_up(self, host: Host | str) -> None:
        sh(["ip", "link", "set", self.host(host).veth, "up"])

    def block_new_connections_to_controller(self) -> None:
        """Drop new connections from the hosts to the root namespace, as a login node's firewall.

        New TCP connections, by their SYN: stateless, because conntrack only starts
        tracking a namespace when a rule first needs it, and would then take the next
        packet of an older connection for a new one. Connections the root namespace opens
        to the hosts, and ones already established, keep working: what a controller that
        dials out to its agents needs. Slurm (slurmd registers with slurmctld) and ``srun``
        (steps call back) do not survive this rule. Removed on exit.
        """
        if firewall_missing():
            raise RigError(firewall_missing())
        rule = ["INPUT", "-s", str(self.subnet), "-p", "tcp", "--syn",
                "-m", "comment", "--comment", f"meshbook-rig-{self.tag}", "-j", "DROP"]
        sh(["iptables", "-I", *rule])
        self.undo.callback(quiet, ["iptables", "-D", *rule])

    def reset_connections_to_controller(self, host: Host | str, seconds: float) -> None:
        """For ``seconds``, answer every TCP packet between ``host`` and the root namespace
        (the controller) with a reset, as a flapping firewall or a rebooted switch does: the
        connections break, and can open again once the rules are gone (this call blocks that
        long). Rules inside the host's namespace, removed with it too."""
        if firewall_missing():
            raise RigError(firewall_missing())
        host = self.host(host)
        inside = ["ip", "netns", "exec", host.ns, "iptables"]
        rules = [["INPUT", "-s", self.controller_addr, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
                 ["OUTPUT", "-d", self.controller_addr, "-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]]
        for rule in rules:
            sh([*inside, "-I", *rule])
        try:
            time.sleep(seconds)
        finally:
            for rule in rules:
                quiet([*inside, "-D", *rule])

    def delay(self, host: Host | str, ms: float) -> None:
        """Every packet ``host`` sends waits ``ms`` (netem): each round trip to it gets ``ms``
        longer. ``ms=0`` removes the delay; namespace deletion removes it too."""
        inside = ["ip", "netns", "exec", self.host(host).ns, "tc", "qdisc"]
        if ms:
            sh([*inside, "replace", "dev", "eth0", "root", "netem", "delay", f"{ms}ms"])
        else:
            quiet([*inside, "del", "dev", "eth0", "root"])


    def limit_rate(self, host: Host | str, mbit: float) -> None:
        """What ``host`` sends leaves at ``mbit`` Mbit/s at most (a token bucket: it replaces
        a :meth:`delay`); ``mbit=0`` removes the limit."""
        inside = ["ip", "netns", "exec", self.host(host).ns, "tc", "qdisc"]
        if mbit:
            sh([*inside, "replace", "dev", "eth0", "root", *_TBF, f"{mbit}mbit"])
        else:
            quiet([*inside, "del", "dev", "eth0", "root"])


def exit_on_sigterm() -> None:
    """Make SIGTERM (a CI timeout, ``timeout``) exit through ``finally`` blocks and atexit, so
    a killed test run still removes its rigs; by default SIGTERM ends Python without either."""
    if threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A /24 of :data:`RIG_RANGE` that no route or address of the machine overlaps yet."""
    used = [ipaddress.ip_network(word, strict=False)
            for line in sh(["ip", "-4", "route", "show", "table", "all"]).splitlines()
            for word in line.split()[:2] if looks_like_network(word)]
    subnets = list(RIG_RANGE.subnets(new_prefix=24))
    for offset in range(len(subnets)):
        candidate = subnets[(seed + offset) % len(subnets)]
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise RigError(f"no free /24 left in {RIG_RANGE} (leftover rigs? `ip -br link | grep mbr`)")


def looks_like_network(word: str) -> bool:
    try:
        ipaddress.ip_network(word, strict=False)
    except ValueError:
        return False
    return "/" in word or word.count(".") == 3


def namespace_pids(ns: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []


def kill_pids(pids: list[int], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace`` seconds (by pid only)."""
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    signal_all([pid for pid in pids if alive(pid)], signal.SIGKILL)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def alive(pid: int) -> bool:
    """Still running (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def quiet(argv: Sequence[str]) -> None:
    """A cleanup step: it may find the thing already gone (that is fine)."""
    subprocess.run(list(argv), capture_output=True)


def leftovers(tag: str) -> list[str]:
    """Namespaces, links and firewall rules of the rig ``tag`` still present (for tests to
    assert on; other runs' rigs on the same machine are not this run's business)."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout \
        if shutil.which("iptables") else ""
    found = [line.split()[0] for line in netns.splitlines() if line.startswith(f"mb-{tag}-")]
    found += [line.split()[0].split("@")[0] for line in links.splitlines()
              if line.startswith((f"mbr{tag}", f"mbv{tag}", f"mbp{tag}"))]
    found += [line for line in rules.splitlines() if f"meshbook-rig-{tag}" in line]
    return found
