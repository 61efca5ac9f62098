"""A mesh across hosts formed by the ``join`` launcher, on this machine's loopback.

The "external launcher" here is the test itself: it runs the printed command, ``python -m
meshbook.mesh.agent join``, once per host, exactly as a Kubernetes Job or mpirun would.
Each agent is a real process talking to the controller over TCP with CurveZMQ; the ranks
are real, and meet in the TCPStore of host 0's agent.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest
import torch

import meshbook
from meshbook.mesh.controller.launch.network import Network
from meshbook.mesh.protocol.remote import TOKEN_ENV


class ExternalLauncher:
    """Starts ``python -m meshbook.mesh.agent join`` per host when the mesh asks for hosts."""

    def __init__(self, token_in_env: bool = False) -> None:
        self.token_in_env = token_in_env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.announced = ""
        self.token = ""
        #: What each agent wrote to stderr, read once it exited (see ``wait_all``).
        self.said: list[str] = []

    def announce(self, text: str, launcher: meshbook.Join, hosts: int) -> None:
        self.announced = text
        path = launcher.token_path
        assert path is not None
        self.token = open(path).read().strip()
        self.mode = stat.S_IMODE(os.stat(path).st_mode)
        command = re.search(r"^  (python -m \S+ join --token-file \S+)$", text, re.M)
        assert command is not None, text
        for _ in range(hosts):
            self.procs.append(self.run_agent([], env={TOKEN_ENV: self.token}) if self.token_in_env
                              else self.run_agent(["--token-file", path]))

    def run_agent(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "meshbook.mesh.agent", "join", *args],
                                env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)

    def wait_all(self, timeout: float = 30.0) -> list[int]:
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                codes.append(-9)
            if proc.stderr is not None:
                self.said.append(proc.stderr.read().decode(errors="replace"))
                proc.stderr.close()
        return codes


def start_joined(tmp_path: object, hosts: int = 2, per_host: int = 2, token_in_env: bool = False,
                 timeout: float = 120, **kw: object) -> tuple[meshbook.Mesh, ExternalLauncher]:
    outside = ExternalLauncher(token_in_env)
    launcher = meshbook.Join(hosts=hosts, per_host=per_host, address="127.0.0.1", token_dir=str(tmp_path),
                             **kw)  # type: ignore[arg-type]
    launcher.announce = lambda text: outside.announce(text, launcher, hosts)
    try:
        mesh = meshbook.start(hosts * per_host, launcher=launcher, timeout=timeout)
    except BaseException:
        codes = outside.wait_all(5)
        for code, said in zip(codes, outside.said):  # pytest shows this beside the failure
            print(f"joining agent exited {code}; its stderr:\n{said}", file=sys.stderr)
        raise
    return mesh, outside


@pytest.fixture(scope="module")
def joined(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[meshbook.Mesh, ExternalLauncher]]:
    mesh, outside = start_joined(tmp_path_factory.mktemp("join"))
    try:
        yield mesh, outside
    finally:
        mesh.stop()
        assert outside.wait_all() == [0, 0], "every joined agent exits when the mesh stops"


def test_joined_hosts_run_cells_and_collectives(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, outside = joined
    assert "--token-file" in outside.announced and TOKEN_ENV in outside.announced
    assert outside.mode == 0o600, "the token file is readable by its owner only"
    token_dir = os.path.dirname(mesh.controller.launcher.token_path)
    assert not any(p.name.startswith("join-") for p in os.scandir(token_dir)), \
        "the token file is removed once the hosts joined"
    values = mesh.run("import os; (rank, os.environ['GROUP_RANK'], os.environ['LOCAL_RANK'])").result()
    assert [values[r] for r in range(4)] == [(0, "0", "0"), (1, "0", "1"), (2, "1", "0"), (3, "1", "1")]
    total = mesh.run("t = torch.ones(3) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()").result()
    assert set(map(tuple, total.values())) == {(10.0, 10.0, 10.0)}


def test_push_and_pull_cross_the_network(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, _ = joined
    data = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: travels as zero-copy frames
    mesh.push(shared=data)
    sums = mesh.run("float(shared.sum())").result()
    assert set(sums.values()) == {float(data.sum())}
    pulled = mesh.pull("shared", ranks=[3])
    assert torch.equal(pulled[3], data)


def test_a_big_push_travels_in_pieces_and_arrives_whole(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, _ = joined
    data = torch.arange(10 << 20, dtype=torch.float32)  # 40 MiB: in pieces, pipelined across the network
    bf16 = torch.randn(3 << 20).to(torch.bfloat16)
    mesh.push(big=data, half=bf16)
    same = mesh.run("(torch.equal(big, torch.arange(10 << 20, dtype=torch.float32)), half.dtype, half.shape)")
    assert set(same.result().values()) == {(True, torch.bfloat16, torch.Size([3 << 20]))}
    assert torch.equal(mesh.pull("half", ranks=[2])[2], bf16)


def test_big_messages_cross_the_network_in_fragments_both_ways(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    """A call with a 40 MiB argument goes down in fragments, and a 40 MiB pull comes up in
    them (so that each link stays heard, tests/test_hosts_faults.py); both arrive whole."""
    mesh, _ = joined
    data = torch.randint(0, 1 << 20, (5 << 20,))  # int64: sums are exact in any order
    weights = {"w": torch.arange(1 << 16), "b": torch.ones(3)}  # frames of all sizes
    sums = mesh.apply(lambda t, state: (int(t.sum()), int(state["w"].sum()), tuple(state["b"].tolist())), data, weights)
    assert set(sums.result().values()) == {(int(data.sum()), int(weights["w"].sum()), (1.0, 1.0, 1.0))}
    mesh.run("big = torch.arange(10 << 20, dtype=torch.float32) * rank\nsmall = [torch.ones(2)] * 5").result()
    pulled = mesh.pull("big", ranks=[1, 3])
    assert torch.equal(pulled[3], torch.arange(10 << 20, dtype=torch.float32) * 3)
    assert torch.equal(pulled[1], torch.arange(10 << 20, dtype=torch.float32))
    assert [h.state for h in mesh.hosts()] == ["ok", "ok"]


def test_parallelize_builds_the_plain_model_once_on_each_host(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, _ = joined

    def layers() -> torch.nn.Module:
        return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))

    def build() -> torch.nn.Module:  # notes on each rank whether it built the plain model there
        import __main__

        model = layers()
        __main__.built_plain = getattr(__main__, "built_plain", False) or not model[0].weight.is_meta
        return model

    mesh.parallelize(build, meshbook.Layout(dp_shard=4))
    assert mesh.run("built_plain").result(echo=False) == {0: True, 1: False, 2: True, 3: False}
    torch.manual_seed(0)
    plain = layers().state_dict()
    mesh.run("full = {k: v.full_tensor() for k, v in model.state_dict().items()}").result()
    for full in mesh.pull("full").values():
        assert full.keys() == plain.keys() and all(torch.equal(full[k], plain[k]) for k in plain)


def test_status_shows_each_host(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, outside = joined
    deadline = time.monotonic() + 10
    while any(h.rtt is None for h in mesh.hosts()) and time.monotonic() < deadline:
        time.sleep(0.1)
    hosts = mesh.hosts()
    assert [h.ranks for h in hosts] == [[0, 1], [2, 3]]
    assert sorted(h.agent_pid for h in hosts) == sorted(p.pid for p in outside.procs)
    for host in hosts:
        row = host.row()
        assert row["address"] == "127.0.0.1" and row["state"] == "ok" and row["round trip"].endswith(" ms")


def test_interrupt_stops_remote_work(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, _ = joined
    run = mesh.run("import time\nfor i in range(600):\n    time.sleep(0.1)")
    time.sleep(1.0)
    run.interrupt()
    with pytest.raises(meshbook.RemoteError) as info:
        run.result(timeout=30)
    assert "KeyboardInterrupt" in str(info.value)
    assert mesh.run("rank").result().values() is not None  # the mesh still answers


def finished(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> tuple[int, str]:
    """The join command's exit code and what it said, once it ended (it must end on its own)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the join command did not end on its own") from None
    return proc.returncode, err.decode(errors="replace")


