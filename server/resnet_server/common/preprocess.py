"""Decode and preprocess one image into the model's input: float32 [3, 224, 224], normalised.

The transform is torchvision's ImageNet eval preset for ResNet18 (``ResNet18_Weights.IMAGENET1K_V1
.transforms()``: resize 256 bilinear with antialias, centre crop 224, scale to [0, 1], normalise),
built from torchvision's ``transforms.v2`` functions with the preset's own numbers. v2 resizes uint8 images in
uint8 (torch's vectorised path) where the v1 preset converts to float first: two to seven times faster
(docs/performance.md, "Figures behind the code"), at the price of pixels that may differ from v1's by one grey
level. Decoding blocks: callers run it in worker threads, never on the event loop.

Raw tensors need no decoding. :func:`check_raw` validates one on arrival (of the pixels it reads only a
float32 tensor's, one vectorised pass: cheap enough for the event loop), and :func:`raw_batch` converts a
whole batch of them later, on the replica's own thread and device: one copy per batch, the resize batched (cheaper
than a round trip through a preprocessing thread), and on CUDA a uint8 upload 4x smaller than the float input it
becomes there.
"""

from __future__ import annotations

import functools
import io
import math
from typing import NamedTuple, Protocol

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from resnet_server.common.devices import to_device
from resnet_server.common.errors import InvalidInput
from resnet_server.common.image_header import declared_size, image_format
from resnet_server.common.model import IMAGENET_WEIGHTS
from resnet_server.common.shapes import CROP, CROP_SHAPE, FLOAT_SHAPE, RESIZE

PRESET = IMAGENET_WEIGHTS.transforms()
if (PRESET.crop_size[0], PRESET.resize_size[0]) != (CROP, RESIZE):  # resnet_server.common.shapes sizes the buffers
    raise ImportError(f"torchvision's preset crops {PRESET.crop_size} after {PRESET.resize_size}, not {CROP} "
                      f"after {RESIZE} as resnet_server.common.shapes says")
MEAN, STD = list(PRESET.mean), list(PRESET.std)


def transform(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] RGB (one image or a batch, on any device) to the model's float [..., 3, 224, 224]:
    :func:`crop`, then :func:`normalise`."""
    return normalise(crop(pixels))


def crop(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] to uint8 [..., 3, 224, 224]: the preset's resize and centre crop (torchvision v2)."""
    return F.center_crop(F.resize(pixels, [RESIZE], interpolation=PRESET.interpolation, antialias=True), [CROP])


def normalise(cropped: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, 224, 224] to the model's float input: scaling to [0, 1] and normalising fused into one
    multiply-add with per-device constants. v2's ToDtype + Normalize steps cost more an image, and
    Normalize copies its mean and std to the device on every call, a blocking copy on CUDA; the values
    agree within 1e-6."""
    batch = cropped if cropped.dim() == 4 else cropped.unsqueeze(0)
    normalised = _normalise(batch)
    return normalised if cropped.dim() == 4 else normalised[0]


def _normalise(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] to float, normalised, written channels-last (the model's layout: no copy later).

    Viewed as rows of [W * 3] values with the per-channel constants tiled along a row, the multiply-add runs
    over long contiguous rows; broadcasting [3, 1, 1] constants over channels-last memory instead gives an
    inner loop of three values, twice as slow."""
    count, channels, height, width = pixels.shape
    out = torch.empty(pixels.shape, device=pixels.device, memory_format=torch.channels_last)
    # A view where the resize left channels-last strides (on the CPU it does), else a copy.
    rows = pixels.permute(0, 2, 3, 1).reshape(count, height, width * channels)
    scale, shift = _normalisation(pixels.device, width)
    torch.addcmul(shift, rows, scale, out=out.permute(0, 2, 3, 1).view(count, height, width * channels))
    return out


