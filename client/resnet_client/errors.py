"""The one exception type of the client: it carries the gRPC status code and the server's message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import grpc

from resnet_client.invalid_images import INVALID_IMAGES_KEY, reasons_given


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


def _invalid_images(error: grpc.RpcError, message: str) -> dict[int, str]:
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    # (key, value) pairs, whichever API made them; grpc-stubs types each as a _Metadatum, which only the sync one is.
    pairs = cast("Sequence[tuple[str, str]]", trailers or ())
    return reasons_given(next((value for key, value in pairs if key == INVALID_IMAGES_KEY), ""), message)
