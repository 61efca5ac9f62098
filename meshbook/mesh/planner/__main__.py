"""``python -m meshbook.mesh.planner FD``: the planner zygote (:mod:`.zygote`), which forks the
planner processes a plan traces its layouts in (:mod:`.jobs`)."""

from __future__ import annotations

import sys

from .zygote import serve

if __name__ == "__main__":
    serve(int(sys.argv[1]))
