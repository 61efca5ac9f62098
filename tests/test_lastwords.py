"""A rank's last messages, kept for its agent: what is kept, in what order, and what never is."""

from __future__ import annotations

import os

from meshbook.mesh.protocol import wire
from meshbook.mesh.protocol.lastwords import BIGGEST, INDEX, RING, LastWords


def messages(sender: wire.Wire, count: int) -> list[bytes]:
    return [bytes(sender.pack({"k": "output", "id": i}, f"line {i}")[0]) for i in range(count)]


def test_the_last_messages_are_read_back_oldest_first() -> None:
    kept = LastWords()
    kept.claim()
    sent = messages(wire.Wire(b"k" * 32), INDEX + 5)
    for message in sent[:3]:
        kept.keep([message])
    assert kept.read() == sent[:3]
    for message in sent[3:]:
        kept.keep([message])
    assert kept.read() == sent[-INDEX:], "the oldest entries are written over"
    kept.close()


def test_messages_the_ring_wrote_over_are_not_read_back() -> None:
    kept = LastWords()
    kept.claim()
    big = [bytes([i]) * (BIGGEST - 100) for i in range(40)]
    for message in big:
        kept.keep([message])
    back = kept.read()
    assert RING // BIGGEST - 1 <= len(back) < RING // (BIGGEST - 100) + 1
    assert back == big[-len(back):], "whole messages only, the newest ones, in order"
    kept.close()


def test_messages_with_buffers_big_ones_and_a_childs_are_not_kept() -> None:
    kept = LastWords()
    kept.keep([b"before the rank claimed it"])
    kept.claim()
    kept.keep([b"envelope", b"a buffer"])
    kept.keep([b"x" * (BIGGEST + 1)])
    pid = os.fork()
    if pid == 0:  # a child the rank forks (a data loader worker) writes nothing here
        kept.keep([b"from the child"])
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    kept.keep([b"kept"])
    assert kept.read() == [b"kept"]
    kept.close()


def test_a_receiver_tells_the_messages_it_took_already() -> None:
    sender, receiver = wire.Wire(b"k" * 32), wire.Wire(b"k" * 32)
    first, second = messages(sender, 2)
    receiver.unpack([first])
    assert receiver.taken([first]) and not receiver.taken([second])
    receiver.unpack([second])
    assert receiver.taken([second]) and receiver.dropped == 0, "asking counts nothing as dropped"
    assert not receiver.taken([b"short"])
