"""Meshes shared by the tests (the orphan checks live in the repository's root conftest)."""

from __future__ import annotations

from typing import Iterator

import pytest

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
