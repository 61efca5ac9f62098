"""IPython's ``display()`` on a rank: to the notebook, as the rank's own ``display`` goes.

Users write ``from IPython.display import display, HTML`` out of habit, and libraries call it
(a progress widget's fallback, a table's ``_repr_html_``). A rank has no IPython shell, so
IPython's function printed the object's ``repr`` (``<IPython.core.display.HTML object>``), and
the import replaced the rank's own ``display`` in the namespace for every later cell.

IPython is not imported for this (it costs every rank a fraction of a second at start, for
a use only some cells have): a finder on ``sys.meta_path`` waits for
``IPython.core.display_functions`` to be imported, and replaces its ``display`` once the module
ran, before ``IPython.display`` takes the name from it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

#: Where IPython defines ``display`` (``IPython.display`` re-exports it from here).
MODULE = "IPython.core.display_functions"


def route_display(display: Callable[..., None]) -> None:
    """From now on, IPython's ``display`` on this rank is ``display`` (now, if IPython's module
    is imported already)."""
    if MODULE in sys.modules:
        _patch(sys.modules[MODULE], display)
        return
    sys.meta_path.insert(0, _DisplayFinder(display))


def _patch(module: ModuleType, display: Callable[..., None]) -> None:
    def ipython_display(*objs: Any, raw: bool = False, **ignored: Any) -> None:
        """IPython's ``display`` on a rank: the rank's own (``display_id``, ``metadata`` and
        ``clear`` have no meaning here)."""
        display(*objs, raw=raw)

    module.display = ipython_display  # type: ignore[attr-defined]


class _DisplayFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when :data:`MODULE` is imported, it asks the other finders for it
    and wraps its loader, so the module's ``display`` is replaced once the module ran."""

    def __init__(self, display: Callable[..., None]) -> None:
        self._display = display

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)  # once: asked again below, and never needed after
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module
        display = self._display

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            _patch(module, display)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
