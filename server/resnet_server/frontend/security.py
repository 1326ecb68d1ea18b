"""Transport security and caller authentication: TLS / mutual TLS credentials and bearer tokens.

Tokens are compared in constant time (``hmac.compare_digest``) against every configured token.
The health service stays open unless ``--auth-health`` is set, because orchestrator probes
carry no token.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

import grpc

from resnet_server.common.config import tls_problem
from resnet_server.common.errors import StartupError
from resnet_server.common.flag_files import TokenEntry, read_token_entries

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def server_credentials(cert: str | None, key: str | None, client_ca: str | None) -> grpc.ServerCredentials | None:
    """None for plaintext; TLS with --tls-cert/--tls-key; mutual TLS (client certificates required) with
    --tls-client-ca."""
    if problem := tls_problem(cert, key, client_ca):
        raise StartupError(problem)
    if not (cert and key):  # tls_problem has refused one without the other
        return None
    try:
        pair = (Path(key).read_bytes(), Path(cert).read_bytes())
        ca = Path(client_ca).read_bytes() if client_ca else None
    except OSError as exc:
        raise StartupError(f"cannot read TLS material: {exc}") from None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def load_tokens(path: str | None) -> list[TokenEntry]:
    """The token file's entries (resnet_server.common.flag_files.read_token_entries); none without a file."""
    if not path:
        return []
    try:
        return read_token_entries(path)
    except ValueError as exc:
        raise StartupError(f"--auth-token-file: {exc}") from None


def presented_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes:
    """The bearer token a call carries (b"" for none). Whitespace around the value is not part of it (Triton's
    perf_analyzer sends ``-H "authorization: Bearer alpha"`` as " Bearer alpha"), and the scheme's name is
    case-insensitive (RFC 7235)."""
    presented = b""
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer":
                presented = token.strip().encode()
    return presented


def token_is_valid(metadata: Iterable[tuple[str, str | bytes]] | None, tokens: list[bytes]) -> bool:
    presented = presented_token(metadata)
    # Compare against every token, always, so timing says nothing about which (if any) matched.
    matches = [hmac.compare_digest(presented, token) for token in tokens]
    return bool(presented) and any(matches)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid ``authorization: Bearer <token>`` with UNAUTHENTICATED."""

    def __init__(self, tokens: list[bytes], protect_health: bool) -> None:
        self._tokens = tokens
        self._protect_health = protect_health

    async def intercept_service(self, continuation, handler_call_details):
        open_call = not self._protect_health and handler_call_details.method.startswith(HEALTH_PREFIX)
        if open_call or token_is_valid(handler_call_details.invocation_metadata, self._tokens):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape (unary or streaming) that answers UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

    async def streaming(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        yield  # pragma: no cover - makes this an async generator

    if handler is None or (not handler.request_streaming and not handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(unary)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_stream_rpc_method_handler(streaming)
