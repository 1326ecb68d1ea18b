"""Images of several frames: an animated GIF is decoded as its first frame only, whatever its frame count; an
animated WEBP is refused; an animated PNG decodes as its default image."""

from __future__ import annotations

import io
import resource
import struct
import time

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from resnet_client import ClassifierError, Client
from resnet_server.common.errors import InvalidInput
from resnet_server.common.preprocess import decode

MAX_PIXELS = 40_000_000


def one_pixel_frames(canvas: int, frames: int) -> bytes:
    """A GIF of a few KB: a ``canvas`` x ``canvas`` screen and ``frames`` frames of one pixel each."""
    screen = b"GIF89a" + struct.pack("<HHBBB", canvas, canvas, 0x80, 0, 0) + b"\0\0\0\xff\xff\xff"
    frame = (b"\x21\xf9\x04\x00\x00\x00\x00\x00" + b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0)
             + b"\x02\x02\x44\x01\x00")
    return screen + frame * frames + b"\x3b"


def animated(fmt: str, frames: int = 4) -> bytes:
    images = [Image.new("RGB", (48, 32), (60 * index, 255 - 60 * index, 10)) for index in range(frames)]
    buffer = io.BytesIO()
    images[0].save(buffer, fmt, save_all=True, append_images=images[1:])
    return buffer.getvalue()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_gif_of_many_one_pixel_frames_decodes_its_first_frame_alone():
    bomb = one_pixel_frames(4000, 200)  # every frame at the canvas's size: 9.6 GB
    assert len(bomb) < 5000
    before = peak_rss_mb()
    started = time.monotonic()
    decoded = decode(bomb, MAX_PIXELS)
    assert time.monotonic() - started < 5
    assert decoded.shape == (3, 4000, 4000) and decoded.dtype == torch.uint8
    assert peak_rss_mb() - before < 400  # one frame (48 MB) and its copies, not 200 of them


def test_the_first_frame_of_an_animated_gif_is_the_image_classified():
    decoded = decode(animated("GIF"), MAX_PIXELS)
    assert decoded.shape == (3, 32, 48)
    np.testing.assert_array_equal(decoded[:, 0, 0].numpy(), [0, 255, 10])


def test_an_animated_png_decodes_as_its_default_image():
    decoded = decode(animated("PNG"), MAX_PIXELS)
    np.testing.assert_array_equal(decoded[:, 0, 0].numpy(), [0, 255, 10])


def test_an_animated_webp_is_refused():
    with pytest.raises(InvalidInput, match="cannot decode WEBP image"):
        decode(animated("WEBP"), MAX_PIXELS)


def test_the_gif_bomb_is_answered_by_its_first_frame_through_the_server(server):
    with Client(server.target, timeout=60) as client:
        (result,) = client.classify([one_pixel_frames(4000, 200)])
        assert len(result.top_k) == 5
        with pytest.raises(ClassifierError) as refused:
            client.classify([animated("WEBP")])
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def progressive_with_scans(extra_scans: int) -> bytes:
    """A flat 6000x6000 progressive JPEG (its AC scans a few bytes each), one of its AC scans repeated: libjpeg
    decodes every scan as a pass over the whole image."""
    buffer = io.BytesIO()
    Image.new("RGB", (6000, 6000), (120, 130, 140)).save(buffer, "JPEG", progressive=True, quality=90)
    data = buffer.getvalue()
    starts = [index for index in range(len(data) - 1) if data[index:index + 2] == b"\xff\xda"]
    end = data.rindex(b"\xff\xd9")
    scans = [data[start:stop] for start, stop in zip(starts, [*starts[1:], end], strict=True)]
    small = min(scans[1:], key=len)
    return data[:starts[0]] + b"".join(scans) + small * extra_scans + b"\xff\xd9"


def test_a_progressive_jpeg_of_thousands_of_scans_is_refused_from_its_bytes():
    bomb = progressive_with_scans(10_000)
    assert len(bomb) < 1_000_000
    started = time.monotonic()
    with pytest.raises(InvalidInput, match=r"has 100\d\d scans, over the limit of 100"):
        decode(bomb, MAX_PIXELS)
    assert time.monotonic() - started < 0.5
    assert decode(progressive_with_scans(0), MAX_PIXELS).shape == (3, 6000, 6000)  # an ordinary one decodes
