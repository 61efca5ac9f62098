"""Which torch.distributed backend a mesh runs, decided once by the controller for every rank.

NCCL needs one GPU per rank: ``torch.cuda.set_device(local_rank)`` with fewer GPUs than ranks
on a host fails with "invalid device ordinal", so ``auto`` picks NCCL only when every host has a
GPU for each of its ranks, and otherwise gloo, with a note saying why (the ranks may still put
tensors on the GPUs they share). A mesh has one backend: a host that sees no GPU beside hosts
that run NCCL is refused (a missing driver or an empty ``CUDA_VISIBLE_DEVICES`` on one node
would otherwise run the whole mesh on gloo, silently). The GPU counts are the agents' own,
taken where the ranks will run (see :mod:`meshbook.mesh.agent.gpus`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import MeshError

#: What ``backend="nccl"`` (and ``auto`` on GPUs) runs: NCCL for CUDA tensors, gloo for CPU ones.
NCCL = "cuda:nccl,cpu:gloo"
CHOICES = ("auto", "gloo", "nccl")


#: The name of the host a local mesh runs on, in what is said of it.
LOCAL = "this host"


@dataclass(frozen=True)
class HostGpus:
    """What one host agent reported: its name, the GPUs its ranks see, how many ranks it runs."""

    name: str
    gpus: int
    ranks: int


@dataclass(frozen=True)
class Backend:
    """The mesh's backend: torch's string, the ranks' device type, and why (when ``auto``
    chose gloo on a machine with GPUs)."""

    torch: str
    device_type: str
    note: str = ""

    @classmethod
    def of(cls, torch: str) -> "Backend":
        """The backend a torch string names: on CUDA when it names CUDA or NCCL (a kept mesh's
        record holds the string only)."""
        return cls(torch, "cuda" if "cuda" in torch or "nccl" in torch else "cpu")


def check_requested(backend: str) -> None:
    """Refuse a backend name before anything starts."""
    if backend not in CHOICES and ":" not in backend:
        raise MeshError(f"backend {backend!r}: use 'auto', 'gloo', 'nccl' or a torch backend "
                        f"string like '{NCCL}'")


def choose(requested: str, hosts: Sequence[HostGpus]) -> Backend:
    """The backend for a mesh whose hosts report ``hosts`` (see the module's doc)."""
    check_requested(requested)
    short = [h for h in hosts if h.gpus < h.ranks]
    if requested == "gloo":
        return Backend("gloo", "cpu")
    if requested != "auto":
        wanted = NCCL if requested == "nccl" else requested
        if "nccl" not in wanted:
            return Backend.of(wanted)
        if short and all(h.gpus == 0 for h in short):
            raise MeshError(f"--backend {requested} needs a GPU per rank, and {_names(short)} "
                            f"{'has' if len(short) == 1 else 'have'} none. Start with --backend gloo "
                            f"(backend='gloo') to run the ranks on CPU collectives")
        if short:
            raise MeshError(f"--backend {requested} needs a GPU per rank, but {_describe(short)}. "
                            f"Start with --backend gloo (backend='gloo'), or with at most "
                            f"{min(h.gpus for h in short)} rank(s) on such a host")
        return Backend(wanted, "cuda")
    if all(h.gpus == 0 for h in hosts):
        return Backend("gloo", "cpu")
    if not short:
        return Backend(NCCL, "cuda")
    blind = [h for h in hosts if h.gpus == 0]
    if blind and len(short) < len(hosts):
        raise MeshError(f"{_describe(blind)}, while the other host(s) have a GPU per rank: one mesh "
                        f"runs one backend. Check the driver and CUDA_VISIBLE_DEVICES there, or start "
                        f"with --backend gloo (backend='gloo') to run every rank on CPU collectives")
    return Backend("gloo", "cpu", f"meshbook: gloo, not NCCL: {_describe(short)} (NCCL needs one GPU per "
                                  f"rank). The ranks can still use the GPUs (shared); --backend nccl "
                                  f"needs fewer ranks per host")


def _describe(hosts: Sequence[HostGpus]) -> str:
    return "; ".join(f"{_names([h])} has {h.gpus} GPU(s) for {h.ranks} rank(s)" for h in hosts)


def _names(hosts: Sequence[HostGpus]) -> str:
    """``this host`` (the local agent's, which has no name of its own), or ``host gpu2``."""
    return ", ".join(h.name if h.name == LOCAL else f"host {h.name}" for h in hosts)
