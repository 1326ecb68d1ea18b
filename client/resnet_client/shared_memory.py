"""Classify images without sending them: a region of /dev/shm that this client makes, registers with a server on the
same machine (Triton's system shared-memory extension; the server runs with ``--allow-client-shm``), writes the
images into, and asks the server to read them from and to write the probabilities into. Standard library only.

The region holds one call's images from its start and their probabilities after them::

    with Client("localhost:50051") as client, client.shared_memory(8 << 20) as region:
        results = region.classify(frames, top_k=5)  # uint8 [H, W, 3] or float32 [3, 224, 224] arrays, or JPEGs

A region serves one call at a time (a thread of its own per region); make one per thread.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
from collections.abc import Callable, Sequence

from .api import grpc_predict_v2_pb2 as oip
from .messages import Classification, ClassScore, ImageLike

SHM_FOLDER = "/dev/shm"
CLASSES = 1000
PROBABILITIES = "probabilities"
TOP_K_OUTPUTS = ("top_k_indices", "top_k_probabilities", "top_k_labels")
ALIGN = 64  # the probabilities start on a cache line
_TENSORS = {"uint8": ("UINT8", "resnet18_uint8"), "float32": ("FP32", "resnet18")}


class SharedMemory:
    """A registered region of ``byte_size`` bytes (Client.shared_memory makes it)."""

    def __init__(self, call: Callable, stub, byte_size: int, mode: int = 0o600) -> None:
        self._call, self._stub = call, stub
        # Not "resnet...": the server keeps names with that prefix for itself.
        self.name = f"rc-{os.getpid()}-{secrets.token_hex(4)}"
        self.key, self.byte_size = f"/{self.name}", byte_size
        fd = os.open(os.path.join(SHM_FOLDER, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.ftruncate(fd, byte_size)
            self._map = mmap.mmap(fd, byte_size)
        except BaseException:
            os.unlink(os.path.join(SHM_FOLDER, self.name))
            raise
        finally:
            os.close(fd)
        try:
            self._call(stub.SystemSharedMemoryRegister, oip.SystemSharedMemoryRegisterRequest(
                name=self.name, key=self.key, byte_size=byte_size), None)
        except BaseException:
            self._remove()
            raise

    def classify(self, images: Sequence[ImageLike], *, top_k: int = 5, temperature: float | None = None,
                 timeout: float | None = None) -> list[Classification]:
        """The images, all of one kind (uint8 [H, W, 3] arrays of one size, float32 [3, 224, 224] arrays, or
        encoded images as bytes), written into the region and classified from it; ``probabilities`` of each
        result are read back from the region. The Open Inference Protocol answers no device or timings: those
        fields are empty."""
        request = self.infer_request(images, top_k=top_k, temperature=temperature)
        response = self._call(self._stub.ModelInfer, request, timeout)
        room = request.outputs[0].parameters["shared_memory_offset"].int64_param
        probabilities = list(struct.unpack_from(f"<{len(images) * CLASSES}f", self._map, room))
        return _results(response, probabilities, len(images), top_k, temperature or 0.0)

    def infer_request(self, images: Sequence[ImageLike], *, top_k: int = 5, temperature: float | None = None
                      ) -> oip.ModelInferRequest:
        """The images written into the region, and the ModelInfer request that names them there (its first
        output, the probabilities, answered into the region after them; the top k in the answer)."""
        datatype, model, shape, data = _tensor(images)
        room = -(-len(data) // ALIGN) * ALIGN
        if room + len(images) * CLASSES * 4 > self.byte_size:
            raise ValueError(f"{len(images)} images need {room + len(images) * CLASSES * 4} bytes; the region "
                             f"holds {self.byte_size}")
        self._map[:len(data)] = data
        request = oip.ModelInferRequest(model_name=model, inputs=[oip.ModelInferRequest.InferInputTensor(
            name="input", datatype=datatype, shape=shape, parameters=self._reference(0, len(data)))])
        request.outputs.add(name=PROBABILITIES, parameters=self._reference(room, len(images) * CLASSES * 4))
        for name in TOP_K_OUTPUTS:
            request.outputs.add(name=name)
        request.parameters["top_k"].int64_param = top_k
        if temperature is not None:
            request.parameters["temperature"].double_param = temperature
        return request

    def _reference(self, offset: int, byte_size: int) -> dict[str, oip.InferParameter]:
        return {"shared_memory_region": oip.InferParameter(string_param=self.name),
                "shared_memory_offset": oip.InferParameter(int64_param=offset),
                "shared_memory_byte_size": oip.InferParameter(int64_param=byte_size)}

    def close(self) -> None:
        """Unregister the region and remove it."""
        try:
            self._call(self._stub.SystemSharedMemoryUnregister,
                       oip.SystemSharedMemoryUnregisterRequest(name=self.name), None)
        finally:
            self._remove()

    def _remove(self) -> None:
        if not self._map.closed:
            self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_FOLDER, self.name))

    def __enter__(self) -> SharedMemory:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _tensor(images: Sequence[ImageLike]) -> tuple[str, str, list[int], bytes]:
    """(datatype, model name, shape, bytes) of the images as one input tensor."""
    if not images:
        raise ValueError("no images to classify")
    if all(isinstance(image, (bytes, bytearray, memoryview)) for image in images):  # encoded: Triton's BYTES
        data = b"".join(struct.pack("<I", len(image)) + bytes(image) for image in images)
        return "BYTES", "resnet18", [len(images)], data
    kinds = {(str(image.dtype), tuple(image.shape)) for image in images}
    if len(kinds) != 1 or (kind := kinds.pop())[0] not in _TENSORS:
        raise ValueError("images must all be uint8 [H, W, 3] arrays of one size, float32 [3, 224, 224] arrays, or "
                         f"encoded bytes; got {sorted(kinds)}")
    datatype, model = _TENSORS[kind[0]]
    return datatype, model, [len(images), *kind[1]], b"".join(image.tobytes() for image in images)


def _results(response: oip.ModelInferResponse, probabilities: list[float], count: int, k: int,
             temperature: float) -> list[Classification]:
    contents = {output.name: response.raw_output_contents[index] for index, output in enumerate(response.outputs)}
    indices = struct.unpack(f"<{count * k}q", contents["top_k_indices"])
    scores = struct.unpack(f"<{count * k}f", contents["top_k_probabilities"])
    labels, raw, offset = [], contents["top_k_labels"], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        labels.append(raw[offset + 4:offset + 4 + length].decode())
        offset += 4 + length
    return [Classification(
        top_k=[ClassScore(indices[i * k + j], labels[i * k + j], scores[i * k + j]) for j in range(k)],
        probabilities=probabilities[i * CLASSES:(i + 1) * CLASSES], logits=None, device="",
        temperature=temperature, queue_ms=0.0, compute_ms=0.0) for i in range(count)]
