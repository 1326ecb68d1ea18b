"""Opening the socket between a front-end and an engine, with every wait bounded.

multiprocessing's ``Listener.accept()`` with an authkey runs the key's challenge inside ``accept``: a peer that
connects and closes ends the accept loop with BrokenPipeError, and one that connects and says nothing blocks it,
so no front-end could connect again. Here the engine accepts without the key and runs the challenge and the Hello
on the connection's own thread, each read and write bounded by HANDSHAKE_SECONDS (a socket time-out, so a silent
peer costs that thread a few seconds and nothing else); the front-end's side is bounded the same way.

Once open, the engine's writes to a front-end are bounded by ``SEND_SECONDS`` (a front-end that reads nothing for
that long is cut off: resnet_server.engine.core), and its reads wait for as long as the front-end is quiet.
"""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from resnet_server.boundary.protocol import (
    EngineInfo,
    EngineLink,
    Hello,
    Ready,
    receive_at_engine,
    receive_at_frontend,
    send,
)

HANDSHAKE_SECONDS = 5.0
SEND_SECONDS = 10.0  # the longest an engine's write to one front-end may block before it is cut off


def set_timeouts(connection: Connection, receive: float | None, send_: float | None) -> None:
    """Bound each blocking read and write on the connection's socket (None: wait for ever). A time-out raises
    an OSError (EAGAIN) from the call that waited; the connection is then closed, its stream being cut."""
    with socket.socket(fileno=_dup(connection)) as view:  # a second descriptor of the same socket
        view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(receive))
        view.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_))


def shut_down(connection: Connection) -> None:
    """Wake every thread blocked on the connection (their reads see EOF, their writes fail) without closing
    its descriptor under them; the thread that owns it closes it."""
    try:
        with socket.socket(fileno=_dup(connection)) as view:
            view.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed or never connected: nothing blocks on it
        pass


def accept_hello(connection: Connection, authkey: bytes) -> Hello:
    """The engine's side of a new connection: the key's challenge both ways, then the front-end's Hello, within
    HANDSHAKE_SECONDS each step. Raises (OSError, EOFError, AuthenticationError, a decode error) otherwise."""
    set_timeouts(connection, HANDSHAKE_SECONDS, HANDSHAKE_SECONDS)
    deliver_challenge(connection, authkey)
    answer_challenge(connection, authkey)
    hello = receive_at_engine(connection)
    if not isinstance(hello, Hello):
        raise EOFError(f"a front-end began with {type(hello).__name__}, not Hello")
    set_timeouts(connection, None, SEND_SECONDS)
    return hello


def connect(link: EngineLink, owner: int) -> tuple[Connection, EngineInfo]:
    """The front-end's side: connect, the key's challenge, Hello and the engine's Ready, within
    HANDSHAKE_SECONDS each step; then reads and writes wait (the front-end makes its socket non-blocking)."""
    connection = Client(link.address, "AF_UNIX")
    try:
        set_timeouts(connection, HANDSHAKE_SECONDS, HANDSHAKE_SECONDS)
        answer_challenge(connection, link.authkey)
        deliver_challenge(connection, link.authkey)
        send(connection, Hello(owner))
        ready = receive_at_frontend(connection)
        if not isinstance(ready, Ready):
            raise EOFError(f"the engine answered Hello with {type(ready).__name__}, not Ready")
        set_timeouts(connection, None, None)
    except BaseException:
        connection.close()
        raise
    return connection, ready.info


def _dup(connection: Connection) -> int:
    return os.dup(connection.fileno())


def _timeval(seconds: float | None) -> bytes:
    if not seconds:
        return struct.pack("ll", 0, 0)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