@functools.cache
def _normalisation(device: torch.device, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 / (255 std), -mean / std) tiled over a row of ``width`` RGB pixels, on ``device``:
    x * scale + shift == (x / 255 - mean) / std for every value of the row."""
    mean, std = torch.tensor(MEAN, dtype=torch.float64), torch.tensor(STD, dtype=torch.float64)
    scale, shift = 1.0 / (255.0 * std), -mean / std
    return scale.float().repeat(width).to(device), shift.float().repeat(width).to(device)


ENCODINGS = ("jpeg", "png", "gif", "webp")
RAW_FORMATS = ("uint8 [H, W, 3] RGB", f"float32 {list(FLOAT_SHAPE)} normalised")


# The request's images as the server carries them: NamedTuples, made once a call (an image) on the hot path at a
# third of a frozen dataclass's cost.
class EncodedImage(NamedTuple):
    data: bytes


class SlotBytes(NamedTuple):
    """An image's bytes where its front-end wrote them: the first ``nbytes`` of row ``slot`` of ``rows``, the
    engine's uint8 [slots, bytes] tensor over the shared slab (``resnet_server.boundary.slab``). Read a batch at a
    time. A NamedTuple, as the images."""

    rows: torch.Tensor
    slot: int
    nbytes: int


class BytesElsewhere(Protocol):
    """An image's bytes not yet in this process: in a client's shared-memory region
    (resnet_server.frontend.shared_memory), read once, straight into where they go. InvalidInput from a read says what
    was wrong with them."""

    def __len__(self) -> int: ...

    def __getitem__(self, part: slice) -> BytesElsewhere: ...

    def read_into(self, target: memoryview) -> None: ...

    def read(self) -> bytes: ...


# An image's bytes: in a front-end, its request's (or a view of them) or a client's region's; in the engine,
# where they lie in the slab.
ImageBytes = bytes | memoryview | SlotBytes | BytesElsewhere


class RawImage(NamedTuple):
    dtype: str  # "uint8" or "float32"
    shape: tuple[int, ...]
    data: ImageBytes


class CroppedImage(NamedTuple):
    """An image a front-end decoded, resized and cropped: uint8 [224, 224, 3] bytes (SlotBytes in the engine),
    normalised with its batch on the engine's device. A quarter of the float input's bytes through the slab."""

    data: ImageBytes


ImageInput = EncodedImage | RawImage


def preprocess(image: ImageInput, max_pixels: int, crop_only: bool = False) -> torch.Tensor:
    """Validate, decode and transform one image on the CPU; InvalidInput says what is wrong with it. With
    ``crop_only`` a uint8 image stops at its crop, uint8 [224, 224, 3] contiguous (to go to an engine, which
    normalises it); a float32 one is the model's input already."""
    if isinstance(image, EncodedImage):
        pixels = decode(image.data, max_pixels)
    else:
        check_raw(image, max_pixels)
        if image.dtype != "uint8" or not crop_only:
            converted = raw_batch([image], torch.device("cpu"))[0]
            if isinstance(converted, InvalidInput):
                raise converted
            return converted
        pixels = stack_bytes([image.data], "uint8", tuple(image.shape), torch.device("cpu"))[0].permute(2, 0, 1)
    return crop(pixels).permute(1, 2, 0).contiguous() if crop_only else transform(pixels)


def check_raw(image: RawImage, max_pixels: int) -> None:
    """Everything about a raw tensor that is checked on arrival: its dtype, shape and length, and a float32
    tensor's values (finite: one vectorised pass, done here so that no engine's one host thread reads a whole
    float batch on the CPU)."""
    if image.dtype == "uint8":
        if len(image.shape) != 3 or image.shape[2] != 3 or min(image.shape) <= 0:
            raise InvalidInput(f"raw uint8 image must have shape [H, W, 3] with H, W > 0, got {list(image.shape)}")
        _check_pixels(image.shape[0], image.shape[1], max_pixels)
        _check_raw_length(image, 1)
    elif image.dtype == "float32":
        if tuple(image.shape) != FLOAT_SHAPE:
            raise InvalidInput(f"raw float32 image must have shape {list(FLOAT_SHAPE)}, got {list(image.shape)}")
        _check_raw_length(image, 4)
        held = image.data  # bytes elsewhere are checked as they are read in, where they go
        if isinstance(held, (bytes, memoryview)) and not np.isfinite(np.frombuffer(held, np.float32)).all():
            raise InvalidInput("raw float32 image contains NaN or infinity")
    else:
        raise InvalidInput(f"raw tensor dtype must be uint8 or float32, got {image.dtype or 'unspecified'}")


def raw_batch(images: list[RawImage], device: torch.device) -> list[torch.Tensor]:
    """Raw images that passed :func:`check_raw` as the model's float [3, 224, 224] inputs on ``device``, one
    batched conversion per distinct shape."""
    rows: dict[int, torch.Tensor] = {}
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for index, image in enumerate(images):
        groups.setdefault((image.dtype, tuple(image.shape)), []).append(index)
    for (dtype, shape), indices in groups.items():
        converted = _convert_group([images[i].data for i in indices], dtype, shape, device)
        rows.update(zip(indices, converted.unbind(0), strict=True))
    return [rows[index] for index in range(len(images))]


