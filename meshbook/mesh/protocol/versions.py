"""What each side of a mesh runs, said at every handshake, and a mismatch refused by name.

Rank operations travel by qualified name and message bodies as pickles, so a controller and an
agent of different meshbook (or torch, or Python) versions would fail somewhere deep and
cryptic: a remote host with another install, a Slurm node with an older venv, a kept mesh
attached after an upgrade. So the versions travel at every handshake (``AGENT_READY``,
``LISTENING``, ``JOIN``, ``AGENT``, ``HELLO``) and in the mesh file, and a mismatch is refused
with a message naming both sides and what to install (as dask's ``versions.py`` reports).
"""

from __future__ import annotations

import functools
import platform
import sys

#: The wire's version: bumped whenever a message, a header or a body changes shape.
PROTOCOL_VERSION = 2

#: What must match on both sides (torch: its pickles and private APIs; Python: pickles).
COMPARED = ("protocol", "meshbook", "torch", "python")


def versions() -> dict[str, str]:
    """This process's versions (see :func:`_read`), a copy of what was read once: every rank's
    hello and every agent's handshake asks, and metadata costs milliseconds to read."""
    return dict(_read())


@functools.cache
def _read() -> dict[str, str]:
    """This process's: the protocol, meshbook, torch (from its metadata when it is not
    imported yet: the controller need not import it) and Python (major.minor). A version's
    local label is dropped (torch ``2.13.0+cu130`` is ``2.13.0``): a notebook on a CPU build
    drives ranks on a CUDA build of the same release, and a package's metadata may say
    ``2.13.0`` where its ``__version__`` says ``2.13.0+cu130``."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "__version__"):
            return str(module.__version__).partition("+")[0]
        try:
            return version(name).partition("+")[0]
        except PackageNotFoundError:
            return "not installed"

    package = sys.modules[__name__.partition(".")[0]]  # imported before any of its modules
    return {"protocol": str(PROTOCOL_VERSION), "meshbook": str(package.__version__), "torch": installed("torch"),
            "python": ".".join(platform.python_version_tuple()[:2])}


def mismatch(ours: dict[str, str], theirs: dict[str, str] | None, we: str, they: str,
             follow_theirs: bool = False) -> str:
    """Why ``we`` and ``they`` cannot work together (empty: they can), and what to install: our
    versions, or theirs with ``follow_theirs`` (an agent says what its controller runs: the
    notebook's install is the one to match). ``theirs`` None or empty: an older meshbook that
    did not say (so: another protocol)."""
    if not theirs:  # only the protocol is known to differ
        theirs = {"protocol": "1 (meshbook before versions were sent)"}
        different = [("protocol", ours.get("protocol", "?"), theirs["protocol"])]
    else:
        different = [(k, ours.get(k, "?"), theirs.get(k, "?")) for k in COMPARED if ours.get(k) != theirs.get(k)]
    if not different:
        return ""
    parts = "; ".join(f"{name} {a} here, {b} there" for name, a, b in different)
    target = theirs if follow_theirs else ours
    install = [f"{name}=={target.get(name)}" if name in ("meshbook", "torch") else f"{name} {target.get(name)}"
               for name, _, _ in different if name != "protocol"] or [f"meshbook=={target.get('meshbook', '?')}"]
    return (f"{we} and {they} run different versions ({parts}): install the same on both "
            f"({', '.join(install)}), then start again")
