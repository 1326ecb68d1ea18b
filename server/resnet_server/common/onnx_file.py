"""An ONNX model file as ResNet18's: one float [N, 3, 224, 224] input, one float [N, 1000] output, and the precision
it was made in. A front-end checks a file a client sends with the ``onnx`` package, without running it; an engine
checks what ONNX Runtime loaded; both name the first thing that differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from resnet_server.common.model import WeightsError

# What a model `resnet-server quantize` made records of where it came from (its metadata_props), which the server
# logs when it serves it; a model without a precision is an fp32 export.
SOURCE_SHA256, CALIBRATION_SHA256, PRECISION = "resnet_source_sha256", "resnet_calibration_sha256", "resnet_precision"
INPUT_SHAPE, OUTPUT_SHAPE = (3, 224, 224), (1000,)
# A file a client sends is the client's text: messages show at most this much of it.
MOST_SHOWN_DIMENSIONS, MOST_SHOWN_CHARACTERS = 8, 64

Tensor = tuple[str, Sequence[object]]  # an input's or output's element type ("float") and shape (ints, names, None)


def unlike_resnet18(inputs: Sequence[Tensor], outputs: Sequence[Tensor]) -> str | None:
    """What in the model's inputs or outputs differs from ResNet18's, or None."""
    for kind, tensors, shape in (("input", inputs, INPUT_SHAPE), ("output", outputs, OUTPUT_SHAPE)):
        if len(tensors) != 1:
            return f"{len(tensors)} {kind}s, not one"
        element, dimensions = tensors[0]
        if element != "float" or len(dimensions) != 1 + len(shape) or tuple(dimensions[1:]) != shape:
            wanted = ", ".join(map(str, shape))
            shown = [_clipped(dimension) for dimension in list(dimensions)[:MOST_SHOWN_DIMENSIONS]]
            return f"its {kind} is {_clipped(element)} {shown}, not float [N, {wanted}]"
    return None


def unlike_served(recorded: dict[str, str], precision: str) -> str | None:
    """Why a model whose metadata says ``recorded`` is not one to serve as ``--precision precision``, or None."""
    made_as = recorded.get(PRECISION, "fp32")
    if made_as == precision:
        return None
    return f"an {made_as[:MOST_SHOWN_CHARACTERS]} model, served as --precision {precision}"


def recorded_text(recorded: dict[str, str], key: str) -> str:
    """What the model records under ``key``, at most a SHA-256's length of it, for a log line."""
    return recorded.get(key, "")[:MOST_SHOWN_CHARACTERS]


def _clipped(value: object) -> object:
    return value[:MOST_SHOWN_CHARACTERS] if isinstance(value, str) else value


def check_onnx_file(path: Path, name: str, precision: str) -> None:
    """WeightsError (said of ``name``) unless the file parses as an ONNX model of ResNet18's inputs and outputs,
    made in ``precision``."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError) as exc:
        raise WeightsError(f"{name}: not an ONNX model ({type(exc).__name__})") from None
    graph = model.graph
    initialised = {initializer.name for initializer in graph.initializer}
    inputs = [_tensor(value) for value in graph.input if value.name not in initialised]
    if (problem := unlike_resnet18(inputs, [_tensor(value) for value in graph.output])) is not None:
        raise WeightsError(f"{name}: not a ResNet18 model: {problem}")
    if (problem := unlike_served({entry.key: entry.value for entry in model.metadata_props}, precision)) is not None:
        raise WeightsError(f"{name}: {problem}")


def _tensor(value) -> Tensor:
    import onnx

    tensor_type = value.type.tensor_type
    try:
        element = onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower() if tensor_type.elem_type else "none"
    except ValueError:  # a number no ONNX type has
        element = f"type {tensor_type.elem_type}"
    dimensions = [dimension.dim_value if dimension.HasField("dim_value") else (dimension.dim_param or None)
                  for dimension in tensor_type.shape.dim]
    return element, dimensions
