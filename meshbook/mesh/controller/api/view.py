"""What the API's parts ask of a mesh view, as a Protocol (so they need not import
:class:`~.mesh.Mesh`, which is built from them: no import circle).

:class:`~.mesh.Mesh` satisfies it; :mod:`.data`, :mod:`.actors` and :mod:`.debug` are typed
against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ...protocol.topology import DimSelector, Topology
from ..core.controller import Controller
from ..core.run import Run

Ranks = Sequence[int] | str | int | None
Where = Mapping[str, DimSelector] | None


class MeshView(Protocol):
    @property
    def controller(self) -> Controller: ...

    @property
    def topology(self) -> Topology: ...

    @property
    def ranks(self) -> list[int]: ...

    def select(self, ranks: Ranks = None, where: Where = None) -> list[int]: ...

    def narrow(self, ranks: Ranks = None, where: Where = None) -> "MeshView": ...

    def call(self, fn: Callable[..., Any], *args: Any, ranks: Sequence[int] | None = None,
             control: bool | None = None, what: str = "", **kwargs: Any) -> Run: ...

    # what the data and actor parts call on each other (their own signatures are theirs)
    def pull(self, *args: Any, **kwargs: Any) -> Any: ...

    def push(self, *args: Any, **kwargs: Any) -> None: ...

    def scatter(self, *args: Any, **kwargs: Any) -> None: ...

    def who(self, *args: Any, **kwargs: Any) -> Any: ...

    def ref(self, *args: Any, **kwargs: Any) -> Any: ...

    def restart(self, *args: Any, **kwargs: Any) -> Any: ...

    def memory(self) -> Any: ...
