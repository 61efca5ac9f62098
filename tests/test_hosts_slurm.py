"""Meshes in Slurm jobs, on a real Slurm whose nodes are network namespaces (tests/rigs/slurm.py).

The controller stays in the root namespace (the login node); each node's agent listens and
the controller dials it. Every test checks that it leaves no job and no per-job directory
behind. Batch jobs take a few seconds to start here, and a time limit is enforced to within
Slurm's ~30 s scheduling tick, so these tests are slow; they need root (``./dev hosts``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from jupyter_kernels import Kernel, wait_gone
from rigs import slurm

import meshbook
from meshbook.mesh.controller.launch.kept import mesh_dir

pytestmark = pytest.mark.hosts

REDUCE = "t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nt.tolist()"


@pytest.fixture
def cluster(slurm_cluster: slurm.Slurm, monkeypatch: pytest.MonkeyPatch) -> Iterator[slurm.Slurm]:
    """The rig's Slurm, its CLIs on this process's environment (as on a login node)."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    yield slurm_cluster
    left = slurm_cluster.job_ids()
    if left:
        slurm_cluster.run(["scancel", *left], check=False)
    assert not left, f"the test left Slurm jobs behind: {left}"


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """Where the per-job directories go (the user's shared home on a cluster)."""
    yield tmp_path / "meshbook"
    assert not list((tmp_path / "meshbook").glob("slurm-*")), "a per-job directory was left behind"


def launcher(home: Path, lines: list[str] | None = None, **kw: Any) -> meshbook.Slurm:
    return meshbook.Slurm(workdir=str(home), announce=(lines if lines is not None else []).append,
                          poll_s=0.5, **kw)


def state(cluster: slurm.Slurm, job: str) -> str:
    return cluster.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], check=False).stdout.strip()