def whole_batch(images: list, device: torch.device) -> torch.Tensor | None:
    """The images as the model's float [B, 3, 224, 224] batch on ``device``, in one conversion, when they are
    all raw images of one dtype and shape or all front-ends' crops (the usual batch); else None, and each kind
    is converted apart (``raw_batch``, ``cropped_batch``). The batch is never cut into rows and stacked again:
    at a GPU batch of about 100 that took a hundred views and a hundred-input copy on the engine's one thread."""
    first = images[0]
    if isinstance(first, CroppedImage) and all(isinstance(image, CroppedImage) for image in images):
        return _crops([image.data for image in images], device)
    if isinstance(first, RawImage):
        key = (first.dtype, tuple(first.shape))
        if all(isinstance(image, RawImage) and (image.dtype, tuple(image.shape)) == key for image in images):
            return _convert_group([image.data for image in images], *key, device)
    return None


def _convert_group(datas: list[ImageBytes], dtype: str, shape: tuple[int, ...], device: torch.device
                   ) -> torch.Tensor:
    stacked = stack_bytes(datas, dtype, shape, device)
    if dtype == "uint8":  # [B, H, W, 3]: resized as channels-last, which torch's uint8 resize handles natively
        return transform(to_device(stacked, device).permute(0, 3, 1, 2))
    return to_device(stacked, device)


def cropped_batch(images: list[CroppedImage], device: torch.device) -> list[torch.Tensor]:
    """Front-ends' crops as the model's float [3, 224, 224] inputs on ``device``: gathered with one copy (pinned,
    for an upload), uploaded as uint8, normalised as one batch."""
    return list(_crops([image.data for image in images], device).unbind(0))


def _crops(datas: list[ImageBytes], device: torch.device) -> torch.Tensor:
    stacked = stack_bytes(datas, "uint8", CROP_SHAPE, device)
    return normalise(to_device(stacked, device).permute(0, 3, 1, 2))


def stack_bytes(datas: list[ImageBytes], dtype: str, shape: tuple[int, ...], device: torch.device
                 ) -> torch.Tensor:
    """The images' bytes copied once, into one new [B, *shape] tensor: on a GPU ``device`` when they are slots
    of a slab registered with CUDA (``resnet_server.engine.registered_slab``), else on the CPU (pinned, for an upload
    to a GPU).

    Bytes go through a memoryview: a plain copy that keeps the GIL. A NumPy copy of each image gives the GIL up
    and must win it back, up to a switch interval per image (docs/performance.md, "Figures behind the code")."""
    size, torch_dtype = (len(datas), *shape), getattr(torch, dtype)
    slots = [data for data in datas if isinstance(data, SlotBytes)]
    if len(slots) == len(datas):
        rows = slots[0].rows
        if rows.is_cuda:  # the registered slab as the GPU sees it in place: one gather kernel reads the images
            return gather_slots(slots, torch.empty(size, dtype=torch_dtype, device=rows.device))
        if device.type == "cuda" and rows.is_pinned():
            return copy_slots(slots, torch.empty(size, dtype=torch_dtype, device=device))
        return gather_slots(slots, torch.empty(size, dtype=torch_dtype, pin_memory=device.type == "cuda"))
    batch = torch.empty(size, dtype=torch_dtype, pin_memory=device.type == "cuda")
    flat, offset = batch.numpy().data.cast("B"), 0
    for data in datas:  # each is exactly one image's bytes: check_raw saw to it on arrival
        copy_into(flat[offset:offset + len(data)], data)
        offset += len(data)
    return batch


def copy_into(target: memoryview, data: ImageBytes) -> None:
    """An image's bytes into ``target`` (as long as they are), in one copy wherever they are (a slab's slots are
    read a batch at a time, never one by one)."""
    if isinstance(data, SlotBytes):
        raise TypeError("an image in a slab slot is read with its batch")
    if isinstance(data, (bytes, memoryview)):
        target[:] = data
    else:
        data.read_into(target)


