"""What each process takes of the server's configuration: the flags (``ServerConfig``) split by the process that
acts on them. The supervisor builds a section for each child from the configuration it checked, so a child sees
the settings it uses and no other, and nothing of its own identity (a front-end's index comes beside it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from resnet_server.common.config import ServerConfig


@dataclass(frozen=True)
class Observability:
    """Every process's logs."""

    log_level: str
    log_format: str


@dataclass(frozen=True)
class Network:
    """A front-end's gRPC and HTTP listeners: where, how large, how long, and who may call."""

    host: str
    port: int
    http_port: int  # 0: no HTTP
    max_message_mb: int
    max_concurrent_streams: int
    max_connection_age: float
    tls_cert: str | None
    tls_key: str | None
    tls_client_ca: str | None
    auth_token_file: str | None
    auth_health: bool


@dataclass(frozen=True)
class EngineConfig:
    """An engine process's: its model, and how batches form and run on its device."""

    weights: str
    precision: str
    max_batch_size: int
    max_queue: int  # the device's images accepted at once: no batch holds more
    max_batch_delay_ms: float
    wait_for_callers_ms: float
    torch_threads: int
    switch_interval_ms: float
    replica_probe_interval: float
    unhealthy_exit_after: float  # out of rotation this long, the engine ends and is replaced
    stuck_batch_timeout: float  # a launched batch unanswered this long, the engine ends and is replaced
    channels_last: bool
    cudnn_benchmark: bool
    compile: bool
    compile_mode: str
    compile_cache: str | None
    torchscript: bool
    decode_on_device: str
    max_pixels: int  # checked again before a JPEG is decoded here (the front-end checked its header)
    runner: str
    runtime: str
    onnx_provider: str  # ONNX Runtime's execution provider, as --onnx-provider says (resnet_server.engine.onnx_runtime)
    grace_period: float
    uses_cuda_graphs: bool  # --cuda-graphs resolved (ServerConfig.uses_cuda_graphs)
    largest_batch: int  # the histograms' and statistics' widest batch
    observability: Observability
    weights_version: int = 1  # of ``weights``: 1 at start, one more with each reload


@dataclass(frozen=True)
class FrontendConfig:
    """A front-end process's: its listener, how it admits, decodes and answers calls, and what GetModelInfo
    reports of the engines' batching."""

    network: Network
    frontends: int  # how many front-ends share the port (resolved from --frontends)
    temperature: float
    temperature_file: str | None
    max_images_per_request: int
    max_pixels: int
    preprocess_threads: int
    event_loop: str
    switch_interval_ms: float
    grace_period: float
    unhealthy_exit_after: float
    precision: str
    runtime: str
    max_batch_delay_ms: float
    wait_for_callers_ms: float
    max_queue: int
    largest_batch: int
    observability: Observability
    model_control: str = "none"
    max_weights_mb: int = 50
    uploads: str = ""  # the supervisor's folder for weights a client sends ("" for a front-end run alone)
    otlp_endpoint: str | None = None
    trace_rate: float = 1.0
    allow_client_shm: bool = False
    max_shm_regions: int = 64
    max_shm_mb: int = 4096
    fair_share: str = "auto"


def _section(kind: type, config: ServerConfig, **given: object):
    """``kind`` with each field taken from ``config`` by name, but those ``given``."""
    return kind(**{field.name: given[field.name] if field.name in given else getattr(config, field.name)
                   for field in fields(kind)})


def observability(config: ServerConfig) -> Observability:
    return _section(Observability, config)


def engine_config(config: ServerConfig, weights: str | None = None, weights_version: int = 1) -> EngineConfig:
    """An engine's section, serving ``weights`` (those served now, after a reload; else --weights)."""
    return _section(EngineConfig, config, observability=observability(config), weights=weights or config.weights,
                    weights_version=weights_version)


def frontend_config(config: ServerConfig, port: int, frontends: int, uploads: str = "",
                    http_port: int | None = None) -> FrontendConfig:
    """A front-end's section, on ``port`` and ``http_port`` (those the first front-end bound, shared by all;
    --http-port if None) as one of ``frontends``; weights a client sends go to ``uploads``."""
    http_port = config.http_port if http_port is None else http_port
    return _section(FrontendConfig, config, network=_section(Network, config, port=port, http_port=http_port),
                    frontends=frontends, observability=observability(config), uploads=uploads)
