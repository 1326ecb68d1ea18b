"""Server configuration: one frozen dataclass, built from flags and their environment twins.

Every flag ``--some-flag`` also reads ``RESNET_SERVER_SOME_FLAG``; a flag given on the command
line wins over the environment, which wins over the default. Only ``main()`` calls
:func:`parse_config`, so importing the server never reads argv or the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from client.flags import non_negative_float, non_negative_int, positive_float, positive_int

from .event_loop import EVENT_LOOPS, uvloop_installed
from .logs import LOG_FORMATS

# torch.compile's own mode names; reduce-overhead replays CUDA graphs.
COMPILE_MODES = ("default", "reduce-overhead")

ENV_PREFIX = "RESNET_SERVER_"


class ConfigError(ValueError):
    """A flag or environment variable has a value the server cannot start with."""


# --max-batch-size 0 picks by device. On an H100 the in-process forward pass still gained from 32 to 64 (fp32
# eager, 13,448 images/s at 64) and 128 (fp16 eager, 17,582): with one engine batching every front-end's calls,
# batches that large form under load, and a light load still runs what is waiting at once (padded to the next of
# the warmed sizes: under half as many rows again). On a CPU the cost per image rises past a few images
# (bench-model on 2 cores: batch 4-8 fastest), and with a cap of 32, 16 callers split into a small batch (1-4
# images) and a big one (9-16) in turn instead of two even batches of 8 (measured: 2-18% fewer images/s, p99/p50
# 1.33-1.44 against 1.20-1.26).
DEFAULT_MAX_BATCH_SIZE = {"cuda": 128, "cpu": 8}


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
    max_concurrent_streams: int = 128
    max_connection_age: float = 0.0  # 0: connections live as long as their clients keep them
    preprocess_threads: int = 2
    torch_threads: int = 0
    switch_interval_ms: float = 0.5  # Python's own is 5 (see the flag's help and the README)
    grace_period: float = 10.0
    replica_probe_interval: float = 30.0
    unhealthy_exit_after: float = 300.0  # 0: never
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
    torchscript: bool = False
    cuda_graphs: str = "auto"  # true, false, or auto: see uses_cuda_graphs
    decode_on_device: str = "auto"
    frontends: int = 0  # 0: auto (server.supervisor.frontend_count)
    event_loop: str = "auto"  # the front-ends' (server.event_loop)
    worker: int = 0  # a front-end process's index (set by server.supervisor, not a flag)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Whether CUDA replicas replay captured graphs: asked for, or auto while neither --compile nor
        --torchscript chooses how the model runs (the CPU runs eager whatever this says)."""
        return self.cuda_graphs == "true" or (self.cuda_graphs == "auto" and not (self.compile or self.torchscript))

    @property
    def largest_batch(self) -> int:
        """The most images a batch can hold on any device this configuration may serve."""
        return self.max_batch_size or max(DEFAULT_MAX_BATCH_SIZE.values())


def _one_of(*options: str) -> Callable[[str], str]:
    """A flag type that accepts exactly one of ``options``."""
    listed = f"{', '.join(options[:-1])} or {options[-1]}"

    def check(text: str) -> str:
        if text not in options:
            raise argparse.ArgumentTypeError(f"must be {listed}, got {text!r}")
        return text

    return check


_precision = _one_of("fp32", "fp16", "bf16")
_compile_mode = _one_of(*COMPILE_MODES)
_log_format = _one_of(*LOG_FORMATS)
_event_loop = _one_of(*EVENT_LOOPS)


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


def _device_list(text: str) -> tuple[str, ...]:
    devices = tuple(part.strip() for part in text.split(",") if part.strip())
    if not devices:
        raise argparse.ArgumentTypeError("needs at least one device")
    return devices