def test_a_third_host_with_the_spent_token_is_refused_and_told(joined: tuple[meshbook.Mesh, ExternalLauncher]) -> None:
    mesh, outside = joined
    refused_before = mesh.controller.network.allowlist.tally()[1]
    started = time.monotonic()
    code, said = finished(outside.run_agent([], env={TOKEN_ENV: outside.token}))
    assert code != 0 and time.monotonic() - started < 20, "a spent token waited out the start timeout"
    assert "refused this token: the hosts it was for have joined already" in said, said
    assert mesh.controller.network.allowlist.tally()[1] > refused_before
    assert len(mesh.hosts()) == 2


@pytest.mark.parametrize("args, env, expected", [
    ([], {TOKEN_ENV: "not-a-token"}, "not a meshbook join token"),
    ([], {TOKEN_ENV: ""}, "no token: set $MESHBOOK_JOIN_TOKEN or pass --token-file"),
    (["--token-file", "/nonexistent/join.token"], {}, "cannot read the token file /nonexistent/join.token"),
])
def test_a_bad_join_command_says_what_is_wrong_and_fails(args: list[str], env: dict[str, str], expected: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "meshbook.mesh.agent", "join", *args],
                            env={**{k: v for k, v in os.environ.items() if k != TOKEN_ENV}, **env},
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    code, said = finished(proc)
    assert code != 0 and expected in said, (code, said)


def test_a_lost_host_fails_the_cell_and_keeps_the_kernel(tmp_path: object) -> None:
    mesh, outside = start_joined(tmp_path, suspect_s=1, lost_s=3)
    try:
        mesh.run("x = rank").result()
        frozen = mesh.hosts()[1]
        os.kill(frozen.agent_pid, signal.SIGSTOP)  # the host stops answering
        run = mesh.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
        with pytest.raises(meshbook.RemoteError) as info:
            run.result(timeout=60)
        assert "host " in str(info.value) and "lost: ranks 2,3" in str(info.value)
        assert [h.state for h in mesh.hosts()] == ["ok", "lost"]
        assert mesh.run("x", ranks=[0, 1]).result().values() is not None
        with pytest.raises(meshbook.MeshError, match="external launcher"):
            mesh.restart([2, 3])
        os.kill(frozen.agent_pid, signal.SIGCONT)  # it finds its controller silent and exits
    finally:
        mesh.stop()
        outside.wait_all()


