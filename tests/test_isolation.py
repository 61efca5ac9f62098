"""What another local user can reach of a running mesh: nothing it could use.

The reach attempts run as a second local user this module creates (and removes), so the
test needs root; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import uuid
from typing import Iterator

import psutil
import pytest

import meshbook

PROBE = """
import json, socket, sys
reached = {}
for kind, target in json.loads(sys.argv[1]):
    try:
        if kind == "tcp":
            socket.create_connection(tuple(target), timeout=2).close()
        elif kind == "unix":
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(2)
                s.connect(target)
        else:
            open(target, "rb").close()
        reached[repr(target)] = "reached"
    except OSError as exc:
        reached[repr(target)] = type(exc).__name__
print(json.dumps(reached))
"""


@pytest.fixture(scope="module")
def stranger() -> Iterator[str]:
    """A throwaway local user: another uid on this machine."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("creating a second local user needs root and useradd")
    name = f"mbprobe{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)


def attempts(user: str, targets: list[tuple[str, object]]) -> dict[str, str]:
    """Try each target as ``user``: "reached", or the error that stopped the attempt."""
    return run_as(user, PROBE, targets)


def run_as(user: str, probe: str, argument: object) -> dict[str, str]:
    """Run the Python ``probe`` as ``user`` with ``argument`` (JSON); its JSON answer."""
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            done = subprocess.run([python, "-c", probe, json.dumps(argument)], user=user,
                                  capture_output=True, text=True, timeout=60, cwd="/")
        except PermissionError:
            continue
        if done.returncode == 0:
            return json.loads(done.stdout)  # type: ignore[no-any-return]
    pytest.skip(f"no Python interpreter that user {user} may run")


def mesh_processes(mesh: meshbook.Mesh) -> list[psutil.Process]:
    agent = psutil.Process(mesh.controller.agents[0].proc.pid)
    return [agent, *agent.children(recursive=True)]


def listeners(mesh: meshbook.Mesh) -> list[tuple[str, int]]:
    return [tuple(c.laddr) for p in mesh_processes(mesh) for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN]


def other_addresses() -> list[str]:
    """This machine's addresses that other machines could use (not loopback)."""
    return [a.address.split("%")[0] for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6) and not a.address.startswith(("127.", "::1"))]


def test_another_user_reaches_no_socket_file_or_store_of_a_mesh(stranger: str) -> None:
    with meshbook.start(4) as mesh:
        rundir = mesh.controller.rundir
        entries = [os.path.join(rundir, name) for name in os.listdir(rundir)]
        assert any(os.path.basename(e).startswith("store-") for e in entries), "the store lives in the rundir"
        targets = [("unix" if stat.S_ISSOCK(os.stat(e).st_mode) else "file", e) for e in entries]
        reached = attempts(stranger, [*targets, ("file", rundir)])
        assert set(reached.values()) == {"PermissionError"}, reached
        assert dict(mesh.run("rank").result()) == {0: 0, 1: 1, 2: 2, 3: 3}


def test_the_mesh_listens_on_loopback_only(stranger: str) -> None:
    """gloo's endpoints are the mesh's only TCP listeners (the store is a file), and they
    listen on loopback, so no other machine reaches them. gloo authenticates no peer, and
    Linux has no unprivileged way to keep another local user off a loopback port: from there
    a connection is accepted but gets nothing, and the mesh's results stay right."""
    with meshbook.start(4) as mesh:
        found = listeners(mesh)
        assert len(found) == 4, found  # one gloo endpoint per rank, no store
        assert all(ip == "127.0.0.1" for ip, _ in found), found
        outside = [("tcp", (address, port)) for address in other_addresses() for _, port in found]
        reached = attempts(stranger, outside)
        assert "reached" not in reached.values(), reached
        garbage = [socket.create_connection(("127.0.0.1", port), timeout=5) for _, port in found]
        for sock in garbage:
            sock.sendall(os.urandom(4096))
        code = "x = torch.ones(1)\ndist.all_reduce(x)\ng = dist.new_group([0, 1])\nx.item()"
        assert dict(mesh.run(code).result(timeout=60)) == {r: 4.0 for r in range(4)}
        for sock in garbage:
            sock.close()


def test_a_re_forked_rank_0_joins_the_new_generations_store(mesh2: meshbook.Mesh) -> None:
    """Rank 0 held no special store role to lose: re-forked, it meets the others in the file
    of the new generation."""
    mesh2.restart([0])
    code = "x = torch.ones(1)\ndist.all_reduce(x)\nx.item()"
    assert dict(mesh2.run(code).result(timeout=60)) == {0: 2.0, 1: 2.0}
    assert os.path.exists(os.path.join(mesh2.controller.rundir, "store-g1"))


SECRETS_PROBE = """
import json, sys
secrets, pids = json.loads(sys.argv[1])
seen = {}
for pid in pids:
    for part in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{part}", "rb") as f:
                text = f.read().decode(errors="replace")
            seen[f"{pid}/{part}"] = "secret" if any(s in text for s in secrets) else "clean"
        except OSError as exc:
            seen[f"{pid}/{part}"] = type(exc).__name__
print(json.dumps(seen))
"""


def test_another_user_reads_no_secret_of_a_mesh_across_hosts(stranger: str, tmp_path: object) -> None:
    """Agents that joined with the token in their environment (the join command's second
    form): their command lines hold no secret, and their environment is closed to others."""
    from test_join import start_joined

    mesh, outside = start_joined(tmp_path, token_in_env=True)
    try:
        secrets = [mesh.controller.wire.key.hex(), outside.token]
        pids = [p.pid for p in outside.procs]
        pids += [c.pid for p in pids for c in psutil.Process(p).children(recursive=True)]
        seen = run_as(stranger, SECRETS_PROBE, [secrets, pids])
        assert len(pids) == 6 and all(seen[f"{pid}/cmdline"] == "clean" for pid in pids), seen
        assert all(seen[f"{pid}/environ"] == "PermissionError" for pid in pids), seen
    finally:
        mesh.stop()
        outside.wait_all()
