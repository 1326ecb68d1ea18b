"""Every field of every RPC the server answers, each with its worst value: the hostile client's requests.

Made from the service descriptors (both APIs, Triton's extensions, health, reflection), so an RPC or a field
added later is tried without anyone remembering to. For each field a request can reach (nested messages and maps
included, MOST_DEPTH deep): a repeated field, packed field or map of millions of entries, or a string or bytes
of LONG bytes. Used by tests/test_hostile_clients.py (each must be refused while health answers) and by
``scripts/benchmarks/soak.py --hostile`` (in a loop, beside normal traffic).
"""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip

MIB = 1 << 20
MANY = 2_000_000  # entries of a repeated field or map: 4 MB of empty ones
LONG = 8 * MIB  # bytes of a string or bytes field
MOST_DEPTH = 4
SERVICES = [pb.DESCRIPTOR.services_by_name["Classifier"], oip.DESCRIPTOR.services_by_name["GRPCInferenceService"],
            health_pb2.DESCRIPTOR.services_by_name["Health"],
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS}


@dataclass(frozen=True)
class Case:
    method: MethodDescriptor
    path: tuple[FieldDescriptor, ...]  # the fields from the request down to the one tried
    worst: str  # "many" or "long"

    @property
    def name(self) -> str:
        return f"{self.method.full_name}:{'.'.join(field.name for field in self.path)}:{self.worst}"

    @property
    def wire(self) -> bytes:
        """The request: the worst value, inside each of its parents (made when sent: they are large)."""
        wire = _leaf(self.path[-1], self.worst)
        for parent in reversed(self.path[:-1]):
            wire = _delimited(parent.number, wire)
        return wire

    @property
    def route(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _delimited(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _leaf(field: FieldDescriptor, worst: str) -> bytes:
    """The field's worst value, as wire bytes of the message that holds it."""
    if worst == "long":
        return _delimited(field.number, b"a" * LONG)
    if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
        return _delimited(field.number, b"") * MANY  # millions of empty entries (a map's too)
    return _delimited(field.number, b"\x01" * (2 * MANY))  # packed: millions of numbers


def _worst_fields(message: Descriptor, path: tuple[FieldDescriptor, ...] = ()) -> Iterator[tuple]:
    """(path of fields, worst) for every field reachable from ``message`` within MOST_DEPTH."""
    for field in message.fields:
        here = (*path, field)
        if field.is_repeated:
            yield here, "many"
        if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            yield here, "long"
        elif field.type == FieldDescriptor.TYPE_MESSAGE and len(here) < MOST_DEPTH and \
                field.message_type not in [step.message_type for step in path]:
            yield from _worst_fields(field.message_type, here)


def cases() -> list[Case]:
    found = []
    for service in SERVICES:
        for method in service.methods:
            found += [Case(method, path, worst) for path, worst in _worst_fields(method.input_type)]
    return found


CASES = cases()




def outcome(channel: grpc.Channel, case: Case, timeout: float = 60) -> str:
    """The status code's name the call ended with; "OK (refused in the stream)" where a stream answered each
    message with an error, as ModelStreamInfer does."""
    method = case.method
    try:
        if not method.client_streaming and not method.server_streaming:
            channel.unary_unary(case.route)(case.wire, timeout=timeout)
            return "OK"
        if not method.client_streaming:
            responses = list(channel.unary_stream(case.route)(case.wire, timeout=timeout))
        else:
            responses = list(channel.stream_stream(case.route)(iter([case.wire]), timeout=timeout))
    except grpc.RpcError as exc:
        return exc.code().name
    if method.name == "ModelStreamInfer" and all(oip.ModelStreamInferResponse.FromString(r).error_message
                                                 for r in responses):
        return REFUSED_IN_STREAM
    return "OK"


REFUSED_IN_STREAM = "OK (refused in the stream)"
ALLOWED = {code.name for code in REFUSALS} | {REFUSED_IN_STREAM}


@dataclass(frozen=True)
class HttpCase:
    """One hostile HTTP request: its name, method and path, body, and headers."""

    name: str
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()


HTTP_REFUSALS = {400, 401, 403, 404, 408, 413, 429, 431}


def _infer_body(**fields: str) -> bytes:
    parts = {"inputs": '[{"name": "input", "datatype": "UINT8", "shape": [1, 1, 1, 3], "data": [1, 2, 3]}]', **fields}
    return ("{" + ", ".join(f'"{key}": {value}' for key, value in parts.items()) + "}").encode()


def http_cases() -> list[HttpCase]:
    """The HTTP routes' worst values: floods of objects, keys, values, strings and dimensions, nesting, long
    strings, lying lengths, too many and too long headers. Each must be refused with a 4xx status."""
    infer = "/v2/models/resnet18/infer"
    many = ", ".join(["{}"] * MANY)
    return [
        HttpCase("inputs flood", "POST", infer, f'{{"inputs": [{many}]}}'.encode()),
        HttpCase("outputs flood", "POST", infer, _infer_body(outputs=f"[{many}]")),
        HttpCase("parameters flood", "POST", infer, _infer_body(parameters="{" + ", ".join(
            f'"k{i}": 1' for i in range(MANY // 4)) + "}")),
        HttpCase("long id", "POST", infer, _infer_body(id='"' + "x" * LONG + '"')),
        HttpCase("shape flood", "POST", infer, _infer_body(inputs='[{"name": "input", "datatype": "UINT8", '
                                                           '"shape": [' + ", ".join(["1"] * MANY) + "]}]")),
        HttpCase("strings flood", "POST", infer, _infer_body(inputs='[{"name": "input", "datatype": "BYTES", '
                                                             '"shape": [1], "data": [' + ", ".join(['""'] * MANY)
                                                             + "]}]")),
        HttpCase("numbers flood", "POST", infer, _infer_body(inputs='[{"name": "input", "datatype": "FP32", '
                                                             '"shape": [1], "data": [' + ",".join(["0"] * (4 * MANY))
                                                             + "]}]")),
        HttpCase("deep data", "POST", infer, _infer_body(inputs='[{"name": "input", "datatype": "FP32", "shape": '
                                                         '[1], "data": ' + "[" * MANY + "]" * MANY + "}]")),
        HttpCase("header length past the body", "POST", infer, _infer_body(),
                 (("Inference-Header-Content-Length", str(1 << 62)),)),
        HttpCase("binary size past the body", "POST", infer, _infer_body(inputs='[{"name": "input", "datatype": '
                                                                         '"UINT8", "shape": [1, 1, 1, 3], '
                                                                         '"parameters": {"binary_data_size": '
                                                                         f'{1 << 62}}}}}]')),
        HttpCase("body over the limit", "POST", infer, b"0" * (64 * MIB + 1)),
        HttpCase("load parameters flood", "POST", "/v2/repository/models/resnet18/load", (
            '{"parameters": {' + ", ".join(f'"k{i}": ""' for i in range(MANY // 4)) + "}}").encode()),
        HttpCase("load file not base64", "POST", "/v2/repository/models/resnet18/load",
                 b'{"parameters": {"file:1/w.pt": "' + b"!" * LONG + b'"}}'),
        HttpCase("region key long", "POST", "/v2/systemsharedmemory/region/r/register",
                 b'{"key": "' + b"k" * LONG + b'", "byte_size": 64}'),
        HttpCase("trace settings flood", "POST", "/v2/trace/setting",
                 ("{" + ", ".join(f'"s{i}": "v"' for i in range(MANY // 4)) + "}").encode()),
        HttpCase("classify images flood", "POST", "/v1/classify",
                 ('{"images": [' + ", ".join(['{"encoded": ""}'] * (MANY // 4)) + "]}").encode()),
        HttpCase("classify shape flood", "POST", "/v1/classify",
                 ('{"images": [{"raw": {"shape": [' + ", ".join(["1"] * MANY) + "]}}]}").encode()),
        HttpCase("long path", "GET", "/v2/models/" + "m" * LONG),
        HttpCase("headers flood", "GET", "/v2", b"", tuple((f"x-h{i}", "v") for i in range(10_000))),
        HttpCase("long header", "GET", "/v2", b"", (("x-long", "v" * LONG),)),
    ]


def http_outcome(host: str, port: int, case: HttpCase, timeout: float = 60) -> str:
    """The status the server answered ``case`` with, or "closed" where it closed the connection without one
    (before the client had sent it all: a refusal too)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.putrequest(case.method, case.path, skip_accept_encoding=True)
        for key, value in case.headers:
            connection.putheader(key, value)
        if case.body or case.method == "POST":
            connection.putheader("Content-Length", str(len(case.body)))
        connection.endheaders(case.body)
        return str(connection.getresponse().status)
    except (ConnectionError, http.client.RemoteDisconnected):
        return "closed"
    finally:
        connection.close()


HTTP_ALLOWED = {str(status) for status in HTTP_REFUSALS} | {"closed"}