def gather_slots(slots: list[SlotBytes], batch: torch.Tensor) -> torch.Tensor:
    """The slots' bytes into ``batch`` with one index_select, on the device the rows are on. On the CPU that is
    one copy that gives the GIL up once, so the engine's socket readers and finisher run while it copies (the
    memoryview copy holds the GIL for the whole batch). On a GPU it is one kernel reading the registered slab over
    the bus (``resnet_server.engine.registered_slab``), instead of a copy an image on the engine's one host thread. Read
    as the widest word that divides the
    image and the slot: fewer, larger reads, which the bus to host memory moves far better than single bytes."""
    first = slots[0]
    word = _widest_word(first.rows, first.nbytes)
    rows = first.rows[:, :first.nbytes].view(word)
    # to a GPU through pinned memory, not queued behind this stream's work: a plain copy would wait for it
    index = to_device(torch.tensor([slot.slot for slot in slots]), rows.device)
    torch.index_select(rows, 0, index, out=batch.view(len(slots), -1).view(torch.uint8).view(word))
    return batch


def _widest_word(rows: torch.Tensor, nbytes: int) -> torch.dtype:
    """The widest integer type whose size divides an image's bytes, the slot's stride and the rows' address."""
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if nbytes % size == 0 and rows.stride(0) % size == 0 and rows.data_ptr() % size == 0:
            return word
    return torch.uint8


def copy_slots(slots: list[SlotBytes], batch: torch.Tensor) -> torch.Tensor:
    """The slots' bytes, in registered (page-locked) memory, into the rows of ``batch`` on a GPU: one DMA an image
    by the device's copy engines, queued on the current stream, with no copy on the host. ``_foreach_copy_`` (what
    torch's optimizers use) queues them all in one call, giving the GIL up once rather than once an image."""
    rows = batch.view(len(slots), -1).view(torch.uint8)
    torch._foreach_copy_(list(rows.unbind(0)), [slot.rows[slot.slot, :slot.nbytes] for slot in slots],
                         non_blocking=True)
    return batch


def check_header(data: bytes, max_pixels: int) -> None:
    """The checks done on arrival for an image decoded later: not empty, not over the pixel limit."""
    if not data:
        raise InvalidInput("image is empty (0 bytes)")
    _check_declared_size(data, max_pixels)


def decode(data: bytes, max_pixels: int) -> torch.Tensor:
    """Encoded bytes to uint8 [3, H, W] RGB, refusing images over max_pixels before decoding them."""
    check_header(data, max_pixels)
    try:
        if image_format(data) == "GIF":
            decoded = _first_gif_frame(data)
        else:  # an animated WEBP is refused by the decoder; an animated PNG decodes as its default image
            decoded = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError, OSError) as exc:
        raise _undecodable(data, exc) from exc
    _check_pixels(decoded.shape[-2], decoded.shape[-1], max_pixels)
    return decoded


def _first_gif_frame(data: bytes) -> torch.Tensor:
    """An animated GIF is classified by its first frame, and only that frame is decoded: torchvision's decoder
    makes every frame at the canvas's size, so a few KB of one-pixel frames on a large canvas asked for gigabytes.
    PIL reads frames lazily; its first frame is torchvision's, pixel for pixel."""
    with Image.open(io.BytesIO(data)) as image:
        rgb = np.asarray(image.convert("RGB"))
    return torch.from_numpy(rgb).permute(2, 0, 1).contiguous()


def _undecodable(data: bytes, exc: Exception) -> InvalidInput:
    """The error for bytes of a known format (check_header refused the others) that the decoder refused, a
    truncated JPEG say: the decoder's own reason."""
    kind = image_format(data)
    # torchvision prefixes its reason with the function and source line: "decode_jpeg, file.cpp:171, reason".
    reason = str(exc).splitlines()[0].rsplit(", ", 1)[-1].strip()[:200] if str(exc) else type(exc).__name__
    return InvalidInput(f"cannot decode {kind} image ({len(data)} bytes): {reason}")


def _check_declared_size(data: bytes, max_pixels: int) -> None:
    """Read only the header (resnet_server.common.image_header) so a decompression bomb is refused unopened."""
    try:
        width, height = declared_size(data)
    except Image.DecompressionBombError:
        raise InvalidInput(f"image declares more pixels than the limit of {max_pixels}") from None
    _check_pixels(height, width, max_pixels)


def _check_pixels(height: int, width: int, max_pixels: int) -> None:
    if height * width > max_pixels:
        raise InvalidInput(f"image has {width}x{height} = {width * height} pixels, over the limit of {max_pixels}")


def _check_raw_length(image: RawImage, itemsize: int) -> None:
    expected = math.prod(image.shape) * itemsize
    if len(image.data) != expected:
        raise InvalidInput(
            f"raw {image.dtype} tensor of shape {list(image.shape)} needs {expected} bytes, got {len(image.data)}"
        )
