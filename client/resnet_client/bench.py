"""``resnet-client bench``: a load generator for the service, closed loop or open loop (Poisson).

Bounded in count and time: every run lasts ``--warmup + --duration`` seconds per sweep point and
targets only the server named. Several ``--processes`` keep the Python client from being the
bottleneck. The server's own view (mean batch size, queue vs compute time per device) comes from
its ``/metrics`` scraped before and after each point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing
import os
import random
import re
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import grpc

from .api import classifier_pb2 as pb
from .client import AsyncClient, Client
from .connection_flags import connection
from .errors import ClassifierError
from .flags import (
    DEFAULT_IMAGE_SIZE,
    comma_list,
    image_size,
    non_negative_float,
    positive_float,
    positive_int,
    size_text,
)
from .progress import ProgressBar

_SERVICE = pb.DESCRIPTOR.services_by_name["Classifier"].full_name
CLASSIFY_METHOD, STREAM_METHOD = f"/{_SERVICE}/Classify", f"/{_SERVICE}/ClassifyStream"  # as the stub names them
MODEL_INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"

@dataclass(frozen=True)
class LoadSpec:
    target: str
    request: bytes  # a serialised ClassifyRequest, sent as it is
    concurrency: int | None  # closed loop: requests in flight per process
    rate: float | None  # open loop: requests per second per process
    warmup: float
    duration: float
    connection: dict  # Client's keyword arguments: timeout, TLS files, token, attempts
    connections: int = 1  # connections of this process, its requests spread over them
    stream: bool = False  # closed loop over ClassifyStream: one stream a request in flight, a request a message
    shared_memory: bool = False  # closed loop over ModelInfer, each caller's images and answers in a region of its own


def make_image(kind: str, width: int, height: int, path: str | None = None) -> pb.Image:
    """The image every request carries; encoded formats need Pillow (or --image FILE)."""
    if path:
        with open(path, "rb") as handle:
            return pb.Image(encoded=handle.read())
    rng = random.Random(0)
    if kind == "uint8":
        return pb.Image(raw=pb.RawTensor(dtype=pb.RawTensor.UINT8, shape=[height, width, 3],
                                         data=rng.randbytes(height * width * 3)))
    if kind == "fp32":
        import struct
        values = [rng.gauss(0.0, 1.0) for _ in range(3 * 224 * 224)]
        return pb.Image(raw=pb.RawTensor(dtype=pb.RawTensor.FLOAT32, shape=[3, 224, 224],
                                         data=struct.pack(f"<{len(values)}f", *values)))
    try:
        from PIL import Image
    except ImportError:
        raise SystemExit("resnet-client bench: error: --input jpeg (the default) and png need Pillow: pip install "
                         "'resnet-grpc[tools]', or send --input uint8 or --image FILE") from None
    buffer = io.BytesIO()
    Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3)).save(buffer, format=kind.upper())
    return pb.Image(encoded=buffer.getvalue())


class _Window:
    """The measured window of one process's run, and the calls that completed inside it."""

    def __init__(self, spec: LoadSpec) -> None:
        started = time.monotonic()
        self.measure_from, self.stop_at = started + spec.warmup, started + spec.warmup + spec.duration
        self.records: list[tuple[float, str]] = []

    def open(self) -> bool:
        return time.monotonic() < self.stop_at

    def record(self, sent: float, code: str) -> None:
        # Every call that completes inside the window counts, whenever it was sent: counting only calls sent
        # inside it would miss those in flight as it opens, an undercount of about latency / duration.
        done = time.monotonic()
        if self.measure_from <= done <= self.stop_at:
            self.records.append((done - sent, code))  # list.append is atomic: callers may be threads


def _bytes_call(channel, method: str = CLASSIFY_METHOD):
    """A call as bytes in, bytes out: the request goes as the bench encoded it once and the answer comes back
    unread, so a call costs the client gRPC's own work (it shares the machine's cores with the server)."""
    return channel.unary_unary(method)


