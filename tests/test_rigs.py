"""The rigs of tests/rigs do what the tests of meshes across hosts rely on, and leave nothing.

Each test proves one property a launcher test will lean on (a host reachable at its address,
a cut that cuts, a firewall that blocks only new inbound connections, latency, ssh landing
in the right host, Slurm running a job on both nodes), so that a failing launcher test points
at the launcher, not at the rig. Marked ``hosts``: ``./dev hosts`` runs them (root).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from rigs import need, netns, slurm, sshd
from rigs.netns import Hosts

pytestmark = pytest.mark.hosts

# A TCP server for a namespace: prints its port, then accepts and echoes until killed.
ECHO_SERVER = """
import socket, sys, threading
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
def echo(conn):
    with conn:
        while data := conn.recv(1024):
            conn.sendall(data)
while True:
    threading.Thread(target=echo, args=(server.accept()[0],), daemon=True).start()
"""

# Connects to argv[1]:argv[2], then echoes each stdin line through the connection.
CLIENT = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
print("connected", flush=True)
for line in sys.stdin:
    conn.sendall(line.encode())
    print(conn.recv(1024).decode().strip(), flush=True)
"""


def serve(hosts: Hosts, host: str) -> int:
    """An echo server on ``host``'s address; its port."""
    proc = hosts.popen(host, [sys.executable, "-c", ECHO_SERVER, hosts[host].addr],
                       stdout=subprocess.PIPE, text=True)
    return int(proc.stdout.readline())


def connects(hosts: Hosts, source: str | None, addr: str, port: int) -> bool:
    """Whether a new TCP connection from ``source`` (``None``: the root namespace) gets through
    within 2 s (a dropped SYN is retried after 1 s, so 2 s tells "dropped" from "slow")."""
    if source is None:
        try:
            socket.create_connection((addr, port), timeout=2).close()
            return True
        except OSError:
            return False
    code = f"import socket; socket.create_connection(('{addr}', {port}), timeout=2)"
    return hosts.run(source, [sys.executable, "-c", code], check=False).returncode == 0


def root_server() -> socket.socket:
    """An echo-less listener in the root namespace, on every address (the login node)."""
    return socket.create_server(("0.0.0.0", 0))


def test_hosts_reach_each_other_and_the_controller(netns_hosts: Hosts) -> None:
    h1, h2 = netns_hosts
    with root_server() as login:
        port = login.getsockname()[1]
        assert connects(netns_hosts, "h1", netns_hosts.controller_addr, port)
        assert connects(netns_hosts, "h2", netns_hosts.controller_addr, port)
    assert connects(netns_hosts, "h2", h1.addr, serve(netns_hosts, "h1"))
    assert connects(netns_hosts, None, h2.addr, serve(netns_hosts, "h2"))
    seen = netns_hosts.run("h1", ["sh", "-c", "hostname; ip -4 -br addr show eth0; "
                                  "echo $TMPDIR; getent ahostsv4 h2 controller"]).stdout
    assert seen.split()[0] == "h1"
    assert f"{h1.addr}/" in seen and str(h1.tmpdir) in seen
    assert f"{h2.addr} " in seen and f"{netns_hosts.controller_addr} " in seen
    unknown = netns_hosts.run("h1", ["getent", "hosts", "nowhere.invalid"], check=False, timeout=5)
    assert unknown.returncode == 2, "an unknown name fails at once (no resolver timeout)"


def test_link_down_cuts_a_host(netns_hosts: Hosts) -> None:
    port = serve(netns_hosts, "h1")
    netns_hosts.link_down("h1")
    assert not connects(netns_hosts, None, netns_hosts["h1"].addr, port)
    assert not connects(netns_hosts, "h2", netns_hosts["h1"].addr, port)
    netns_hosts.link_up("h1")
    assert connects(netns_hosts, None, netns_hosts["h1"].addr, port)


