"""Re-execute the tutorial notebooks in place, storing fresh outputs.

    python notebooks/refresh.py                 # all of them
    python notebooks/refresh.py 01_quickstart   # some of them

CI runs them with ``pytest --nbval`` and compares against the stored outputs, so run this
after changing a notebook or an output format, and read the diff before committing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent


def refresh(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    started = time.monotonic()
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(notebook, path)
    print(f"{path.name}: {time.monotonic() - started:.0f} s")


def main(names: list[str]) -> None:
    paths = sorted(HERE.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.stem.startswith(n) for n in names)]
    for path in paths:
        refresh(path)


if __name__ == "__main__":
    main(sys.argv[1:])