def test_an_agent_that_stops_on_its_own_fails_what_waited_on_its_ranks(tmp_path: object) -> None:
    """A joined agent that is terminated kills its ranks and says so on its way out: its link
    never goes silent for long enough to be lost, so that is how the notebook learns it."""
    mesh, outside = start_joined(tmp_path, hosts=2, per_host=1)
    try:
        run = mesh.run("import time\nif rank == 1:\n    time.sleep(600)\nrank")
        os.kill(mesh.hosts()[1].agent_pid, signal.SIGTERM)
        with pytest.raises(meshbook.RemoteError) as info:
            run.result(timeout=30, echo=False)
        assert "stopped (terminated by SIGTERM): ranks 1" in str(info.value), str(info.value)
        assert dict(info.value.partial) == {0: 0}
        with pytest.raises(meshbook.MeshError, match="degraded"):
            mesh.run("rank")
        assert dict(mesh.run("rank", ranks=[0]).result()) == {0: 0}
    finally:
        mesh.stop()
        outside.wait_all()


def test_ranks_that_all_die_say_their_last_words_and_wait_for_a_restart(tmp_path: object) -> None:
    """Across hosts too, the line a rank printed right before it died arrives; and ranks that
    all died of their code, under agents that live on, are a restart away: the mesh stays."""
    mesh, outside = start_joined(tmp_path, hosts=1, per_host=2)
    try:
        run = mesh.run("import os\nprint(f'goodbye from {rank}', flush=True)\nos._exit(3)")
        with pytest.raises(meshbook.RemoteError) as info:
            run.result(timeout=60, echo=False)
        assert {f.died for f in info.value.failures.values()} == {"exit code 3"}
        said = "".join(e.text for e in run.events() if isinstance(e, meshbook.Output))
        assert "goodbye from 0" in said and "goodbye from 1" in said, said
        ticks: list[int] = []
        mesh.controller.tick_listeners.append(lambda runs: ticks.append(1))
        deadline = time.monotonic() + 60
        while len(ticks) < 3 and time.monotonic() < deadline:  # at each, a mesh beyond restart ends
            time.sleep(0.05)
        assert len(ticks) >= 3 and not mesh.controller.stopped
        mesh.restart([0, 1])
        assert dict(mesh.run("rank").result()) == {0: 0, 1: 1}
    finally:
        mesh.stop()
        outside.wait_all()


def test_a_router_opened_while_the_receiver_takes_its_sockets_is_watched(tmp_path: object,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver once read the network's version after taking its sockets: a join router
    opened in between was never watched, and no host could join (a rare start-up failure
    under load). Here the router opens exactly then, every time."""
    listed, opened = threading.Event(), threading.Event()
    real_sockets, real_open_join = Network.sockets, Network.open_join

    def sockets(self: Network) -> list[object]:
        found = real_sockets(self)
        if self.router is None and not listed.is_set() and threading.current_thread().name == "meshbook-receiver":
            listed.set()
            opened.wait(60)  # the router opens now, while this list lacks it
        return found

    def open_join(self: Network, *args: object) -> object:
        listed.wait(60)  # the receiver is taking its sockets
        try:
            return real_open_join(self, *args)
        finally:
            opened.set()

    monkeypatch.setattr(Network, "sockets", sockets)
    monkeypatch.setattr(Network, "open_join", open_join)
    mesh, outside = start_joined(tmp_path, hosts=1, per_host=1, timeout=60)
    try:
        assert listed.is_set(), "the receiver took its sockets while the router opened"
        assert dict(mesh.run("rank").result()) == {0: 0}
    finally:
        mesh.stop()
        outside.wait_all()


def test_a_watch_that_cannot_be_built_leaves_the_receiver_working(tmp_path: object,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver rebuilds its watch when the hosts' sockets change. One that cannot be
    built (no file descriptors left) once closed the old watch first and left the receiver
    with nothing to wait on: every later turn failed, and no answer ever came."""
    from meshbook.mesh.controller.core import transport

    mesh, outside = start_joined(tmp_path, hosts=1, per_host=1, timeout=60)
    real, failed = transport.Watch, threading.Event()

    def watch(sockets: list[object], *descriptors: object) -> object:
        if not failed.is_set():
            failed.set()
            raise OSError(24, "Too many open files")
        return real(sockets, *descriptors)

    try:
        monkeypatch.setattr(transport, "Watch", watch)
        network = mesh.controller.transport.network
        assert network is not None
        network.version += 1  # as when a link is replaced
        mesh.controller.transport.wake()
        assert dict(mesh.run("rank").result(timeout=30)) == {0: 0}
        assert failed.is_set()
    finally:
        mesh.stop()
        outside.wait_all()
