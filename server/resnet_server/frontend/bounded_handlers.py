"""Every gRPC method's handler with its request bounded (server.frontend.bounds) before it is parsed.

gRPC calls a method's request deserializer on the event loop and answers UNKNOWN when it raises, so the bounded
reader returns a :class:`Refused` in place of the request, and the method's behaviour, wrapped here, answers it
(INVALID_ARGUMENT over a bound, RESOURCE_EXHAUSTED over the message limit; a stream ends with it) without
running.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor

from resnet_server.common.errors import ServingError
from resnet_server.frontend.bounds import OverBound, WireBounds, check


class Refused:
    """A request refused unread: its status code, and why."""

    __slots__ = ("code", "reason")

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        self.code, self.reason = code, reason


class _RefusedInStream(ServingError):
    """A stream's message was refused: the stream ends with its code (a servicer that maps its errors itself
    maps this one too)."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.reason)
        self.code = refused.code


def bounded(handler: grpc.RpcMethodHandler, request: Descriptor, bounds: WireBounds,
            most_bytes: int | None = None) -> grpc.RpcMethodHandler:
    """``handler`` (one method's, as the generated code makes it) with its requests checked against ``bounds``,
    and against ``most_bytes`` where the server's message limit is set higher for another method."""
    read = handler.request_deserializer

    def read_bounded(data: bytes) -> object:
        if most_bytes is not None and len(data) > most_bytes:
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the request holds {len(data)} bytes, over the "
                           f"limit of {most_bytes} (--max-message-mb)")
        try:
            check(request, data, bounds)
        except OverBound as exc:
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return read(data) if read is not None else data

    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")
    behaviour = getattr(handler, kind)
    wrap = _stream_requests if handler.request_streaming else _unary_request
    return handler._replace(request_deserializer=read_bounded, **{kind: wrap(behaviour)})  # type: ignore[attr-defined]


def _unary_request(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behaviour):
        async def answers(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            if isinstance(request, Refused):
                await context.abort(request.code, request.reason)
            async for response in behaviour(request, context):
                yield response
        return answers

    async def answer(request: object, context: grpc.aio.ServicerContext) -> object:
        if isinstance(request, Refused):
            await context.abort(request.code, request.reason)
        return await behaviour(request, context)
    return answer


def _stream_requests(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def checked(requests: AsyncIterator[object]) -> AsyncIterator[object]:
        async for request in requests:
            if isinstance(request, Refused):
                raise _RefusedInStream(request)
            yield request

    if inspect.isasyncgenfunction(behaviour):
        async def answers(requests: AsyncIterator[object], context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[object]:
            try:
                async for response in behaviour(checked(requests), context):
                    yield response
            except _RefusedInStream as refused:
                await context.abort(refused.code, str(refused))
        return answers

    async def answer(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> object:
        try:
            return await behaviour(checked(requests), context)
        except _RefusedInStream as refused:
            await context.abort(refused.code, str(refused))
    return answer
