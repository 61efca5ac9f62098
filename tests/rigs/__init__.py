"""Test rigs that stand in for a cluster on one machine, for the tests of meshes across hosts.

Real parts only, so a launcher is tested against what it meets on real clusters:

- :mod:`rigs.netns` — Linux network namespaces as hosts, joined by a bridge in the root
  namespace (the login node), with network cuts, a firewall and latency on demand.
- :mod:`rigs.sshd` — a real OpenSSH server in each of those hosts, and a client config.
- :mod:`rigs.slurm` — a real Slurm: slurmctld on the login node, one slurmd per host.

Every rig is a context manager that stops every daemon it started by pid and removes every
namespace, interface, firewall rule and file it made, even when the test fails. Each module
has ``missing()``, saying why the rig cannot run here (not root, a package absent), for the
tests to skip with that reason (in CI they fail instead). The fixtures are in
``tests/conftest.py``; the tests that use these rigs are marked ``hosts`` (``./dev hosts``).
"""

from __future__ import annotations

import os
from typing import Callable, TypeVar

import pytest


def need(*checks: Callable[[], str | None]) -> None:
    """Skip with the reason the first check gives, if any; in CI fail instead (CI installs
    what the rigs need, so a rig that cannot run there is a broken CI, not a pass)."""
    for missing in checks:
        reason = missing()
        if reason:
            if os.environ.get("CI"):
                pytest.fail(f"CI must run the rigs: {reason}")
            pytest.skip(reason)


R = TypeVar("R", bound="Rig")


class Rig:
    """A context manager that starts what :meth:`open` starts and always closes it (:meth:`close`),
    even when starting fails halfway (close undoes whatever was done)."""

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: R) -> R:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
