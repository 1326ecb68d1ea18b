"""Server configuration: one frozen dataclass, built from flags and their environment twins.

Every flag ``--some-flag`` also reads ``RESNET_SERVER_SOME_FLAG``; a flag given on the command
line wins over the environment, which wins over the default. Only ``main()`` calls
:func:`parse_config`, so importing the server never reads argv or the environment.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import socket
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resnet_client.flags import (
    int_between,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from resnet_server.common.event_loop import EVENT_LOOPS, uvloop_installed
from resnet_server.common.flag_files import read_temperature, read_token_entries
from resnet_server.common.logs import LOG_FORMATS

# torch.compile's own mode names; reduce-overhead replays CUDA graphs, and max-autotune also tries kernel choices.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")

ENV_PREFIX = "RESNET_SERVER_"


class ConfigError(ValueError):
    """A flag or environment variable has a value the server cannot start with."""


# --max-batch-size 0 picks by device: a GPU's forward pass still gains up to 128, and one engine batching every
# front-end's calls forms batches that large under load; a CPU's cost per image rises past a few images, and a
# larger cap splits closed-loop callers into uneven batches (docs/performance.md, "Figures behind the code").
DEFAULT_MAX_BATCH_SIZE = {"cuda": 128, "cpu": 8}
# Every batch size up to --max-batch-size is warmed before SERVING, the largest with its whole input in memory:
# past this a batch gains nothing on any device served here, and a typo (100000) would exhaust memory at start-up.
MAX_BATCH_SIZE_LIMIT = 1024


# After a wait for answered callers runs out, the next waits are skipped: as many as the skip stands at,
# which starts at one, doubles with each wait that runs out (at most this many) and halves with each whose
# callers come back. Traffic whose callers do not come back (open loop, callers that pause) then pays the
# wait about once in this many batches rather than on every batch (its chance arrivals that look like
# callers coming back only slow the climb, where starting over at one would wait twice as often), while a
# closed loop that straggled once is waited for again after a single batch (ten batches of turns cost it a
# tenth of its throughput and its latency's spread).
MOST_WAITS_SKIPPED = 10


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    http_port: int = 8080  # 0: no HTTP
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8000
    devices: tuple[str, ...] = ("auto",)
    weights: str = "imagenet"
    temperature: float = 1.0
    temperature_file: str | None = None
    max_batch_size: int = 0  # 0: per device (DEFAULT_MAX_BATCH_SIZE)
    max_batch_delay_ms: float = 0.0
    wait_for_callers_ms: float = 0.0
    max_queue: int = 256
    max_images_per_request: int = 64
    max_pixels: int = 40_000_000
    max_message_mb: int = 64
    model_control: str = "none"  # explicit: the model repository RPCs may reload the weights
    max_weights_mb: int = 50  # a little over ResNet18's fp32 state_dict (44.7 MiB)
    otlp_endpoint: str | None = None  # None: tracing off (unless the SDK's OTEL_EXPORTER_OTLP_* variables say)
    trace_rate: float = 1.0
    allow_client_shm: bool = False  # Triton's system shared-memory extension (off, as Triton's own default)
    max_shm_regions: int = 64  # per client token
    max_shm_mb: int = 4096  # per client token, every region's byte_size together
    max_concurrent_streams: int = 128
    max_connection_age: float = 0.0  # 0: connections live as long as their clients keep them
    preprocess_threads: int = 2
    torch_threads: int = 0
    switch_interval_ms: float = 0.5  # Python's own is 5 (see the flag's help)
    grace_period: float = 10.0
    replica_probe_interval: float = 30.0
    unhealthy_exit_after: float = 300.0  # 0: never
    stuck_batch_timeout: float = 60.0  # 0: never
    log_level: str = "INFO"
    log_format: str = "text"
    precision: str = "fp32"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_file: str | None = None
    auth_health: bool = False
    channels_last: bool = True
    cudnn_benchmark: bool = True
    compile: bool = False
    compile_mode: str = "default"
    compile_cache: str | None = None  # None: inductor's own folder (under the temp folder)
    torchscript: bool = False
    cuda_graphs: str = "auto"  # true, false, or auto: see uses_cuda_graphs
    decode_on_device: str = "auto"
    frontends: int = 0  # 0: auto (resnet_server.supervisor.launcher.frontend_count)
    event_loop: str = "auto"  # the front-ends' (resnet_server.common.event_loop)
    runner: str = "model"  # what runs the engines' batches (resnet_server.engine.runners)
    runtime: str = "torch"  # what runs the forward pass: PyTorch, or ONNX Runtime (resnet_server.engine.onnx_runtime)
    onnx_provider: str = "auto"  # ONNX Runtime's execution provider: cpu, openvino, or auto (openvino where installed)
    fair_share: str = "auto"  # who shares a device fairly: callers by token, by peer address, or off

    def __post_init__(self) -> None:
        """Each field of the type it is declared with, and each choice one of its values: a configuration built in
        code (a test, a script) is checked as the flag parser checks a command line. ConfigError if not."""
        for name, expected in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not _has_type(value, expected):
                shown = expected.__name__ if isinstance(expected, type) else str(expected)
                raise ConfigError(f"{name} must be {shown}, got {value!r} ({type(value).__name__})")
        for name, options in _CHOICES.items():
            if getattr(self, name) not in options:
                raise ConfigError(f"{name} must be one of {', '.join(options)}, got {getattr(self, name)!r}")
        try:
            runner_spec(self.runner)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"runner {exc}") from None

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether CUDA replicas replay captured graphs: asked for, or auto while neither --compile nor
        --torchscript chooses how the model runs (the CPU runs eager whatever this says)."""
        return self.cuda_graphs == "true" or (self.cuda_graphs == "auto" and not (self.compile or self.torchscript))

    @property
    def largest_batch(self) -> int:
        """The most images a batch can hold on any device this configuration may serve."""
        return self.max_batch_size or max(DEFAULT_MAX_BATCH_SIZE.values())