def _by_reference(client: Client, stack: contextlib.ExitStack, request: bytes):
    """(call, request bytes): ModelInfer of the bench request's images from a region of /dev/shm made for this
    caller (closed when ``stack`` is), its probabilities answered into the region."""
    images = [image.encoded if image.HasField("encoded") else _RawImage(image.raw)
              for image in pb.ClassifyRequest.FromString(request).images]
    region = stack.enter_context(client.shared_memory(sum(len(_bytes_of(image)) for image in images)
                                                      + len(images) * 4000 + 4096))
    infer = region.infer_request(images, top_k=1)
    return _bytes_call(client._channel, MODEL_INFER_METHOD), infer.SerializeToString()


class _RawImage:
    """A raw tensor of the bench's request, as the shared-memory helper takes an array."""

    def __init__(self, raw: pb.RawTensor) -> None:
        self.dtype = {pb.RawTensor.UINT8: "uint8", pb.RawTensor.FLOAT32: "float32"}.get(raw.dtype, "")
        self.shape, self._data = tuple(raw.shape), raw.data

    def tobytes(self) -> bytes:
        return self._data


def _bytes_of(image) -> bytes:
    return image if isinstance(image, bytes) else image.tobytes()


def closed_loop(spec: LoadSpec) -> list[tuple[float, str]]:
    """``spec.concurrency`` threads, each sending its next request when the last one is answered.

    Blocking stubs rather than grpc.aio: at c=1 they add less of the client's own latency and CPU a call, so
    that what is measured is the server; at c=16 the two served the same (docs/performance.md, "Figures behind
    the code")."""
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(Client(spec.target, **spec.connection, own_connection=spec.connections > 1))
                   for _ in range(spec.connections)]
        window = _Window(spec)

        def loop(client: Client) -> None:
            classify, metadata, request = _bytes_call(client._channel), client._config.metadata(), spec.request
            region = contextlib.ExitStack()
            if spec.shared_memory:
                classify, request = _by_reference(client, region, request)
            with region:
                _call_until_closed(classify, request, metadata, client.timeout, window)

        threads = [threading.Thread(target=loop, args=(clients[i % len(clients)],), daemon=True)
                   for i in range(spec.concurrency or 0)]  # run only with a concurrency
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return window.records


def _call_until_closed(classify, request: bytes, metadata, timeout: float, window: _Window) -> None:
    while window.open():
        sent = time.monotonic()
        try:
            classify(request, timeout=timeout, metadata=metadata)
            code = "OK"
        except Exception as error:  # noqa: BLE001 - every failure is counted, and the loop goes on
            code = _code(error)
        window.record(sent, code)


async def _async_clients(stack: contextlib.AsyncExitStack, spec: LoadSpec) -> list[AsyncClient]:
    """``spec.connections`` clients, each on a connection of its own when there are several; closed with ``stack``."""
    return [await stack.enter_async_context(
        AsyncClient(spec.target, **spec.connection, own_connection=spec.connections > 1))
        for _ in range(spec.connections)]


async def _open_loop(spec: LoadSpec) -> list[tuple[float, str]]:
    """Requests sent at Poisson arrival times, ``spec.rate`` a second, whether or not earlier ones returned."""
    if not spec.rate:
        raise ValueError("an open loop needs a rate")
    rate = spec.rate
    async with contextlib.AsyncExitStack() as stack:
        clients = await _async_clients(stack, spec)
        # Each client's stub and call metadata, worked out once: metadata() reads the TLS files it is given.
        senders = [(_bytes_call(client._channel), client._config.metadata(), client.timeout) for client in clients]
        window = _Window(spec)

        async def one(classify, metadata: list[tuple[str, str]], timeout: float) -> None:
            sent = time.monotonic()
            try:
                await classify(spec.request, timeout=timeout, metadata=metadata)
                code = "OK"
            except Exception as error:  # noqa: BLE001 - every failure is counted
                code = _code(error)
            window.record(sent, code)

        tasks: list[asyncio.Task[None]] = []
        rng = random.Random(os.getpid())
        next_at = time.monotonic()
        while next_at < window.stop_at:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(*senders[len(tasks) % len(senders)])))
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return window.records


