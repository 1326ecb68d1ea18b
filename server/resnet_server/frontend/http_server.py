"""The HTTP listener of a front-end: aiohttp on the running event loop (uvloop, as gRPC's), on a socket bound
here so that front-ends share the port (SO_REUSEPORT) only among themselves, with the gRPC port's TLS."""

from __future__ import annotations

import socket
import ssl

from aiohttp import web

from resnet_server.common.config import host_port
from resnet_server.common.errors import StartupError
from resnet_server.common.sections import Network
from resnet_server.frontend.http_answers import middlewares
from resnet_server.frontend.http_api import KEEPALIVE_SECONDS, HttpApi

MOST_HEADER_BYTES = 8190  # a request line's and a header's (aiohttp's own defaults, said here)
MOST_HEADERS = 128


def listening_socket(host: str, port: int, shared: bool) -> socket.socket:
    """A socket listening on ``host:port``, with SO_REUSEPORT where the front-ends share it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen for HTTP on {host_port(host, port)}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


def tls_context(network: Network) -> ssl.SSLContext | None:
    """The gRPC port's certificate and client CA (mutual TLS) for HTTPS, or None for plain HTTP."""
    if not (network.tls_cert and network.tls_key):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(network.tls_cert, network.tls_key)
        if network.tls_client_ca:
            context.load_verify_locations(network.tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"cannot use the TLS material for HTTP: {exc}") from None
    return context


class HttpListener:
    """One front-end's HTTP server; ``port`` once started."""

    def __init__(self, api: HttpApi, network: Network, shared: bool, tokens: list[bytes], grace: float) -> None:
        self._api, self._network, self._shared, self._grace = api, network, shared, grace
        application = web.Application(middlewares=middlewares(tokens, network.auth_health),
                                      client_max_size=max(api.most_body_bytes, api.most_load_bytes))
        application.add_routes(api.routes())
        self._runner = web.AppRunner(application, access_log=None, keepalive_timeout=KEEPALIVE_SECONDS,
                                     max_line_size=MOST_HEADER_BYTES, max_field_size=MOST_HEADER_BYTES,
                                     max_headers=MOST_HEADERS, shutdown_timeout=grace)
        self.port = 0

    async def start(self) -> int:
        sock = listening_socket(self._network.host, self._network.http_port, self._shared)
        self.port = sock.getsockname()[1]
        await self._runner.setup()
        await web.SockSite(self._runner, sock, ssl_context=tls_context(self._network)).start()
        return self.port

    async def stop(self) -> None:
        """Stop listening, let the calls in flight finish within the grace period, close the connections."""
        await self._runner.cleanup()