_FIELD_TYPES = typing.get_type_hints(ServerConfig)
FlagType = Callable[[str], Any]  # what argparse calls with a flag's text: the value, or an error
AUTO_BOOLEAN = ("true", "false", "auto")


def _has_type(value: object, expected: object) -> bool:
    """isinstance for the field types ServerConfig uses; a bool is no number here, though Python's bool is an int."""
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(expected) is tuple:
        return isinstance(value, tuple) and all(isinstance(item, str) for item in value)
    if isinstance(expected, types.UnionType):
        return any(_has_type(value, option) for option in typing.get_args(expected))
    return isinstance(expected, type) and isinstance(value, expected)


def _one_of(*options: str) -> Callable[[str], str]:
    """A flag type that accepts exactly one of ``options``."""
    listed = f"{', '.join(options[:-1])} or {options[-1]}"

    def check(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"must be {listed}, got {text!r}")
        return text

    return check


PRECISIONS = ("fp32", "fp16", "bf16", "int8")
RUNTIMES = ("torch", "onnxruntime")
ONNX_PROVIDERS = ("auto", "cpu", "openvino")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MODEL_CONTROL_MODES = ("none", "explicit")
FAIR_SHARE_MODES = ("auto", "token", "peer", "off")
# The fields that take one of a few values, and those values (what the flags below accept, and what a
# configuration built in code is checked against).
_CHOICES = {"precision": PRECISIONS, "compile_mode": COMPILE_MODES, "log_format": LOG_FORMATS,
            "event_loop": EVENT_LOOPS, "log_level": LOG_LEVELS, "cuda_graphs": AUTO_BOOLEAN,
            "decode_on_device": AUTO_BOOLEAN, "model_control": MODEL_CONTROL_MODES, "runtime": RUNTIMES,
            "fair_share": FAIR_SHARE_MODES, "onnx_provider": ONNX_PROVIDERS}