async def stream_loop(spec: LoadSpec) -> list[tuple[float, str]]:
    """``spec.concurrency`` ClassifyStream calls, each sending its next request when the last one is answered.

    A message on an open stream skips what a call costs both ends (its HTTP/2 stream, headers and status):
    about half the CPU a request of unary calls, for the client as for the server."""
    async with contextlib.AsyncExitStack() as stack:
        clients = await _async_clients(stack, spec)
        window = _Window(spec)

        async def loop(client: AsyncClient) -> None:
            open_stream, metadata = client._channel.stream_stream(STREAM_METHOD), client._config.metadata()
            while window.open():  # a stream the server ended (its first failed request ends it) is opened again
                call = open_stream(timeout=spec.warmup + spec.duration + client.timeout, metadata=metadata)
                await _stream_requests(call, spec.request, window)

        await asyncio.gather(*(loop(clients[i % len(clients)]) for i in range(spec.concurrency or 0)))
    return window.records


async def _stream_requests(call, request: bytes, window: _Window) -> None:
    """One request at a time on ``call`` while the window is open; a failure is recorded and ends the stream."""
    sent = time.monotonic()
    try:
        while window.open():
            sent = time.monotonic()
            await call.write(request)
            if await call.read() is grpc.aio.EOF:  # type: ignore[attr-defined]  # missing from grpc-stubs
                raise EOFError("the stream ended without an answer")
            window.record(sent, "OK")
        await call.done_writing()
    except Exception as error:  # noqa: BLE001 - every failure is counted, and the loop opens another stream
        window.record(sent, (await call.code()).name if call.done() else _code(error))
        call.cancel()


def _code(error: Exception) -> str:
    """The status code's name of a failed call (grpc.RpcError, or grpc.aio's AioRpcError), else the type's."""
    return error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__


class _WindowCpu:
    """This process's CPU seconds (all its threads, gRPC's own included) over the measured window: whether the
    client, sharing the machine with the server, had cores to spare."""

    def __init__(self, spec: LoadSpec) -> None:
        self._ended = threading.Event()
        self._span = (spec.warmup, spec.duration)
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._meter, daemon=True)
        self._thread.start()

    def _meter(self) -> None:
        warmup, duration = self._span
        if self._ended.wait(warmup):
            return  # the run ended during its warm-up: nothing measured
        start, started = time.process_time(), time.monotonic()
        self._ended.wait(duration)
        # Per second of the window, times its length: the same figure if the run ended a little early.
        self.seconds = (time.process_time() - start) * duration / max(time.monotonic() - started, 1e-9)

    def stop(self) -> float:
        self._ended.set()
        self._thread.join()
        return self.seconds


def _worker(spec: LoadSpec) -> tuple[list[tuple[float, str]], float]:
    """The calls made (latency, code) and the process's CPU seconds over the measured window."""
    cpu = _WindowCpu(spec)
    if spec.stream:
        records = asyncio.run(stream_loop(spec))
    else:
        records = closed_loop(spec) if spec.concurrency else asyncio.run(_open_loop(spec))
    return records, cpu.stop()


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[index]


_SAMPLE = re.compile(r'^(resnet_\w+|process_cpu_seconds_total)\{([^}]*)\} ([-+\deE.naif]+)$')
_CPU = "process_cpu_seconds_total"  # per server process (label worker): front-ends "0", "1"..., "engine-cuda:0"
_CALLER_WAITS = "resnet_caller_waits_total"
_BATCH_PART = "resnet_batch_part_seconds_total"
# Counters the server view reads by a second label, which goes into the key: series:value.
_BY_LABEL = {_CALLER_WAITS: "outcome", _BATCH_PART: "part"}
BATCH_PARTS = ("input", "infer", "output")


