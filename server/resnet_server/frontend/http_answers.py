"""Every HTTP route's call as it is answered: the protocol and request id made current, its bearer token checked,
its body read within the size limit and a deadline, and what it raises answered as the HTTP status its kind maps
to, with ``{"error": "..."}``: the HTTP twin of resnet_server.frontend.handlers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
from aiohttp import web

from resnet_server.common.errors import ErrorKind, InvalidImages
from resnet_server.common.logs import current_protocol
from resnet_server.frontend.handlers import answered_error
from resnet_server.frontend.request_ids import call_id
from resnet_server.frontend.security import token_is_valid

# One mapping from a domain error's kind to the HTTP status a client expects (gRPC's is by name).
HTTP_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 400, ErrorKind.FAILED_PRECONDITION: 400, ErrorKind.UNAUTHENTICATED: 401,
    ErrorKind.PERMISSION_DENIED: 403, ErrorKind.NOT_FOUND: 404, ErrorKind.ALREADY_EXISTS: 409,
    ErrorKind.RESOURCE_EXHAUSTED: 429, ErrorKind.INTERNAL: 500, ErrorKind.UNIMPLEMENTED: 501,
    ErrorKind.UNAVAILABLE: 503, ErrorKind.DEADLINE_EXCEEDED: 504,
}
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready"})  # orchestrators' probes carry no token
BODY_SECONDS = 30.0  # a body still arriving after this is a slow client's: refused (408), its slot freed
JSON = "application/json"


class HttpContext:
    """What the servicer methods read of a gRPC call's context, from an HTTP request: its headers as metadata
    (token, x-request-id, traceparent), no deadline, and the metadata they answer with, sent back as headers."""

    def __init__(self, request: web.Request) -> None:
        self._metadata = [(key.lower(), value) for key, value in request.headers.items()]
        self._peer = request.transport.get_extra_info("peername") if request.transport is not None else ""
        self.answered: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def set_trailing_metadata(self, pairs: Iterable[tuple[str, str]]) -> None:
        self.answered = list(pairs)

    def trailing_metadata(self) -> list[tuple[str, str]]:
        return self.answered

    def done(self) -> bool:
        return False

    def peer(self) -> str:
        """The client's address as gRPC writes a peer (``ipv4:HOST:PORT``, ``ipv6:[HOST]:PORT``)."""
        address = self._peer
        if not isinstance(address, tuple):
            return f"unix:{address}"
        host, port = address[0], address[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


CONTEXT = web.RequestKey("context", HttpContext)  # where the middleware keeps a request's HttpContext


def error_response(exc: BaseException) -> web.Response:
    """``exc`` answered with its kind's status; one not raised on purpose is logged with the request id, which its
    message gives the caller."""
    kind, message = answered_error(exc)
    body: dict[str, Any] = {"error": message}
    if isinstance(exc, InvalidImages):
        body["invalid_images"] = list(exc.reasons)
    return web.json_response(body, status=HTTP_STATUS[kind], dumps=dumps)


def dumps(value: object) -> str:
    return msgspec.json.encode(value).decode()


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused (413) from its Content-Length before it is read when it is over ``limit``, and read with a
    deadline (408), so that a slow client holds a connection no longer."""
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit, request.content_length)
    try:
        body = await asyncio.wait_for(request.read(), BODY_SECONDS)  # at most the application's client_max_size
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=dumps({"error": f"the body did not arrive within {BODY_SECONDS:g}s"}),
                                     content_type=JSON) from None
    if len(body) > limit:  # chunked, with no Content-Length to say so first
        raise _too_large(limit, len(body))
    return body


def _too_large(limit: int, size: int) -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size, content_type=JSON, text=dumps(
        {"error": f"the body holds {size} bytes, over the limit of {limit} (--max-message-mb)"}))


def context_of(request: web.Request) -> HttpContext:
    """The request's HttpContext, made once by the middleware for every route."""
    context: HttpContext = request[CONTEXT]
    return context


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middlewares(tokens: list[bytes], protect_health: bool) -> list:
    @web.middleware
    async def answered(request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route's call: the protocol and request id made current, its token checked, what it raises
        answered as its status."""
        current_protocol.set("http")
        context = request[CONTEXT] = HttpContext(request)
        call_id(context)  # type: ignore[arg-type]  # reads its metadata as gRPC's context
        if tokens and (protect_health or request.path not in OPEN_PATHS) and \
                not token_is_valid([("authorization", request.headers.get("Authorization", ""))], tokens):
            return web.json_response({"error": "missing or invalid bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"}, dumps=dumps)
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own (no route, wrong method) answered as JSON too
            if exc.content_type == JSON:
                raise
            return web.json_response({"error": exc.reason}, status=exc.status, headers={
                key: value for key, value in exc.headers.items() if key.lower() == "allow"}, dumps=dumps)
        except Exception as exc:  # noqa: BLE001 - answered as its status
            return error_response(exc)
    return [answered]
