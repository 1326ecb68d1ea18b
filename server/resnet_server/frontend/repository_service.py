"""Triton's model repository extension over the one model served: RepositoryIndex, RepositoryModelLoad (new
weights while serving: from --weights again, or a file the client sends) and RepositoryModelUnload.

Off unless the server runs with ``--model-control explicit``: then each answers PERMISSION_DENIED naming the
flag. Weights a client sends are bounded (``--max-weights-mb``), written to the supervisor's private folder and
read there as the engines will read them (``torch.load(weights_only=True)`` or safetensors: no pickled code
runs) before any engine is asked: a file that is not a ResNet18 state_dict is refused naming its first wrong key,
and nothing changes on any device. A server started on an ONNX model (``--weights FILE.onnx``) takes an ONNX model
instead, checked for ResNet18's input and output and for the precision served.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import model_config_pb2 as mc
from resnet_server.common.errors import InvalidInput, NotFound, PermissionDenied
from resnet_server.common.memory import give_back_freed_memory
from resnet_server.common.model import WeightsError, check_weights_file
from resnet_server.common.onnx_file import check_onnx_file
from resnet_server.common.threads import in_the_background
from resnet_server.frontend.supervisor_client import SupervisorClient
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

FILE_PREFIX = "file:"  # a parameter holding a file's bytes, as tritonclient's load_model(files=...) sends it
_PARAMETERS = 3  # RepositoryModelLoadRequest.parameters: map entries, each a key (1) and a value (2)
_ENTRY_VALUE = 2
_BYTES_PARAM = 4  # ModelRepositoryParameter.bytes_param
MOST_FILES = 8  # the walk runs on the event loop: past this many files it stops (one is loaded; more are refused)


class LoadRequest(NamedTuple):
    """A RepositoryModelLoadRequest without the files it carries, and those apart: (key, memoryview of the bytes
    gRPC received). A file of weights is tens of MB: protobuf's parse and reading its field would copy it twice
    more, all held while every engine loads it. ``unreadable``: why it is refused unread."""

    message: oip.RepositoryModelLoadRequest
    files: list[tuple[str, memoryview]]
    unreadable: str | None = None


def read_load_request(data: bytes) -> LoadRequest:
    """gRPC's request deserializer for RepositoryModelLoad (resnet_server.frontend.wire walks it)."""
    try:
        return _split_files(memoryview(data))
    except WireError as exc:
        walk_error = exc
    try:
        message = parse_whole(oip.RepositoryModelLoadRequest, data, walk_error)
    except Unreadable as exc:
        return LoadRequest(oip.RepositoryModelLoadRequest(), [], str(exc))
    files = [(key, memoryview(value.bytes_param)) for key, value in message.parameters.items()
             if key.startswith(FILE_PREFIX)]
    for key, _ in files:
        del message.parameters[key]
    return LoadRequest(message, files)


def _split_files(view: memoryview) -> LoadRequest:
    others, other_count = bytearray(), 0
    files: list[tuple[str, memoryview]] = []
    for field, wire_type, key_at, start, end in fields(view, 0, len(view)):
        if field == _PARAMETERS and wire_type == LENGTH_DELIMITED and (file := _file(view[start:end])) is not None:
            if len(files) == MOST_FILES:
                raise WireError(f"more than {MOST_FILES} files")
            files.append(file)
            continue
        other_count += 1
        if other_count > MOST_OTHER_FIELDS:
            raise WireError(f"more than {MOST_OTHER_FIELDS} fields besides the files")
        others += view[key_at:end]
    try:
        return LoadRequest(oip.RepositoryModelLoadRequest.FromString(bytes(others)), files)
    except DecodeError as exc:
        raise WireError(str(exc)) from None


def _file(entry_view: memoryview) -> tuple[str, memoryview] | None:
    """A parameters entry's key and its bytes_param, where the key names a file; None for any other entry."""
    try:
        entry, values = pull_out(oip.RepositoryModelLoadRequest.ParametersEntry, entry_view, 0, len(entry_view),
                                 _ENTRY_VALUE, 1)
        if not entry.key.startswith(FILE_PREFIX):
            return None
        value = values[0] if values else memoryview(b"")
        _, contents = pull_out(oip.ModelRepositoryParameter, value, 0, len(value), _BYTES_PARAM, 1)
    except TooMany as exc:  # a field given twice: protobuf's own parse says what it means
        raise WireError("a parameter's field given twice") from exc
    return entry.key, contents[0] if contents else memoryview(b"")