_precision = _one_of(*PRECISIONS)
_runtime = _one_of(*RUNTIMES)
_onnx_provider = _one_of(*ONNX_PROVIDERS)
_compile_mode = _one_of(*COMPILE_MODES)
_log_format = _one_of(*LOG_FORMATS)
_model_control = _one_of(*MODEL_CONTROL_MODES)
_fair_share = _one_of(*FAIR_SHARE_MODES)


def _endpoint(text: str) -> str | None:
    """An OTLP receiver's address; empty: none (tracing off), so that a deployment can leave the variable blank."""
    return text.strip() or None


def _ratio(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value
_event_loop = _one_of(*EVENT_LOOPS)


def _log_level(text: str) -> str:
    return _one_of(*LOG_LEVELS)(text.strip().upper())


def runner_spec(text: str) -> str:
    """model, free[:MS] or faulty:FILE (resnet_server.engine.runners says what each does)."""
    kind, colon, argument = text.partition(":")
    valid = (kind == "model" and not colon) or (kind == "faulty" and argument) or (
        kind == "free" and (not colon or _is_milliseconds(argument)))
    if not valid:
        raise argparse.ArgumentTypeError(f"must be model, free[:MS] or faulty:FILE, got {text!r}")
    return text


def _is_milliseconds(text: str) -> bool:
    try:
        non_negative_float(text)
    except argparse.ArgumentTypeError:
        return False
    return True


def weights_source(text: str) -> str:
    """imagenet, random, or a file that exists: a misspelt name or a wrong path is refused before any process
    starts, rather than by each engine after the others have started."""
    if text in ("imagenet", "random") or os.path.isfile(text):
        return text
    raise argparse.ArgumentTypeError(f"must be imagenet, random or the path of a state_dict file; "
                                     f"{text!r} is neither, and no such file exists")


def writable_folder(text: str) -> str:
    """A folder this process may write in, made if missing: a wrong path is refused at start-up, not met by each
    engine as it compiles."""
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the folder {text!r}: {exc.strerror}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"the folder {text!r} is not writable by this user")
    return text


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def _auto_boolean(text: str) -> str:
    if text.strip().lower() == "auto":
        return "auto"
    return "true" if _boolean(text) else "false"


def _auto_count(text: str) -> int:
    """A positive count, or auto (0)."""
    return 0 if text.strip().lower() == "auto" else positive_int(text)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _device_list(text: str) -> tuple[str, ...]:
    """The devices' names, checked as names here; whether this machine has them, when the server starts."""
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise argparse.ArgumentTypeError("needs at least one device")
    for device in devices:
        if not _DEVICE.fullmatch(device):
            raise argparse.ArgumentTypeError(f"unknown device {device!r}: use cpu, cuda, cuda:N, auto, or a "
                                             "comma-separated list")
    return devices


_batch_size_cap = int_between(0, MAX_BATCH_SIZE_LIMIT)


def readable_file(text: str) -> str:
    """A file this user can read: a wrong path is refused before any process starts, not by each front-end."""
    try:
        with open(text, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc.strerror}") from None
    return text


