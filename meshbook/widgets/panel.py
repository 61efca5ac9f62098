"""The base of meshbook's widgets: one live HTML panel, and fallbacks where widgets do not
render (nbconvert, GitHub, nbval) — the same HTML, and a deterministic ``text/plain``."""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets


class HTMLPanel(widgets.VBox):
    """A widget showing one HTML panel.

    Subclasses set ``self._html.value`` and define :meth:`text`: a deterministic
    ``text/plain`` (no times, no changing numbers) for nbconvert, GitHub and nbval.
    """

    def __init__(self, value: str = "", **kwargs: Any) -> None:
        self._html = widgets.HTML(value)
        super().__init__(children=[self._html], **kwargs)

    def text(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return str(self._html.value)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(super()._repr_mimebundle_(**kwargs) or {})
        bundle.update({"text/plain": self.text(), "text/html": self._html.value})
        return bundle
