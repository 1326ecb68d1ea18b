"""Prometheus metrics: per-device histograms of latency, queue wait and compute, and counters;
beside them, the model's totals that the Open Inference Protocol's ModelStatistics reports.

Every series carries a ``device`` label (the replica's name, e.g. ``cuda:0`` or ``cpu#1`` when
one device holds several replicas). Units are seconds; counters end in ``_total``. Each server
builds its own :class:`CollectorRegistry`, so tests read fresh samples with ``get_sample_value``.
"""

from __future__ import annotations

from typing import TypedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, PlatformCollector, ProcessCollector
from prometheus_client import start_http_server as _start_http_server

from resnet_server.common.config import MOST_WAITS_SKIPPED, host_port
from resnet_server.common.errors import StartupError
from resnet_server.common.statistics import ModelStatistics, SharedRow

# 0.5 ms to 10 s: a GPU batch takes a few ms, a CPU batch or a queued burst up to seconds.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFIX = "resnet_"
CHILD_METRICS_HOST = "127.0.0.1"  # engines' and front-ends' own endpoints: the supervisor's is the public one


class _Labelled(TypedDict):
    """The keyword arguments every series here shares: its label names and the server's registry."""

    labelnames: list[str]
    registry: CollectorRegistry


class Metrics:
    """All of the server's series, in one registry, and its ModelStatistics totals."""

    def __init__(self, largest_batch: int, shared_statistics: SharedRow | None = None) -> None:
        self.statistics = ModelStatistics(largest_batch, shared_statistics)
        self.registry = CollectorRegistry()
        # The process's RSS, CPU, open fds and start time (which the restart alert and panel count), and Python's.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        by_device = _Labelled(labelnames=["device"], registry=self.registry)
        by_code = _Labelled(labelnames=["device", "code"], registry=self.registry)
        self.request_latency = Histogram(
            PREFIX + "request_duration_seconds", "Server-side latency of a classification request, "
            "from arrival to answer (decode, queue, compute), by protocol (grpc, http)", buckets=LATENCY_BUCKETS,
            labelnames=["device", "protocol"], registry=self.registry)
        self.queue_wait = Histogram(
            PREFIX + "queue_wait_seconds", "Time an image waited in its device queue before its batch ran",
            buckets=LATENCY_BUCKETS, **by_device)
        self.compute = Histogram(
            PREFIX + "batch_compute_seconds", "Time of one batch on the device: converting inputs left "
            "to the replica (raw tensors, JPEGs decoded on the device), copy in, forward pass, softmax and the "
            "copy back to the CPU", buckets=LATENCY_BUCKETS, **by_device)
        self.batch_part = Counter(
            PREFIX + "batch_part_seconds", "Seconds of batch compute by part (Triton's compute_input, compute_infer "
            "and compute_output): input (converting the inputs left to the replica, copy in), infer (forward "
            "pass, softmax, copy back) and output (top-k and each image's results)",
            labelnames=["device", "part"], registry=self.registry)
        self.batch_size = Histogram(
            PREFIX + "batch_size", "Images per forward pass", buckets=BATCH_SIZE_BUCKETS, **by_device)
        self.padded = Counter(
            PREFIX + "padded_images", "Zero rows added to batches to reach a size warmed at start-up (CUDA pads "
            "each batch up to its next bucket; the CPU splits instead)", **by_device)
        self.requests = Counter(PREFIX + "requests", "Classification requests answered, by gRPC status code (an "
                                "HTTP call's by the code its status maps from) and protocol (grpc, http)",
                                labelnames=["device", "code", "protocol"], registry=self.registry)
        self.images = Counter(PREFIX + "images", "Images answered, by gRPC status code", **by_code)
        # By caller class (--fair-share): a token's name from the token file, "peer" for every address, "all" with
        # --fair-share off; never an address or anything else a client chooses.
        self.caller_images = Counter(PREFIX + "caller_images", "Images answered by caller (a token's name with "
                                     "--fair-share token; peer; all with off) and gRPC status code "
                                     "(RESOURCE_EXHAUSTED: refused, the queue full or the caller over its share)",
                                     labelnames=["caller", "code"], registry=self.registry)
        self.caller_images_in_flight = Gauge(PREFIX + "caller_images_in_flight", "Images accepted and not yet "
                                             "answered, by caller (as resnet_caller_images_total)",
                                             labelnames=["caller"], registry=self.registry)
        self.dropped = Counter(
            PREFIX + "dropped_images", "Queued images dropped before compute, by reason (deadline, cancelled)",
            labelnames=["device", "reason"], registry=self.registry)
        self.caller_waits = Counter(
            PREFIX + "caller_waits", "Waits for the callers of the batch just answered (--wait-for-callers-ms, or "
            "under fair share for a caller whose turn the others would take), by outcome (came_back: as many images "
            "came as it held, a full batch, or the caller waited for; ran_out: the wait held a "
            f"batch back until its limit, and the next 1 to {MOST_WAITS_SKIPPED} waits are skipped)",
            labelnames=["device", "outcome"], registry=self.registry)
        self.queue_depth = Gauge(PREFIX + "queue_depth", "Images waiting in the device queue", **by_device)
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Requests being served", **by_device)
        self.batches_in_flight = Gauge(PREFIX + "batches_in_flight", "Batches launched on the device and not yet "
                                       "answered (up to 2 on CUDA, where one is launched while another computes)",
                                       **by_device)
        self.healthy = Gauge(PREFIX + "replica_healthy", "1 while the replica is in rotation, else 0", **by_device)
        self.probes = Counter(
            PREFIX + "replica_probes", "Test batches (one blank image) run on a replica out of rotation, by result "
            "(passed: it rejoined; failed: it stays out)", labelnames=["device", "result"], registry=self.registry)
        self.load_time = Gauge(PREFIX + "model_load_seconds", "Time to load, place and warm up the model",
                               **by_device)
        self.model = Info(PREFIX + "model", "The model served", **by_device)
        self.weights_version = Gauge(PREFIX + "weights_version", "The version of the weights served: 1 at start, "
                                     "one more with each reload", **by_device)
        self.reloads = Counter(PREFIX + "weights_reloads", "Reloads of the weights on this device, by outcome "
                               "(loaded; failed: these weights could not be made ready; aborted: another device's "
                               "could not, and this one keeps serving the old)", labelnames=["device", "outcome"],
                               registry=self.registry)
        self.reload_time = Gauge(PREFIX + "weights_reload_seconds", "The last reload's time from its start to the "
                                 "swap (loading and preparing beside the served weights, then waiting for a pause "
                                 "between batches)", **by_device)
        self.gpu_allocated = Gauge(PREFIX + "gpu_memory_allocated_bytes", "CUDA memory held by tensors",
                                   **by_device)
        self.gpu_reserved = Gauge(PREFIX + "gpu_memory_reserved_bytes", "CUDA memory reserved by the caching "
                                  "allocator", **by_device)
        self.gpu_utilization = Gauge(PREFIX + "gpu_utilization_ratio", "Share of the last sample period in which "
                                     "a kernel ran on the GPU (NVML; present when nvidia-ml-py is installed)",
                                     **by_device)


def serve_metrics(metrics: Metrics, host: str, port: int):
    """Expose /metrics over HTTP in a daemon thread; returns the HTTP server (None when port is 0)."""
    return serve_registry(metrics.registry, host, port) if port else None


def serve_registry(registry: CollectorRegistry, host: str, port: int):
    """Serve ``registry`` on ``host:port``/metrics from a daemon thread; the HTTP server."""
    try:
        httpd, _thread = _start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise StartupError(f"cannot serve /metrics on {host_port(host, port)}: {exc.strerror}") from None
    return httpd


def serve_child_metrics(registry: CollectorRegistry):
    """An engine's or front-end's /metrics on a loopback port the system picks, for the supervisor to read; the
    HTTP server (its ``server_port`` is reported to the supervisor)."""
    return serve_registry(registry, CHILD_METRICS_HOST, 0)