# (flag, type, help). Defaults come from ServerConfig so they live in one place.
_FLAGS: list[tuple[str, object, str]] = [
    ("host", str, "address the gRPC server binds to"),
    ("port", non_negative_int, "gRPC port (0 picks a free one)"),
    ("metrics-host", str, "address of the Prometheus /metrics endpoint"),
    ("metrics-port", non_negative_int, "Prometheus /metrics port (0 turns the endpoint off)"),
    ("device", _device_list, "cpu, cuda, cuda:N, auto, or a comma-separated list (one replica each)"),
    ("weights", str, "imagenet (torchvision, cached under TORCH_HOME), a PATH to a state_dict, or random"),
    ("temperature", positive_float, "default softmax temperature T (finite, > 0)"),
    ("temperature-file", str, "JSON file with a fitted temperature (resnet-client calibrate); overrides --temperature"),
    ("max-batch-size", non_negative_int, "most images in one forward pass; 0 = 32 on CUDA, 8 on the CPU"),
    ("max-batch-delay-ms", non_negative_float, "longest the oldest queued image waits for a fuller batch"),
    ("wait-for-callers-ms", non_negative_float, "after answering a batch, longest a replica waits for as many new "
                                                 "images as it answered before starting a smaller batch: for "
                                                 "closed-loop callers, who send again once answered (0: off)"),
    ("max-queue", positive_int, "images accepted per replica and not yet answered; beyond it new requests get "
                                 "RESOURCE_EXHAUSTED at once"),
    ("max-images-per-request", positive_int, "most images in one request"),
    ("max-pixels", positive_int, "most pixels (H*W) in one image; guards against decompression bombs"),
    ("max-message-mb", positive_int, "largest gRPC message received or sent, in MiB"),
    ("max-concurrent-streams", positive_int, "most concurrent RPCs per HTTP/2 connection"),
    ("max-connection-age", non_negative_float, "seconds after which the server asks a client to reconnect "
                                                "(HTTP/2 GOAWAY; calls in flight get --grace-period), so that "
                                                "clients rebalance over servers and workers added since (0: never)"),
    ("preprocess-threads", positive_int, "threads that decode and preprocess images (one torch thread each)"),
    ("torch-threads", non_negative_int, "torch threads of each replica (0: every core for a CPU, one for a GPU)"),
    ("switch-interval-ms", positive_float, "how long a Python thread holds the GIL while another waits for it "
                                            "(sys.setswitchinterval), in every process; shorter lets an engine's "
                                            "batcher launch its next GPU kernel sooner while its other threads "
                                            "are busy"),
    ("frontends", _auto_count, "gRPC front-end processes sharing the port (SO_REUSEPORT) and feeding one engine "
                               "process per device through shared memory; auto: half the cores left after one "
                               "per device, 1 to 8 (--workers is the old name)"),
    ("event-loop", _event_loop, "the front-ends' event loop: uvloop (libuv; 7-21% less CPU a call), asyncio "
                                "(Python's own), or auto: uvloop where installed (the server extra installs it)"),
    ("grace-period", non_negative_float, "seconds to finish accepted calls on SIGTERM/SIGINT"),
    ("replica-probe-interval", non_negative_float, "seconds between test batches (one blank image) on a replica "
                                                    "taken out of rotation; it rejoins when one passes (0: it "
                                                    "stays out until the server restarts)"),
    ("unhealthy-exit-after", non_negative_float, "seconds with no replica in rotation after which the server "
                                                  "drains and exits 1, so that its orchestrator (or, with "
                                                  "--workers, the supervisor) replaces it (0: never)"),
    ("log-level", str, "DEBUG, INFO, WARNING or ERROR"),
    ("log-format", _log_format, "text (readable lines) or json (one object per line, for log pipelines)"),
    ("tls-cert", str, "server certificate chain (PEM); with --tls-key turns TLS on"),
    ("tls-key", str, "server private key (PEM)"),
    ("tls-client-ca", str, "CA (PEM) that client certificates must chain to: mutual TLS, certificates required"),
    ("auth-token-file", str, "file of accepted bearer tokens, one per line; calls without one get UNAUTHENTICATED"),
    ("auth-health", _boolean, "require the token on the health service too (probes then need it)"),
    ("precision", _precision, "fp32, fp16 or bf16 weights and activations (softmax is always fp32)"),
    ("channels-last", _boolean, "channels_last memory format (faster convolutions on CUDA and the CPU)"),
    ("cudnn-benchmark", _boolean, "let cuDNN autotune convolutions (at warm-up, before SERVING)"),
    ("compile", _boolean, "torch.compile the model for each power-of-two batch size up to --max-batch-size "
                          "(at warm-up, before SERVING); other batch sizes run as compiled pieces on the CPU, "
                          "padded on CUDA"),
    ("compile-mode", _compile_mode, "with --compile: default, or reduce-overhead (each compiled graph replayed as "
                                    "a CUDA graph on CUDA replicas, recorded at warm-up; the same as default on "
                                    "the CPU)"),
    ("torchscript", _boolean, "run the model as a frozen TorchScript graph (traced at start-up): the whole forward "
                              "pass in C++, holding the GIL once instead of at every operator, so a busy event "
                              "loop no longer slows it (see the README's Devices section); not with --compile"),
    ("cuda-graphs", _auto_boolean, "on CUDA devices, capture the model and softmax as one CUDA graph per warmed "
                                   "batch size at start-up and replay it for each batch (a few calls from Python a "
                                   "batch instead of about 64; no compiler needed); auto: on unless --compile or "
                                   "--torchscript chooses the runner; nothing changes on the CPU"),
    ("decode-on-device", _auto_boolean, "decode JPEGs in batches on the replica's device (nvjpeg on CUDA) and "
                                        "resize/normalise there; auto: on for CUDA devices, off for the CPU"),
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
        f"{ENV_PREFIX}<FLAG> (e.g. {env_name('device')}=cuda:1); flags win.",
    )
    defaults = ServerConfig()
    for flag, kind, help_text in _FLAGS:
        name = env_name(flag)
        default = getattr(defaults, _field_name(flag))
        for alias in (name, *(env_name(old.removeprefix("--")) for old in _ALIASES.get(flag, ()))):
            if alias in env:
                default = _from_env(alias, env[alias], kind)
                break
        shown = ",".join(default) if isinstance(default, tuple) else default
        # A boolean flag alone means true: `--compile` is `--compile true`.
        optional_value = {"nargs": "?", "const": kind("true")} if kind in (_boolean, _auto_boolean) else {}
        shown = "auto" if kind is _auto_count and not default else shown
        parser.add_argument(f"--{flag}", *_ALIASES.get(flag, ()), dest=_field_name(flag), type=kind, default=default,
                            **optional_value, help=f"{help_text} [env {name}; default {shown}]")
    return parser


