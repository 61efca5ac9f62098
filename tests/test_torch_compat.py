"""One test per private torch API meshbook uses (all of them live in rank/torch_compat.py):
when a torch release moves one, the test that names it fails. They run on real ranks."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

import meshbook
from meshbook.mesh.rank import torch_compat


@pytest.fixture(scope="module")
def pair() -> Iterator[meshbook.Mesh]:
    with meshbook.start(2) as mesh:
        yield mesh


def test_a_pending_collective_is_seen_from_the_control_thread(pair: meshbook.Mesh) -> None:
    def records(worker: object) -> list:  # on the control thread: answered while the rank is busy
        return [(e["profiling_name"], e["process_group"][1]) for e in torch_compat.flight_records()]

    assert pair.run("import os\nos.environ['TORCH_FR_BUFFER_SIZE']").result().unique() == \
        torch_compat.FLIGHT_RECORDER_ENTRIES
    run = pair.run("import time\nif rank == 0:\n    w = dist.all_reduce(torch.ones(3), async_op=True)\n"
                   "time.sleep(60)")
    try:
        deadline = time.monotonic() + 20
        while True:
            pending = pair.call(records, control=True).result(timeout=10)
            if pending[0]:
                break
            assert time.monotonic() < deadline, "the flight recorder never showed the collective"
            time.sleep(0.2)
        assert pending[0] == [("gloo:all_reduce", "default_pg")] and pending[1] == []
    finally:
        run.interrupt()
        with pytest.raises(meshbook.RemoteError):
            run.result(timeout=30, echo=False)
        run.step_report()
    assert pair.call(records, control=True).result(timeout=10).unique() == [], "done once re-created"


def test_a_call_that_did_not_match_is_found_in_the_recorder_of_the_rank_that_went_on(pair: meshbook.Mesh) -> None:
    """gloo completes rank 0's all_reduce of 2 floats against rank 1's of 4, and rank 1 waits:
    the recorder keeps rank 0's finished call (flight_records(done_too=True)), so the abort
    says the calls do not match, not that rank 0 never joined, and rank 0's result is refused."""
    with pytest.raises(meshbook.RemoteError) as info:
        pair.run("x = torch.ones(4 if rank else 2) * (rank + 1)\ndist.all_reduce(x)\nx.tolist()").result(
            timeout=60, echo=False)
    failure = info.value.failures[1]
    assert failure.type_name == "CollectiveAborted" and set(info.value.failures) == {0, 1}
    # Rank 0's call completed: its result, a success by gloo's word, is refused as wrong
    assert info.value.failures[0].type_name == "CollectiveMismatched", info.value.failures[0]
    assert failure.message.startswith("meshbook aborted its all_reduce #1 ([4] float): the calls do not match (rank 0 "
                                      "called all_reduce #1 ([2] float), and went on)"), failure.message
    assert "rank 0's all_reduce #1 ([2] float) was paired with the others' all_reduce #1 ([4] float): whatever " \
           "rank 0 computed from it is wrong" in info.value.hint
    assert set(pair.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").result().values()) == {2.0}
    # The groups were re-created, and number from 1 again: rank 0's calls of the old ones are
    # not taken for calls of these (it called no #2 here, whatever the old group's #2 was).
    with pytest.raises(meshbook.RemoteError) as info:
        pair.run("for _ in range(2):\n    dist.all_reduce(t)\nif rank == 1:\n    dist.all_reduce(t)").result(
            timeout=60, echo=False)
    assert "rank 0 finished the cell without joining it" in info.value.failures[1].message


def test_nccl_recorder_is_absent_from_a_cpu_build() -> None:
    assert torch_compat.oldest_nccl_pending() is None  # no NCCL in this torch: nothing to read


def test_groups_backends_and_their_counts(pair: meshbook.Mesh) -> None:
    def counts() -> list:
        return [(name, torch_compat.is_default_group(pg), [(b.name(), torch_compat.issued(b))
                                                           for b in torch_compat.backends(pg)])
                for name, pg in torch_compat.process_groups()]

    before = pair.apply(counts).result()[0]
    pair.run("dist.all_reduce(torch.ones(1))").result()
    after = pair.apply(counts).result()[0]
    default = [c for c in after if c[1]]
    assert len(default) == 1 and default[0][2][0][0] == "gloo"
    assert default[0][2][0][1] == [c for c in before if c[1]][0][2][0][1] + 1


def test_the_collective_counter_counts_eager_and_functional_gathers_alike(pair: meshbook.Mesh) -> None:
    def gathered() -> list:
        import torch
        import torch.distributed as dist
        from torch.distributed import _functional_collectives as funcol

        seen: list = []
        part, whole = torch.ones(256), torch.empty(512)  # 1 KiB a rank, 2 KiB gathered
        with torch_compat.collective_counter(lambda kind, size: seen.append((kind, size))) as counter:
            dist.all_gather_into_tensor(whole, part)
            funcol.wait_tensor(funcol.all_gather_tensor(part, 0, dist.group.WORLD))
        return [seen, dict(counter.bytes), counter.calls]

    assert pair.apply(gathered).result().unique() == [[("all_gather", 2048)] * 2, {"all_gather": 4096}, 2]


def test_the_default_group_timeout_can_be_set_and_read() -> None:
    from datetime import timedelta

    def timeouts() -> list[float]:  # read where torch keeps it (no public getter)
        import torch.distributed as dist

        return [b.options._timeout.total_seconds() for b in torch_compat.backends(dist.group.WORLD)]

    with meshbook.start(1) as mesh:
        before = mesh.apply(timeouts).result()[0]
        mesh.apply(torch_compat.set_default_group_timeout, timedelta(seconds=7)).result()
        assert (before, mesh.apply(timeouts).result()[0]) == ([300.0], [7.0])


def test_abort_process_groups_exists() -> None:
    with meshbook.start(1) as mesh:  # on gloo it aborts nothing; the call itself must exist
        assert mesh.apply(torch_compat.abort_process_groups).result()[0] is True



def test_the_groups_fully_shard_keeps_are_found(pair: meshbook.Mesh) -> None:
    """A wrapped module and its wrapped submodules keep the mesh's group as an object (one,
    found once); a module nothing wrapped keeps none."""
    pair.run("from torch.distributed.fsdp import fully_shard\n"
             "from meshbook.mesh.rank import torch_compat\n"
             "wrapped = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))\n"
             "fully_shard(wrapped[0], mesh=device_mesh)\nfully_shard(wrapped, mesh=device_mesh);").result()
    kept = pair.run("[torch_compat.fsdp2_groups(torch.nn.Linear(2, 2)),\n"
                    " [g is device_mesh.get_group() for g in torch_compat.fsdp2_groups(wrapped)]]").result()
    assert kept.unique() == [[], [True]]


def test_the_ranks_of_each_group_by_the_name_its_flight_records_give_it(pair: meshbook.Mesh) -> None:
    def named(worker: object) -> tuple[dict, list]:
        return torch_compat.group_ranks(), [e["process_group"][0] for e in torch_compat.flight_records(done_too=True)]

    pair.run("solo = dist.new_group([rank])\ndist.all_reduce(torch.ones(1), group=solo)").result()
    for rank, (groups, recorded) in pair.call(named, control=True).result(timeout=10).items():
        assert set(groups.values()) == {(0, 1), (rank,)}  # the world's, and its own
        assert (rank,) in {groups.get(name) for name in recorded}  # the all_reduce over its own


def test_collectives_issued_outside_python_are_counted_and_recorded(pair: meshbook.Mesh) -> None:
    def issue() -> list:
        import torch
        from torch.distributed import distributed_c10d as c10d

        before = torch_compat.issued_by_groups()
        c10d._get_default_group().allreduce([torch.ones(2)]).wait()  # as DDP issues it, from C++
        entries = torch_compat.finished_and_pending_collectives()
        return [torch_compat.issued_by_groups() - before, entries[-1]["profiling_name"],
                entries[-1]["process_group"][0] == torch_compat.group_name(c10d._get_default_group())]

    assert pair.apply(issue).result().unique() == [1, "gloo:all_reduce", True]
