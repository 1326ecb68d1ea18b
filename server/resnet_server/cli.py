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
    argv = list(sys.argv[1:] if argv is None else argv)
    # After the check: their imports need the server's packages.
    if argv[:1] == ["bench-model"]:
        from resnet_server.engine.bench_model import main as bench_model

        return bench_model(argv[1:])
    if argv[:1] == ["quantize"]:
        from resnet_server.engine.quantize import main as quantize

        return quantize(argv[1:])
    from resnet_server.supervisor.main import main as serve

    return serve(argv)
