"""The parameters of Open Inference Protocol requests and tensors: the model's own (temperature, top_k) and
Triton's shared-memory reference (a tensor's bytes in a client's region instead of the message)."""

from __future__ import annotations

from typing import NamedTuple

from resnet_server.common.errors import InvalidInput

SHM_REGION, SHM_BYTE_SIZE, SHM_OFFSET = "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"


def parameter(parameters, name: str):
    """The value of one InferParameter, whichever oneof field carries it, or None."""
    if name not in parameters:
        return None
    param = parameters[name]
    kind = param.WhichOneof("parameter_choice")
    return None if kind is None else getattr(param, kind)


def temperature_parameter(parameters) -> float | None:
    value = parameter(parameters, "temperature")
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except ValueError:
        raise InvalidInput(f"parameter temperature must be a number, got {value!r}") from None


def top_k_parameter(parameters) -> int | None:
    value = parameter(parameters, "top_k")
    if value is None:
        return None
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):
        raise InvalidInput(f"parameter top_k must be an integer, got {value!r}") from None


MOST_PRIORITY = 1 << 31


def priority_parameter(parameters) -> int:
    """Triton's ``priority``: 1 is served first among a caller's calls, then 2, ...; 0 (or none) after them."""
    value = parameter(parameters, "priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MOST_PRIORITY:
        raise InvalidInput(f"parameter priority must be a whole number from 0 to {MOST_PRIORITY}, got "
                           f"{str(value)[:32]!r}")
    return value


class RegionReference(NamedTuple):
    """Where a tensor's bytes are in a client's shared-memory region (Triton's tensor parameters)."""

    region: str
    byte_size: int
    offset: int


def region_reference(parameters) -> RegionReference | None:
    """The tensor's shared-memory reference, or None when its bytes travel in the message."""
    region = parameter(parameters, SHM_REGION)
    if region is None:
        if SHM_BYTE_SIZE in parameters or SHM_OFFSET in parameters:
            raise InvalidInput(f"{SHM_BYTE_SIZE} and {SHM_OFFSET} go with {SHM_REGION}, which is missing")
        return None
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"parameter {SHM_REGION} must name a region, got {region!r}")
    byte_size, offset = parameter(parameters, SHM_BYTE_SIZE), parameter(parameters, SHM_OFFSET)
    if byte_size is None:
        raise InvalidInput(f"parameter {SHM_BYTE_SIZE} must go with {SHM_REGION}")
    return RegionReference(region, _count(SHM_BYTE_SIZE, byte_size), _count(SHM_OFFSET, offset or 0))


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"parameter {name} must be a whole number of bytes, got {value!r}")
    return value
