"""An encoded image's declared size, read from its header before any decoder sees it.

The pixel limit (``--max-pixels``) has to hold before decoding: a JPEG of under 1 MiB can declare hundreds of
megapixels. PIL reads most headers lazily, but libjpeg (torchvision's decoder, and nvjpeg on a GPU) decodes
JPEGs PIL refuses to open: a stray standalone marker after the start of image is enough. So a JPEG's size is
read here, from its frame header (the SOFn marker segment), the way libjpeg finds it; other formats through
PIL; and an image of a format we decode whose header cannot be read is refused, never decoded unchecked.
"""

from __future__ import annotations

import io
import struct
import warnings

from PIL import Image

from resnet_server.common.errors import InvalidInput

JPEG_MAGIC = b"\xff\xd8\xff"
# Each format's signature: bytes that decide what a file claims to be, before any decoder is asked.
SIGNATURES = ((JPEG_MAGIC, "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"))
# Markers with no length after them: TEM, RST0-7, SOI, EOI.
_STANDALONE = {0x01, *range(0xD0, 0xDA)}
# Start-of-frame markers (every coding process; not DHT C4, JPG C8 nor DAC CC): they carry the size.
_FRAME = {*range(0xC0, 0xD0)} - {0xC4, 0xC8, 0xCC}
_START_OF_SCAN = 0xDA
# Scans of a progressive JPEG: libjpeg decodes any number, each a pass over every block of the image, so a
# 36 Mpx JPEG of under 1 MB with 10,000 near-empty scans held a decoding thread for a minute. Real encoders write
# about 10 (libjpeg's progressive script), jpegtran at most 100; libjpeg's own tools offer -maxscans for this.
MOST_JPEG_SCANS = 100


def image_format(data: bytes) -> str | None:
    """The format ``data`` claims by its signature, or None."""
    kind = next((name for signature, name in SIGNATURES if data.startswith(signature)), None)
    if kind is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        kind = "WEBP"
    return kind


def declared_size(data: bytes) -> tuple[int, int]:
    """(width, height) as the image's header declares them; InvalidInput for bytes of no format we decode, and
    for an image of such a format whose header says no size."""
    kind = image_format(data)
    if kind == "JPEG":
        _check_scans(data)
        return jpeg_size(data)
    if kind is None:  # refused by its signature, no decoder asked
        raise InvalidInput(f"cannot decode image ({len(data)} bytes): not a JPEG, PNG, GIF or WEBP file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as header:
                return header.size
    except Image.DecompressionBombError:  # PIL's own, larger ceiling (about 179 Mpx)
        raise
    except Exception:  # noqa: BLE001 - whatever PIL cannot read, we do not decode
        raise InvalidInput(f"cannot decode {kind} image ({len(data)} bytes): its header gives no size") from None


def _check_scans(data: bytes) -> None:
    """Refuse a JPEG of more than MOST_JPEG_SCANS scans. Entropy-coded data never holds the start-of-scan marker
    (a 0xFF byte there is followed by 0x00), so its count in the bytes is the count of scans (or more, where a
    marker segment's payload holds those two bytes: a refusal, never a decode)."""
    scans = data.count(b"\xff\xda")
    if scans > MOST_JPEG_SCANS:
        raise InvalidInput(f"JPEG image ({len(data)} bytes) has {scans} scans, over the limit of {MOST_JPEG_SCANS}")


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the first frame header, walking the marker segments from the start of image as
    libjpeg does; InvalidInput if the scan starts, or the bytes end, before a frame header."""
    position = 2  # after SOI
    while position + 1 < len(data):
        if data[position] != 0xFF:
            break
        marker = data[position + 1]
        position += 2
        if marker == 0xFF:  # fill bytes before a marker
            position -= 1
            continue
        if marker in _STANDALONE:
            continue
        if marker == _START_OF_SCAN or position + 2 > len(data):
            break
        (length,) = struct.unpack_from(">H", data, position)
        if length < 2:
            break
        if marker in _FRAME:
            if position + 7 > len(data):
                break
            height, width = struct.unpack_from(">HH", data, position + 3)
            return width, height
        position += length
    raise InvalidInput(f"cannot decode JPEG image ({len(data)} bytes): no frame header (SOFn) before its data")
