"""Every timing and environment variable a user may tune, in one place (README: "Settings").

The protocol's own rhythm (how often ranks beat, how long a host may be silent) is named here
and read from here by every process, so a controller, its agents and its ranks agree. The
variables a user can set are listed in :data:`VARIABLES` with their defaults and what they do;
the readers below read them at the moment they matter (a start, a connection), so a value set
in a notebook cell before ``%mesh start`` counts. :data:`VARIABLES` is the one list: README's
"Settings" table shows it, and a test checks that it shows all of it.
"""

from __future__ import annotations

import os

#: How often a rank's control thread sends a heartbeat (seconds).
HEARTBEAT_S = 0.5
#: How often the controller pings an agent on another host.
HOST_PING_S = 1.0
#: A host not heard from for this long is "suspect" in the status...
HOST_SUSPECT_S = 5.0
#: ...and after this long "lost": its ranks are dead, and its agent stops them on its side.
HOST_LOST_S = 15.0
#: How far back a rank's sampling report (stragglers, waiting) looks.
WINDOW_S = 10.0

SUSPECT_ENV = "MESHBOOK_HOST_SUSPECT_S"
LOST_ENV = "MESHBOOK_HOST_LOST_S"
PORT_RANGE_ENV = "MESHBOOK_PORT_RANGE"
TOKEN_ENV = "MESHBOOK_JOIN_TOKEN"
MMAP_ENV = "MESHBOOK_CPU_MMAP_THRESHOLD"
#: glibc maps blocks this size and up on their own on CPU ranks that parallelize (see DESIGN,
#: "Planning and applying parallel layouts").
CPU_MMAP_THRESHOLD = 128 << 10

#: The variables a user can set: name -> (default, what it does).
VARIABLES = {
    SUSPECT_ENV: (str(HOST_SUSPECT_S), "a host silent this long shows as suspect (seconds)"),
    LOST_ENV: (str(HOST_LOST_S), "a host silent this long is lost; its ranks stop themselves a second before"),
    PORT_RANGE_ENV: ("", "the ports meshbook listens on across hosts, e.g. 40000-40999 (default: any free port)"),
    TOKEN_ENV: ("", "the join token of `python -m meshbook.mesh.agent join` (or --token-file)"),
    MMAP_ENV: (str(CPU_MMAP_THRESHOLD), "CPU ranks that parallelize: glibc maps blocks from this size up on their "
                                        "own, so a step's peak memory is what a plan predicts; 0 keeps glibc's "
                                        "sliding threshold (steps up to 1.5x faster on CPU, peaks 20-85% higher)"),
}


def cpu_mmap_threshold() -> int:
    text = os.environ.get(MMAP_ENV, "").strip()
    try:
        return int(text) if text else CPU_MMAP_THRESHOLD
    except ValueError:
        raise ValueError(f"{MMAP_ENV}={text!r}: give a size in bytes, e.g. {CPU_MMAP_THRESHOLD}, or 0") from None


def host_suspect_s() -> float:
    return _seconds(SUSPECT_ENV, HOST_SUSPECT_S)


def host_lost_s() -> float:
    return _seconds(LOST_ENV, HOST_LOST_S)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give a number of seconds, e.g. {default:g}") from None
