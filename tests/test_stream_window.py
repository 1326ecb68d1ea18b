"""A stream's window bounds the requests it has started and the bytes they and their answers hold, so a client
that sends and never reads pins a bounded amount of the server's memory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from resnet_server.frontend.streams import STREAM_WINDOW, STREAM_WINDOW_BYTES, in_order


class Answer:
    def __init__(self, number: int, size: int) -> None:
        self.number, self.size = number, size

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        return self.size


async def numbers(count: int) -> AsyncIterator[int]:
    """Requests as gRPC hands them over: each message a turn of the loop."""
    for number in range(count):
        await asyncio.sleep(0)
        yield number


async def settle() -> None:
    """Let every task that can run, run (no time passes)."""
    for _ in range(100):
        await asyncio.sleep(0)


async def test_large_answers_stop_the_reading_at_the_byte_bound():
    started: list[int] = []

    async def handle(number: int) -> Answer:
        started.append(number)
        return Answer(number, STREAM_WINDOW_BYTES // 4)

    answers = in_order(numbers(200), handle)
    assert (await anext(answers)).number == 0
    await settle()
    assert len(started) <= 7  # four answers fill the window; one more starts before the first is weighed
    rest = [answer.number async for answer in answers]
    assert rest == list(range(1, 200))


async def test_large_requests_count_too_and_one_always_goes():
    started: list[int] = []

    async def handle(number: int) -> Answer:
        started.append(number)
        return Answer(number, 10)

    answers = in_order(numbers(10), handle, weigh=lambda _: STREAM_WINDOW_BYTES * 2)
    assert (await anext(answers)).number == 0
    await settle()
    assert len(started) == 2  # each over the bound alone: one more starts once the first is taken
    assert [answer.number async for answer in answers] == list(range(1, 10))


async def test_small_answers_are_bounded_by_count():
    started: list[int] = []
    gate = asyncio.Event()

    async def handle(number: int) -> Answer:
        started.append(number)
        await gate.wait()
        return Answer(number, 10)

    answers = in_order(numbers(500), handle)
    first = asyncio.ensure_future(anext(answers))
    await settle()
    # The one being answered, the window's queue behind it, and the one its reader holds.
    assert len(started) == STREAM_WINDOW + 2
    gate.set()
    assert (await first).number == 0
    assert [answer.number async for answer in answers] == list(range(1, 500))
