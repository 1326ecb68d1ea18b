"""A stream's requests handled concurrently and answered in order, within a window of requests and bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

STREAM_WINDOW = 64  # requests of one stream started and not yet answered: past it, the stream's reader waits
STREAM_WINDOW_BYTES = 64 << 20  # and the bytes those requests and their answers hold


_TAKEN = -1


class _HeldBytes:
    """The bytes a stream's window holds; the reader waits for room while they are over the bound."""

    def __init__(self, most: int) -> None:
        self.most, self.held = most, 0
        self._released = asyncio.Event()

    async def room(self) -> None:
        """Until the window holds no more than its bound (one request always goes: an empty window has room)."""
        while self.held > self.most:
            self._released.clear()
            await self._released.wait()

    def add(self, count: int) -> None:
        self.held += count

    def release(self, count: int) -> None:
        self.held -= count
        self._released.set()


def message_bytes(message: object) -> int:
    """An answer's size on the wire (a protobuf message's)."""
    byte_size = getattr(message, "ByteSize", None)
    return int(byte_size()) if byte_size is not None else 0


async def in_order(requests: AsyncIterator[R], handle: Callable[[R], Awaitable[T]],
                   weigh: Callable[[R], int] = lambda _: 0) -> AsyncIterator[T]:
    """Start handle(request) for each request as it arrives and yield the results in request order. The server's
    queue (--max-queue) bounds the images in flight, refusing the excess at once as it refuses unary calls; and
    a stream's window holds at most STREAM_WINDOW requests started and unanswered, and STREAM_WINDOW_BYTES of
    them (``weigh``: a request's bytes) and of their answers: a client that sends and does not read its answers
    finds the stream's reading paused (gRPC's flow control then holds its sends), not its answers piling up in
    the server."""
    pending: asyncio.Queue[tuple[asyncio.Task, int] | None] = asyncio.Queue(STREAM_WINDOW)
    held = _HeldBytes(STREAM_WINDOW_BYTES)
    answer_bytes: dict[asyncio.Task, int] = {}  # answers held, by task; TAKEN: yielded before it was weighed

    def weigh_answer(task: asyncio.Task) -> None:
        if answer_bytes.pop(task, None) == _TAKEN or task.cancelled() or task.exception() is not None:
            return
        answer_bytes[task] = size = message_bytes(task.result())
        held.add(size)

    async def read_requests() -> None:
        try:
            async for request in requests:
                await held.room()
                size = weigh(request)
                held.add(size)
                task = asyncio.ensure_future(handle(request))
                task.add_done_callback(weigh_answer)
                await pending.put((task, size))
        finally:
            await pending.put(None)  # the writer stops here; `await reader` then re-raises any error

    reader = asyncio.create_task(read_requests())
    try:
        while (started := await pending.get()) is not None:
            task, size = started
            result = await task
            weighed = answer_bytes.pop(task, None)  # None: done, its callback not run yet (it will not count it)
            if weighed is None:
                answer_bytes[task] = _TAKEN
            held.release(size + (weighed or 0))
            yield result
        await reader
    finally:
        reader.cancel()
        while not pending.empty():
            if (left := pending.get_nowait()) is not None:
                left[0].cancel()