def test_firewall_blocks_only_new_connections_to_the_controller(netns_hosts: Hosts) -> None:
    need(netns.firewall_missing)
    port = serve(netns_hosts, "h1")
    with root_server() as login:
        login_port = login.getsockname()[1]
        before = netns_hosts.popen("h2", [sys.executable, "-c", CLIENT,
                                          netns_hosts.controller_addr, str(login_port)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert before.stdout.readline() == "connected\n"
        conn = login.accept()[0]
        netns_hosts.block_new_connections_to_controller()
        assert not connects(netns_hosts, "h2", netns_hosts.controller_addr, login_port)
        assert connects(netns_hosts, None, netns_hosts["h1"].addr, port), "root -> host dials"
        before.stdin.write("still there\n")
        before.stdin.flush()
        assert conn.recv(1024) == b"still there\n", "an established connection carries on"
        conn.close()


def test_delay_adds_latency(netns_hosts: Hosts) -> None:
    """A functional check that netem is on (its lower bound only: load makes it slower).

    Skipped even in CI where the kernel lacks netem: no package brings it back."""
    if netns.delay_missing():
        pytest.skip(netns.delay_missing())
    port = serve(netns_hosts, "h1")
    netns_hosts.delay("h1", 20)
    started = time.monotonic()
    socket.create_connection((netns_hosts["h1"].addr, port), timeout=5).close()
    assert time.monotonic() - started > 0.015  # the SYN-ACK waited 20 ms in h1
    netns_hosts.delay("h1", 0)


def test_ssh_lands_in_each_host(ssh_hosts: sshd.Sshd) -> None:
    for host in ssh_hosts.hosts:
        seen = ssh_hosts.run(host.name, "hostname; ip -4 addr; echo $XDG_RUNTIME_DIR")
        assert seen.returncode == 0, seen.stderr
        assert seen.stdout.split()[0] == host.name
        assert f"inet {host.addr}/" in seen.stdout and str(host.runtime_dir) in seen.stdout
    python = ssh_hosts.run("h2", f"{sys.executable} -c 'import meshbook, tempfile; "
                                 f"print(meshbook.__name__, tempfile.gettempdir())'")
    assert python.stdout.split() == ["meshbook", str(ssh_hosts.hosts["h2"].tmpdir)], python.stderr


def test_ssh_refuses_a_client_without_the_key(ssh_hosts: sshd.Sshd) -> None:
    stranger = ssh_hosts.dir / "stranger"
    sshd.keygen(stranger)
    denied = subprocess.run(["ssh", "-F", "/dev/null", "-i", str(stranger), "-o", "IdentitiesOnly=yes",
                             "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                             "-o", f"UserKnownHostsFile={ssh_hosts.dir / 'known_hosts'}",
                             f"root@{ssh_hosts.hosts['h1'].addr}", "true"],
                            capture_output=True, text=True, timeout=30)
    assert denied.returncode == 255 and "Permission denied" in denied.stderr


def test_slurm_runs_a_job_on_both_nodes(slurm_cluster: slurm.Slurm) -> None:
    out = slurm_cluster.run(["srun", "-N2", "sh", "-c", "echo $(hostname) $TMPDIR"]).stdout
    seen = dict(line.split() for line in out.splitlines())
    assert sorted(seen) == ["h1", "h2"]
    assert seen["h1"] == str(slurm_cluster.hosts["h1"].tmpdir)


def test_squeue_sees_a_job_and_scancel_ends_it(slurm_cluster: slurm.Slurm) -> None:
    job = slurm_cluster.run(["sbatch", "--parsable", "-N2", "-t", "1", "--wrap",
                             "srun sleep 60"]).stdout.strip()
    states = slurm_cluster.run(["squeue", "-h", "-o", "%i %T"]).stdout
    assert f"{job} PENDING" in states or f"{job} RUNNING" in states
    slurm_cluster.run(["scancel", job])
    wait_until(lambda: job not in slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout,
               "the cancelled job to leave the queue")


def test_nothing_is_left_behind_even_when_a_test_fails() -> None:
    need(netns.missing, sshd.missing, slurm.missing)
    with pytest.raises(RuntimeError, match="a failing test"):
        with Hosts(2) as hosts, sshd.Sshd(hosts) as server, slurm.Slurm(hosts) as cluster:
            tag, rig_dir = hosts.tag, hosts.dir
            cluster.run(["sbatch", "-N2", "--wrap", "srun sleep 300"])
            over_ssh = subprocess.Popen(server.command("h1", "sleep 300"))
            wait_until(lambda: "RUNNING" in cluster.run(["squeue", "-h", "-o", "%T"]).stdout,
                       "the job to start")
            started = [p.pid for p in hosts.procs + cluster.daemons]
            started += [pid for h in hosts for pid in netns.namespace_pids(h.ns)]
            raise RuntimeError("a failing test")
    assert netns.leftovers(tag) == []
    assert not rig_dir.exists()
    assert [pid for pid in started if netns.alive(pid)] == []
    assert over_ssh.wait(timeout=10) == 255  # its connection was closed by the host


def wait_until(ready: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)

