"""Launchers: the ways a mesh's host agents are started, one class each, in one registry.

Built in: ``local`` (this machine, the default), ``ssh`` (the system client), ``join`` (any
external launcher runs a printed command) and ``slurm`` (a job, or an allocation you hold).
Each is registered under the entry-point group :data:`GROUP`, and a package of a site's own
adds one the same way, without patching meshbook::

    [project.entry-points."meshbook.launchers"]
    k8s = "mysite.meshbook_k8s:Kubernetes"     # a subclass of meshbook.Launcher

``start(launcher="k8s")`` then finds it, and ``%mesh start`` gets its options
(``add_arguments``/``from_args``). The contract is :class:`~.base.Launcher`.
"""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points

from ...protocol.errors import MeshError
from .base import Launcher, shared_arguments
from .join import Join
from .local import LocalLauncher
from .slurm import Slurm
from .ssh import SSH

#: The entry-point group launchers are registered under.
GROUP = "meshbook.launchers"
#: The launchers meshbook brings (also registered under GROUP by its own package metadata, but
#: found here even when it runs from a source tree that was never installed).
BUILT_IN: dict[str, type[Launcher]] = {"local": LocalLauncher, "ssh": SSH, "join": Join, "slurm": Slurm}


def launchers() -> dict[str, type[Launcher]]:
    """Every registered launcher by name: the built-in ones, then any a package registered."""
    found = dict(BUILT_IN)
    for entry in entry_points(group=GROUP):
        if entry.name in found:
            continue
        try:
            cls = entry.load()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in must not break meshbook
            raise MeshError(f"the launcher {entry.name!r} ({entry.value}) of group {GROUP} cannot be "
                            f"loaded: {type(exc).__name__}: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, Launcher)):
            raise MeshError(f"{entry.value} (launcher {entry.name!r}) is not a meshbook.Launcher subclass")
        found[entry.name] = cls
    return found


def get_launcher(launcher: str | Launcher) -> Launcher:
    """A launcher by name (``"local"``, a registered one), or the one given."""
    if isinstance(launcher, Launcher):
        return launcher
    known = launchers()
    if not isinstance(launcher, str) or launcher not in known:
        raise MeshError(f"unknown launcher {launcher!r}; available: {', '.join(known)} (a package can "
                        f"register one under the entry-point group {GROUP!r})")
    try:
        return known[launcher]()
    except TypeError:  # it needs its settings (hosts, a job...)
        raise MeshError(f"the {launcher} launcher needs its settings: pass an instance, e.g. "
                        f"launcher=meshbook.{known[launcher].__name__}(...), or use %mesh start's options") from None


def add_start_arguments(parser: argparse.ArgumentParser) -> None:
    """``%mesh start``'s launcher options: the shared ones once, then each launcher's own."""
    shared_arguments(parser)
    for cls in launchers().values():
        cls.add_arguments(parser)


def launcher_from_args(args: argparse.Namespace) -> Launcher:
    """The launcher ``%mesh start``'s options ask for (``local`` when none does)."""
    chosen = [launcher for cls in launchers().values() if (launcher := cls.from_args(args)) is not None]
    if len(chosen) > 1:
        raise MeshError(f"{', '.join(type(c).name for c in chosen)}: these are ways to start ranks on other "
                        f"hosts: pick one")
    if chosen:
        return chosen[0]
    for flag in ("per_host", "python"):
        if getattr(args, flag, None) is not None:
            raise MeshError(f"--{flag.replace('_', '-')} goes with a launcher for other hosts "
                            f"(--hosts, --join, --slurm)")
    return LocalLauncher()


__all__ = ["BUILT_IN", "GROUP", "Launcher", "add_start_arguments", "get_launcher", "launcher_from_args", "launchers"]
