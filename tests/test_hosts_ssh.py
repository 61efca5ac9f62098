"""Meshes across hosts started through a real sshd, on network namespaces as hosts.

Each namespace is a host with its own address and hostname (which resolves to 127.0.1.1, as
on Debian: an agent that advertised its hostname would be unreachable); the controller stays
in the root namespace, the "login node". These tests need root and ``ip netns`` (the
``hosts`` marker; ``./dev hosts`` runs them).
"""

from __future__ import annotations

import sys
import time

import pytest
from jupyter_kernels import Kernel
from rigs import need, netns, sshd

import meshbook

pytestmark = pytest.mark.hosts


def ssh_mesh(ssh_hosts: sshd.Sshd, **kw: object) -> meshbook.Mesh:
    launcher = meshbook.SSH(ssh_hosts.aliases[:2], per_host=2, python=sys.executable,
                            ssh_options=["-F", str(ssh_hosts.ssh_config)], **kw)  # type: ignore[arg-type]
    return meshbook.start(launcher=launcher, timeout=120)  # 2 hosts x 2 per host: 4 ranks


def test_two_hosts_end_to_end_when_hosts_cannot_dial_the_controller(ssh_hosts: sshd.Sshd) -> None:
    hosts = ssh_hosts.hosts
    hosts.block_new_connections_to_controller()  # compute nodes cannot reach the login node
    mesh = ssh_mesh(ssh_hosts)
    try:
        assert mesh.world_size == 4
        names = mesh.run("import socket; socket.gethostname()").result()
        assert [names[r] for r in range(4)] == ["h1", "h1", "h2", "h2"]
        total = mesh.run("t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()").result()
        assert set(map(tuple, total.values())) == {(10.0, 10.0)}
        assert [h.address for h in mesh.hosts()] == [hosts["h1"].addr, hosts["h2"].addr]
        env = mesh.run("import os; os.environ.get('GLOO_SOCKET_IFNAME')").result()
        assert set(env.values()) == {"eth0"}, "gloo listens on the interface that routes to the controller"
    finally:
        mesh.stop()


def test_a_host_cut_off_is_lost_and_re_formed_on_another() -> None:
    need(netns.missing, sshd.missing)
    with netns.Hosts(3) as hosts, sshd.Sshd(hosts) as ssh:  # h3: where the lost host's ranks go
        mesh = ssh_mesh(ssh)
        try:
            mesh.run("kept = rank * 10").result()
            started = time.monotonic()
            hosts.link_down(hosts["h2"])
            run = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
            with pytest.raises(meshbook.RemoteError) as info:
                run.result(timeout=60)
            assert "host h2 lost: ranks 2,3" in str(info.value)
            assert time.monotonic() - started < 30, "lost after 15 s of silence, then the cell fails"
            assert [h.state for h in mesh.hosts()] == ["ok", "lost"]
            assert mesh.run("kept", ranks=[0, 1]).result().values() is not None
            # A new agent that cannot start fails the restart, and leaves every rank it was to
            # fork dead, not "starting" for good (rank 1, of h1, is forked after the new agents).
            with pytest.raises(meshbook.MeshError, match="could not start the agent on nowhere"):
                mesh.restart([1, 2, 3], on="nowhere")
            assert [s.state for s in mesh.status()] == ["idle", "dead", "dead", "dead"]
            mesh.restart([1, 2, 3], on="h3")  # h2 stays cut off; rank 0 keeps its variables
            assert [(h.name, h.address, h.state) for h in mesh.hosts()] == \
                [("h1", hosts["h1"].addr, "ok"), ("h3", hosts["h3"].addr, "ok")]
            kept = mesh.run("globals().get('kept')").result()
            assert [kept[r] for r in range(4)] == [0, None, None, None]
            total = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result()
            assert set(total.values()) == {4.0}
        finally:
            mesh.stop()


#: Run on a rank: its TCP connections to other hosts, as (remote address, accepted on a port of
#: this process's own): gloo connects each pair once, one of the two dialling the other.
CONNECTIONS = ("import psutil\n"
               "_own = {c.laddr.port for c in psutil.Process().net_connections('tcp') if c.status == 'LISTEN'}\n"
               "sorted({(c.raddr.ip, c.laddr.port in _own) for c in psutil.Process().net_connections('tcp')\n"
               "        if c.status == 'ESTABLISHED' and c.raddr and c.raddr.ip != c.laddr.ip})")


