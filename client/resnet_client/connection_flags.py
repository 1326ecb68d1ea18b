"""The flags that say which server to reach and how, shared by every resnet-client command."""

from __future__ import annotations

import argparse
import os

from .channel import DEFAULT_ATTEMPTS, DEFAULT_PORT
from .client import Client
from .flags import int_between, positive_float

SERVER_ENV = "RESNET_CLIENT_SERVER"


DEFAULT_SERVER = "localhost:50051"


DEFAULT_TIMEOUT = 30.0


# A load generator reports every failure as it happens: no retries unless asked for.
BENCH_ATTEMPTS = 1


TOKEN_ENV = "RESNET_CLIENT_TOKEN"


def add_connection_flags(parser: argparse.ArgumentParser, attempts: int = DEFAULT_ATTEMPTS,
                         attempts_default_text: str | None = None) -> None:
    """The connection flags, on the top-level parser and on each subcommand's, so they may come before or
    after the subcommand (after wins). Each defaults to SUPPRESS: argparse copies every attribute of a
    subcommand's namespace over the top level's, defaults included, which would undo a flag given before
    it; ``parse_args`` supplies the defaults after parsing."""
    parser.add_argument("--server", default=argparse.SUPPRESS,
                        help=f"host[:port], a comma-separated list of IP[:port], or dns:///name[:port]; the port "
                             f"is {DEFAULT_PORT} unless given (default: env {SERVER_ENV}, else {DEFAULT_SERVER})")
    parser.add_argument("--timeout", type=positive_float, default=argparse.SUPPRESS,
                        help=f"seconds per call (default {DEFAULT_TIMEOUT})")
    parser.add_argument("--tls-ca", default=argparse.SUPPRESS,
                        help="CA certificate (PEM) that signed the server's certificate; enables TLS")
    parser.add_argument("--tls-cert", default=argparse.SUPPRESS, help="client certificate (PEM) for mutual TLS")
    parser.add_argument("--tls-key", default=argparse.SUPPRESS, help="client private key (PEM) for mutual TLS")
    parser.add_argument("--token", default=argparse.SUPPRESS,
                        help=f"bearer token sent as 'authorization: Bearer ...' (default: env {TOKEN_ENV})")
    parser.add_argument("--attempts", type=int_between(1, 5), default=argparse.SUPPRESS, metavar="1-5",
                        help="tries per call when a server answers UNAVAILABLE, each on the next server "
                             f"(default {attempts_default_text or attempts}; 1: no retries)")
    parser.set_defaults(default_attempts=attempts)


def fill_connection_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Give each connection flag given neither before nor after the subcommand its default."""
    defaults = {"server": os.environ.get(SERVER_ENV, DEFAULT_SERVER), "timeout": DEFAULT_TIMEOUT, "tls_ca": None,
                "tls_cert": None, "tls_key": None, "token": os.environ.get(TOKEN_ENV),
                "attempts": args.default_attempts}
    for name, value in defaults.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def connection(args: argparse.Namespace) -> dict:
    """The connection flags as keyword arguments of Client and AsyncClient (all but the target)."""
    return {"timeout": args.timeout, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert, "tls_key": args.tls_key,
            "token": args.token, "attempts": args.attempts}


def connect(args: argparse.Namespace, trace: bool = False) -> Client:
    return Client(args.server, **connection(args), trace=trace)