def bind_address(text: str) -> str:
    """An address this machine can listen on: an IP address of its own (IPv6 with or without brackets), 0.0.0.0 or
    :: for all, or a name that resolves to one. Refused here rather than by each front-end's failed start."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError):
        raise argparse.ArgumentTypeError(f"{text!r} is neither an IP address nor a name this machine resolves") \
            from None
    for family, kind, protocol, _, address in found:
        with socket.socket(family, kind, protocol) as probe:
            try:
                probe.bind(address)  # port 0: a free one, given back at once
                return host
            except OSError:
                continue
    raise argparse.ArgumentTypeError(f"{text!r} is not an address of this machine")


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC and URLs read it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _file_that(read: Callable[[str], object]) -> Callable[[str], str]:
    """A flag's type: the path of a file that ``read`` reads without a ValueError."""
    def checked(text: str) -> str:
        try:
            read(readable_file(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    checked.__name__ = f"file_{read.__name__}"
    return checked


_temperature_file = _file_that(read_temperature)
_token_file = _file_that(read_token_entries)


def tls_problem(cert: str | None, key: str | None, client_ca: str | None) -> str | None:
    """Why the TLS flags cannot go together, or None: a certificate without its key (or the other way round), or
    a client CA without both."""
    if bool(cert) != bool(key):
        return "TLS needs both --tls-cert and --tls-key"
    if client_ca and not cert:
        return "--tls-client-ca needs --tls-cert and --tls-key"
    return None


# (flag, type, help). Defaults come from ServerConfig so they live in one place. The help is also the README's
# flags table (flags_table(); tests/test_config.py checks that they agree), so it says what a user needs there.
FLAGS: list[tuple[str, FlagType, str]] = [
    ("host", bind_address, "gRPC bind address: an address of this machine, 0.0.0.0 or :: for all"),
    ("port", port_number, "gRPC port, 0 to 65535 (0 picks a free one)"),
    ("http-port", port_number, "HTTP port on the same address, 0 to 65535 (0 turns HTTP off): the Open Inference "
                               "Protocol's REST API with Triton's binary tensors, and POST /v1/classify in JSON "
                               "(docs/api.md); the front-ends share it as they share the gRPC port"),
    ("metrics-host", bind_address, "/metrics bind address; expose it only inside the cluster"),
    ("metrics-port", port_number, "/metrics port of the whole server, 0 to 65535 (0 turns the endpoint off); the "
                                  "engines and front-ends serve theirs on loopback ports the system picks, which "
                                  "the supervisor reads for each scrape"),
    ("device", _device_list, "cpu, cuda, cuda:N, auto (every visible GPU, else cpu), or a comma-separated list, "
                             "one engine each"),
    ("weights", weights_source, "imagenet (torchvision's, cached under TORCH_HOME), random (seeded, untrained), "
                                "or the PATH of a state_dict file (a plain state_dict, a checkpoint dict with "
                                "state_dict or model, module.-prefixed keys; saved on any device), or of an ONNX "
                                "model (.onnx, with --runtime onnxruntime: one `resnet-server quantize` made); "
                                "checked before any process starts"),
    ("temperature", positive_float, "default softmax temperature T, finite and > 0; each request may override it"),
    ("temperature-file", _temperature_file, "JSON {\"temperature\": T} (as written by resnet-client "
                                            "calibrate); wins over --temperature"),
    ("max-batch-size", _batch_size_cap, f"most images in one forward pass, at most {MAX_BATCH_SIZE_LIMIT}; 0 = by "
                                        f"device: {DEFAULT_MAX_BATCH_SIZE['cuda']} on CUDA, "
                                        f"{DEFAULT_MAX_BATCH_SIZE['cpu']} on the CPU, or --max-queue if less. "
                                        "Batches run only at sizes warmed before SERVING (1, 2, 4, 8, 16, 24, 32, "
                                        "48 ... up to this): CUDA pads up to the next (resnet_padded_images_total), "
                                        "the CPU splits"),
    ("max-batch-delay-ms", non_negative_float, "how long the oldest waiting image may wait for a fuller batch"),
    ("wait-for-callers-ms", non_negative_float, "after answering a batch, how long a device may wait for as many "
                                                 "new images as it held before starting a smaller one: for "
                                                 "closed-loop callers, who otherwise split into two batches that "
                                                 "take turns (0: off)"),
    ("max-queue", positive_int, "images accepted per device and not yet answered, for the whole server (its "
                                 "engine's shared-memory slots); beyond it RESOURCE_EXHAUSTED at once"),
    ("max-images-per-request", positive_int, "most images in one request; more is INVALID_ARGUMENT"),
    ("max-pixels", positive_int, "most pixels (H*W) per image, checked from the header before decoding "
                                 "(decompression bombs)"),
    ("max-message-mb", positive_int, "largest gRPC message received or sent, in MiB"),
    ("model-control", _model_control, "explicit: the Open Inference Protocol's model repository RPCs "
                                      "(RepositoryModelLoad, RepositoryModelUnload, RepositoryIndex; `resnet-client "
                                      "reload`) may load new weights while serving; none: they answer "
                                      "PERMISSION_DENIED. SIGHUP reloads --weights either way"),
    ("max-weights-mb", positive_int, "largest file of weights a client may send to load (--model-control explicit), "
                                     "in MiB; gRPC's receive limit grows to it if --max-message-mb is less, while "
                                     "inference requests keep --max-message-mb"),
    ("allow-client-shm", _boolean, "clients on this machine may register system shared-memory regions (files "
                                   "under /dev/shm) and send inputs and take outputs through them (Triton's "
                                   "system shared-memory extension); off, those RPCs answer PERMISSION_DENIED"),
    ("max-shm-regions", positive_int, "most shared-memory regions one client token (without tokens: all clients) "
                                      "may hold registered"),
    ("max-shm-mb", positive_int, "most bytes, in MiB, one client token's shared-memory regions may span together "
                                 "(they are read and written in place, not mapped or copied into the server)"),
    ("fair-share", _fair_share, "how a device is shared when callers want more than it computes: token (each bearer "
                                "token's calls take their turn), peer (each client address's), off (first come, "
                                "first served), or auto: token with --auth-token-file, else peer. Within a "
                                "caller, Triton's priority parameter orders its calls (docs/operations.md)"),
    ("max-concurrent-streams", positive_int, "most concurrent RPCs per HTTP/2 connection"),
    ("max-connection-age", non_negative_float, "seconds after which a connection is asked to reconnect (HTTP/2 "
                                                "GOAWAY, +-10% jitter; calls in flight get --grace-period), so "
                                                "that clients rebalance over servers and front-ends added since "
                                                "(0: never)"),
    ("preprocess-threads", positive_int, "threads of each front-end that decode and preprocess images (each runs "
                                         "torch one-threaded)"),
    ("torch-threads", non_negative_int, "torch threads of each engine (0: every core for a CPU, one host thread "
                                        "for a GPU)"),
    ("switch-interval-ms", positive_float, "how long a Python thread holds the GIL while another waits for it "
                                           "(sys.setswitchinterval), in the front-ends and the engines; shorter "
                                           "lets an engine launch its next GPU batch sooner while its other "
                                           "threads are busy (Python's own is 5 ms)"),
    ("frontends", _auto_count, "gRPC front-end processes sharing the port (SO_REUSEPORT) and feeding one engine "
                               "process per device through shared memory; auto: half the cores left after one "
                               "per device, 1 to 8 (also accepted as --workers and RESNET_SERVER_WORKERS)"),
    ("event-loop", _event_loop, "the front-ends' event loop: uvloop (libuv; less front-end CPU a call, "
                                "docs/performance.md), asyncio (Python's own), or auto: uvloop where installed "
                                "(the server extra installs it)"),
    ("grace-period", non_negative_float, "seconds to finish accepted calls after SIGTERM or SIGINT"),
    ("replica-probe-interval", non_negative_float, "seconds between test batches (one blank image) on a device "
                                                    "taken out of rotation; it rejoins when one passes (0: it "
                                                    "stays out until the server restarts)"),
    ("unhealthy-exit-after", non_negative_float, "seconds out of rotation after which an engine drains and "
                                                  "exits 1, and the supervisor replaces it (a fresh process, a "
                                                  "fresh CUDA context) while the front-ends keep the port; a "
                                                  "front-end run alone gives up after as long with no device in "
                                                  "rotation (0: never)"),
    ("stuck-batch-timeout", non_negative_float, "seconds a launched batch may go unanswered before its engine "
                                                "is ended and the supervisor starts a new one (a hung device or "
                                                "thread; 0: never)"),
    ("otlp-endpoint", _endpoint, "turns tracing on (empty: off): OpenTelemetry spans of every call to this OTLP "
                                 "receiver, over HTTP for http(s)://HOST:PORT/v1/traces, else over gRPC (HOST:PORT, or "
                                 "http(s)://HOST:PORT); the SDK's OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
                                 "OTEL_EXPORTER_OTLP_ENDPOINT, _PROTOCOL and OTEL_SERVICE_NAME are honoured too"),
    ("trace-rate", _ratio, "with tracing on: the share of calls without a caller's traceparent that are traced, 0 "
                           "to 1 (a caller's sampled flag decides for its own calls)"),
    ("log-level", _log_level, "DEBUG, INFO, WARNING or ERROR"),
    ("log-format", _log_format, "text (readable lines) or json (one object per line: time UTC, level, logger, "
                                "message, exception)"),
    ("tls-cert", readable_file, "server certificate chain (PEM); with --tls-key turns TLS on (plaintext is then "
                                "refused)"),
    ("tls-key", readable_file, "server private key (PEM)"),
    ("tls-client-ca", readable_file, "mutual TLS: clients must present a certificate from this CA (PEM)"),
    ("auth-token-file", _token_file, "accepted bearer tokens, one per line (# comments), each optionally "
                                     "followed by name=NAME (its label in metrics) and weight=N (its share with "
                                     "--fair-share); calls without 'authorization: Bearer <token>' get "
                                     "UNAUTHENTICATED"),
    ("auth-health", _boolean, "also require the token on grpc.health.v1.Health (kept open by default for "
                              "orchestrator probes)"),
    ("precision", _precision, "fp32, fp16 or bf16 weights and activations (the softmax in float64, then fp32); "
                              "bf16 is faster than fp32 on CPUs with AMX or AVX-512 BF16 (docs/operations.md); int8: "
                              "an ONNX model `resnet-server quantize` made, given as --weights, with --runtime "
                              "onnxruntime"),
    ("channels-last", _boolean, "channels_last memory format, on CUDA and on the CPU (faster convolutions)"),
    ("cudnn-benchmark", _boolean, "cuDNN autotuning, paid at warm-up for every warmed batch size before SERVING"),
    ("compile", _boolean, "torch.compile (inductor, weights frozen) for every warmed batch size at warm-up, before "
                          "SERVING; needs a C++ compiler at start-up (the container image has one)"),
    ("compile-mode", _compile_mode, "with --compile: default, reduce-overhead (each batch size recorded as a "
                                    "CUDA graph at warm-up and replayed; as default on the CPU), or max-autotune "
                                    "(as reduce-overhead, and inductor times several kernels for each operation "
                                    "at warm-up and keeps the fastest: a longer start)"),
    ("compile-cache", writable_folder, "with --compile: the folder where inductor keeps what it compiles (kernels; "
                                       "on a GPU whole graphs), reused by the next start; inductor keys it on "
                                       "torch's version, the device, the precision and each batch size, so a "
                                       "change compiles afresh. Default: inductor's own folder under the temp "
                                       "folder, which a container loses. With --runtime onnxruntime: where the "
                                       "ONNX export is kept, by its weights' SHA-256 and the versions"),
    ("torchscript", _boolean, "run the model and softmax as a frozen TorchScript graph traced at start-up (the "
                              "GIL held once a batch instead of at every operator; docs/operations.md); not with "
                              "--compile"),
    ("cuda-graphs", _auto_boolean, "on CUDA, capture the model and softmax as one CUDA graph per warmed batch size "
                                   "at start-up and replay it per batch (no compiler); auto: on unless --compile "
                                   "or --torchscript is asked for; false: eager; nothing changes on the CPU"),
    ("runtime", _runtime, "what runs the forward pass: torch (PyTorch), or onnxruntime: the served weights exported "
                          "to ONNX at start-up (kept in --compile-cache, or a folder under the temp folder, by their "
                          "SHA-256 and the versions) and run by ONNX Runtime's CPU execution provider with "
                          "--torch-threads' threads; fp32 on CPU devices, not with --compile or --torchscript (the "
                          "server extra installs it; docs/operations.md)"),
    ("onnx-provider", _onnx_provider, "with --runtime onnxruntime, its execution provider: cpu (ONNX Runtime's own "
                                      "kernels), openvino (Intel's OpenVINO, through ONNX Runtime's OpenVINO execution "
                                      "provider: onnxruntime-openvino installed in place of onnxruntime), or auto: "
                                      "openvino where that build is installed, else cpu; one that fails to load falls "
                                      "back to cpu with a warning saying why (docs/operations.md)"),
    ("runner", runner_spec, "what runs each batch: model; or, to measure the serving path's own cost, free[:MS]: no "
                            "forward pass, ready-made scores landing MS ms after the launch (answers meaningless); or "
                            "faulty:FILE: the model, its batches failing as FILE says (fault injection for tests; "
                            "docs/operations.md)"),
    ("decode-on-device", _auto_boolean, "decode JPEGs in batches on the device (nvjpeg on CUDA) and preprocess "
                                        "there; auto: on for CUDA, off for the CPU"),
]


# Old names that still work: --workers was whole server processes before there were engine processes.
_ALIASES = {"frontends": ("--workers",)}


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.upper().replace("-", "_")


def _field_name(flag: str) -> str:
    return "devices" if flag == "device" else flag.replace("-", "_")


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resnet-server",
        description="ResNet18 image classification over gRPC. Every flag has an environment twin "
        f"{ENV_PREFIX}<FLAG> (e.g. {env_name('device')}=cuda:1); flags win. A boolean flag alone means true "
        "(--compile is --compile true). `resnet-server bench-model --help`: the in-process benchmark.",
    )
    defaults = ServerConfig()
    for flag, kind, help_text in FLAGS:
        name = env_name(flag)
        default = getattr(defaults, _field_name(flag))
        for alias in (name, *(env_name(old.removeprefix("--")) for old in _ALIASES.get(flag, ()))):
            if alias in env:
                default = _from_env(alias, env[alias], kind)
                break
        shown = _shown_default(kind, default)
        # A boolean flag alone means true: `--compile` is `--compile true`.
        optional_value: dict[str, Any] = {}
        if kind in (_boolean, _auto_boolean):
            optional_value = {"nargs": "?", "const": kind("true")}
        parser.add_argument(f"--{flag}", *_ALIASES.get(flag, ()), dest=_field_name(flag), type=kind, default=default,
                            **optional_value, help=_escaped(f"{help_text} [env {name}; default {shown}]"))
    return parser


def _escaped(help_text: str) -> str:
    """argparse %-formats every help string (for %(default)s): a literal % must be doubled."""
    return help_text.replace("%", "%%")


def _shown_default(kind: FlagType, default: object) -> str:
    """A default as a user would type it."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, tuple):
        return ",".join(default)
    if kind is _auto_count and not default:
        return "auto"
    return f"{default:g}" if isinstance(default, float) else str(default)


def flags_table() -> str:
    """The README's table of flags, from the same list as --help."""
    defaults = ServerConfig()
    rows = ["| flag | env | default | meaning |", "| --- | --- | --- | --- |"]
    for flag, kind, help_text in FLAGS:
        shown = _shown_default(kind, getattr(defaults, _field_name(flag)))
        rows.append(f"| `--{flag}` | `{env_name(flag)}` | `{shown}` | {help_text} |")
    return "\n".join(rows) + "\n"


def _from_env(name: str, text: str, kind: FlagType) -> object:
    try:
        return kind(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{name}={text!r}: {exc}") from None


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Build the configuration from argv (flags win) and env (``RESNET_SERVER_*``)."""
    env = os.environ if env is None else env
    namespace = build_parser(env).parse_args(argv)
    config = ServerConfig(**vars(namespace))
    if problem := graph_problem(config.compile, config.compile_mode, config.torchscript,
                                 config.cuda_graphs == "true"):
        raise ConfigError(problem)
    if problem := runtime_problem(config):
        raise ConfigError(problem)
    if problem := tls_problem(config.tls_cert, config.tls_key, config.tls_client_ca):
        raise ConfigError(problem)
    if problem := port_clash(config):
        raise ConfigError(problem)
    if config.fair_share == "token" and not config.auth_token_file:
        raise ConfigError("--fair-share token tells callers apart by their bearer tokens: it needs --auth-token-file "
                          "(or choose peer)")
    if config.max_batch_size > config.max_queue:
        raise ConfigError(f"--max-batch-size {config.max_batch_size} is over --max-queue {config.max_queue}, the "
                          "images a device holds at once: no batch could fill; raise --max-queue or lower the batch")
    if config.max_images_per_request > config.max_queue:
        raise ConfigError(f"--max-images-per-request {config.max_images_per_request} is over --max-queue "
                          f"{config.max_queue}, the images a device holds at once: such a request would be refused "
                          "for ever; raise --max-queue or lower the request limit")
    if config.event_loop == "uvloop" and not uvloop_installed():
        raise ConfigError("--event-loop uvloop: uvloop is not installed (pip install uvloop), or choose asyncio")
    return config


def port_clash(config: ServerConfig) -> str | None:
    """Two listeners given the same port where their addresses may be the same, or None."""
    listeners = [("--port", "gRPC", config.port, config.host), ("--http-port", "HTTP", config.http_port, config.host),
                 ("--metrics-port", "/metrics", config.metrics_port, config.metrics_host)]
    for index, (flag, what, port, host) in enumerate(listeners):
        for other_flag, other, other_port, other_host in listeners[index + 1:]:
            if port and port == other_port and _may_overlap(host, other_host):
                return f"{flag} and {other_flag} are both {port}: {what} and {other} need a port each"
    return None


def _may_overlap(host: str, other: str) -> bool:
    """Whether two bind addresses may be the same socket address: the same, or either of them every address."""
    return host == other or bool({host, other} & {"0.0.0.0", "::", ""})


HOW_TO_QUANTIZE = ("make one with resnet-server quantize --weights W --calibration DIR --out model.int8.onnx, "
                   "then serve --runtime onnxruntime --precision int8 --weights model.int8.onnx")


def runtime_problem(config: ServerConfig) -> str | None:
    """Why the runtime cannot serve as configured, or None: int8 is an ONNX file quantized for ONNX Runtime, and an
    ONNX file is served by ONNX Runtime only."""
    onnx_file = config.weights.endswith(".onnx")
    if config.precision == "int8" and not (onnx_file and config.runtime == "onnxruntime"):
        return f"--precision int8 serves an int8 ONNX model with --runtime onnxruntime: {HOW_TO_QUANTIZE}"
    if config.runtime != "onnxruntime":
        return f"--weights {config.weights[-64:]}: an ONNX file is served with --runtime onnxruntime" \
            if onnx_file else None
    if config.precision not in ("fp32", "int8"):
        return f"--runtime onnxruntime serves fp32 or int8, not --precision {config.precision}"
    chosen = [flag for flag, on in (("--compile", config.compile), ("--torchscript", config.torchscript),
                                    ("--cuda-graphs true", config.cuda_graphs == "true")) if on]
    if chosen:
        return f"--runtime onnxruntime and {' and '.join(chosen)} exclude each other: choose one"
    if any(device.startswith("cuda") for device in config.devices):
        return "--runtime onnxruntime runs on the CPU: serve --device cpu, or run torch on a GPU"
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return "--runtime onnxruntime: ONNX Runtime is not installed (pip install 'resnet-grpc[server]')"
    return None


def graph_problem(compile: bool, mode: str, torchscript: bool, cuda_graphs: bool = False) -> str | None:
    """Why the flags that choose how the model runs cannot go together, or None: a compile mode other than
    default without --compile, or more than one of --compile, --torchscript and --cuda-graphs."""
    chosen = [flag for flag, on in (("--compile", compile), ("--torchscript", torchscript),
                                    ("--cuda-graphs", cuda_graphs)) if on]
    if len(chosen) > 1:
        return f"{' and '.join(chosen)} exclude each other: choose one"
    return None if compile or mode == "default" else f"--compile-mode {mode} needs --compile"
