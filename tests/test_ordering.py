"""A link's numbering on its own: in order, gaps held and filled, nothing twice, and what is
no longer kept reported as lost (protocol/ordering.py); and big messages cut into fragments
and put together again (protocol/fragments.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from meshbook.mesh.protocol.fragments import Assembly, split
from meshbook.mesh.protocol.ordering import ASK_AGAIN_MAX_S, ASK_AGAIN_S, Incoming, Outgoing


def test_in_order_messages_are_delivered_at_once() -> None:
    incoming = Incoming()
    assert incoming.take(1, [b"a"], 0.0) == [[b"a"]]
    assert incoming.take(2, [b"b"], 0.0) == [[b"b"]]
    assert incoming.acknowledged == 2 and incoming.ask(10.0) is None


def test_a_gap_holds_what_follows_until_it_is_filled() -> None:
    incoming = Incoming()
    incoming.take(1, [b"1"], 0.0)
    assert incoming.take(4, [b"4"], 1.0) == [] and incoming.take(3, [b"3"], 1.0) == []
    assert incoming.ask(1.0) == (2, 2), "the gap is asked for: not what came after it"
    assert incoming.ask(1.0 + ASK_AGAIN_S / 2) is None, "not again at once"
    assert incoming.ask(1.0 + ASK_AGAIN_S) == (2, 2), "asked again when the answer is late"
    assert incoming.take(2, [b"2"], 2.0) == [[b"2"], [b"3"], [b"4"]]
    assert incoming.take(3, [b"3"], 2.0) == [], "sent again but already here: dropped"
    assert incoming.acknowledged == 4 and incoming.ask(9.0) is None


def test_a_gap_that_asking_does_not_fill_is_asked_for_less_and_less_often() -> None:
    """Each ask has the sender send the gap again: a resend still on its way behind a big
    transfer is not asked for every second. Once the gap closes, asking is prompt again."""
    incoming = Incoming()
    incoming.take(2, [b"2"], 100.0)
    asks = [t / 2 - 100 for t in range(200, 280) if incoming.ask(t / 2) is not None]
    assert asks == [0.0, 1.0, 3.0, 7.0, 15.0, 23.0, 31.0, 39.0]
    assert max(b - a for a, b in zip(asks, asks[1:])) == ASK_AGAIN_MAX_S
    assert incoming.take(1, [b"1"], 140.0) == [[b"1"], [b"2"]]
    incoming.take(4, [b"4"], 141.0)
    assert incoming.ask(141.0) == (3, 3) and incoming.ask(141.0 + ASK_AGAIN_S) == (3, 3), \
        "a new gap is asked for promptly"


@settings(max_examples=400, derandomize=True)  # the same examples on every run: never a flake
@given(arrivals=st.lists(st.integers(min_value=1, max_value=6), max_size=12),
       lost=st.sets(st.integers(min_value=1, max_value=6)), told_at=st.integers(min_value=0, max_value=12))
def test_whatever_comes_in_whatever_order_is_delivered_as_the_rule_says(
        arrivals: list[int], lost: set[int], told_at: int) -> None:
    """Any arrivals (late, twice, some never) and numbers told lost at any point, against the
    rule in its plainest form: a number is delivered once, when every number before it came or
    was told lost; a number that comes after its turn passed is dropped. The in-order path
    (nothing held, nothing lost: delivered at once) must agree with it."""
    incoming, delivered = Incoming(), []
    expected, waiting, skipped, wanted = 1, set(), set(), []

    def go_on() -> None:
        nonlocal expected
        while expected in waiting or expected in skipped:
            if expected in waiting:
                wanted.append(expected)
            expected += 1

    for i, seq in enumerate([*arrivals, 0]):
        if i == told_at:
            delivered += incoming.give_up([(n, n) for n in sorted(lost)])
            skipped |= {n for n in lost if n >= expected and n not in waiting}
            go_on()
        if seq:
            delivered += incoming.take(seq, [seq], 0.0)
            if seq >= expected:
                waiting.add(seq)
                go_on()
    assert [frames[0] for frames in delivered] == wanted
    assert incoming.expected == expected


def test_what_the_sender_no_longer_keeps_is_lost_and_the_rest_goes_on() -> None:
    out = Outgoing(keep_messages=3)
    sent = [out.number([bytes([n])]) for n in range(1, 6)]
    assert sent == [1, 2, 3, 4, 5] and out.kept == 3
    assert out.gone(2) == [(2, 2)] and [n for n, _ in out.since(2)] == [3, 4, 5], "message 2 is gone"
    assert out.gone(3) == []
    incoming = Incoming(expected=2)
    incoming.take(5, [b"5"], 0.0)
    assert incoming.give_up(out.gone(2)) == [] and incoming.newest_lost == 2
    assert incoming.take(3, [b"3"], 0.0) == [[b"3"]] and incoming.take(4, [b"4"], 0.0) == [[b"4"], [b"5"]]
    out.acknowledged(4)
    assert [n for n, _ in out.since(5)] == [5]


def test_a_message_too_big_to_keep_is_sent_but_not_kept() -> None:
    out = Outgoing(keep_bytes=10)
    assert out.number([b"x" * 11]) == 1 and out.kept == 0
    assert out.number([b"small"]) == 2 and out.gone(2) == [] and out.gone(1) == [(1, 1)]


def test_what_came_is_delivered_although_its_sender_let_it_go() -> None:
    """A pull's result too big to keep arrived after a gap (an output line lost in a reset):
    the line is still kept, so it comes again, and the result is not thrown away."""
    out = Outgoing(keep_bytes=10)
    line, result, after = out.number([b"line"]), out.number([b"x" * 11]), out.number([b"exit"])
    incoming = Incoming()
    assert incoming.take(result, [b"result"], 0.0) == [] and incoming.take(after, [b"exit"], 0.0) == []
    asked = incoming.ask(ASK_AGAIN_S)
    assert asked == (line, line) and out.gone(*asked) == [], "the gap is the line, which is kept"
    assert [n for n, _ in out.since(*asked)] == [line], "it comes again, and only it"
    assert out.gone(line) == [(result, result)], "asked from the line on, the result would be lost"
    assert incoming.take(line, [b"line"], 1.0) == [[b"line"], [b"result"], [b"exit"]]


def test_a_loss_skips_what_never_came_and_delivers_what_did_in_its_place() -> None:
    """The sender no longer keeps 2, 5 and 6; 3 and 5 came after the gap at 1, which is sent
    again, and so is 4. Told twice (each side asks again while a gap waits), it is no news."""
    incoming = Incoming()
    incoming.take(3, [b"3"], 0.0)
    incoming.take(5, [b"5"], 0.0)
    assert incoming.give_up([(2, 2), (5, 6)]) == [] and incoming.newest_lost == 6, "1 is still to come"
    assert incoming.give_up([[2, 2], [5, 6]]) == [] and incoming.newest_lost == 6, "no news"
    assert incoming.take(1, [b"1"], 1.0) == [[b"1"], [b"3"]], "2 skipped, 3 in its place"
    assert incoming.take(4, [b"4"], 1.0) == [[b"4"], [b"5"]], "5 came: delivered, and 6 skipped"
    assert incoming.acknowledged == 6 and incoming.ask(9.0) is None
    assert incoming.give_up([(5, 6)]) == [] and incoming.newest_lost == 6, "told again, late: no news"


def test_an_ask_that_crossed_an_acknowledgement_names_nothing_lost() -> None:
    """A resend asked from a number the other side acknowledged since (the ask and the ping
    crossed) must not report what it has as lost."""
    out = Outgoing()
    for n in range(1, 7):
        out.number([bytes([n])])
    out.acknowledged(6)
    assert out.gone(3) == [] and out.since(3) == []


# -- a big message in fragments (protocol/fragments.py) -------------------------------------------

frame_sizes = st.lists(st.integers(min_value=0, max_value=40), min_size=0, max_size=6)


def parts(message: list[bytes], piece: int = 16, before: list[bytes] | None = None) -> list[list[Any]]:
    """``message`` as a link sends it: its fragments, then its last part (after ``before``)."""
    cut = split(message, at=len(before or []), piece=piece)
    return [*cut.fragments, cut.last(before or [])]


def whole(assembly: Assembly, sent: list[list[Any]]) -> list[list[bytes]]:
    """What ``assembly`` passes on of ``sent``, each frame as bytes."""
    return [[bytes(f) for f in m] for m in map(assembly.take, sent) if m is not None]


@given(sizes=frame_sizes, piece=st.integers(min_value=1, max_value=16), at=st.integers(min_value=0, max_value=2))
def test_a_message_in_fragments_comes_out_whole(sizes: list[int], piece: int, at: int) -> None:
    """Any frames, any piece size, after a route or not: the fragments and the last part put
    the message together again, byte for byte, and no fragment carries much more than a piece."""
    message = [b"envelope", *(bytes(range(n)) for n in sizes)]
    route = [b"r"] * at
    sent = parts(message, piece, route)
    if sum(map(len, message)) < 2 * piece:
        assert sent == [[*route, *message]], "a small message travels as it is"
    assert all(sum(memoryview(p).nbytes for p in fragment[2:]) <= piece for fragment in sent[:-1])
    assert whole(Assembly(), sent) == [[*route, *message]]


def test_a_message_whose_fragment_was_lost_is_dropped_and_what_follows_passes() -> None:
    big, small = [b"envelope", bytes(100), bytes(range(50))], [b"op"]
    sent = parts(big)
    assembly = Assembly()
    assert whole(assembly, sent[:2] + sent[3:]) == [] and assembly.dropped == 1, "the third never came"
    assert whole(assembly, sent[:2] + [small]) == [small] and assembly.dropped == 2, \
        "a message after fragments (the rest never came) passes, and the half-made message is dropped"
    assert whole(assembly, sent) == [big]


def test_fragments_of_two_messages_are_never_put_together() -> None:
    """A loss takes the end of one message (its last part too) and the start of the next (its
    first fragment too): the next one's remaining fragments go nowhere, its last part is
    dropped, and the message after it comes whole."""
    first, second = parts([b"e1", bytes(range(64))]), parts([b"e2", bytes(range(64, 128))])
    assembly = Assembly()
    taken = whole(assembly, first[:2] + second[1:]) + whole(assembly, first)
    assert taken == [[b"e1", bytes(range(64))]] and assembly.dropped == 2


def test_a_small_message_passes_as_it_is() -> None:
    assembly = Assembly()
    assert assembly.take([b"", b"op"]) == [b"", b"op"], "an empty route (an operation) is no fragment"
    assert assembly.take([b"x\x01\x00\x00\x00", b"a"]) == [b"x\x01\x00\x00\x00", b"a"]
    assert assembly.dropped == 0


def test_no_fragment_of_a_message_too_big_to_keep_is_kept() -> None:
    """Its pieces would pin all of it, and part of it could not come again anyway."""
    out = Outgoing(keep_bytes=200)
    cut = split([b"e", bytes(300)], piece=16)
    numbers = [out.number(part, of=cut.nbytes) for part in (*cut.fragments, cut.last())]
    assert out.kept == 0 and out.gone(numbers[0]) == [(numbers[0], numbers[-1])]
    small = split([b"e", bytes(40)], piece=16)
    for part in (*small.fragments, small.last()):
        out.number(part, of=small.nbytes)
    assert out.kept == len(small.fragments) + 1


def test_an_ask_names_the_gap_and_only_the_gap_comes_again() -> None:
    out = Outgoing()
    for n in range(1, 7):
        out.number([bytes([n])])
    incoming = Incoming()
    for n in (1, 4, 5, 6):
        incoming.take(n, [bytes([n])], 0.0)
    asked = incoming.ask(ASK_AGAIN_S)
    assert asked == (2, 3) and [n for n, _ in out.since(*asked)] == [2, 3] and out.gone(*asked) == []
