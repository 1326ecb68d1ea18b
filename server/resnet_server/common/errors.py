"""Domain exceptions, each of a kind a caller can act on; no transport here.

The core (preprocessing, batching, replicas) raises these and knows nothing of gRPC or HTTP; each front-end maps
a kind to its own status once, where its methods are registered (resnet_server.frontend.answers for gRPC).
Anything else is INTERNAL with a generic message, so no internals leak to callers (the details go to the log
with the request id).
"""

from __future__ import annotations

import asyncio
import enum

from resnet_client.invalid_images import invalid_images_message  # the wire format, beside the client's reader of it


class ErrorKind(enum.Enum):
    """What went wrong for the caller. The names are gRPC's status codes, which the kinds map to one for one."""

    INVALID_ARGUMENT = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    NOT_FOUND = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    PERMISSION_DENIED = enum.auto()
    UNAUTHENTICATED = enum.auto()
    ALREADY_EXISTS = enum.auto()
    UNIMPLEMENTED = enum.auto()
    UNAVAILABLE = enum.auto()
    INTERNAL = enum.auto()


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says why, in one line."""


class ServingError(Exception):
    """Base of every error a caller may see; its message is safe to send. ``kind``: its class's, unless given
    (an error the supervisor answered, of the kind it names)."""

    kind = ErrorKind.INTERNAL

    def __init__(self, message: str = "", kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class InvalidInput(ServingError):
    kind = ErrorKind.INVALID_ARGUMENT


class InvalidImages(InvalidInput):
    """Some images of a request are invalid: each one's reason, by its position in the request. The request
    is refused as a whole; the caller learns which images to drop (resnet_client.invalid_images' ``INVALID_IMAGES_KEY``
    trailer) and may send the others again."""

    def __init__(self, reasons: dict[int, str], total: int) -> None:
        self.reasons = dict(sorted(reasons.items()))
        super().__init__(invalid_images_message(self.reasons, total))


class Overloaded(ServingError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class OverShare(Overloaded):
    """The caller holds its share of a device's queue (--fair-share): others' calls are still taken."""


class DeadlineExpired(ServingError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class NotFound(ServingError):
    kind = ErrorKind.NOT_FOUND


class FailedPrecondition(ServingError):
    kind = ErrorKind.FAILED_PRECONDITION


class PermissionDenied(ServingError):
    kind = ErrorKind.PERMISSION_DENIED


class AlreadyExists(ServingError):
    kind = ErrorKind.ALREADY_EXISTS


class Unimplemented(ServingError):
    kind = ErrorKind.UNIMPLEMENTED


class Unavailable(ServingError):
    kind = ErrorKind.UNAVAILABLE


class ComputeFailed(ServingError):
    """A batch failed on the device; the message is generic on purpose."""

    kind = ErrorKind.INTERNAL


INTERNAL_MESSAGE = "internal error while serving the request"


def caller_error(exc: BaseException) -> tuple[ErrorKind, str]:
    """The kind and caller-safe message of any exception."""
    if isinstance(exc, ServingError):
        return exc.kind, str(exc) or exc.kind.name
    return ErrorKind.INTERNAL, INTERNAL_MESSAGE


def outcome(exc: BaseException) -> str:
    """How a call that raised ``exc`` ended, as metrics and spans name it: its kind's name, or CANCELLED."""
    return "CANCELLED" if isinstance(exc, asyncio.CancelledError) else caller_error(exc)[0].name
