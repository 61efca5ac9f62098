"""Faults across hosts, reproduced on the namespace-hosts: nothing runs twice, nothing is lost
unnoticed, nothing hangs, nothing is left behind.

The hosts are network namespaces with a real sshd each (tests/rigs); faults are real: an agent
stopped with SIGSTOP, a firewall that answers every packet of a link with a TCP reset, agents
that joined from an "external launcher" (the test). Ranks write a side effect per step to a
file named by their pid, which counts what a stale copy of a rank does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rigs import need, netns, sshd

import meshbook

pytestmark = pytest.mark.hosts

REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


def ssh_mesh(server: sshd.Sshd, hosts: int = 2, **kw: object) -> meshbook.Mesh:
    launcher = meshbook.SSH(server.aliases[:hosts], per_host=2, python=sys.executable,
                            ssh_options=["-F", str(server.ssh_config)], **kw)  # type: ignore[arg-type]
    return meshbook.start(launcher=launcher, timeout=120)


def wait_until(check, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_tcp_reset_on_a_hosts_link_loses_nothing(ssh_hosts: sshd.Sshd) -> None:
    """1.5 s of TCP resets on h2's link, mid-cell: what was in flight either way is sent again
    (the link's numbers say what is missing); the cell ends with every rank's output and
    result, and the mesh goes on (it used to lose the results and hang)."""
    need(netns.firewall_missing)
    mesh = ssh_mesh(ssh_hosts)
    try:
        run = mesh.run("import time\nfor i in range(40):\n    print(f'step {i}', flush=True)\n"
                       "    time.sleep(0.1)\nrank * 10")
        time.sleep(1.0)
        ssh_hosts.hosts.reset_connections_to_controller("h2", 1.5)
        values = run.result(timeout=60, echo=False)
        assert dict(values) == {0: 0, 1: 10, 2: 20, 3: 30}
        printed = {(e.rank, line) for e in run.events() if isinstance(e, meshbook.Output)
                   for line in e.text.splitlines()}
        assert all((r, f"step {i}") in printed for r in range(4) for i in range(40)), "output was lost"
        assert [h.state for h in mesh.hosts()] == ["ok", "ok"]
        assert set(mesh.run(REDUCE).result(timeout=60).values()) == {4.0}
        run = mesh.run(REDUCE)  # a request sent while the link resets arrives all the same
        resetting = threading.Thread(target=ssh_hosts.hosts.reset_connections_to_controller, args=("h2", 1.5))
        resetting.start()
        time.sleep(0.3)
        late = mesh.run("rank")
        resetting.join()
        assert set(run.result(timeout=60).values()) == {4.0}
        assert dict(late.result(timeout=60)) == {0: 0, 1: 1, 2: 2, 3: 3}
    finally:
        mesh.stop()


def test_a_pull_slower_than_the_loss_window_keeps_its_host(ssh_hosts: sshd.Sshd) -> None:
    """A 64 MiB pull from h2 over a link limited to 64 Mbit/s takes 8 s, longer than the 6 s
    after which a silent host is lost. It comes up in fragments, each heard as it arrives, so
    the host stays and the value arrives whole (as one message, h2 was lost and the pull failed)."""
    import torch

    need(netns.rate_missing)
    mesh = ssh_mesh(ssh_hosts, suspect_s=2, lost_s=6)
    try:
        mesh.run("big = torch.arange(16 << 20, dtype=torch.float32) + rank").result(timeout=60)
        ssh_hosts.hosts.limit_rate("h2", 64)
        try:
            pulled = mesh.pull("big", ranks=[2])
        finally:
            ssh_hosts.hosts.limit_rate("h2", 0)
        assert torch.equal(pulled[2], torch.arange(16 << 20, dtype=torch.float32) + 2)
        assert [h.state for h in mesh.hosts()] == ["ok", "ok"]
        assert dict(mesh.run("rank").result(timeout=60)) == {0: 0, 1: 1, 2: 2, 3: 3}
    finally:
        mesh.stop()


def test_a_stopped_agent_never_runs_what_came_for_its_lost_host(tmp_path: Path) -> None:
    """SIGSTOP h2's agent mid-cell: its host is lost, its ranks are re-formed on h3. The old
    ranks stop on their own before the host is declared lost, and when the old agent resumes
    it runs nothing that was queued for it: it ends. Two copies of ranks 2,3 never act at once."""
    need(netns.missing, sshd.missing)
    side = tmp_path / "writes"
    side.mkdir()
    step = (f"import os, time\nfor i in range(600):\n    with open(f'{side}/{{rank}}-{{os.getpid()}}', 'a') as f:\n"
            f"        f.write('x')\n    time.sleep(0.1)")
    with netns.Hosts(3) as hosts, sshd.Sshd(hosts) as server:
        mesh = ssh_mesh(server, suspect_s=2, lost_s=6)
        try:
            old = {s.rank: s.pid for s in mesh.status() if s.rank in (2, 3)}
            stopped = mesh.hosts()[1].agent_pid
            run = mesh.run(step)
            wait_until(lambda: len(list(side.iterdir())) == 4, "every rank to write")
            os.kill(stopped, signal.SIGSTOP)
            wait_until(lambda: mesh.hosts()[1].state == "lost", "h2 to be lost", timeout=30)
            run.interrupt()  # ranks 0,1 go on with their loop: stop them
            with pytest.raises(meshbook.RemoteError, match="host h2 lost: ranks 2,3"):
                run.result(timeout=60, echo=False)
            mesh.restart([2, 3], on="h3")
            written = {p.name: p.stat().st_size for p in side.iterdir()}
            mesh.run(step.replace("600", "20")).result(timeout=60)
            os.kill(stopped, signal.SIGCONT)
            time.sleep(3)  # time for a ghost to act, if there were one
            for rank, pid in old.items():
                assert (side / f"{rank}-{pid}").stat().st_size == written[f"{rank}-{pid}"], \
                    f"the old rank {rank} wrote after its host was declared lost"
            wait_until(lambda: not any(netns.alive(p) for p in [stopped, *old.values()]),
                       "the old agent and its ranks to end", timeout=30)
            assert set(mesh.run(REDUCE).result(timeout=60).values()) == {4.0}
        finally:
            mesh.stop()


def test_a_joined_hosts_link_resets_and_it_comes_back_with_its_own_key(netns_hosts: netns.Hosts,
                                                                       tmp_path: Path) -> None:
    """The join key is revoked once the hosts have joined; a joined agent dialled again with a
    key of its own, so a reset link reconnects, and everything ends with the mesh (the agent
    used to be refused, block in a send for ever, and outlive the kernel)."""
    need(netns.firewall_missing)
    hosts = netns_hosts
    agents: list[subprocess.Popen[bytes]] = []

    def announce(text: str) -> None:
        path = re.search(r"--token-file (\S+)", text).group(1)  # type: ignore[union-attr]
        for host in hosts:
            agents.append(hosts.popen(host, [sys.executable, "-m", "meshbook.mesh.agent", "join",
                                             "--token-file", path], stdin=subprocess.DEVNULL))

    launcher = meshbook.Join(hosts=2, per_host=2, address=hosts.controller_addr, token_dir=str(tmp_path),
                             announce=announce)
    mesh = meshbook.start(launcher=launcher, timeout=120)
    try:
        run = mesh.run("import time\ntime.sleep(3)\nrank")
        time.sleep(0.5)
        hosts.reset_connections_to_controller("h2", 1.5)
        assert dict(run.result(timeout=60)) == {0: 0, 1: 1, 2: 2, 3: 3}
        assert set(mesh.run(REDUCE).result(timeout=60).values()) == {4.0}
        assert [h.state for h in mesh.hosts()] == ["ok", "ok"]
    finally:
        mesh.stop()
    for agent in agents:
        assert agent.wait(20) == 0, "a joined agent outlived its mesh"


def test_the_store_listens_on_the_meshs_address_only(ssh_hosts: sshd.Sshd, capfd: pytest.CaptureFixture[str]) -> None:
    mesh = ssh_mesh(ssh_hosts)
    try:
        assert set(mesh.run(REDUCE).result().values()) == {4.0}
        time.sleep(0.5)
        assert "hostname of the client socket cannot be retrieved" not in capfd.readouterr().err, \
            "c10d's noise about hosts without reverse DNS reached the notebook"
        first = mesh.hosts()[0]
        listening = ssh_hosts.hosts.run("h1", ["ss", "-ltnH"]).stdout
        local = [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(f":{first.store_port}")]
        assert local == [f"{first.address}:{first.store_port}"], listening
    finally:
        mesh.stop()


def test_a_host_named_twice_is_refused(ssh_hosts: sshd.Sshd) -> None:
    with pytest.raises(meshbook.MeshError, match="h1 is named twice"):
        meshbook.start(launcher=meshbook.SSH(["h1", "h1"], per_host=2, ssh_options=["-F", str(ssh_hosts.ssh_config)]))


def test_nothing_is_left_behind_when_the_kernel_is_sigkilled(ssh_hosts: sshd.Sshd) -> None:
    """A SIGKILLed kernel cannot clean up: its ssh sessions and tunnels end on their own (the
    pipes it held close), its agents with them, and what it left on disk goes at the next
    start on this machine; a SIGKILLed agent's directory goes at the next start on its host."""
    import psutil
    from jupyter_kernels import Kernel, wait_gone

    config = str(ssh_hosts.ssh_config)
    kernel = Kernel()
    try:
        kernel.ok(f"import meshbook, os\n%load_ext meshbook\nmesh = meshbook.start(launcher=meshbook.SSH("
                  f"['h1', 'h2'], per_host=1, python={sys.executable!r}, ssh_options=['-F', {config!r}], "
                  f"tunnel=True))", timeout=180)
        assert kernel.value("dict(mesh.run('rank').result())") == {0: 0, 1: 1}
        rundir = kernel.value("mesh.controller.rundir")
        logs = kernel.value("[a.log for a in mesh.controller.agents]")
        agents = kernel.value("[h.agent_pid for h in mesh.hosts()]")
        sessions = [p.pid for p in psutil.Process(kernel.pid).children(recursive=True) if p.name() == "ssh"]
        assert len(sessions) == 4, "a session and a tunnel per host"
        os.kill(kernel.pid, signal.SIGKILL)
        assert wait_gone([*sessions, *agents], 30.0) == [], "ssh processes or agents outlived the kernel"
        assert os.path.exists(rundir) and all(os.path.exists(log) for log in logs)
    finally:
        kernel.close()
    meshbook.start(1).stop()  # the next start on this machine
    assert not os.path.exists(rundir) and not any(os.path.exists(log) for log in logs)


def test_a_sigkilled_agents_directory_goes_at_the_next_start_on_its_host(ssh_hosts: sshd.Sshd) -> None:
    h1 = ssh_hosts.hosts["h1"]
    mesh = ssh_mesh(ssh_hosts)
    try:
        agent = mesh.hosts()[0].agent_pid
        left = [p for p in h1.runtime_dir.iterdir() if p.name.startswith(f"mb-{agent}-")]
        assert len(left) == 1
        os.kill(agent, signal.SIGKILL)
        wait_until(lambda: mesh.hosts()[0].state == "lost" or mesh.status()[0].state == "dead", "h1's ranks to die")
    finally:
        mesh.stop()
    assert left[0].exists(), "a SIGKILLed agent cannot clean up"
    ssh_mesh(ssh_hosts).stop()
    assert not left[0].exists(), "the next agent on h1 removed what the killed one left"
