"""What the controller and a host agent on another host agree on, besides messages.

* Every message to an agent is ``[head, *message frames]``, the head holding its epoch, seq
  and route (:func:`encode_head`), and every message
  from one ``[seq, *message frames]``: ``seq`` numbers what each side sends on the link, so a
  connection that resets loses nothing unnoticed (:mod:`.ordering`; 0: not numbered, for the
  few messages outside a link's life: joining, telling an older controller it is fenced).
  The epoch is the sending
  controller's (a kept mesh attached by a new kernel gets a higher one, and its agents refuse
  what an older controller sends); an empty route is an operation for the agent itself;
  otherwise the route names a channel and the ranks of that host the agent relays the
  (unchanged, rank-signed) message to. One message per host, fanned out there.
* A listening agent (started through ssh) prints one line, :data:`LISTENING` and a JSON
  object (its address, port, pid, GPU count), once the controller can dial it. An agent on
  the controller's own host prints :data:`AGENT_READY` and its GPU count once it has imported
  torch, then waits for its configuration on stdin.
* A joining agent (started by any launcher) reads a token, from a file or :data:`TOKEN_ENV`:
  the controller's address, the Curve keys and the mesh key, base64 over JSON.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

from .config import TOKEN_ENV  # noqa: F401 - the joining agent reads it, named with the other settings

LISTENING = "MESHBOOK-AGENT-LISTENING"
AGENT_READY = "MESHBOOK-AGENT-READY"


_SEQ = struct.Struct("<Q")


def encode_seq(seq: int) -> bytes:
    """The first frame of a message up a link: its number on the link."""
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    return int(_SEQ.unpack(frame)[0])

_DOWN = struct.Struct("<QQ")


def encode_head(epoch: int, seq: int, route: bytes) -> bytes:
    """The first frame of a message down a link: the controller's epoch, the message's number
    on the link, and its route (or what stands in its place: ``b""`` for the agent itself,
    a fragment's mark). One frame, not three: a request to 128 hosts is 256 frames fewer to
    send, and to encrypt, since CurveZMQ boxes every frame on its own."""
    return _DOWN.pack(epoch, seq) + route


def decode_head(frame: bytes) -> tuple[int, int, bytes]:
    """``(epoch, seq, route)`` of :func:`encode_head`."""
    epoch, seq = _DOWN.unpack_from(frame)
    return epoch, seq, frame[_DOWN.size:]


def encode_route(channel: str, ranks: list[int]) -> bytes:
    return channel.encode() + struct.pack(f"<{len(ranks)}I", *ranks)


def decode_route(route: bytes) -> tuple[str, list[int]]:
    return route[:1].decode(), list(struct.unpack(f"<{(len(route) - 1) // 4}I", route[1:]))


def encode_token(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).decode()


def decode_token(text: str) -> dict[str, Any]:
    """The token's content; ValueError if it is not a whole meshbook join token."""
    try:
        data = json.loads(base64.urlsafe_b64decode(text.strip().encode()))
        if not all(k in data for k in ("controller", "join", "key", "server_public")):
            raise ValueError("fields missing")
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a meshbook join token ({exc})") from None
    return data
