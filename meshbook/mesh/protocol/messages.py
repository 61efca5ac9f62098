"""The protocol's vocabulary: every message kind, channel and header key, named once.

A message is a signed envelope (:mod:`.wire`) whose header says what it is (``KIND``) and
which request it belongs to (``ID``). Each receiver dispatches on the kind through a handler
table; a kind it has no handler for is counted and logged, never silently dropped.

Who sends what:

* controller -> rank, on the rank's ``MAIN`` channel (its main thread, in order): ``EXEC``
  (cell code), ``APPLY`` (a notebook function), ``CALL`` (a rank operation of
  :mod:`meshbook.mesh.rank.ops`); on its ``CONTROL`` channel (its control thread, answered
  while the main thread is busy): ``CALL`` and ``INPUT`` (a line for its debugger); ``ACTOR``
  (spawn an actor, or call one of its endpoints; main channel).
* rank -> rank, on the target's ``MAIN`` channel, signed with the target mesh's key: ``PEER``
  (an endpoint call from an actor handle a rank holds), answered with ``RESULT``/``ERROR``
  straight to the caller's reply socket named in ``REPLY_TO``, after a ``RELEASED`` when the
  target unmapped the shared memory of the call's arguments (the caller may reuse it); on its
  ``CONTROL`` channel, ``PEER_STOP``: the caller gave up waiting (Ctrl-C): stop the call.
* controller -> agent: ``OP``, whose body names the operation (``AgentOp``).
* rank -> controller: ``HELLO``, ``READY``, ``INIT_FAILED`` (start-up and new process-group
  generations), ``OUTPUT``, ``DISPLAY``, ``INPUT`` (a debugger prompt), ``DEBUG_END``,
  ``RESULT``, ``ERROR``, ``HEARTBEAT`` and ``COLLECTIVES`` (when it entered and left each
  collective, batched: the exact computing / waiting split and who arrives last).
* agent -> controller: ``AGENT`` (its ranks' pids), ``EXIT`` (a rank died), ``RESULT`` (of an
  operation, e.g. a py-spy dump), ``HOST_BEAT`` (the answer to a ``PING``: the round trip and
  liveness of a host across the network), ``JOIN`` (an agent started by an external launcher
  announces itself), ``FENCED`` (a message came from a controller with an older epoch than
  the newest the agent has seen: another kernel attached the mesh), ``RESEND`` / ``LOST``
  (messages from the controller went missing on the link; see ``protocol/ordering.py``),
  ``BUNDLE`` (an agent on another host: what its ranks sent, checked by the agent and signed
  once, with a request's identical results as one entry; see ``protocol/bundle.py``).
"""

from __future__ import annotations

from typing import Any

# -- kinds -----------------------------------------------------------------------------------

EXEC = "exec"
APPLY = "apply"
CALL = "call"
INPUT = "input"
OP = "op"
HELLO = "hello"
READY = "ready"
INIT_FAILED = "init_failed"
OUTPUT = "out"
DISPLAY = "display"
DEBUG_END = "debug_end"
RESULT = "result"
ERROR = "error"
HEARTBEAT = "hb"
AGENT = "agent"
EXIT = "exit"
HOST_BEAT = "host_beat"
JOIN = "join"
ACTOR = "actor"
PEER = "peer"
PEER_STOP = "peer_stop"  # rank -> rank (control channel): interrupt the PEER request ID
RELEASED = "released"
FENCED = "fenced"
COLLECTIVES = "collectives"
RESEND = "resend"  # agent -> controller: messages went missing on the link, send again
LOST = "lost"  # agent -> controller: what was asked again is no longer kept
BUNDLE = "bundle"  # agent -> controller: its ranks' messages, checked there, signed once

#: Requests from the notebook that run user code (an actor's constructor or endpoint too: its
#: collectives pair with the cells' ones): an irregular end of one triggers a step check. Not
#: ``PEER``: an actor's call to another actor is none of the controller's runs.
USER_KINDS = (EXEC, APPLY, ACTOR)

#: The endpoint meshbook calls with an actor mesh's failures (on a supervising actor): its
#: delivery is meshbook's, never held back behind a failure, nor step-checked.
SUPERVISE = "__supervise__"


def pairs_collectives(kind: str, body: Any) -> bool:
    """Whether a request issues collectives that pair across ranks: a cell, an applied
    function, an actor's constructor or endpoint, or a rank operation declared
    ``@rank_op(collective=True)`` (plan's probe, parallelize). A failure of one is
    step-checked, and a rank that failed one holds back what was sent before the check
    (DESIGN.md, "Ranks in step")."""
    if kind in USER_KINDS:
        return not (kind == ACTOR and isinstance(body, dict) and body.get("endpoint") == SUPERVISE)
    return kind == CALL and isinstance(body, dict) and bool(getattr(body.get("fn"), "collective", False))


class AgentOp:
    """What the controller asks of a host agent (the ``op`` field of an ``OP`` body)."""

    SIGNAL = "signal"
    SPAWN = "spawn"
    PYSPY = "pyspy"
    CONFIGURE = "configure"  # an agent on another host: its configuration, over the connection
    PING = "ping"  # the controller's heartbeat to an agent on another host
    STOP = "stop"  # end an agent on another host (a local one sees its stdin close)
    ATTACH = "attach"  # a new controller took over a kept mesh: report the ranks (pids, generations)
    WELCOME = "welcome"  # a joining agent's own key is admitted: come back with it
    RESEND = "resend"  # a link missed messages: send numbers ``from`` to ``to`` again (either way)
    LOST = "lost"  # what was asked again is no longer kept: skip the numbers in ``lost`` (ranges)


# -- channels: a rank binds one socket per channel -------------------------------------------

MAIN = "x"
CONTROL = "c"
CHANNELS = (MAIN, CONTROL)

# -- header keys -----------------------------------------------------------------------------

KIND = "k"
ID = "id"  # the request a message answers or belongs to (None: none)
RANK = "rank"  # the rank that sent it
HOST = "host"  # the agent that sent it
RANKS = "ranks"  # the ranks an agent operation is for
DURATION = "t"  # seconds the rank spent on the request
HAS_GROUP = "pg"  # False: the rank lost its process group (a step check follows)
GENERATION = "generation"  # the process-group generation a READY / INIT_FAILED is about
REPLY_TO = "reply"  # where a rank-to-rank (PEER) call is answered
TYPE = "type"  # a RESULT's type (module.qualname): named when the notebook cannot unpickle it
