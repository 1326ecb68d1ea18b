"""An engine's side of its front-ends' sockets, read by the batcher's own worker thread.

The worker reads the front-ends' messages itself when it looks for work, and blocks on their sockets only
when it has none. A front-end's message to an engine that is busy then costs one write and wakes no
thread; a reader thread of its own, always waiting on the socket, was woken by every message, and then had
to wake the worker in turn (on the 2-core VM such wake-ups cost the engine and the front-end more than the
Python of a call's hand-off). Messages that arrive while the worker computes wait in the socket: they are
few (a front-end sends one message a turn of its event loop, and at most as many images as the slab has
slots wait), and the worker reads every one of them before it forms its next batch.

Connections are accepted on another thread (the handshake may wait on a slow peer) and handed over with
:meth:`Inbox.add`; any thread can interrupt a wait with :meth:`Inbox.wake`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

Peer = TypeVar("Peer")  # whatever the owner keeps per connection (server.engine's _FrontEnd)


class Inbox(Generic[Peer]):
    """``handle(peer, kind, payload)`` is called for every message, ``gone(peer)`` once a peer's socket has
    closed; both on the thread that calls :meth:`wait`."""

    def __init__(self, handle: Callable[[Peer, str, tuple], None], gone: Callable[[Peer], None]) -> None:
        self._handle, self._gone = handle, gone
        self._selector = selectors.DefaultSelector()
        self._doorbell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._selector.register(self._doorbell, selectors.EVENT_READ)
        self._joining: collections.deque[tuple[Connection, Peer]] = collections.deque()

    def add(self, connection: Connection, peer: Peer) -> None:
        """From any thread: read ``connection``'s messages from the next wait on."""
        self._joining.append((connection, peer))
        self.wake()

    def wake(self) -> None:
        """From any thread: end the current or next wait at once."""
        os.eventfd_write(self._doorbell, 1)

    def wait(self, timeout: float | None) -> bool:
        """Handle every message the peers have sent, waiting up to ``timeout`` seconds (None: without limit) for
        the first; False if the wait ran out with nothing arrived and no wake-up."""
        events = self._selector.select(timeout)
        for key, _ in events:
            if key.data is None:
                self._answer_doorbell()
            else:
                self._read(key.fileobj, key.data)
        return bool(events)

    def _answer_doorbell(self) -> None:
        with contextlib.suppress(BlockingIOError):  # read by an earlier turn already
            os.eventfd_read(self._doorbell)
        while self._joining:
            connection, peer = self._joining.popleft()
            self._selector.register(connection, selectors.EVENT_READ, peer)

    def _read(self, connection: Connection, peer: Peer) -> None:
        """Every message the socket holds now (one ``recv`` each; ``poll`` says whether another is there)."""
        try:
            while True:
                kind, payload = connection.recv()
                self._handle(peer, kind, payload)
                if not connection.poll():
                    return
        except (EOFError, OSError):
            self._selector.unregister(connection)
            connection.close()
            self._gone(peer)

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            if key.data is not None:
                key.fileobj.close()
        self._selector.close()
        os.close(self._doorbell)
