"""An OOM kill is reported as one, on cgroup v1 and v2 alike.

The readers are tested on directories laid out like each cgroup version (and a kernel log in
``/dev/kmsg``'s record format); a rank really killed by the OOM killer, inside a memory cgroup
this test creates, needs root and a cgroup v1 memory hierarchy.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

import meshbook
from meshbook import RemoteError
from meshbook.mesh.agent.oom import in_kernel_log, oom_kills


def lay_out(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[str, str]:
    """A fake cgroup root with ``files`` and a ``/proc/self/cgroup`` saying ``membership``."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(membership)
    return str(root), str(tmp_path / "self-cgroup")


@pytest.mark.parametrize("membership, files, kills", [
    pytest.param("0::/user.slice/job\n", {
        "user.slice/job/memory.events": "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"},
        2, id="v2 memory.events"),
    pytest.param("5:cpu,cpuacct:/job\n4:memory:/job\n1:name=systemd:/job\n", {
        "memory/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n",
        "memory/job/memory.failcnt": "31\n"}, 7, id="v1 memory.oom_control"),
    pytest.param("4:memory:/job\n", {
        "memory/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n",
        "memory/job/memory.failcnt": "31\n"}, 31, id="v1 before kernel 4.13: limit hits"),
    pytest.param("4:memory:/job\n0::/job\n", {
        "memory/job/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
        "unified/README": "the v2 hierarchy here has no memory controller\n"}, 4, id="hybrid: v1 memory"),
])
def test_the_oom_kill_count_is_read_from_either_cgroup_version(tmp_path: Path, membership: str,
                                                               files: dict[str, str], kills: int) -> None:
    assert oom_kills(*lay_out(tmp_path, membership, files)) == kills


def test_no_memory_cgroup_reads_nothing(tmp_path: Path) -> None:
    root, membership = lay_out(tmp_path, "1:name=systemd:/\n", {})
    assert oom_kills(root, membership) is None
    assert oom_kills(root, str(tmp_path / "missing")) is None


def test_the_kernel_log_names_the_pid_after_it_started(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text(
        "6,1,1000000,-;Out of memory: Killed process 4242 (python) total-vm:100kB\n"  # an older 4242
        "4,2,9000000,-;python invoked oom-killer: gfp_mask=0x140cca\n"
        " SUBSYSTEM=memory\n"
        "3,3,9000100,-;Memory cgroup out of memory: Killed process 4243 (python) total-vm:9GB\n"
        "6,4,9500000,-;oom_reaper: reaped process 4243 (python)\n")
    assert in_kernel_log(4243, since=5.0, path=str(log))
    assert not in_kernel_log(4242, since=5.0, path=str(log))  # that one died before
    assert not in_kernel_log(424, since=0.0, path=str(log))
    assert not in_kernel_log(4243, since=0.0, path=str(tmp_path / "unreadable"))


@pytest.fixture
def small_cgroup() -> Iterator[str]:
    """A 256 MiB memory cgroup (v1) under ours, removed afterwards."""
    from meshbook.mesh.agent.oom import CGROUP_ROOT, MEMBERSHIP, memory_cgroups

    v1, _ = memory_cgroups(MEMBERSHIP)
    parent = os.path.join(CGROUP_ROOT, "memory") + (v1 or "")
    if os.geteuid() != 0 or v1 is None or not os.access(parent, os.W_OK):
        pytest.skip("a real OOM kill needs root and a writable cgroup v1 memory hierarchy")
    path = os.path.join(parent, f"meshbook-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        if os.path.exists(os.path.join(path, name)):
            Path(path, name).write_text(str(256 << 20))
    yield path
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.rmdir(path)
            return
        except OSError:  # its last process is still being torn down
            time.sleep(0.1)


def test_a_rank_the_oom_killer_takes_is_reported_as_such(small_cgroup: str) -> None:
    with meshbook.start(2) as mesh:
        code = (f"if rank == 1:\n"
                f"    open({os.path.join(small_cgroup, 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
                f"    hog = torch.ones(2 ** 28)\n"
                f"rank")
        with pytest.raises(RemoteError) as failed:
            mesh.run("import os\n" + code).result(timeout=60)
        assert "rank 1 died: SIGKILL (killed by the OOM killer)" in str(failed.value)
        assert mesh.status()[1].cause == "SIGKILL (killed by the OOM killer)"


def test_an_out_of_memory_error_lets_go_of_the_memory_its_frames_held() -> None:
    """A rank keeps its last exception for %mesh debug; an OOM's frames hold the very tensors
    that filled the memory, so their variables are released (the stack is still shown)."""
    cell = ("import weakref\ndef step():\n    activations = torch.ones(1000)\n"
            "    global held\n    held = weakref.ref(activations)\n    raise {}('CUDA out of memory')\nstep()")
    with meshbook.start(1) as mesh:
        with pytest.raises(RemoteError):
            mesh.run(cell.format("ValueError")).result()
        assert mesh.run("held() is None").result()[0] is False  # any other error keeps its frames
        with pytest.raises(RemoteError) as info:
            mesh.run("class OutOfMemoryError(RuntimeError): pass\n" + cell.format("OutOfMemoryError")).result()
        assert "cell line 7, in step" in info.value.render()  # the traceback is still told in full
        assert mesh.run("held() is None").result()[0] is True
