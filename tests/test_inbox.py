"""server.inbox: an engine's worker reading its front-ends' sockets itself (real socket pairs)."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

from server.engine import send_message
from server.inbox import Inbox


def make_inbox():
    handled, gone = [], []
    inbox = Inbox(lambda peer, kind, payload: handled.append((peer, kind, payload)), gone.append)
    return inbox, handled, gone


def test_every_message_of_every_peer_is_handled_in_one_wait_in_order():
    inbox, handled, _ = make_inbox()
    ends = {}
    for peer in ("a", "b"):
        mine, theirs = Pipe()
        inbox.add(mine, peer)
        ends[peer] = theirs
    for number in range(3):
        for end in ends.values():
            send_message(end, ("submit", [number]))
    assert inbox.wait(1.0)  # the doorbell registers both; their messages may need a second turn
    while len(handled) < 6:
        assert inbox.wait(1.0)
    for peer in ends:
        assert [(kind, payload) for who, kind, payload in handled if who == peer] == [
            ("submit", [0]), ("submit", [1]), ("submit", [2])]
    assert not inbox.wait(0.05)  # nothing left: the wait runs out
    inbox.close()


def test_a_wake_from_another_thread_ends_a_wait_without_limit():
    inbox, handled, _ = make_inbox()
    timer = threading.Timer(0.1, inbox.wake)
    timer.start()
    assert inbox.wait(None)
    assert handled == []
    timer.join()
    inbox.close()


def test_a_closed_peer_is_gone_once_and_no_longer_read():
    inbox, handled, gone = make_inbox()
    mine, theirs = Pipe()
    inbox.add(mine, "a")
    send_message(theirs, ("cancel", [7]))
    theirs.close()
    while not gone:
        assert inbox.wait(1.0)
    assert handled == [("a", "cancel", [7])]  # what it sent before it closed is still handled
    assert gone == ["a"] and mine.closed
    assert not inbox.wait(0.05)  # its socket has left the selector
    inbox.close()