def metrics_urls(urls: str | None) -> list[str]:
    return [url.strip() for url in (urls or "").split(",") if url.strip()]


def scrape(urls: str | None) -> dict[tuple[str, str], float]:
    """{(series, device): value} for the sums and counts the server view needs, summed over a comma-separated
    list of URLs (several servers) and over the other labels (a server's ``worker``: each of its processes); {}
    without one."""
    values: Counter[tuple[str, str]] = Counter()
    for url in metrics_urls(urls):
        values.update(_scrape_one(url))
    return dict(values)


def _scrape_one(url: str) -> dict[tuple[str, str], float]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        series, labels, value = match.groups()
        key = _key(series, labels)
        if key is not None:
            values[key] = values.get(key, 0.0) + float(value)
    return values


def _key(series: str, labels: str) -> tuple[str, str] | None:
    """Where a sample is summed: (series, device), a process's CPU by its kind, or None for what is not read."""
    if series == _CPU:
        return _CPU, _process_kind(_label(labels, "worker"))
    if series in _BY_LABEL:
        series += ":" + (_label(labels, _BY_LABEL[series]) or "")
    elif not series.endswith(("_sum", "_count")):
        return None
    device = _label(labels, "device")
    return None if device is None else (series, device)


def _process_kind(worker: str | None) -> str:
    if worker is None or worker == "supervisor":
        return "supervisor"
    return "engines" if worker.startswith("engine") else "frontends"


