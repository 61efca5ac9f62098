"""The base of meshbook's widgets: one live HTML panel, and fallbacks where widgets do not
render (nbconvert, GitHub, nbval) — the same HTML, and a deterministic ``text/plain``.

A live widget view only renders while its kernel holds the widget's model: a notebook saved
with one and reopened after a kernel restart (or on GitHub) shows "Error displaying widget:
model not found", never the fallbacks. So a panel is displayed under a ``display_id`` and,
once it stops changing (:meth:`HTMLPanel.freeze`), each of its displays is replaced by the
static HTML and text alone: what a saved notebook stores is then readable anywhere.

Frontends find the display to replace in two ways. JupyterLab routes an update to the output
area of the request it answers, so an update sent from a later cell (``dashboard.close()``)
must carry the header of the cell that showed the panel; nbclient (nbconvert, nbval) and the
classic notebook only listen to the running cell, and look the display id up across cells.
So an update from a later cell is sent under both headers; each frontend ignores the copy it
cannot place.
"""

from __future__ import annotations

import sys
import uuid
from typing import Any

import ipywidgets as widgets
from IPython import get_ipython
from IPython.display import display


class HTMLPanel(widgets.VBox):
    """A widget showing one HTML panel.

    Subclasses set ``self.html_view.value`` and define :meth:`text`: a deterministic
    ``text/plain`` (no times, no changing numbers) for nbconvert, GitHub and nbval.
    """

    def __init__(self, value: str = "", **kwargs: Any) -> None:
        self.html_view = widgets.HTML(value)
        self._shown: list[tuple[str, dict[str, Any]]] = []  # (display_id, parent header)
        super().__init__(children=[self.html_view], **kwargs)

    def text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return str(self.html_view.value)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(super()._repr_mimebundle_(**kwargs) or {})
        bundle.update(self.static_bundle())
        return bundle

    def static_bundle(self) -> dict[str, str]:
        """What the panel shows now, without the live view: HTML and text."""
        return {"text/plain": self.text(), "text/html": self.html_view.value}

    def _ipython_display_(self) -> None:
        self.show()

    def show(self) -> None:
        """Display the live panel in the running cell (what ``display(panel)`` does)."""
        display_id = uuid.uuid4().hex
        kernel = _kernel()
        if kernel is not None:
            self._shown.append((display_id, kernel.get_parent()))
        display(self._repr_mimebundle_(), raw=True, display_id=display_id)

    def freeze(self) -> None:
        """Replace every display of this panel with its static HTML and text: a saved
        notebook keeps the panel as it is now, readable without a kernel."""
        kernel = _kernel()
        shown, self._shown = self._shown, []
        if kernel is not None and shown:
            sys.stdout.flush()  # what the cell printed before comes first
            sys.stderr.flush()
            running = kernel.get_parent()
            for display_id, parent in shown:
                content = {"data": self.static_bundle(), "metadata": {},
                           "transient": {"display_id": display_id}}
                for header in [parent] if parent == running else [parent, running]:
                    kernel.session.send(kernel.iopub_socket, "update_display_data", content, parent=header)

    def close(self) -> None:
        """Leave a static snapshot where the panel was shown, then close the widget."""
        self.freeze()
        self.html_view.close()
        super().close()


def _kernel() -> Any:
    """The running Jupyter kernel, or ``None`` (a terminal IPython, a script)."""
    return getattr(get_ipython(), "kernel", None)
