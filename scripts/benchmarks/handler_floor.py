"""The least a ModelInfer handler can do for one image, served by a bare gRPC server: the floor under the
front-end's own cost, by value and by reference (``shared_memory_cost.py --loads handler``).

A grpc.aio server on uvloop, as the front-end's, whose one method takes the bytes of a ModelInferRequest for one
FP32 or UINT8 image and does only what no handler can leave out. It reads the request as the front-end does (the
image a view of gRPC's bytes: ``resnet_server.frontend.wire.pull_out``, protobuf for the rest); by value it copies
the image into a slot and, for FP32, checks that every float is finite, and answers the 4,000 bytes of
probabilities inline; by reference it reads the image from the region the input names with ``preadv`` into the
slot (checking FP32 floats alike), writes each output the request names into its region with ``pwrite``, and
answers a response that names them. What it leaves out, and the front-end cannot: the engine's hand-off (a
message each way and the scores read back), admission, the checks of every field, top-k, metrics and statistics.
Its regions are files under /dev/shm that it makes at its start, named as perf_analyzer names its regions, and
removes when it stops.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from grpc_floor import serve_aio

from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_server.frontend.wire import pull_out

IMAGE_BYTES = 3 * 224 * 224 * 4  # the largest image the requests carry: FP32 [1, 3, 224, 224]
OUTPUTS = ("probabilities", "top_k_indices", "top_k_probabilities", "top_k_labels")
REGIONS = {"input_data": IMAGE_BYTES, **{f"{name}_data": 4000 for name in OUTPUTS}}  # perf_analyzer's names
RAW_INPUT_CONTENTS = oip.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
PROBABILITIES = bytes(4000)
BY_VALUE_ANSWER = oip.ModelInferResponse(
    model_name="resnet18", model_version="1",
    outputs=[oip.ModelInferResponse.InferOutputTensor(name="probabilities", datatype="FP32", shape=[1, 1000])],
    raw_output_contents=[PROBABILITIES]).SerializeToString()


def serve_handler(ports, stop, loop: str = "uvloop") -> None:
    """grpc_floor.serve_aio with the handler below, and its regions made first and removed when it stops."""
    prefix = f"/dev/shm/handler-floor-{os.getpid()}-"
    regions = {}
    try:
        for name, size in REGIONS.items():
            regions[name] = os.open(prefix + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(regions[name], size)
        slot = memoryview(bytearray(IMAGE_BYTES))
        serve_aio(ports, stop, loop, functools.partial(handle, regions, slot))
    finally:
        for name, fd in regions.items():
            os.close(fd)
            os.unlink(prefix + name)


async def handle(regions: dict[str, int], slot: memoryview, request: bytes, context) -> bytes:
    message, contents = pull_out(oip.ModelInferRequest, memoryview(request), 0, len(request), RAW_INPUT_CONTENTS, 8)
    tensor = message.inputs[0]
    if contents:
        image = slot[:len(contents[0])]
        image[:] = contents[0]
        _check(tensor.datatype, image)
        return BY_VALUE_ANSWER
    size = tensor.parameters["shared_memory_byte_size"].int64_param
    image = slot[:size]
    os.preadv(regions[tensor.parameters["shared_memory_region"].string_param], [image], 0)
    _check(tensor.datatype, image)
    response = oip.ModelInferResponse(model_name=message.model_name, model_version="1")
    for asked in message.outputs:
        region = asked.parameters["shared_memory_region"].string_param
        os.pwrite(regions[region], PROBABILITIES, 0)
        output = response.outputs.add(name=asked.name, datatype="FP32", shape=[1, 1000])
        output.parameters["shared_memory_region"].string_param = region
        output.parameters["shared_memory_byte_size"].int64_param = len(PROBABILITIES)
        response.raw_output_contents.append(b"")
    return response.SerializeToString()


def _check(datatype: str, image: memoryview) -> None:
    if datatype == "FP32" and not np.isfinite(np.frombuffer(image, np.float32)).all():
        raise ValueError("an image holds NaN or infinity")