def server_cpu(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """The server's processes' CPU between two scrapes, in cores, by kind (front-ends, engines, supervisor):
    beside the client's, whether the machine's cores ran out first."""
    return {kind: (value - before.get((series, kind), 0.0)) / seconds
            for (series, kind), value in sorted(after.items()) if series == _CPU}


def _label(labels: str, name: str) -> str | None:
    found = re.search(rf'(?:^|,){name}="([^"]*)"', labels)
    return found.group(1) if found else None


def server_view(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per device: mean batch size, mean queue wait, and a batch's mean compute time and its parts (input,
    infer, output; ms) over the run; with --wait-for-callers-ms, how many of its waits held a batch back until
    the callers came back or it ran out."""
    def delta(series: str, device: str) -> float:
        return after.get((series, device), 0.0) - before.get((series, device), 0.0)

    view = {}
    for device in sorted({device for series, device in after if series != _CPU}):
        batches = delta("resnet_batch_size_count", device)
        images = delta("resnet_batch_size_sum", device)
        if not batches:
            continue
        view[device] = {
            "mean_batch_size": images / batches,
            "mean_queue_ms": 1000 * delta("resnet_queue_wait_seconds_sum", device) / max(images, 1),
            "mean_compute_ms": 1000 * delta("resnet_batch_compute_seconds_sum", device) / batches,
        }
        if any((f"{_BATCH_PART}:{part}", device) in after for part in BATCH_PARTS):  # where the server reports them
            view[device].update({f"mean_{part}_ms": 1000 * delta(f"{_BATCH_PART}:{part}", device) / batches
                                 for part in BATCH_PARTS})
        waits = {outcome: delta(f"{_CALLER_WAITS}:{outcome}", device) for outcome in ("came_back", "ran_out")}
        if any(waits.values()):
            view[device].update({f"caller_waits_{outcome}": count for outcome, count in waits.items()})
    return view


def run_point(args: argparse.Namespace, request: bytes, concurrency: int | None, rate: float | None) -> dict:
    per_process = [LoadSpec(args.server, request,
                            _share(concurrency, args.processes, i), None if rate is None else rate / args.processes,
                            args.warmup, args.duration, connection(args), args.connections, args.stream,
                            args.shared_memory == "system")
                   for i in range(args.processes)]
    per_process = [spec for spec in per_process if spec.concurrency or spec.rate]
    before, scraped = scrape(args.metrics), time.monotonic()
    with multiprocessing.get_context("spawn").Pool(len(per_process)) as pool:
        pending = pool.map_async(_worker, per_process)
        label = f"{load_label(concurrency, rate):>8}"
        _wait(pending, args.warmup + args.duration, ProgressBar(label, args.quiet))
        outcomes = pending.get()
    records = [record for chunk, _ in outcomes for record in chunk]
    client_cpu = sum(cpu for _, cpu in outcomes)
    after, between_scrapes = scrape(args.metrics), time.monotonic() - scraped
    latencies = sorted(latency for latency, code in records if code == "OK")
    ok = len(latencies)
    return {
        "concurrency": concurrency, "rate": rate, "images_per_request": args.images_per_request, "stream": args.stream,
        "shared_memory": args.shared_memory, "requests": len(records), "ok": ok,
        "requests_per_s": ok / args.duration, "images_per_s": ok * args.images_per_request / args.duration,
        "p50_ms": 1000 * percentile(latencies, 50), "p90_ms": 1000 * percentile(latencies, 90),
        "p99_ms": 1000 * percentile(latencies, 99), "max_ms": 1000 * (latencies[-1] if latencies else float("nan")),
        "errors": dict(Counter(code for _, code in records if code != "OK")),
        "client_cpu_cores": client_cpu / args.duration,  # the client processes' CPU over the window, in cores
        "server": server_view(before, after),
        # warm-up included, as in the server view: both come from the same two scrapes
        "server_cpu_cores": server_cpu(before, after, between_scrapes),
    }


def _share(total: int | None, parts: int, index: int) -> int | None:
    if total is None:
        return None
    return total // parts + (1 if index < total % parts else 0)


def _wait(pending, seconds: float, bar: ProgressBar) -> None:
    """Wait for the point's processes, the bar showing the time gone of ``seconds``."""
    started = time.monotonic()
    while not pending.ready():
        pending.wait(0.5)
        done = (time.monotonic() - started) / seconds
        bar.update(done, f"{100 * min(1.0, done):5.1f}%")
    bar.close()


def load_label(concurrency: int | None, rate: float | None) -> str:
    return f"c={concurrency}" if concurrency else f"r={rate:g}"


def print_table(points: list[dict]) -> None:
    """One line a point; the server's view per device (a line more for each device after the first; '-' where
    there is no view: no --metrics answered), and a line for its waits for callers where it made any."""
    print(f"{'load':>10} {'req/s':>8} {'img/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'cli-cores':>9} {'device':>8} {'batch':>6} {'queue ms':>9} {'compute ms':>10} {'input ms':>8}  errors")
    for point in points:
        load = load_label(point["concurrency"], point["rate"])
        client = (f"{load:>10} {point['requests_per_s']:8.1f} {point['images_per_s']:8.1f} {point['p50_ms']:8.1f} "
                  f"{point['p90_ms']:8.1f} {point['p99_ms']:8.1f} {point['max_ms']:8.1f} "
                  f"{point['client_cpu_cores']:9.2f}")
        views = list(point["server"].items()) or [("-", {})]
        for index, (device, view) in enumerate(views):
            server = " ".join(f"{view[key]:{width}.2f}" if key in view else f"{'-':>{width}}"
                              for key, width in (("mean_batch_size", 6), ("mean_queue_ms", 9),
                                                 ("mean_compute_ms", 10), ("mean_input_ms", 8)))
            first = index == 0
            errors = (point["errors"] or "") if first else ""
            print(f"{client if first else ' ' * len(client)} {device:>8} {server}  {errors}".rstrip())
            if "caller_waits_came_back" in view:
                print(f"{'':>10} {device}: waits for callers: {view['caller_waits_came_back']:.0f} came back, "
                      f"{view['caller_waits_ran_out']:.0f} ran out")


def plot(points: list[dict], path: str, title: str) -> None:
    """Throughput and p50/p99 latency against the load, both from zero; a log2 load axis for wide sweeps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    open_loop = not points[0]["concurrency"]
    x = [point["rate"] if open_loop else point["concurrency"] for point in points]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [point["images_per_s"] for point in points], marker="o", label="served")
    if open_loop:  # what was offered: a served line below it means the server is saturated
        per_request = points[0]["images_per_request"]
        left.plot(x, [rate * per_request for rate in x], linestyle="--", color="grey", label="offered")
        left.legend()
    left.set(ylabel="images/s", title="throughput")
    for key in ("p50", "p99"):
        right.plot(x, [point[f"{key}_ms"] for point in points], marker="o", label=key)
    right.set(ylabel="latency (ms)", title="latency")
    right.legend()
    for axes in (left, right):
        axes.set_xlabel("offered rate (requests/s)" if open_loop else "concurrency (requests in flight)")
        axes.set_ylim(bottom=0)
        if max(x) >= 8 * min(x):
            axes.set_xscale("log", base=2)
            axes.set_xticks(x, [f"{value:g}" for value in x])
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path)


def add_parser(commands) -> argparse.ArgumentParser:
    bench = commands.add_parser("bench", help="load-test a server (closed or open loop)")
    load = bench.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=positive_int, help="closed loop: requests in flight (default 1)")
    load.add_argument("--rate", type=positive_float, help="open loop: requests per second, Poisson arrivals")
    bench.add_argument("--sweep", type=comma_list(positive_float),
                       help="several concurrencies (or rates with --rate), e.g. 1,4,16,64")
    bench.add_argument("--input", choices=["jpeg", "png", "uint8", "fp32"], default="jpeg",
                       help="what each image is sent as: encoded, or a raw tensor (default %(default)s)")
    bench.add_argument("--image", help="send this file instead of a generated image")
    bench.add_argument("--image-size", type=image_size, default=DEFAULT_IMAGE_SIZE,
                       help=f"WxH of the generated image (default {size_text(DEFAULT_IMAGE_SIZE)})")
    bench.add_argument("--images-per-request", type=positive_int, default=1,
                       help="copies of the image in each request (default %(default)s)")
    bench.add_argument("--processes", type=positive_int, default=1,
                       help="client processes sharing the load (default %(default)s)")
    bench.add_argument("--connections", type=positive_int, default=1,
                       help="connections per process, its requests spread over them (the server hands each "
                            "connection to one of its front-end processes; default %(default)s)")
    bench.add_argument("--stream", action="store_true",
                       help="closed loop over ClassifyStream: one stream a request in flight, each request a message "
                            "on it (about half the CPU a request of unary calls, on both ends)")
    bench.add_argument("--shared-memory", choices=["none", "system"], default="none",
                       help="system: on the server's machine, each caller's images go in a region of /dev/shm it "
                            "registers, and each call (ModelInfer) names them there instead of carrying them; "
                            "the server needs --allow-client-shm")
    bench.add_argument("--duration", type=positive_float, default=10.0,
                       help="measured seconds per point (default %(default)s)")
    bench.add_argument("--warmup", type=non_negative_float, default=2.0,
                       help="unmeasured seconds before each point (default %(default)s)")
    bench.add_argument("--metrics", help="server's /metrics URL, or a comma-separated list (several servers: "
                                         "summed); '' for none (default http://HOST:8000/metrics)")
    bench.add_argument("--json", action="store_true", help="one JSON object a point, a line each, instead of the table")
    bench.add_argument("--plot", help="write throughput and latency against load to this PNG")
    bench.add_argument("--quiet", action="store_true", help="no progress bar (drawn only on a terminal)")
    bench.set_defaults(run=run_bench)
    return bench


def first_call_failure(args: argparse.Namespace, request: bytes) -> str | None:
    """One call with the bench's request before any load: "CODE: message" if it fails, else None.

    A server that cannot be reached, a refused token or a request the server refuses (too many pixels or images)
    fails every call alike; said now, in a second, rather than after a whole sweep of failed calls (against a
    closed port, a flood of UNAVAILABLE). Failures under load (overload, deadlines)
    are still counted by code in the table."""
    with Client(args.server, **connection(args)) as client, contextlib.ExitStack() as region:
        try:
            if args.shared_memory == "system":
                infer, by_reference = _by_reference(client, region, request)
                infer(by_reference, timeout=client.timeout, metadata=client._config.metadata())
            else:
                client._call(client._stub.Classify, pb.ClassifyRequest.FromString(request), None)
        except ClassifierError as error:
            return str(error)
        except grpc.RpcError as error:
            return str(ClassifierError.from_rpc_error(error))
    return None


def run_bench(args: argparse.Namespace) -> int:
    if args.metrics is None and "," not in args.server:
        args.metrics = f"http://{args.server.rsplit(':', 1)[0].removeprefix('dns:///')}:8000/metrics"
    loads = args.sweep or [args.rate if args.rate else (args.concurrency or 1)]
    if problem := usage_problem(args, loads):
        return complain(problem, 2)
    width, height = args.image_size
    image = make_image(args.input, width, height, args.image)
    request = pb.ClassifyRequest(images=[image] * args.images_per_request, top_k=1).SerializeToString()
    if failure := first_call_failure(args, request):
        return complain(f"the first call, before any load, failed: {failure}", 1)
    silent = [url for url in metrics_urls(args.metrics) if not _scrape_one(url)]  # the first call made samples
    if silent:
        print(f"resnet-client bench: note: no server view (batch size, queue, compute) from {', '.join(silent)}: "
              "no answer with this server's metrics; pass --metrics URL, or --metrics '' for none", file=sys.stderr)
    points = [run_point(args, request, concurrency=None if args.rate else int(load), rate=load if args.rate else None)
              for load in loads]
    report(args, points)
    if problem := run_failure(points):
        return complain(problem, 1)
    return 0


def complain(problem: str, code: int) -> int:
    print(f"resnet-client bench: error: {problem}", file=sys.stderr)
    return code


def usage_problem(args: argparse.Namespace, loads: list[float]) -> str | None:
    """What makes this combination of flags unusable, which argparse alone does not see."""
    if args.stream and args.rate:
        return "--stream is a closed loop: give --concurrency or --sweep, not --rate"
    if args.shared_memory == "system" and (args.rate or args.stream):
        return "--shared-memory system is a closed loop of ModelInfer calls: give --concurrency or --sweep, not " \
               "--rate or --stream"
    if not args.rate and any(load != int(load) for load in loads):
        return f"argument --sweep: concurrencies are whole numbers, got {', '.join(f'{load:g}' for load in loads)}"
    return None


def report(args: argparse.Namespace, points: list[dict]) -> None:
    if args.json:
        for point in points:
            print(json.dumps(point))
    else:
        print_table(points)
    if args.plot:
        images = "1 image" if args.images_per_request == 1 else f"{args.images_per_request} images"
        plot(points, args.plot, f"{args.server}: {args.input} {size_text(args.image_size)}, {images} a request")


def run_failure(points: list[dict]) -> str | None:
    """Why the run's figures measure no server, if they do not."""
    if all(point["ok"] == 0 for point in points):
        return f"no request succeeded: {points[-1]['errors']}"
    if unavailable := sum(point["errors"].get("UNAVAILABLE", 0) for point in points):
        # The first call reached the server: calls that found it gone since mean the figures measure no server.
        return f"the server stopped answering during the run: {unavailable} calls failed UNAVAILABLE"
    return None
