"""What ``--slurm``/``meshbook.Slurm`` accept and refuse, and how squeue's time left reads
(no Slurm needed; the launcher against a real Slurm is in test_hosts_slurm.py)."""

from __future__ import annotations

import pytest

import meshbook
from meshbook.mesh.controller.launch.slurm import JobState


def test_a_spec_becomes_the_job_request() -> None:
    slurm = meshbook.Slurm.from_spec("nodes=2,gpus-per-node=8,time=2:00:00,partition=gpu",
                                     sbatch="--account=proj --qos='high prio'")
    assert (slurm.nodes, slurm.per_node, slurm.time, slurm.partition) == (2, 8, "2:00:00", "gpu")
    assert slurm.sbatch == ["--account=proj", "--qos=high prio"]
    assert slurm.default_ranks() == 16
    assert [p.ranks for p in slurm.plan(16)] == [list(range(8)), list(range(8, 16))]
    assert meshbook.Slurm.from_spec("nodes=2", per_node=3).default_ranks() == 6


@pytest.mark.parametrize("spec, says", [
    ("nodes=two", "nodes=two: give a positive whole number"),
    ("gpus=8", "'gpus=8' is not one of job=, nodes="),
    ("nodes", "'nodes' is not one of"),
    ("job=12,time=1:00:00", "job=ID runs inside an allocation you already have"),
])
def test_a_bad_spec_says_what_to_do(spec: str, says: str) -> None:
    with pytest.raises(meshbook.MeshError, match=says):
        meshbook.Slurm.from_spec(spec)


def test_a_plan_needs_nodes_that_fit() -> None:
    with pytest.raises(meshbook.MeshError, match="need 3 host"):
        meshbook.Slurm(nodes=2, per_node=2).plan(6)
    with pytest.raises(meshbook.MeshError, match="needs nodes=N"):
        meshbook.Slurm().plan(4)


@pytest.mark.parametrize("left, seconds", [("1:52:10", 6730), ("9:57", 597), ("2-00:00:01", 172801),
                                           ("UNLIMITED", None), ("INVALID", None)])
def test_time_left_as_squeue_writes_it(left: str, seconds: int | None) -> None:
    assert JobState("RUNNING", left=left).left_s() == seconds


def test_keep_in_a_users_allocation_says_what_to_do() -> None:
    with pytest.raises(meshbook.MeshError, match="keep= with --slurm job=ID is not supported yet"):
        meshbook.start(2, keep="1h", launcher=meshbook.Slurm(job=123, per_node=1))