def _from_env(name: str, text: str, kind) -> object:
    try:
        return kind(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{name}={text!r}: {exc}") from None


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Build the configuration from argv (flags win) and env (``RESNET_SERVER_*``)."""
    env = os.environ if env is None else env
    namespace = build_parser(env).parse_args(argv)
    config = ServerConfig(**vars(namespace))
    if config.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ConfigError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {config.log_level!r}")
    if problem := graph_problem(config.compile, config.compile_mode, config.torchscript,
                                 config.cuda_graphs == "true"):
        raise ConfigError(problem)
    if config.event_loop == "uvloop" and not uvloop_installed():
        raise ConfigError("--event-loop uvloop: uvloop is not installed (pip install uvloop), or choose asyncio")
    return config


def graph_problem(compile: bool, mode: str, torchscript: bool, cuda_graphs: bool = False) -> str | None:
    """Why the flags that choose how the model runs cannot go together, or None: a compile mode other than
    default without --compile, or more than one of --compile, --torchscript and --cuda-graphs."""
    chosen = [flag for flag, on in (("--compile", compile), ("--torchscript", torchscript),
                                    ("--cuda-graphs", cuda_graphs)) if on]
    if len(chosen) > 1:
        return f"{' and '.join(chosen)} exclude each other: choose one"
    return None if compile or mode == "default" else f"--compile-mode {mode} needs --compile"
