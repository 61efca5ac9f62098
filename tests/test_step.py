"""Ranks never silently out of step: interrupts, failures and deaths (real gloo meshes).

A collective pairs the n-th call of every member; these tests stop ranks at different
points and check that the next collective is still right (or refused), never silently wrong,
and that the cell says what meshbook did.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import replace
from typing import Iterator

import pytest

import meshbook
from meshbook import RemoteError
from meshbook.mesh.protocol.errors import RankFailure, broke_its_group
from meshbook.mesh.rank import torch_compat

ASYNC_LOOP = """import time; i = 0
while True:
    w = dist.all_reduce(torch.ones(1), async_op=True); time.sleep(0.01 * (rank + 1)); w.wait(); i += 1
"""
CHECK = "x = torch.tensor([10.0 * (rank + 1)]); dist.all_reduce(x); x.item()"


@pytest.fixture(scope="module")
def pair() -> Iterator[meshbook.Mesh]:
    with meshbook.start(2) as m:
        yield m


def failures_of(run: meshbook.Run, timeout: float = 30) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        run.result(timeout=timeout, echo=False)
    return info.value


def test_an_unpaired_async_collective_is_found_and_the_groups_re_created(pair: meshbook.Mesh) -> None:
    pair.run("model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))").result()
    run = pair.run("import time\nif rank == 0:\n    w = dist.all_reduce(torch.ones(1), async_op=True)\n"
                   "time.sleep(60)")
    time.sleep(1.5)
    run.interrupt()
    error = failures_of(run)
    assert {f.type_name for f in error.failures.values()} == {"KeyboardInterrupt"}
    report = run.step_report()
    assert "out of step after the interrupt: in the default group, rank 0 has issued" in report
    assert report.count("re-created") >= 1 and report.count("The ranks were out of step") == 1
    assert "[0,1] bound to the old groups, re-create: model = DDP(model.module) (it broadcasts rank 0's weights)" \
        in report
    assert run.step_report() == ""  # said once
    assert dict(pair.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}


def test_interrupts_at_random_moments_never_give_a_wrong_result_or_a_silent_hang(pair: meshbook.Mesh) -> None:
    chooser = random.Random(12)
    resynced = 0
    for attempt in range(12):
        run = pair.run(ASYNC_LOOP)
        time.sleep(chooser.uniform(0.2, 1.0))
        run.interrupt()
        # a rank blocked in a collective its stopped peer will never join is freed on its own
        assert run.wait(30), f"attempt {attempt}: the run did not end after the interrupt"
        assert run.exception() is not None
        resynced += "re-created" in run.step_report(timeout=60)
        values = pair.run(CHECK).result(timeout=30, echo=False)
        assert dict(values) == {0: 30.0, 1: 30.0}, f"attempt {attempt}: {values}"
    assert resynced > 0  # the loop does get out of step: the check is not a no-op here


def test_a_cell_failing_on_some_ranks_after_a_collective_others_skipped(pair: meshbook.Mesh) -> None:
    run = pair.run("if rank == 1:\n    raise ValueError('bad batch')\n"
                   "w = dist.all_reduce(torch.ones(1), async_op=True)")
    error = failures_of(run)
    assert list(error.failures) == [1]
    report = run.step_report()
    assert "after the failed cell: in the default group, rank 0 has issued" in report, report
    assert "rank 1 has issued" in report
    assert dict(pair.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}


def test_a_rank_that_failed_a_run_others_still_run_runs_nothing_later_first(pair: meshbook.Mesh) -> None:
    """Rank 1 failed at once, rank 0 went on to an all_reduce: a run sent meanwhile (a cell
    after one that timed out) started on rank 1 and its all_reduce paired with rank 0's,
    giving both runs 102.0 as successes, then the mesh hung. Rank 1 is held for the check
    instead; rank 0's collective, which nobody will join, is aborted."""
    first = pair.run("import time\nif rank == 1:\n    raise ValueError('bad')\ntime.sleep(2)\n"
                     "t = torch.tensor([100.0])\ndist.all_reduce(t)\nt.item()")
    deadline = time.monotonic() + 30
    while 1 not in first.failed_ranks():
        assert time.monotonic() < deadline, "rank 1 never failed"
        time.sleep(0.02)
    later = pair.run(CHECK)  # sent while rank 0 still runs the first
    error = failures_of(first)
    assert {r: f.type_name for r, f in error.failures.items()} == {0: "CollectiveAborted", 1: "ValueError"}
    assert dict(later.result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}, "paired with the first's collective"
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_run_sent_before_a_rank_failed_the_last_never_pairs_with_it(pair: meshbook.Mesh) -> None:
    """The next run was queued on both ranks before rank 1 failed the first (a cell after one
    that timed out). Rank 1 started it at once, and its all_reduce paired with the one rank 0
    still issued in the first: 120.0 on rank 0 as the first's success. Now a rank that failed
    a cell runs nothing sent before the step check of that failure (as a notebook skips the
    cells queued after an error): rank 0's collective, which nobody joins, is aborted, and
    neither runs the queued one; the groups are re-created and the next run is right."""
    first = pair.run("import time\nif rank == 1:\n    time.sleep(1)\n    raise ValueError('bad')\ntime.sleep(3)\n"
                     "t = torch.tensor([100.0])\ndist.all_reduce(t)\nt.item()")
    queued = pair.run(CHECK, name=7)  # behind the first on both ranks, before rank 1 fails
    error = failures_of(first, timeout=60)
    assert {r: f.type_name for r, f in error.failures.items()} == {0: "CollectiveAborted", 1: "ValueError"}
    error = failures_of(queued, timeout=60)
    assert {r: f.type_name for r, f in error.failures.items()} == {0: "NotRun", 1: "NotRun"}, error
    assert error.failures[1].message.startswith("not run: this rank failed an earlier run before this reached it")
    assert error.failures[0].message == error.failures[1].message, "the ranks group as one line"
    counts = re.search(r"rank 0 has issued (\d+), rank 1 has issued (\d+)", first.step_report(timeout=60))
    assert counts and int(counts[1]) == int(counts[2]) + 1, "rank 0's aborted all_reduce is the one between them"
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_parallelize_queued_before_a_rank_failed_is_held_back_as_a_cell_is(pair: meshbook.Mesh) -> None:
    """meshbook's parallelize issues collectives as a cell does (each host's plain model is
    offered with all_gather_object). Queued before rank 1 failed the cell ahead of it, it ran
    at once there, and its collective met the all_reduce rank 0 still issued in that cell."""
    from functools import partial

    from bench import models

    first = pair.run("import time\nif rank == 1:\n    time.sleep(1)\n    raise ValueError('bad')\ntime.sleep(3)\n"
                     "t = torch.tensor([100.0])\ndist.all_reduce(t)\nt.item()")
    raised: list[BaseException] = []

    def build() -> None:
        try:
            pair.parallelize(partial(models.gpt, vocab=64, dim=16, layers=2, heads=2), meshbook.Layout(dp_shard=2))
        except BaseException as exc:  # noqa: BLE001 - looked at below
            raised.append(exc)

    thread = threading.Thread(target=build)
    thread.start()  # sent at once: behind the first on both ranks, before rank 1 fails it
    failures_of(first, timeout=60)
    thread.join(60)
    assert raised and isinstance(raised[0], RemoteError), raised
    assert {f.type_name for f in raised[0].failures.values()} == {"NotRun"}, raised[0]
    assert "this rank failed an earlier run" in raised[0].failures[1].message
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_send_a_failed_cell_left_is_never_received_by_a_later_cell(pair: meshbook.Mesh) -> None:
    """Rank 1 failed before its recv; rank 0's send blocked. The next cell's recv on rank 1
    got the stale 111.0, as a success. Rank 0's send is aborted (rank 1 will never receive it),
    the groups are re-created, and the next cell's transfer is its own."""
    first = pair.run("t = torch.tensor([111.0])\nif rank == 1:\n    raise ValueError('x')\ndist.send(t, 1)")
    failures = failures_of(first).failures
    assert failures[0].message.startswith("meshbook aborted its send #1 to rank 1 ([1] float): rank 1 failed "
                                          "the cell without joining it"), failures[0].message
    later = pair.run("t = torch.tensor([222.0])\nif rank == 0:\n    dist.send(t, 1)\nelse:\n"
                     "    t.zero_()\n    dist.recv(t, 0)\nt.item()")
    assert dict(later.result(timeout=60, echo=False)) == {0: 222.0, 1: 222.0}
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_collective_called_with_other_sizes_that_completes_fails_every_member(pair: meshbook.Mesh) -> None:
    """gloo completes a broadcast of 3 floats into rank 1's 4: torch checks nothing, and rank 1's
    result came back as a success. The clock's records say what each member called."""
    error = failures_of(pair.run("x = torch.ones(3 + rank)\ndist.broadcast(x, 0)\nx.sum().item()"))
    assert sorted(error.failures) == [0, 1] and error.failures[0] == replace(error.failures[1], rank=0)
    assert error.failures[1].type_name == "CollectiveMismatched"
    assert re.fullmatch(
        r"its broadcast #\d+ in the group of ranks 0,1 did not match across them \(rank 0 passed \[3\] float; rank 1 "
        r"passed \[4\] float\): torch does not check this, the collective completed, and what every member computed "
        r"from it is wrong\. Pass tensors of the same size and dtype on every member of the group",
        error.failures[1].message), error.failures[1].message
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_result_timeout_bounds_the_wait_for_the_step_check_too(pair: meshbook.Mesh) -> None:
    """The run ended, its check waits for a rank busy with later work: result(timeout=2)
    waited the check's own 30 s."""
    failed = pair.run("import time\ntime.sleep(0.5)\nif rank == 1:\n    raise ValueError('bad')\ntime.sleep(1)")
    busy = pair.run("import time\ntime.sleep(8)", ranks=[0])  # queued on rank 0 before the check
    assert failed.wait(30)
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        failed.result(timeout=2)
    assert time.monotonic() - started < 6, "waited for the check beyond the timeout"
    assert "meshbook checks that every rank is at the same collective" in info.value.hint
    busy.result(timeout=60, echo=False)
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_check_waiting_for_a_rank_busy_with_earlier_work_is_told_not_waited_for(pair: meshbook.Mesh) -> None:
    """Rank 1 runs something long sent before; rank 0's cell fails, and its step check waits
    for rank 1. The cell's error comes after a short grace with what the check waits for, not
    after the check's 30 s (rank 1's work may run for hours)."""
    busy = pair.run("import time\ntime.sleep(60)", ranks=[1])
    failed = pair.run("raise ValueError('bad')", ranks=[0])
    started = time.monotonic()
    with pytest.raises(RemoteError) as info:
        failed.result()
    assert time.monotonic() - started < 20, "waited the check's 30 s for a rank busy with earlier work"
    assert "it waits for rank(s) 1 to finish what they run" in info.value.hint, info.value.hint
    busy.interrupt()
    with pytest.raises(RemoteError, match="KeyboardInterrupt"):
        busy.result(timeout=60, echo=False)
    assert dict(pair.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_collective_that_timed_out_has_its_groups_re_created() -> None:
    """Both ranks issued one collective, so the counts agreed, but the timeout closed gloo's
    connections: every later collective failed with 'Connection closed by peer'."""
    with meshbook.start(2, collective_timeout=2) as mesh:
        run = mesh.run("import time\nt = torch.ones(1)\nif rank == 1:\n    time.sleep(4)\ndist.all_reduce(t)")
        error = failures_of(run, timeout=60)
        assert set(error.failures) == {0, 1}
        assert ("in a way that breaks its process group (a timeout, or a closed connection: every later "
                "collective on it would fail too), so meshbook re-created the process groups") in run.step_report()
        assert dict(mesh.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_a_timeout_told_inside_another_error_has_its_groups_re_created() -> None:
    """The same, where the user's code wraps gloo's timeout (``raise ... from e``), or a Ctrl-C
    lands as it times out: the error's headline is not gloo's, and every later collective
    failed with gloo's bare 'Application timeout caused pair closure'."""
    with meshbook.start(2, collective_timeout=2) as mesh:
        run = mesh.run("x = torch.ones(4)\ntry:\n"
                       "    dist.broadcast(x, src=0) if rank == 0 else dist.all_reduce(x)\n"
                       "except RuntimeError as e:\n    raise SystemError('training step failed') from e")
        error = failures_of(run, timeout=60)
        assert {f.type_name for f in error.failures.values()} == {"SystemError"}
        assert "so meshbook re-created the process groups" in run.step_report()
        assert dict(mesh.run(CHECK).result(timeout=60, echo=False)) == {0: 30.0, 1: 30.0}


def test_gloos_bare_pair_closure_says_the_group_broke() -> None:
    closed = RankFailure(0, "RuntimeError", "Application timeout caused pair closure")
    assert broke_its_group(closed)
    assert not broke_its_group(replace(closed, died="SIGKILL"))
    assert not broke_its_group(RankFailure(0, "ValueError", "bad lr", detail="Raised while handling:\n  KeyError: 'x'"))


def test_a_module_left_on_the_old_groups_says_so_when_it_fails_and_works_once_rebuilt() -> None:
    """After the groups were re-created, a DDP module built before calls its closed group (gloo:
    "Connection closed by peer ... typically caused by a remote worker crashing") and an FSDP2
    module the destroyed group fully_shard kept (torch: "... is not initialized in the world
    group map"). The step report names both, and so does each one's error. A DTensor and a
    tensor parallel module find their mesh's groups by name: they work on the new ones, and
    are not named."""
    with meshbook.start(2) as mesh:
        mesh.run("from torch.distributed.tensor import distribute_tensor, Shard\n"
                 "from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel\n"
                 "from torch.distributed.fsdp import fully_shard\n"
                 "net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
                 "d = distribute_tensor(torch.arange(4.0), device_mesh, [Shard(0)])\n"
                 "torch.manual_seed(0)\n"
                 "tp = parallelize_module(torch.nn.Linear(4, 4), device_mesh, ColwiseParallel())\n"
                 "before = tp(torch.ones(2, 4)).sum().item()\n"
                 "fs = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))\n"
                 "fully_shard(fs[0], mesh=device_mesh)\nfully_shard(fs, mesh=device_mesh)\n"
                 "for layer in fs:\n    break\n"  # a loop variable on a part of fs: rebuilt with fs, not named
                 "fs(torch.ones(2, 4)).sum().backward()").result()
        first = mesh.run("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(x)")
        failures_of(first)
        report = first.step_report()
        assert "re-created the process groups" in report
        assert ("\n[0,1] bound to the old groups, re-create: fs, an FSDP2 module, by building it anew and sharding "
                "that on `device_mesh`") in report, report
        assert report.endswith("; net = DDP(net.module) (it broadcasts rank 0's weights)"), \
            "a DTensor, a tensor parallel module: not named"
        for code, said in (("net(torch.ones(3, 2)).sum().backward()", "Connection closed by peer"),
                           ("fs(torch.ones(2, 4)).sum().backward()", "is not initialized in the world group map")):
            for failure in failures_of(mesh.run(code)).failures.values():
                assert failure.message.startswith("fs (FSDP2 module), net (DDP module) still use process groups "
                                                  "meshbook re-created since they were built"), failure.message
                assert said in failure.message  # what the collective said, kept
        assert mesh.run("d.full_tensor().tolist()").result().unique() == [0.0, 1.0, 2.0, 3.0]
        assert mesh.run("tp(torch.ones(2, 4)).sum().item() == before").result().unique() is True
        mesh.run("net = torch.nn.parallel.DistributedDataParallel(net.module)").result()
        mesh.run("net(torch.ones(3, 2)).sum().backward()").result(timeout=30)
        assert dict(mesh.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}


def test_a_failure_on_the_live_groups_blames_no_stale_variable() -> None:
    """After a re-creation, a stale DDP module and an unused group of the user's sit in the
    namespace. A timeout (each rank waits to receive from the other) and a collective on the new groups that fails as
    a peer closes (a rank dies) are no fault of theirs: gloo's own words head those errors."""
    with meshbook.start(2, collective_timeout=2) as mesh:
        mesh.run("net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
                 "g = dist.new_group([0, 1])").result()
        bad = mesh.run("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('bad batch')\ndist.all_reduce(x)")
        failures_of(bad)
        assert "net = DDP(net.module)" in bad.step_report(), "stale: told once, by the check"
        deadlock = mesh.run("buf = torch.zeros(3)\ndist.recv(buf, src=1 - rank)")  # each waits for the other
        said = failures_of(deadlock).failures[0].message
        assert said.startswith("[") and "Timed out" in said, said
        deadlock.step_report()
        died = failures_of(mesh.run("import os, time\nx = torch.ones(1)\nif rank == 1:\n    os._exit(3)\n"
                                    "time.sleep(0.5)\ndist.all_reduce(x)"))
        assert "still use" not in died.failures[0].message, died.failures[0].message


def test_replicas_an_update_left_apart_are_told_even_where_the_counts_agree(pair: meshbook.Mesh) -> None:
    """Rank 1 applied an optimizer step that rank 0 failed before: no collective was
    skipped, so the ranks are in step, but the DDP replicas (and the optimizer's state) now
    differ for good, with no error. The check says so, and what it says brings them back."""
    pair.run("model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
             "model(torch.ones(1, 2)).sum().backward()").result()
    run = pair.run("if rank == 0:\n    raise ValueError('bad batch')\nopt.step()")
    failures_of(run)
    report = run.step_report(timeout=60)
    assert report.startswith("Replicas differ between ranks: model (0 | 1); opt (0 | 1). An update"), report
    assert "re-created" not in report, "in step: nothing was re-created"
    pair.run("for t in [*model.parameters(), *model.buffers()]: dist.broadcast(t.data, 0)\n"
             "kept = [opt.state_dict()]; dist.broadcast_object_list(kept, 0); opt.load_state_dict(kept[0])").result()
    again = pair.run("if rank == 0:\n    raise ValueError('bad batch')")
    failures_of(again)
    assert again.step_report(timeout=60) == "", "brought together as it said"
    pair.run("del model, opt").result()


def test_a_cell_nobody_follows_still_tells_what_its_check_found(pair: meshbook.Mesh) -> None:
    """A cell let go at its ``--timeout``: the check after it found replicas apart, and said it
    to nobody (its report waited for a follower). It goes where the cell's late output goes,
    after how the cell ended."""
    pair.run("model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))\n"
             "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
             "model(torch.ones(1, 2)).sum().backward()").result()
    told: list[str] = []
    run = pair.run("import time\nif rank == 0:\n    time.sleep(1)\n    raise ValueError('bad batch')\nopt.step()")
    run.on_late_end, run.on_late_note = told.append, told.append
    run.let_go()
    deadline = time.monotonic() + 30
    while len(told) < 2:
        assert time.monotonic() < deadline, told
        time.sleep(0.05)
    assert "ValueError: bad batch" in told[0], told
    assert told[1].startswith("Replicas differ between ranks: model (0 | 1). An update"), told
    assert run.step_report(0) == "", "said once"
    pair.run("del model, opt").result()


def test_point_to_point_operations_are_no_step_out_of_step() -> None:
    """gloo counts sends and receives in a group's sequence with its collectives, and a chain
    (a pipeline's stages) runs different numbers of them: the next failed cell's check found
    the ranks out of step and re-created every group, making every module stale."""
    with meshbook.start(3) as mesh:
        mesh.run("t = torch.ones(2)\nif rank == 0:\n    dist.send(t, 1)\nelif rank == 1:\n"
                 "    dist.recv(t, 0)\n    dist.isend(t, 2).wait()\nelse:\n"
                 "    dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1)])[0].wait()").result()
        failed = mesh.run("if rank == 2:\n    raise ValueError('bad batch')")
        failures_of(failed)
        assert failed.step_report(30) == ""
        assert [s.generation for s in mesh.status()] == [0, 0, 0]
        assert mesh.run("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()").result().unique() == 3.0


def test_a_failure_that_leaves_the_ranks_in_step_re_creates_nothing(pair: meshbook.Mesh) -> None:
    pair.run("kept = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))").result()
    generation = pair.status()[0].generation
    run = pair.run("x = torch.ones(1); dist.all_reduce(x)\n1 / 0")
    failures_of(run)
    assert run.step_report() == ""
    assert pair.status()[0].generation == generation
    assert pair.run("kept(torch.ones(2)).sum().item() == kept(torch.ones(2)).sum().item()").result().unique()


def test_an_interrupt_stops_only_its_own_run_and_cancels_it_where_it_has_not_started(
        pair: meshbook.Mesh) -> None:
    background = pair.run("import time\ntime.sleep(3)\n'background done'")
    queued = pair.run("never = 1")
    time.sleep(0.5)
    queued.interrupt()
    error = failures_of(queued)
    assert {f.type_name for f in error.failures.values()} == {"KeyboardInterrupt"}
    assert all("before it started" in f.message for f in error.failures.values())
    assert background.result(timeout=30).unique() == "background done"
    assert pair.run("'never' in globals()").result().unique() is False


def test_a_dead_rank_frees_the_others_at_once_with_their_variables() -> None:
    with meshbook.start(3) as mesh:
        mesh.run("keep = rank * 100").result()
        started = time.monotonic()
        run = mesh.run("import os, time\nx = torch.ones(1)\nif rank == 1:\n    time.sleep(0.5)\n"
                       "    os._exit(0)\ndist.all_reduce(x)")
        assert run.wait(60), "the survivors stayed blocked on the dead rank"
        took = time.monotonic() - started
        error = run.exception()
        assert error is not None and error.failures[1].died == "exit code 0"
        for survivor in (0, 2):  # freed by meshbook, or by gloo noticing the closed connection first
            failure = error.failures[survivor]
            assert ("rank 1 died (exit code 0)" in failure.message if failure.type_name == "CollectiveAborted"
                    else "Connection closed by peer" in failure.message), failure.headline
        assert error.hint.startswith("rank 1 died (exit code 0). %mesh restart 1"), error.hint
        # The cause heads the error, not gloo's "Connection closed by peer" on the survivors.
        assert str(error).startswith("3 ranks failed; first: [1] RankDied: rank 1 died"), str(error)
        assert error.render().startswith("[1] RankDied"), error.render()
        assert "%mesh restart 1" in error.hint
        print(f"the cell failed {took:.1f} s after it started (rank 1 died at 0.5 s)")
        verdict = " ".join(mesh.diagnose().verdict)
        assert "finished the cell without joining it" not in verdict
        mesh.restart([1])
        values = mesh.run("t = torch.ones(1); dist.all_reduce(t); (globals().get('keep'), t.item())").result()
        assert dict(values) == {0: (0, 3.0), 1: (None, 3.0), 2: (200, 3.0)}


def test_the_diagnosis_says_how_a_rank_that_stopped_left_the_cell() -> None:
    with meshbook.start(3) as mesh:
        run = mesh.run("x = torch.ones(1)\nif rank == 1:\n    raise ValueError('bad batch')\n"
                       "dist.all_reduce(x)")
        deadline = time.monotonic() + 30
        settled = ("rank 1 stopped with ValueError at cell line 3 (raise ValueError('bad batch')) before joining it "
                   "(now at meshbook's step check of every rank's collective count)")
        verdict = ""
        while not verdict.endswith(settled):  # on a loaded machine, first "(now at meshbook's collective positions)"
            assert time.monotonic() < deadline, verdict
            time.sleep(0.1)
            if run.pending == [0, 2] and all(s.pending for s in mesh.snapshots([0, 2]).values()):
                (verdict,) = mesh.diagnose().verdict
        recovery = mesh.recover()
        assert recovery.aborted == [0, 2] and "ranks 0,2 had their collective aborted" in recovery.render()
        assert run.wait(30)
        assert dict(mesh.run(CHECK).result(timeout=30)) == {0: 60.0, 1: 60.0, 2: 60.0}


def test_a_rank_held_by_a_step_check_says_so_in_the_diagnosis(pair: meshbook.Mesh) -> None:
    background = pair.run("import time\ntime.sleep(5)", ranks=[1])
    failed = pair.run("1 / 0", ranks=[0])  # irregular: a step check follows, waiting for rank 1
    failures_of(failed)
    deadline = time.monotonic() + 30
    while not pair.snapshots([0])[0].busy:
        assert time.monotonic() < deadline, "rank 0 never reached the step check"
        time.sleep(0.1)
    (verdict,) = pair.diagnose().verdict
    assert "rank 0 at meshbook's step check of every rank's collective count" in verdict, verdict
    assert "[0] in meshbook's step check" in pair.stacks().render()
    background.result(timeout=30)
    assert failed.step_report(timeout=30) == ""  # in step: nothing re-created


def test_an_interrupt_does_not_cut_a_step_check_short(pair: meshbook.Mesh) -> None:
    background = pair.run("import time\ntime.sleep(4)", ranks=[1])
    # rank 0 issues an all_reduce rank 1 never will, then fails: a check, which rank 1 joins late
    failed = pair.run("w = dist.all_reduce(torch.ones(1), async_op=True)\n1 / 0", ranks=[0])
    failures_of(failed)
    deadline = time.monotonic() + 30
    while "step check" not in pair.snapshots([0])[0].doing:
        assert time.monotonic() < deadline, "rank 0 never reached the step check"
        time.sleep(0.1)
    pair.interrupt([0])  # a plain SIGINT while rank 0 waits for the verdict
    background.result(timeout=30)
    report = failed.step_report(timeout=60)
    assert "rank 0 has issued" in report and "ranks 0,1 kept their variables" in report, report
    assert dict(pair.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}


def test_each_backend_of_a_group_is_counted_on_its_own(pair: meshbook.Mesh) -> None:
    """A GPU mesh's group runs NCCL and gloo side by side, each with its own count; a group
    asked for with a device:backend string is counted per backend here too (a CPU gloo one)."""
    run = pair.run("cpu = dist.new_group(backend='cpu:gloo')\n"
                   "if rank == 1:\n    raise ValueError('bad batch')\n"
                   "w = dist.all_reduce(torch.ones(1), group=cpu, async_op=True)")
    failures_of(run)
    report = run.step_report()
    assert "in group" in report and "rank 0 has issued 1, rank 1 has issued 0" in report, report
    from meshbook.mesh.rank.ops import positions

    counted = pair.call(positions).result()[0].groups
    assert {key.split("/")[1] for key in counted} == {"gloo"}, counted
    assert dict(pair.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}


def test_a_rank_that_fails_beside_a_dead_one_runs_the_next_cell() -> None:
    """No step check follows a failure while a rank is dead (its restart re-creates the groups),
    so the controller tells the rank that failed not to hold back what comes next."""
    with meshbook.start(2) as mesh:
        with pytest.raises(RemoteError):
            mesh.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", ranks=[1]).result(timeout=30,
                                                                                                 echo=False)
        with pytest.raises(RemoteError, match="ZeroDivisionError"):
            mesh.run("1 / 0", ranks=[0]).result(timeout=30, echo=False)
        assert mesh.run("rank + 10", ranks=[0]).result(timeout=30, echo=False)[0] == 10


def test_a_collective_that_paired_with_another_cells_is_a_failure_not_a_wrong_value(pair: meshbook.Mesh) -> None:
    """A cell on rank 0 only waits in an all_reduce over ranks 0 and 1 (rank 1 is not in it);
    the next cell, on both, reaches rank 1 first: its all_reduce pairs with rank 0's old one,
    and rank 1 gets 1 + 100. That value is wrong, so rank 1 answers CollectiveMispaired,
    naming the cell it paired with; rank 0's own all_reduce of the new cell never pairs and is
    aborted, as before. The ranks are in step afterwards."""
    def waiting(worker: object) -> bool:  # on the control thread: answered while the rank waits
        return bool(torch_compat.flight_records())

    pair.run("x = torch.ones(1)\ndist.all_reduce(x)\nx.item()", ranks=[0])
    deadline = time.monotonic() + 30
    while not pair.call(waiting, ranks=[0], control=True).result(timeout=10)[0]:
        assert time.monotonic() < deadline, "rank 0 never entered its all_reduce"
        time.sleep(0.1)
    both = pair.run("y = torch.full((1,), 100.0)\ndist.all_reduce(y)\ny.item()")
    error = failures_of(both, timeout=60)
    assert error.failures[1].type_name == "CollectiveMispaired", error.failures[1]
    assert re.match(r"its collective #\d+ in the group of ranks 0,1 paired with the one rank\(s\) 0 in "
                    r"run\('x = torch.ones\(1\)'\) issued, another request: what this rank computed from it is "
                    r"wrong\.", error.failures[1].message), error.failures[1].message
    assert error.failures[0].type_name == "CollectiveAborted" and 1 not in error.partial
    assert dict(pair.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}


def test_an_interrupted_cell_waiting_for_ranks_outside_it_is_freed_by_the_interrupt(pair: meshbook.Mesh) -> None:
    """gloo ignores SIGINT: a rank of a cell on rank 0 only, waiting in an all_reduce over ranks
    0 and 1, stayed in it after the interrupt (a second one re-created the groups). Rank 1 is
    not in the cell and idle: only a later cell could join, wrongly, so the interrupt aborts it."""
    def waiting(worker: object) -> bool:
        return bool(torch_compat.flight_records())

    run = pair.run("x = torch.ones(1)\ndist.all_reduce(x)", ranks=[0])
    deadline = time.monotonic() + 30
    while not pair.call(waiting, ranks=[0], control=True).result(timeout=10)[0]:
        assert time.monotonic() < deadline, "rank 0 never entered its all_reduce"
        time.sleep(0.1)
    run.interrupt()
    failure = failures_of(run, timeout=30).failures[0]
    assert failure.type_name == "CollectiveAborted", failure
    assert re.match(r"interrupted: meshbook aborted its all_reduce #\d+ \(\[1\] float\): rank 1 took no "
                    r"part in this cell, and would never join it", failure.message), failure.message
    assert dict(pair.run(CHECK).result(timeout=30)) == {0: 30.0, 1: 30.0}
