"""Code written for torchrun runs on a mesh unmodified (real ranks, real torchrun, gloo)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import meshbook
from meshbook import RemoteError

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "torchrun_train.py"


@pytest.fixture(scope="module")
def mesh() -> Iterator[meshbook.Mesh]:
    with meshbook.start(dims={"dp": 2}) as m:
        yield m


def cells_of(script: Path) -> list[str]:
    """The script's ``# %%`` sections, as a user pastes them into cells."""
    cells: list[list[str]] = []
    for line in script.read_text().splitlines(keepends=True):
        if line.startswith("# %%"):
            cells.append([])
        if cells:
            cells[-1].append(line)
    return ["".join(cell) for cell in cells]


def test_the_environment_torchrun_sets(mesh: meshbook.Mesh) -> None:
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR"]
    values = mesh.run(f"import os\n[os.environ[n] for n in {names!r}] + [int(os.environ['MASTER_PORT']) > 0]"
                      ).result()
    assert dict(values) == {0: ["0", "2", "0", "2", "0", "127.0.0.1", True],
                            1: ["1", "2", "1", "2", "0", "127.0.0.1", True]}


def test_init_process_group_is_a_no_op_said_once(mesh: meshbook.Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    value = mesh.run("for _ in range(3):\n    dist.init_process_group('gloo', world_size=2, rank=rank)\n"
                     "dist.get_world_size()").result()
    assert value.unique() == 2
    err = capsys.readouterr().err
    assert err.count("the mesh already initialised the process group (gloo, world size 2)") == 1, err


def test_init_process_group_with_a_backend_the_mesh_does_not_run(mesh: meshbook.Mesh) -> None:
    with pytest.raises(RemoteError) as info:
        mesh.run("dist.init_process_group(backend='nccl')").result(echo=False)
    message = info.value.failures[0].message
    assert "this mesh's process group runs gloo" in message and "--backend nccl" in message
    with pytest.raises(RemoteError) as info:
        mesh.run("dist.init_process_group(world_size=8, rank=rank)").result(echo=False)
    assert "read RANK and WORLD_SIZE from os.environ" in info.value.failures[1].message
    assert mesh.run("x = torch.ones(1); dist.all_reduce(x); x.item()").result().unique() == 2.0


def test_init_process_group_timeout_bounds_the_groups_collectives_as_under_torchrun() -> None:
    """A script that asks for 3 s expects a hang to fail in 3 s, not in the mesh's 300 s."""
    with meshbook.start(2) as small:
        with pytest.raises(RemoteError, match="give a datetime.timedelta above zero"):
            small.run("dist.init_process_group('gloo', timeout=3)").result(echo=False)
        small.run("from datetime import timedelta\n"
                  "dist.init_process_group('gloo', timeout=timedelta(seconds=3))").result(echo=False)
        started = time.monotonic()
        run = small.run("import time\nt = torch.ones(1)\nif rank == 0:\n    dist.all_reduce(t)\n"
                        "else:\n    time.sleep(60)")
        while 0 in run.pending:
            assert time.monotonic() - started < 40, "the hung collective did not time out"
            time.sleep(0.1)
        failure = run.exception().failures[0]  # type: ignore[union-attr]
        assert "timed out" in failure.message.lower() or "timeout" in failure.message.lower(), failure.message
        small.interrupt([1])
        run.wait(30)


def test_destroy_process_group_keeps_the_mesh_and_what_was_built_on_it(
        mesh: meshbook.Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    mesh.run("net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))").result()
    mesh.run("sub = dist.new_group([0, 1])\ndist.destroy_process_group(sub)\ndist.destroy_process_group()").result()
    assert "destroy_process_group() keeps the mesh's process group" in capsys.readouterr().err
    values = mesh.run("net(torch.ones(1, 2)).sum().backward()\nx = torch.ones(1); dist.all_reduce(x)\n"
                      "(dist.is_initialized(), x.item())").result()
    assert values.unique() == (True, 2.0)


def test_every_rank_starts_with_its_own_random_state(mesh: meshbook.Mesh) -> None:
    draws = mesh.run("import random, numpy\n(torch.rand(1).item(), random.random(), numpy.random.rand())").result()
    assert len({v for v in draws.values()}) == 2
    assert all(a != b for a, b in zip(draws[0], draws[1]))


def test_bytes_to_sys_stdout_buffer(mesh: meshbook.Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    mesh.run("import sys\nsys.stdout.buffer.write('caf\\u00e9 '.encode()[:4])\n"
             "sys.stdout.buffer.write('caf\\u00e9 '.encode()[4:] + b'ok\\n')\nsys.stdout.flush()").result()
    assert "[0,1] café ok" in capsys.readouterr().out


def test_the_environment_follows_a_restarted_rank() -> None:
    with meshbook.start(2) as mesh:
        mesh.run("import os\nos.environ['RANK'] = 'changed by the user'").result()
        mesh.restart([1])
        after = mesh.run("import os\n(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['MASTER_PORT'])"
                         ).result()
        assert after[0][:2] == ("0", "0") and after[1][:2] == ("1", "1") and after[0][2] == after[1][2]


# gloo's teardown in torch itself sometimes aborts a worker at destroy_process_group() after the
# script has finished (a C++ thread left joinable); it is torchrun's run, not meshbook's, that crashed
TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun_losses(losses_file: Path) -> None:
    """Run the script under real torchrun, which writes its losses. Retried only when torch's teardown aborted."""
    env = dict(os.environ, LOSSES_FILE=str(losses_file), OMP_NUM_THREADS="1")
    for attempt in range(3):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT)],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
        try:
            output, _ = torchrun.communicate(timeout=240)
        finally:  # torchrun's workers too, however it ended
            with contextlib.suppress(ProcessLookupError):
                os.killpg(torchrun.pid, signal.SIGKILL)
        if torchrun.returncode == 0 or TEARDOWN_ABORT not in output or attempt == 2:
            break
        losses_file.unlink(missing_ok=True)
    assert torchrun.returncode == 0, output[-3000:]


def test_a_pasted_torchrun_script_gives_torchrun_s_losses(mesh: meshbook.Mesh, tmp_path: Path) -> None:
    losses_file = tmp_path / "torchrun.json"
    torchrun_losses(losses_file)
    expected = json.loads(losses_file.read_text())
    for cell in cells_of(SCRIPT):
        mesh.run(cell).result()
    losses = mesh.pull("losses")
    assert losses[0] == losses[1] == expected  # bit for bit, on every rank
    assert len(expected) == 3 * 8 and expected[-1] < expected[0]
    # the model is still usable after the script's destroy_process_group()
    assert mesh.run("model(features[:2]).shape[0]").result().unique() == 2


CELL_CLASSES = """
import dataclasses, io, pickle
@dataclasses.dataclass
class Cfg:
    lr: float
    name: str = "run"
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
objs = [None] * world_size
dist.all_gather_object(objs, Cfg(0.1 * (rank + 1)))
buffer = io.BytesIO()
torch.save(Net(), buffer)
buffer.seek(0)
restored = torch.load(buffer, weights_only=False)
(pickle.loads(pickle.dumps(Cfg(0.5))), [o.lr for o in objs], type(restored).__name__, __name__)
"""


def test_classes_defined_in_a_cell_pickle_as_in_a_script(mesh: meshbook.Mesh) -> None:
    """A cell's namespace is a real ``__main__`` module's, so pickle finds its classes (it
    looks them up as ``__main__.Cfg``), as under torchrun and in a plain kernel."""
    values = mesh.run(CELL_CLASSES).result()
    cfg, lrs, restored, name = values[0]
    assert (cfg.lr, cfg.name, restored, name) == (0.5, "run", "Net", "__main__")
    assert lrs == pytest.approx([0.1, 0.2])
    assert values[1][1] == values[0][1]
