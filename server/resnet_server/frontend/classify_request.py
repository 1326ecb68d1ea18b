"""A ClassifyRequest read from its wire bytes with each raw image's pixels left where gRPC put them.

``resnet_server.frontend.wire`` takes the ``images`` out of the request and each ``RawTensor``'s ``data`` out of its
tensor as memoryviews of the request's own bytes; protobuf parses the rest (temperature, top_k, the flags, a tensor's
dtype and shape, unknown fields). An image whose oneof is set twice (protobuf keeps the last, or merges two
tensors) and anything ``resnet_server.frontend.wire`` refuses go to protobuf's own parse of the whole request. It
saves the event loop CPU on every call (docs/performance.md, "Figures behind the code").
"""

from __future__ import annotations

from typing import NamedTuple

from resnet_client.api import classifier_pb2 as pb
from resnet_server.common.preprocess import EncodedImage, ImageInput, RawImage
from resnet_server.frontend.wire import (
    LENGTH_DELIMITED,
    MOST_OTHER_FIELDS,
    TooMany,
    Unreadable,
    WireError,
    fields,
    parse_whole,
    pull_out,
)

DTYPES = {pb.RawTensor.UINT8: "uint8", pb.RawTensor.FLOAT32: "float32"}
_IMAGES = 1  # ClassifyRequest.images
_ENCODED, _RAW = 1, 2  # Image's oneof
_DATA = 3  # RawTensor.data


class ReadRequest(NamedTuple):
    """The images, ready for the core, and the request's other fields (its ``images`` left empty); or why the
    request is refused unread: bytes that are no ClassifyRequest (protobuf's reason), or more images than a
    request may hold (the servicer answers INVALID_ARGUMENT: gRPC's own answer to a deserializer that raises is
    UNKNOWN, and an error in its log)."""

    images: list[ImageInput]
    fields: pb.ClassifyRequest
    unreadable: str | None = None

    def size(self) -> int:
        """The bytes it holds: its images'."""
        return sum(len(image.data) for image in self.images)


def too_many_images(most: int) -> str:
    return f"request has more than {most} images, the limit of {most} (--max-images-per-request)"


def read_classify_request(data: bytes, max_images: int) -> ReadRequest:
    """gRPC's request deserializer for Classify and ClassifyStream (bound to the server's image limit). It runs
    on the event loop, so it reads no further than ``max_images`` images (resnet_server.frontend.wire)."""
    view = memoryview(data)
    try:
        request, images = pull_out(pb.ClassifyRequest, view, 0, len(view), _IMAGES, max_images)
        return ReadRequest([_image(image) for image in images], request)
    except TooMany:
        return _refused(too_many_images(max_images))
    except WireError as exc:
        walk_error = exc
    try:
        request = parse_whole(pb.ClassifyRequest, data, walk_error)
    except Unreadable as exc:
        return _refused(str(exc))
    if len(request.images) > max_images:
        return _refused(too_many_images(max_images))
    return ReadRequest([image_input(image) for image in request.images], request)


def _refused(reason: str) -> ReadRequest:
    return ReadRequest([], pb.ClassifyRequest(), reason)


def image_input(image: pb.Image) -> ImageInput:
    """A parsed Image as the core takes it (its bytes copied out of the message)."""
    if image.WhichOneof("data") == "raw":
        raw = image.raw
        return RawImage(DTYPES.get(raw.dtype, ""), tuple(raw.shape), raw.data)
    return EncodedImage(image.encoded)


def _image(view: memoryview) -> ImageInput:
    chosen = None
    for count, (number, wire_type, _, start, end) in enumerate(fields(view, 0, len(view))):
        if count == MOST_OTHER_FIELDS:
            raise WireError(f"an image of more than {MOST_OTHER_FIELDS} fields")
        if number in (_ENCODED, _RAW) and wire_type == LENGTH_DELIMITED:
            if chosen is not None:
                raise WireError("the oneof set twice")
            chosen = number, view[start:end]
    if chosen is None:  # no data: as protobuf reads it, an empty encoded image (refused by validation)
        return EncodedImage(b"")
    number, value = chosen
    if number == _ENCODED:
        return EncodedImage(bytes(value))  # decoders take bytes; the decode costs far more than the copy
    tensor, data = pull_out(pb.RawTensor, value, 0, len(value), _DATA, MOST_OTHER_FIELDS)
    return RawImage(DTYPES.get(tensor.dtype, ""), tuple(tensor.shape), data[-1] if data else b"")  # the last wins
