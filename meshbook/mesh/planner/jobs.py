"""A planner's life: read jobs from stdin, answer each on stdout, until stdin closes.

Frames are a 4-byte length and a cloudpickle (the model's factory travels by value from the
notebook); stdout carries frames only, so torch's warnings go to stderr, which the
controller keeps to quote if the process dies. A planner is a fork of the zygote
(:mod:`.zygote`), which set up its stdin, stdout and stderr.
"""

from __future__ import annotations

import os
import sys

from ..protocol.errors import MeshError
from ..protocol.plan import read_frame, write_frame
from . import trace


def answer_jobs() -> None:
    jobs, answers = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # a print anywhere must not corrupt the frames
    while (job := read_frame(jobs)) is not None:
        kind, args = job
        try:
            write_frame(answers, ("ok", getattr(trace, kind)(*args)))
        except Exception as exc:  # the controller turns it into a MeshError in the cell
            # A MeshError says what to do already; anything else says what it is.
            write_frame(answers, ("error", str(exc) if isinstance(exc, MeshError) else f"{type(exc).__name__}: {exc}"))
