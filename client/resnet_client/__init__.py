"""Light client for the ResNet18 gRPC service (grpcio and protobuf only; no torch)."""

from .client import AsyncClient, Client
from .errors import ClassifierError
from .files import FileError, classify_files
from .messages import Classification, ClassScore
from .shared_memory import SharedMemory

__all__ = ["AsyncClient", "Client", "ClassifierError", "Classification", "ClassScore", "FileError", "SharedMemory",
           "classify_files"]
