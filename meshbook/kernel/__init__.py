"""Glue to the Jupyter kernel: output attributed to the right cell, kernelspec install.

``python -m meshbook.kernel install [--user|--sys-prefix]`` installs a "Python 3 (meshbook)"
kernel that loads the extension at start.
"""

from .bridge import KernelBridge, cell_allows_stdin, install, uninstall

__all__ = ["KernelBridge", "cell_allows_stdin", "install", "uninstall"]
