"""The GPU paths on a real CUDA machine: ``./dev gpu`` (pytest -m gpu), skipped without a GPU.

Written for the machine a user most often has, one GPU: a one-rank NCCL mesh, and four gloo
ranks sharing it. A hang needs no second GPU: a collective enqueued behind a kernel that spins
for seconds stays uncompleted in NCCL's flight recorder for as long. The test process plays the
notebook, so it must never touch CUDA itself (one test checks that it holds no CUDA context).
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Iterator

import pytest

import meshbook
from meshbook.mesh.agent.gpus import GpuCount
from meshbook.mesh.protocol.backends import NCCL
from meshbook.mesh.protocol.limits import KeptOnRank

#: GPUs this torch sees, counted as an agent counts them: in a subprocess (this process plays
#: the notebook and must not initialise CUDA). 0 on a CPU build of torch.
GPUS = GpuCount().result()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    GPUS == 0, reason="no GPU that torch can use here (./dev gpu installs a CUDA build of torch)")]

#: A kernel that keeps the GPU busy for about ``seconds`` (cycles measured first), so that what
#: is enqueued behind it waits: a stand-in for a peer that never arrives.
SPIN = """
def spin(seconds):
    torch.cuda._sleep(1000); torch.cuda.synchronize()  # a first launch is slow: it would skew the count
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(10 ** 8); end.record(); end.synchronize()
    torch.cuda._sleep(int(10 ** 8 * seconds * 1000 / max(start.elapsed_time(end), 1e-3)))
