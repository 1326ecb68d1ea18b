"""Domain exceptions, and the one place that maps them to gRPC status codes.

The core (preprocessing, batching, replicas) raises these and knows nothing of gRPC; the
servicers call :func:`status_for` to answer. Anything else becomes INTERNAL with a generic
message, so no internals leak to callers (the details go to the log with the request id).
"""

from __future__ import annotations

import grpc

from resnet_client.errors import invalid_images_message  # the wire format, beside the client's reader of it


class StartupError(RuntimeError):
    """The server cannot start as configured; the message says why, in one line."""


class ServingError(Exception):
    """Base of every error a caller may see; its message is safe to send."""

    code = grpc.StatusCode.INTERNAL


class InvalidInput(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class InvalidImages(InvalidInput):
    """Some images of a request are invalid: each one's reason, by its position in the request. The request
    is refused as a whole; the caller learns which images to drop (client.errors' ``INVALID_IMAGES_KEY``
    trailer) and may send the others again."""

    def __init__(self, reasons: dict[int, str], total: int) -> None:
        self.reasons = dict(sorted(reasons.items()))
        super().__init__(invalid_images_message(self.reasons, total))


class Overloaded(ServingError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExpired(ServingError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServingError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(ServingError):
    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(ServingError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unimplemented(ServingError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Unavailable(ServingError):
    code = grpc.StatusCode.UNAVAILABLE


class ComputeFailed(ServingError):
    """A batch failed on the device; the message is generic on purpose."""

    code = grpc.StatusCode.INTERNAL


INTERNAL_MESSAGE = "internal error while serving the request"


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and caller-safe message for any exception."""
    if isinstance(exc, ServingError):
        return exc.code, str(exc) or exc.code.name
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
