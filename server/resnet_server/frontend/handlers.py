"""Every gRPC method's handler as it is registered: its request bounded (resnet_server.frontend.bounds) before it
is parsed, the call's request id made current, and what it raises answered with the status code its kind maps to.
The servicers only translate messages and raise.

gRPC calls a method's request deserializer on the event loop and answers UNKNOWN when it raises, so the bounded
reader returns a :class:`Refused` in place of the request, and the method's behaviour, wrapped here, answers it
(INVALID_ARGUMENT over a bound, RESOURCE_EXHAUSTED over the message limit; a stream ends with it) without
running.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor

from resnet_client.invalid_images import INVALID_IMAGES_KEY  # the client reads it; it installs without torch
from resnet_server.common.errors import ErrorKind, InvalidImages, ServingError, caller_error
from resnet_server.common.logs import current_request
from resnet_server.frontend.bounds import OverBound, WireBounds, check
from resnet_server.frontend.request_ids import call_id

log = logging.getLogger(__name__)


class Refused(ServingError):
    """A request refused unread, in place of the request: why, and its kind."""


def answered_error(exc: BaseException) -> tuple[ErrorKind, str]:
    """The kind and caller-safe message for ``exc``, whichever protocol answers it; one not raised on purpose is
    logged with the current request id, which its message gives the caller."""
    kind, message = caller_error(exc)
    if not isinstance(exc, ServingError):
        rid = current_request.get()
        log.error("request %s failed unexpectedly", rid, exc_info=exc)
        message = f"{message} (request id {rid})"
    return kind, message


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and caller-safe message for ``exc`` (answered_error's)."""
    kind, message = answered_error(exc)
    return grpc.StatusCode[kind.name], message


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with ``exc``'s status (raises, as context.abort does)."""
    remaining = context.time_remaining()
    if context.done() or (remaining is not None and remaining <= 0):
        # The caller is gone (cancelled, or its deadline passed): there is no one to answer, and
        # grpc refuses to send a status on a finished call.
        raise asyncio.CancelledError(f"request {current_request.get()} ended before its answer") from exc
    if isinstance(exc, InvalidImages):  # beside what is set already (a traceparent)
        context.set_trailing_metadata((*(context.trailing_metadata() or ()),
                                       (INVALID_IMAGES_KEY, ",".join(map(str, exc.reasons)))))
    await context.abort(*grpc_status(exc))


def registered(handler: grpc.RpcMethodHandler, request: Descriptor, bounds: WireBounds,
               most_bytes: int | None = None) -> grpc.RpcMethodHandler:
    """``handler`` (one method's, as the generated code makes it) with its requests checked against ``bounds``
    and against ``most_bytes`` where the server's message limit is set higher for another method, and its errors
    answered as status codes."""
    read = handler.request_deserializer

    def read_bounded(data: bytes) -> object:
        if most_bytes is not None and len(data) > most_bytes:
            return Refused(f"the request holds {len(data)} bytes, over the limit of {most_bytes} "
                           "(--max-message-mb)", ErrorKind.RESOURCE_EXHAUSTED)
        try:
            check(request, data, bounds)
        except OverBound as exc:
            return Refused(str(exc), ErrorKind.INVALID_ARGUMENT)
        return read(data) if read is not None else data

    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")
    behaviour = getattr(handler, kind)
    wrap = _stream_requests if handler.request_streaming else _unary_request
    return handler._replace(request_deserializer=read_bounded, **{kind: wrap(behaviour)})  # type: ignore[attr-defined]


def _unary_request(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def run(request: object, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Refused):
            raise request
        return behaviour(request, context)
    return _answering(run, inspect.isasyncgenfunction(behaviour))


def _stream_requests(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    def run(requests: AsyncIterator[object], context: grpc.aio.ServicerContext) -> Any:
        return behaviour(_checked(requests), context)
    return _answering(run, inspect.isasyncgenfunction(behaviour))


async def _checked(requests: AsyncIterator[object]) -> AsyncIterator[object]:
    async for request in requests:
        if isinstance(request, Refused):
            raise request
        yield request


def _answering(run: Callable[..., Any], streams_answers: bool) -> Callable[..., Any]:
    """The method's behaviour as gRPC calls it: the request id made current, an error answered as its status."""
    if streams_answers:
        async def answers(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
            call_id(context)
            try:
                async for response in run(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - answered as its status
                await abort_with(context, exc)
        return answers

    async def answer(request: object, context: grpc.aio.ServicerContext) -> object:
        call_id(context)
        try:
            return await run(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - answered as its status
            await abort_with(context, exc)
            raise  # abort raises; this line only satisfies type checkers
    return answer