class RepositoryService:
    """The three RPCs' work; InferenceService answers them with it."""

    def __init__(self, control: SupervisorClient, explicit: bool, max_weights_bytes: int, names: list[str],
                 precision: str = "fp32") -> None:
        self.control = control
        self.precision = precision  # an ONNX model sent must have been made in it (--precision)
        self.explicit = explicit
        self.max_weights_bytes = max_weights_bytes
        self.names = names
        # Writing and checking a client's file runs in the background: calls being served keep the CPU.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="weights", initializer=in_the_background)

    def index(self, request: oip.RepositoryIndexRequest) -> oip.RepositoryIndexResponse:
        self._allowed()
        served = self.control.served
        if request.ready and not served.loaded:
            return oip.RepositoryIndexResponse()
        state, reason = ("READY", "") if served.loaded else ("UNAVAILABLE", "unloaded")
        return oip.RepositoryIndexResponse(models=[
            oip.RepositoryIndexResponse.ModelIndex(name=name, version=str(served.version), state=state, reason=reason)
            for name in self.names])

    async def load(self, request: LoadRequest, configs: dict[str, mc.ModelConfig]) -> oip.RepositoryModelLoadResponse:
        self._allowed()
        if request.unreadable is not None:
            raise InvalidInput(request.unreadable)
        self._known(request.message.model_name)
        if (served := configs.get(request.message.model_name)) is not None:  # none until the model has loaded once
            _check_config(request.message, served)
        try:
            path = await self._received_weights(request.files)
        finally:
            if request.files:  # gRPC's copies of the file, freed as it was received (its bytes stay until answered)
                give_back_freed_memory()
        await self.control.load(str(path) if path is not None else None)
        return oip.RepositoryModelLoadResponse()

    async def unload(self, request: oip.RepositoryModelUnloadRequest) -> oip.RepositoryModelUnloadResponse:
        self._allowed()
        self._known(request.model_name)
        await self.control.unload()
        return oip.RepositoryModelUnloadResponse()

    def _allowed(self) -> None:
        if not self.explicit:
            raise PermissionDenied("the model repository is read-only: start the server with --model-control "
                                   "explicit to load and unload models (or send it SIGHUP to reload --weights)")

    def _known(self, name: str) -> None:
        if name not in self.names:
            raise NotFound(f"unknown model {name!r}; this server serves {' and '.join(map(repr, self.names))}")

    async def _received_weights(self, files: list[tuple[str, memoryview]]) -> Path | None:
        """The file of weights the request carries, written where the engines read it and checked; None if it
        carries none (reload from --weights)."""
        if not files:
            return None
        if len(files) > 1:
            raise InvalidInput(f"{len(files)} files sent; send one file of weights (a ResNet18 state_dict saved "
                               "by torch.save, or a safetensors file)")
        (name, data), = files
        if len(data) > self.max_weights_bytes:
            raise InvalidInput(f"{name} is {len(data) / 2**20:.1f} MiB, over --max-weights-mb "
                               f"{self.max_weights_bytes // 2**20}")
        if self.control.uploads is None:
            raise InvalidInput("this front-end has no folder for weights a client sends")
        # The engines serve a file of the kind they started with: an ONNX model (--weights FILE.onnx), or weights.
        serves_onnx = self.control.served.source.endswith(".onnx")
        path = self.control.uploads / f"{uuid.uuid4().hex}.{'onnx' if serves_onnx else 'weights'}"
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, _write_private, path, data)
            if serves_onnx:
                await loop.run_in_executor(self._executor, check_onnx_file, path, name, self.precision)
            else:
                await loop.run_in_executor(self._executor, check_weights_file, path)
        except WeightsError as exc:  # said of the file as the client named it, not of the server's copy
            path.unlink(missing_ok=True)
            raise InvalidInput(str(exc).replace(str(path), name).replace(path.name, name)) from None
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path


def _write_private(path: Path, data: memoryview) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def _check_config(request: oip.RepositoryModelLoadRequest, served: mc.ModelConfig) -> None:
    """A ``config`` parameter is accepted where it asks for what is served already; else INVALID_ARGUMENT naming
    the first field it would change (this server serves one model, as its flags say)."""
    if "config" not in request.parameters:
        return
    asked = mc.ModelConfig()
    try:  # its length is bounded before the request is read (resnet_server.frontend.bounds: MOST_CONFIG_BYTES)
        json_format.Parse(request.parameters["config"].string_param, asked)
    except json_format.ParseError as exc:
        raise InvalidInput(f"config is not a ModelConfig in JSON: {str(exc)[:200]}") from None
    except RecursionError:  # JSON nested deeper than Python's stack
        raise InvalidInput("config is not a ModelConfig in JSON: nested too deeply") from None
    for field, value in asked.ListFields():
        if getattr(served, field.name) != value:
            raise InvalidInput(f"config asks for {field.name} {_shown(value)[:200]}; this server serves "
                               f"{_shown(getattr(served, field.name))} and cannot change it at load (its flags "
                               "decide it)")


def _shown(value: object) -> str:
    return json_format.MessageToJson(value, indent=None) if isinstance(value, Message) else repr(value)