def wait_until(check: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def occupy(cluster: slurm.Slurm) -> str:
    """A job holding both nodes whole (what a busy cluster looks like)."""
    job = cluster.run(["sbatch", "--parsable", "-N2", "--exclusive", "--wrap", "sleep 300"]).stdout.strip()
    wait_until(lambda: state(cluster, job) == "RUNNING", "the occupying job to run")
    return job


def gone(cluster: slurm.Slurm, job: str) -> bool:
    return state(cluster, job) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")


def test_a_two_node_mesh_in_a_submitted_job(cluster: slurm.Slurm, home: Path) -> None:
    lines: list[str] = []
    mesh = meshbook.start(4, launcher=launcher(home, lines, nodes=2, time="10:00",
                                               sbatch="--job-name=mb-test --comment=x"), timeout=120)
    try:
        job = mesh.job()
        assert lines[0] == f"submitted Slurm job {job.job}"
        assert (job.state, job.nodes, job.submitted) == ("RUNNING", "h[1-2]", True)
        assert re.fullmatch(r"\d+:\d\d", job.left), job.left  # squeue's %L: 9:57
        assert re.fullmatch(rf"Slurm job {job.job}: RUNNING on h\[1-2\], \d+:\d\d left", str(job))
        names = mesh.run("import socket; socket.gethostname()").result()
        assert [names[r] for r in range(4)] == ["h1", "h1", "h2", "h2"]
        assert set(map(tuple, mesh.run(REDUCE).result().values())) == {(10.0, 10.0)}
        assert [h.address for h in mesh.hosts()] == [cluster.hosts["h1"].addr, cluster.hosts["h2"].addr]
        name = cluster.run(["squeue", "-h", "-j", job.job, "-o", "%j"]).stdout.strip()
        assert name == "mb-test", "the --sbatch options reach sbatch (after meshbook's own)"
        secret = next(home.glob("slurm-*/bootstrap.json"))
        assert secret.stat().st_mode & 0o777 == 0o600 and secret.parent.stat().st_mode & 0o777 == 0o700
        assert mesh.controller.wire.key.hex() not in cluster.run(
            ["scontrol", "show", "job", job.job]).stdout, "no secret on a command line"
        from meshbook.widgets import Dashboard

        dashboard = Dashboard(mesh, refresh=0.2)
        try:
            dashboard.refresh()
            assert re.search(rf"Slurm job {job.job}: RUNNING on h\[1-2\], \d+:\d\d left",
                             dashboard.html_view.value), "the dashboard shows the job and its time left"
        finally:
            dashboard.close()
    finally:
        mesh.stop()
    assert gone(cluster, job.job), "stopping the mesh ends the job it submitted"


def test_pending_then_running_is_shown(cluster: slurm.Slurm, home: Path) -> None:
    blocker = occupy(cluster)
    lines: list[str] = []

    def announce(line: str) -> None:
        lines.append(line)
        if " pending " in line and sum(" pending " in seen for seen in lines) == 1:
            threading.Timer(2.0, cluster.run, [["scancel", blocker]]).start()

    mesh = meshbook.start(2, launcher=meshbook.Slurm(nodes=2, workdir=str(home), announce=announce,
                                                     poll_s=0.5), timeout=120)
    try:
        job = mesh.job().job
        pending = [line for line in lines if " pending " in line]
        assert pending and re.fullmatch(rf"job {job} pending \((Resources|Priority)\), position 1",
                                        pending[0]), lines
        assert mesh.job().state == "RUNNING"
        assert set(map(tuple, mesh.run(REDUCE).result().values())) == {(3.0, 3.0)}
    finally:
        mesh.stop()


def test_an_interrupt_while_pending_cancels_the_job(cluster: slurm.Slurm, home: Path) -> None:
    blocker = occupy(cluster)
    lines: list[str] = []

    def announce(line: str) -> None:
        lines.append(line)
        if " pending " in line:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C (the kernel's interrupt) while it waits

    try:
        with pytest.raises(meshbook.MeshError, match=r"interrupted: cancelled Slurm job (\d+) while it was pending"):
            meshbook.start(2, launcher=meshbook.Slurm(nodes=2, workdir=str(home), announce=announce,
                                                      poll_s=0.5), timeout=120)
        job = lines[0].split()[-1]
        assert state(cluster, job) in ("CANCELLED", ""), "the pending job was cancelled"
    finally:
        cluster.run(["scancel", blocker])
        wait_until(lambda: gone(cluster, blocker), "the occupying job to end")


def test_scancel_mid_cell_fails_the_cell(cluster: slurm.Slurm, home: Path) -> None:
    mesh = meshbook.start(2, launcher=launcher(home, nodes=2), timeout=120)
    try:
        job = mesh.job().job
        run = mesh.run("import time\nfor _ in range(600): time.sleep(0.1)")
        cluster.run(["scancel", job])
        with pytest.raises(meshbook.RemoteError) as info:
            run.result(timeout=60)
        assert f"job {job} ended: CANCELLED" in str(info.value)
        assert mesh.job().state.startswith(f"job {job} ended: CANCELLED")
    finally:
        mesh.stop()
    assert gone(cluster, job)


def test_a_busy_slurmctld_still_says_how_the_job_ended(cluster: slurm.Slurm, home: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The controller gave the launcher twice its poll (1 s here) to say why its agents stopped.
    With squeue answering late (a busy slurmctld; here the real squeue behind a 3 s pause) the
    job's end came after that, and the cell failed with "the agent of host h1 stopped (terminated
    by SIGTERM)" (the time-limit test did so under load). It waits for a look at the job begun
    after the agents stopped."""
    mesh = meshbook.start(2, launcher=launcher(home, nodes=2), timeout=120)
    try:
        job = mesh.job().job
        slow = tmp_path / "bin"
        slow.mkdir()
        (slow / "squeue").write_text(f"#!/bin/sh\nsleep 3\nexec {shutil.which('squeue')} \"$@\"\n")
        (slow / "squeue").chmod(0o755)
        monkeypatch.setenv("PATH", f"{slow}{os.pathsep}{os.environ['PATH']}")
        run = mesh.run("import time\nfor _ in range(600): time.sleep(0.1)")
        cluster.run(["scancel", job])
        with pytest.raises(meshbook.RemoteError) as info:
            run.result(timeout=90)
        assert f"job {job} ended: CANCELLED" in str(info.value), str(info.value)
    finally:
        mesh.stop()
    assert gone(cluster, job)


def test_the_time_limit_runs_the_hook_once_in_the_kernel_that_drives_the_mesh(
        cluster: slurm.Slurm, home: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A kept mesh attached again, as after a kernel restart: Slurm's signal runs the hook the
    job was submitted with in the kernel that attached it (the mesh file keeps the code), not in
    the one that let go; and once: a kernel that attaches after it ran does not run it again.
    The signal is sent by hand, as Slurm sends it: Slurm's own comes at a ~30 s tick, up to a
    minute early."""
    lines: list[str] = []
    first = meshbook.start(2, launcher=launcher(home, lines, nodes=2, time="10", on_time_limit="save()"),
                           keep="10m", timeout=120)
    job, mesh_id = first.job().job, first.controller.lease.id
    try:
        first.run(f"def save():\n    open('{tmp_path}/saved-' + str(rank), 'w').write('step 7')").result()
        assert "left (time limit); save what you need" in capfd.readouterr().err, \
            "under 10 minutes left: a warning with the next cell"
        mesh = meshbook.attach(mesh_id)  # this process's handle lets go of it, as a new kernel's attach does
    except BaseException:
        first.stop()
        raise
    try:
        assert first.controller.stopped and mesh.job().job == job
        cluster.run(["scancel", "--batch", "--signal=USR1", job])
        wait_until(lambda: len(list(tmp_path.glob("saved-*"))) == 2, "the attached kernel to run the hook")
        wait_until(lambda: "on_time_limit done" in capfd.readouterr().out, "the hook to end")
        assert not any("signalled" in line for line in lines), lines  # not the first's: it let go
        for saved in tmp_path.glob("saved-*"):
            saved.unlink()
        mesh = meshbook.attach(mesh_id)
        time.sleep(12)  # two looks of its watcher (every 5 s)
        assert not list(tmp_path.glob("saved-*")), "a kernel that attached after the hook ran ran it again"
    finally:
        mesh.stop()
    assert gone(cluster, job)


def test_a_mesh_inside_an_allocation_the_user_has(cluster: slurm.Slurm, home: Path) -> None:
    allocation = cluster.run(["sbatch", "--parsable", "-N2", "--wrap", "sleep 300"]).stdout.strip()
    try:
        wait_until(lambda: state(cluster, allocation) == "RUNNING", "the allocation to run")
        mesh = meshbook.start(2, launcher=launcher(home, job=allocation, per_node=1), timeout=120)
        try:
            assert (mesh.job().job, mesh.job().submitted) == (allocation, False)
            names = mesh.run("import socket, os; socket.gethostname(), os.environ['SLURM_JOB_ID']").result()
            assert [names[r] for r in range(2)] == [("h1", allocation), ("h2", allocation)]
            assert set(map(tuple, mesh.run(REDUCE).result().values())) == {(3.0, 3.0)}
        finally:
            mesh.stop()
        assert state(cluster, allocation) == "RUNNING", "the user's allocation outlives the mesh"
    finally:
        cluster.run(["scancel", allocation])
        wait_until(lambda: gone(cluster, allocation), "the allocation to end")


def test_the_magics_on_slurm_and_a_cancelled_job_fails_the_cell(cluster: slurm.Slurm, home: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(home.parent))  # the kernel's ~/.meshbook
    kernel = Kernel()
    try:
        started = kernel.ok("import meshbook\n%load_ext meshbook\n"
                            "%mesh start --slurm nodes=2,time=30:00 --sbatch \"--job-name=mb-magic --comment=x\"",
                            timeout=180).stream()
        job = re.search(r"submitted Slurm job (\d+)", started).group(1)  # type: ignore[union-attr]
        assert "started" in started and "2 ranks" in started, started
        status = kernel.ok("%mesh status").stream()
        assert re.search(rf"Slurm job {job}: RUNNING on h\[1-2\], \d+:\d\d left", status), status
        msg_id, sent_at = kernel.submit("%%mesh\nimport time\nfor _ in range(600): time.sleep(0.1)")
        time.sleep(1)
        cluster.run(["scancel", job])
        reply = kernel.wait(msg_id, sent_at, timeout=90)
        assert reply.status == "error" and f"job {job} ended: CANCELLED" in reply.error_text, reply.error_text
        assert kernel.value("6 * 7") == 42, "the kernel is healthy"
        wait_until(lambda: "mesh ended: " in kernel.ok("%mesh status").stream(), "the mesh to end with its job")
        assert f"job {job} ended: CANCELLED" in kernel.ok("%mesh status").stream()
        again = kernel.ok("%mesh start --slurm nodes=2,time=30:00", timeout=180).stream()  # no --force needed
        second = re.search(r"submitted Slurm job (\d+)", again).group(1)  # type: ignore[union-attr]
        assert "started" in again and second != job
        kernel.ok("%mesh stop")
    finally:
        kernel.close()
    assert gone(cluster, job) and gone(cluster, second)


def test_a_kept_slurm_mesh_survives_its_kernel_and_a_new_kernel_attaches_it(
        cluster: slurm.Slurm, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(home.parent))  # the kernel's ~/.meshbook
    # A plain mesh's agents would end 2 s after the kernel's death; a kept one's, when its lease does.
    monkeypatch.setenv("MESHBOOK_HOST_SUSPECT_S", "1")
    monkeypatch.setenv("MESHBOOK_HOST_LOST_S", "2")
    first, second, job = Kernel(), None, ""
    try:
        started = first.ok("import meshbook\n%load_ext meshbook\n%mesh start --slurm nodes=2,time=30:00 --keep 10m",
                           timeout=180).stream()
        job = re.search(r"submitted Slurm job (\d+)", started).group(1)  # type: ignore[union-attr]
        mesh_id = first.value("meshbook.current().controller.lease.id")
        assert f"%mesh attach {mesh_id}" in started, started
        first.ok("%%mesh\nimport socket\nmarker = f'rank {rank} kept on {socket.gethostname()}'")
        path = Path(mesh_dir()) / f"{mesh_id}.json"
        record = json.loads(path.read_text())
        assert (record["launcher_state"]["job"], [h["name"] for h in record["hosts"]]) == (job, ["h1", "h2"])
        assert record["launcher"] == "slurm" and record["versions"]["meshbook"] == meshbook.__version__
        assert [h["addr"] for h in record["hosts"]] == [cluster.hosts["h1"].addr, cluster.hosts["h2"].addr]
        assert all(h["port"] and h["pid"] and h["store_port"] for h in record["hosts"]), record["hosts"]
        os.kill(first.pid, signal.SIGKILL)
        assert wait_gone([first.pid]) == []
        time.sleep(3)  # past the host-loss timeout
        assert state(cluster, job) == "RUNNING", "the kept mesh's job outlives the kernel"

        second = Kernel()
        listed = second.ok("import meshbook\n%load_ext meshbook\n%mesh list").stream()
        assert any(mesh_id in line and f"{job} RUNNING" in line and "slurm" in line
                   for line in listed.splitlines()), listed
        assert "attached" in second.ok(f"%mesh attach {mesh_id}").stream()
        assert re.search(rf"Slurm job {job}: RUNNING", second.ok("%mesh status").stream())
        out = second.ok("%%mesh --ordered\nprint(marker)").stream()
        assert "rank 0 kept on h1" in out and "rank 1 kept on h2" in out, out
        second.ok("%mesh stop", timeout=60)
        assert gone(cluster, job), "stopping the attached mesh ends its job"
        wait_until(lambda: not path.exists(), "the agents to remove the mesh file")
    finally:
        for kernel in {first, second} - {None}:
            kernel.close()
        if job and not gone(cluster, job):
            cluster.run(["scancel", job])
            wait_until(lambda: gone(cluster, job), "the kept job to end")


def test_a_kept_slurm_mesh_whose_lease_runs_out_ends_its_job_and_leaves_nothing(
        cluster: slurm.Slurm, home: Path) -> None:
    mesh = meshbook.start(2, launcher=launcher(home, nodes=2, time="10:00"), keep="5s", timeout=120)
    job, job_dir = mesh.job().job, mesh.controller.launcher.current.dir
    path = Path(mesh_dir()) / f"{mesh.controller.lease.id}.json"
    assert path.exists() and job in [r.job for r in meshbook.list_meshes()]
    assert dict(mesh.run("rank").result()) == {0: 0, 1: 1}
    mesh.controller.stop("this process lets go of it", detach=True)  # as when the kernel dies
    assert state(cluster, job) == "RUNNING"
    wait_until(lambda: gone(cluster, job), "the lease to run out and the job to end")
    assert not os.path.exists(job_dir), "the batch script removes the per-job directory"
    wait_until(lambda: not path.exists(), "the agents to remove the mesh file")
    assert job not in [r.job for r in meshbook.list_meshes()]


def test_a_slurm_that_does_not_answer_is_not_a_job_that_ended(cluster: slurm.Slurm, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept mesh's file holds its keys: forgetting it because slurmctld was busy for a moment
    would lose the mesh. Only Slurm saying it no longer knows the job ends it."""
    from meshbook.mesh.controller.launch.slurm import UNANSWERED, query

    assert query("999999") is None, "a job id Slurm does not know"
    silent = tmp_path / "slurm.conf"
    text = Path(cluster.conf).read_text()
    silent.write_text(re.sub(r"(?m)^SlurmctldPort=.*$", "SlurmctldPort=9", text)
                      if "SlurmctldPort=" in text else text + "\nSlurmctldPort=9\n")
    monkeypatch.setenv("SLURM_CONF", str(silent))
    state = query("1")
    assert state is not None and state.state == UNANSWERED and state.active
