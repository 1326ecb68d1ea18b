"""Light client for the ResNet18 gRPC service (grpcio and protobuf only; no torch).

The names below load on first use (PEP 562), so that importing one module of the package, as the server does
with ``resnet_client.invalid_images`` (the wire format of a refused batch, beside the client's reader of it),
imports no grpc into a process that speaks none."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .errors import ClassifierError
    from .files import FileError, classify_files
    from .messages import Classification, ClassScore
    from .shared_memory import SharedMemory

_MODULE_OF = {"AsyncClient": "client", "Client": "client", "ClassifierError": "errors", "FileError": "files",
              "classify_files": "files", "Classification": "messages", "ClassScore": "messages",
              "SharedMemory": "shared_memory"}
__all__ = ["AsyncClient", "Client", "ClassifierError", "Classification", "ClassScore", "FileError", "SharedMemory",
           "classify_files"]


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
