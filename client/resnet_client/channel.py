"""Channel construction shared by Client and AsyncClient: targets, balancing, TLS, token, limits."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_PORT = 50051
DEFAULT_TARGET = f"localhost:{DEFAULT_PORT}"
# Targets gRPC resolves itself, with no host and port to complete.
_NO_PORT_SCHEMES = ("unix:", "unix-abstract:", "vsock:")
DEFAULT_ATTEMPTS = 3
# How soon a lost connection is tried again: 0.1 s, then growing (x1.6, with jitter) up to 5 s, where gRPC's
# defaults are 1 s and 120 s; meanwhile round_robin fails calls at once. When a server's front-end dies,
# the reconnect can land on its listener before that closes and be reset: with the defaults a closed loop then
# failed for about a second (docs/operations.md). And 120 s would keep a client away from a server that
# is back for up to two minutes.
RECONNECT_BACKOFF = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 5000)]


@dataclass(frozen=True)
class ChannelConfig:
    """Where and how to connect. Several targets, or a DNS name with several addresses, are balanced
    per call with gRPC's round_robin policy (one HTTP/2 connection to each replica).

    A classifier call that gets UNAVAILABLE (a server still loading, draining, or left with no healthy
    replica) is retried by gRPC itself, up to ``attempts`` tries in all, and round_robin sends each try to
    the next server. Classification has no side effects, so a retry is always safe; RESOURCE_EXHAUSTED
    (overload) is not retried, so that a busy fleet is not sent more work."""

    targets: Sequence[str] = (DEFAULT_TARGET,)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token: str | None = None
    attempts: int = DEFAULT_ATTEMPTS  # 1: no retries
    # gRPC shares one connection among the channels of a process that name the same target with the same
    # options; a client with its own opens its own, so that several spread over a server's front-end processes
    # (the kernel hands each new connection to one of them).
    own_connection: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.attempts <= 5:  # gRPC's own ceiling is 5 tries
            raise ValueError(f"attempts must be between 1 and 5, got {self.attempts}")

    @property
    def target(self) -> str:
        if len(self.targets) == 1:
            return self.targets[0]
        # gRPC's static address list resolver: ipv4:host:port,host:port (IP addresses only).
        return "ipv4:" + ",".join(self.targets)

    def options(self) -> list[tuple[str, object]]:
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.service_config", json.dumps(self.service_config())),
            # A call is retried only while its request is still buffered (256 KiB by default): keep whole
            # requests, so that a many-image call is retried too.
            ("grpc.per_rpc_retry_buffer_size", MAX_MESSAGE_BYTES),
            *([("grpc.use_local_subchannel_pool", 1)] if self.own_connection else []),
            *RECONNECT_BACKOFF,
        ]

    def service_config(self) -> dict:
        config: dict = {"loadBalancingConfig": [{"round_robin": {}}]}
        if self.attempts > 1:
            config["methodConfig"] = [{
                "name": [{"service": "resnet.v1.Classifier"}],
                "retryPolicy": {"maxAttempts": self.attempts, "initialBackoff": "0.05s", "maxBackoff": "1s",
                                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
            }]
        return config

    def credentials(self) -> grpc.ChannelCredentials | None:
        """None for plaintext; TLS (optionally with a client certificate) and/or a bearer token otherwise."""
        if not (self.tls_ca or self.tls_cert):
            return None
        channel = grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca), private_key=_read(self.tls_key),
            certificate_chain=_read(self.tls_cert))
        if self.token:
            token = grpc.access_token_call_credentials(self.token)
            return grpc.composite_channel_credentials(channel, token)
        return channel

    def metadata(self) -> list[tuple[str, str]]:
        """A token over plaintext cannot use call credentials (gRPC refuses them without TLS)."""
        if self.token and self.credentials() is None:
            return [("authorization", f"Bearer {self.token}")]
        return []


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def parse_targets(target: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(target, str):
        target = [part.strip() for part in target.split(",") if part.strip()]
    return tuple(with_default_port(part) for part in target) or (DEFAULT_TARGET,)


def with_default_port(target: str) -> str:
    """``target`` with DEFAULT_PORT where it names no port: gRPC's own default is 443 (HTTPS)."""
    if target.startswith(_NO_PORT_SCHEMES):
        return target
    scheme, address = ("dns:///", target.removeprefix("dns:///")) if target.startswith("dns:///") else ("", target)
    if scheme == "" and target.startswith(("ipv4:", "ipv6:", "dns:")):
        return target  # a resolver's own syntax: left as written
    if address.startswith("["):  # [IPv6] or [IPv6]:port
        has_port = "]:" in address
    else:
        has_port = address.count(":") == 1
        address = address if address.count(":") < 2 else f"[{address}]"  # a bare IPv6 address
    if not has_port:
        return f"{scheme}{address}:{DEFAULT_PORT}"
    port = address.rsplit(":", 1)[1]
    # gRPC would take 99999 as 99999 mod 65536: another port, and a baffling refusal from it.
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"{target!r}: the port must be a number from 1 to 65535")
    return scheme + address
