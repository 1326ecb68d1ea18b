"""The one exception type of the client: it carries the gRPC status code and the server's message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import grpc

# Trailing metadata of a request refused for some of its images: their positions, comma-separated. The status
# message says why, a line ``images[i]: reason`` each (or just the reason, for a request of one image).
INVALID_IMAGES_KEY = "resnet-invalid-images"


class ClassifierError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, invalid_images: dict[int, str] | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        # For INVALID_ARGUMENT from a server that names them: each invalid image's reason, by its position in
        # the request; the other images were valid and were not run.
        self.invalid_images = invalid_images or {}

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> ClassifierError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        details = (error.details() if hasattr(error, "details") else str(error)) or ""
        return cls(code or grpc.StatusCode.UNKNOWN, details, _invalid_images(error, details))


REASONS_LISTED = 8  # a status message travels in a trailer too, whose size gRPC limits (8 KiB by default)


def invalid_images_message(reasons: dict[int, str], total: int) -> str:
    """The status message of a request refused for some of its ``total`` images (the server writes it, and
    ``_invalid_images`` reads it back): a lone image's reason as it is; otherwise a line per invalid image,
    ``images[i]: reason``, under a count when there are several."""
    if total == 1:
        return next(iter(reasons.values()))
    lines = [f"images[{index}]: {reason}" for index, reason in list(reasons.items())[:REASONS_LISTED]]
    if len(reasons) > REASONS_LISTED:
        lines.append(f"... and {len(reasons) - REASONS_LISTED} more")
    head = [] if len(reasons) == 1 else [f"{len(reasons)} of {total} images are invalid"]
    return "\n".join(head + lines)


def _invalid_images(error: grpc.RpcError, message: str) -> dict[int, str]:
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    # (key, value) pairs, whichever API made them; grpc-stubs types each as a _Metadatum, which only the sync one is.
    pairs = cast("Sequence[tuple[str, str]]", trailers or ())
    listed = next((value for key, value in pairs if key == INVALID_IMAGES_KEY), "")
    positions = [int(text) for text in listed.split(",") if text.strip().isdigit()]
    if len(positions) == 1 and not message.startswith("images["):  # a lone image: the message is its reason
        return {positions[0]: message}
    reasons = {}
    for line in message.splitlines():
        head, _, reason = line.partition("]: ")
        if head.startswith("images[") and head[7:].isdigit():
            reasons[int(head[7:])] = reason
    return {position: reasons.get(position, message) for position in positions}