"""


@pytest.fixture(scope="module")
def nccl1() -> Iterator[meshbook.Mesh]:
    with meshbook.start(1) as mesh:  # auto, a GPU for its one rank: NCCL
        mesh.run(SPIN).result()
        yield mesh


def test_one_rank_runs_nccl_on_its_gpu(nccl1: meshbook.Mesh) -> None:
    assert nccl1.controller.chosen is not None and nccl1.controller.chosen.torch == NCCL
    assert nccl1.status()[0].device == "cuda:0"
    out = nccl1.run("import os\nt = torch.ones(4, device=device)\ndist.all_reduce(t)\n"
                    "c = torch.ones(2)\ndist.all_reduce(c)\n(t.sum().item(), c.sum().item(), "
                    "str(dist.get_backend()), os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING'])").result()[0]
    assert out[:2] == (4.0, 2.0) and "nccl" in out[2] and out[3] == "2"


def test_cuda_tensors_and_dtensors_move_and_show(nccl1: meshbook.Mesh) -> None:
    import torch

    nccl1.push(w=torch.arange(6.0).reshape(2, 3))
    assert nccl1.run("w.device.type").result()[0] == "cuda", "a push lands on the rank's GPU"
    assert torch.equal(nccl1.pull("w")[0], torch.arange(6.0).reshape(2, 3))
    nccl1.run("from torch.distributed.tensor import Shard, distribute_tensor\n"
              "d = distribute_tensor(torch.arange(8.0, device=device), device_mesh, [Shard(0)])").result()
    listed = nccl1.who()
    assert listed["w"][0].device == "cuda:0" and listed["d"][0].type == "DTensor"
    assert torch.equal(nccl1.ref("d").full_tensor(), torch.arange(8.0))
    shard = nccl1.run("d").result()[0]
    assert type(shard) is torch.Tensor and shard.device.type == "cpu", "a DTensor result comes as its local shard"


def test_memory_shows_the_gpu(nccl1: meshbook.Mesh) -> None:
    nccl1.run("block = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device)").result()
    deadline = time.monotonic() + 10
    while True:
        row = nccl1.memory().rows[0]
        if row.cuda_allocated and row.cuda_allocated >= 256 * 2 ** 20:
            break
        assert time.monotonic() < deadline, f"no CUDA memory in the heartbeats: {row}"
        time.sleep(0.5)
    assert row.pool == "cuda:0" and row.pool_limit and row.cuda_reserved >= row.cuda_allocated
    nccl1.run("del block").result()


def test_a_stop_press_during_a_cuda_loop_and_during_a_sync(nccl1: meshbook.Mesh) -> None:
    loop = nccl1.run("x = torch.randn(512, 512, device=device)\nfor i in range(10 ** 7):\n    x = torch.tanh(x @ x)")
    time.sleep(2.0)
    started = time.monotonic()
    loop.interrupt()
    with pytest.raises(meshbook.RemoteError, match="KeyboardInterrupt"):
        loop.result(timeout=60, echo=False)
    assert time.monotonic() - started < 30
    # Blocked in a sync: the stop takes effect when it returns (queued GPU work still runs).
    sync = nccl1.run("spin(4)\ntorch.cuda.synchronize()\n'not reached'")
    time.sleep(1.0)
    assert not sync.done(), "spin(4) took under a second"
    started = time.monotonic()
    sync.interrupt()
    with pytest.raises(meshbook.RemoteError, match="KeyboardInterrupt"):
        sync.result(timeout=60, echo=False)
    assert time.monotonic() - started < 30
    assert nccl1.run("t = torch.ones(1, device=device)\ndist.all_reduce(t)\nt.item()").result()[0] == 1.0


def test_an_oversize_cuda_result_stays_on_the_rank_uncopied(nccl1: meshbook.Mesh) -> None:
    nccl1.run("import resource\nbefore = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss").result()
    kept = nccl1.run("torch.ones(2 ** 28, device=device)", max_bytes=64 * 2 ** 20).result()[0]
    assert isinstance(kept, KeptOnRank) and kept.nbytes >= 2 ** 30
    assert nccl1.run("_.device.type").result()[0] == "cuda", "the kept result is the cell's `_`, on the GPU"
    grown = nccl1.run("(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024").result()[0]
    assert grown < 2 ** 29, f"the rank's peak RSS grew by {grown} bytes: the result was copied to host memory"


def test_nccl_flight_recorder_shows_in_diagnose_and_heartbeats(nccl1: meshbook.Mesh) -> None:
    run = nccl1.run("spin(8)\nt = torch.ones(3, device=device)\ndist.all_reduce(t)\nt.sum().item()")
    try:
        deadline = time.monotonic() + 6
        while True:
            snap = nccl1.diagnose().snapshots[0]
            if snap.pending:
                break
            assert time.monotonic() < deadline, "NCCL's recorder showed nothing pending"
            time.sleep(0.3)
        assert snap.pending[-1].op == "all_reduce"
        time.sleep(2.5)  # heartbeats: the rank sits in .item(), waiting for its collective on the GPU
        assert nccl1.stuck(run).get(0, 0.0) > 1.0
    finally:
        assert run.result(timeout=60, echo=False)[0] == 3.0


def test_an_nccl_timeout_keeps_the_rank_and_its_variables() -> None:
    with meshbook.start(1, collective_timeout=5) as mesh:
        mesh.run(SPIN + "kept = 42\nimport os\npid = os.getpid()").result()
        pid = mesh.run("pid").result()[0]
        run = mesh.run("spin(25)\nt = torch.ones(1, device=device)\ndist.all_reduce(t)\ntorch.cuda.synchronize()")
        run.wait(120)  # the watchdog times the collective out after 5 s; torch's default would SIGABRT
        time.sleep(5)
        assert mesh.status()[0].state != "dead", mesh.status()[0].cause
        assert mesh.run("(kept, os.getpid())").result(timeout=60)[0] == (42, pid)
        mesh.recover()
        check = "t = torch.ones(1, device=device)\ndist.all_reduce(t)\n(t.item(), kept)"
        assert mesh.run(check).result()[0] == (1.0, 42)


def test_a_rank_restart_comes_back_on_its_gpu(nccl1: meshbook.Mesh) -> None:
    nccl1.restart([0])
    nccl1.run(SPIN).result()
    assert nccl1.run("str(device), torch.cuda.current_device()").result()[0] == ("cuda:0", 0)


def test_actor_arguments_land_on_the_ranks_gpu(nccl1: meshbook.Mesh) -> None:
    import torch

    class Where(meshbook.Actor):
        @meshbook.endpoint
        def device_of(self, x):
            return x.device.type

    actor = nccl1.spawn("where", Where)
    assert actor.device_of.call(torch.ones(2)).result()[0] == "cuda"


def test_four_gloo_ranks_share_one_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if GPUS >= 4:
        pytest.skip("four GPUs here: auto runs NCCL")
    with meshbook.start(4) as mesh:
        note = capsys.readouterr().err
        assert f"has {GPUS} GPU(s) for 4 rank(s)" in note and mesh.controller.chosen.torch == "gloo"
        out = mesh.run("g = torch.full((2,), float(rank), device='cuda:0')\nc = g.cpu()\ndist.all_reduce(c)\n"
                       "dist.all_reduce(g)\n(c.tolist(), g.tolist())").result()
        assert out.unique() == ([6.0, 6.0], [6.0, 6.0])
        deadline = time.monotonic() + 10
        while not all(r.cuda_allocated for r in mesh.memory().rows):
            assert time.monotonic() < deadline, "gloo ranks holding CUDA tensors report no CUDA memory"
            time.sleep(0.5)


def test_the_notebook_and_the_agent_hold_no_cuda_context(nccl1: meshbook.Mesh) -> None:
    """Only the rank has a CUDA context (``import torch`` maps the driver's libraries, and holds
    none): a notebook or an agent with one would take GPU memory, and an agent's would be
    inherited, broken, by every rank it forks."""
    import sys

    torch = sys.modules.get("torch")
    assert torch is None or not torch.cuda.is_initialized()
    rank_pid = nccl1.status()[0].pid
    agent = int(open(f"/proc/{rank_pid}/stat").read().split(")")[1].split()[1])
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.split()
    if str(rank_pid) not in apps:
        pytest.skip(f"nvidia-smi lists no process of this pid namespace ({apps}): it cannot tell who holds a context")
    assert str(os.getpid()) not in apps, "the notebook process holds a CUDA context"
    assert str(agent) not in apps, "the agent that forks ranks holds a CUDA context"


def test_a_plan_on_a_gpu_rank_predicts_cuda_memory(nccl1: meshbook.Mesh) -> None:
    """``mesh.plan`` measures the rank's free CUDA memory, and ``parallelize`` builds on the GPU
    and compares the allocator's peak with the prediction (4 blocks of width 1024: ~50M
    parameters, ~0.8 GiB with AdamW's state, far above the allocator's 2 MiB granules)."""
    from functools import partial

    from bench import models

    build = partial(models.gpt, vocab=4096, dim=1024, layers=4, heads=8)
    report = nccl1.plan(build, (4, 128), checkpointing=("none",))
    assert report.probe.device == "cuda" and report.best.layout.family == "1 rank"
    nccl1.parallelize(build, report.best)
    nccl1.run("x = torch.randint(0, 4096, (4, 128), device=device)\n"
              "losses = [step(x, x).item() for _ in range(4)]\n"
              "ratio = torch.cuda.max_memory_reserved(device) / step.predicted").result()
    (losses,) = nccl1.pull("losses").values()
    assert losses[-1] < losses[0]
    (ratio,) = nccl1.pull("ratio").values()
    assert 0.8 < ratio < 1.2, ratio
    nccl1.run("import time\ntorch.cuda.synchronize()\nstarted = time.perf_counter()\nfor _ in range(5): step(x, x)\n"
              "torch.cuda.synchronize()\ntimes = (time.perf_counter() - started) / 5 / step.predicted_s").result()
    (times,) = nccl1.pull("times").values()
    assert 0.4 < times < 2.5, f"a step took {times:.2f}x the predicted time"
    nccl1.run("del model, optimizer, step; torch.cuda.empty_cache()").result()