def test_ranks_with_work_pending_on_a_silent_hosts_ranks_leave_their_groups_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 2 and 3 (h2) leave an ``async_op`` all_reduce unwaited that ranks 0 and 1 (h1)
    never join, then h1 goes silent: no FIN ever closes a connection to it. gloo's destroy
    waits for the pending work until the collective timeout, so ranks 2 and 3, leaving their
    groups at the restart, shut the connections they opened to h1 too, not only those on their
    own ports: the restart waited for them, then re-forked them, and their variables were lost.

    h1 is host 0, which keeps the store: re-formed on h3, it moves the store, and a rank of h2
    forked after that meets the others there (its agent learnt the old place at its start)."""
    need(netns.missing, sshd.missing)
    monkeypatch.setenv("MESHBOOK_HOST_SUSPECT_S", "2")
    monkeypatch.setenv("MESHBOOK_HOST_LOST_S", "6")
    with netns.Hosts(3) as hosts, sshd.Sshd(hosts) as ssh:
        launcher = meshbook.SSH(ssh.aliases[:2], per_host=2, python=sys.executable,
                                ssh_options=["-F", str(ssh.ssh_config)])
        mesh = meshbook.start(launcher=launcher, timeout=120, collective_timeout=60)
        try:
            mesh.run("kept = rank\nt = torch.ones(1)\n"
                     "w = dist.all_reduce(t, async_op=True) if rank >= 2 else None").result()
            # gloo pairs two ranks with one connection, dialled by the one of the higher address
            dialled = mesh.run(CONNECTIONS, ranks=[2, 3]).result()
            assert all((hosts["h1"].addr, False) in dialled[r] for r in (2, 3)), \
                f"the case under test: ranks 2 and 3 dialled ranks 0 and 1 ({dialled})"
            hosts.link_down(hosts["h1"])
            deadline = time.monotonic() + 60
            while [h.state for h in mesh.hosts()] != ["lost", "ok"]:
                assert time.monotonic() < deadline, f"h1 never found lost: {mesh.hosts()}"
                time.sleep(0.2)
            recovery = mesh.restart([0, 1], on="h3", timeout=40)
            assert recovery.restarted == [0, 1] and recovery.seconds < 30, recovery.render()
            kept = mesh.run("kept", ranks=[2, 3]).result()
            assert [kept[r] for r in (2, 3)] == [2, 3]
            failed = mesh.run("try:\n    w.wait()\nexcept RuntimeError:\n    failed = True\nelse:\n    failed = False\n"
                              "failed", ranks=[2, 3]).result()
            assert set(failed.values()) == {True}, "the pending work failed, it did not complete"
            assert mesh.restart([2], timeout=40).restarted == [2]  # forked by h2's agent, at the new store
            total = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result()
            assert set(total.values()) == {4.0}
        finally:
            mesh.stop()


def test_from_a_notebook(ssh_hosts: sshd.Sshd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mesh across hosts driven from a real kernel; a host cut off fails its cell and the
    kernel carries on. (ssh reads the config of the user's passwd home, not $HOME, so the
    rig's config is given as the launcher's ssh options.)"""
    monkeypatch.setenv("MESHBOOK_HOST_SUSPECT_S", "2")
    monkeypatch.setenv("MESHBOOK_HOST_LOST_S", "6")
    kernel = Kernel()
    try:
        kernel.ok(f"import meshbook\n%load_ext meshbook\nmesh = meshbook.start(4, launcher=meshbook.SSH("
                  f"['h1', 'h2'], python={sys.executable!r}, ssh_options=['-F', {str(ssh_hosts.ssh_config)!r}]))")
        reply = kernel.ok("%%mesh\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
        assert reply.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "[0-3] 10.0"
        status = kernel.ok("%mesh status").stream()
        for host in ssh_hosts.hosts:
            assert host.addr in status, status
        ssh_hosts.hosts.link_down(ssh_hosts.hosts["h2"])
        failed = kernel.execute("%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()", timeout=90)
        assert failed.status == "error" and "host h2 lost: ranks 2,3" in failed.error_text
        assert kernel.value("1 + 1") == 2
        assert "lost" in kernel.ok("%mesh status").stream()
        kernel.ok("%mesh stop")
    finally:
        kernel.close()


def test_a_host_that_cannot_start_an_agent_says_why(ssh_hosts: sshd.Sshd) -> None:
    launcher = meshbook.SSH(["h1"], python="/nonexistent/python", ssh_options=["-F", str(ssh_hosts.ssh_config)])
    with pytest.raises(meshbook.MeshError) as info:
        meshbook.start(2, launcher=launcher, timeout=60)
    text = str(info.value)
    assert "could not start the agent on h1" in text and "/nonexistent/python" in text
    assert "No such file" in text or "not found" in text, "ssh's own words are quoted"


def test_twenty_ms_of_latency_breaks_nothing(ssh_hosts: sshd.Sshd) -> None:
    if netns.delay_missing():  # not in CI's kind of kernel either: netem is a kernel option
        pytest.skip(netns.delay_missing())
    hosts = ssh_hosts.hosts
    for host in hosts:
        hosts.delay(host, 20)  # every packet a host sends waits 20 ms
    mesh = ssh_mesh(ssh_hosts)
    try:
        total = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result()
        assert set(total.values()) == {4.0}
        deadline = time.monotonic() + 10
        while any(h.rtt is None for h in mesh.hosts()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(h.rtt is not None and h.rtt > 0.015 and h.state == "ok" for h in mesh.hosts())
        run = mesh.run("import time\ntime.sleep(600)")
        time.sleep(1)
        run.interrupt()
        with pytest.raises(meshbook.RemoteError, match="KeyboardInterrupt"):
            run.result(timeout=30)
        assert set(mesh.run("rank % 2").result().values()) == {0, 1}
    finally:
        mesh.stop()
