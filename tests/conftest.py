"""Meshes and rigs shared by the tests (the orphan checks live in the repository's root conftest).

The rigs (``tests/rigs``: namespace-hosts, sshd, Slurm) need root and a few Debian packages;
where those are missing their fixtures skip saying why, except in CI, where that is a failure.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from rigs import need, netns, slurm, sshd

import meshbook


@pytest.fixture(scope="module")
def mesh4() -> Iterator[meshbook.Mesh]:
    """A 4-rank (dp=2, tp=2) gloo mesh shared by a module's tests."""
    mesh = meshbook.start(dims={"dp": 2, "tp": 2})
    yield mesh
    mesh.stop()


@pytest.fixture
def mesh2() -> Iterator[meshbook.Mesh]:
    """A fresh 2-rank mesh for a test that may break it."""
    mesh = meshbook.start(2)
    yield mesh
    mesh.stop()


@pytest.fixture
def netns_hosts() -> Iterator[netns.Hosts]:
    """Two namespace-hosts ``h1``, ``h2`` on a bridge; the test process is the login node."""
    need(netns.missing)
    with netns.Hosts(2) as hosts:
        yield hosts


@pytest.fixture
def ssh_hosts(netns_hosts: netns.Hosts) -> Iterator[sshd.Sshd]:
    """An sshd on each of ``netns_hosts``; ``ssh -F ssh_hosts.ssh_config h1`` reaches h1."""
    need(sshd.missing)
    with sshd.Sshd(netns_hosts) as server:
        yield server


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[slurm.Slurm]:
    """A Slurm whose nodes ``h1``, ``h2`` are namespace-hosts (shared by a module's tests)."""
    need(netns.missing, slurm.missing)
    with netns.Hosts(2) as hosts, slurm.Slurm(hosts) as cluster:
        yield cluster
