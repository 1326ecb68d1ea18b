"""resnet-server's entry point, importing nothing of the server until its packages are known to be there.

pip installs every console script of a distribution whatever extras were asked for, so a client-only install
(``pip install resnet-grpc``) has this command too: it says in one line what to install instead of failing
on an import deep in the server.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# What the server extra brings that the client's own install does not.
SERVER_MODULES = ("torch", "torchvision", "prometheus_client", "grpc_reflection", "PIL")


def missing_modules() -> list[str]:
    missing = []
    for name in SERVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    if missing := missing_modules():
        print(f"resnet-server: error: this install has the client only (no {', '.join(missing)}); the server "
              "needs its extra: pip install 'resnet-grpc[server]'", file=sys.stderr)
        return 1
    from .app import main as serve  # after the check: its imports need the server's packages

    return serve(argv)
