"""OpenTelemetry traces, received by a real OTLP receiver on loopback (the collector's gRPC trace service from
opentelemetry-proto): a caller's trace continued, its sampled flag honoured, the request's path as child spans
whose durations are the answer's own timings, batched calls sharing a batch id, refusals with their code, the
ids in the answer and the log lines, and a receiver that is down costing no call."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import tritonclient.grpc as tc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from resnet_client import AsyncClient, Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_client.cli import main
from resnet_server.common.logs import JsonFormatter, TextFormatter, TraceIds
from tests.helpers import encode, free_port, random_rgb, wait_for
from tests.server_process import Workers

PIXELS = random_rgb(81, 224, 224)
REQUEST = pb.ClassifyRequest(images=[pb.Image(raw=pb.RawTensor(dtype=pb.RawTensor.UINT8, shape=[224, 224, 3],
                                                                data=PIXELS.tobytes()))], top_k=3)
CLASSIFY = "resnet.v1.Classifier/Classify"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every span exported to it, by trace id (hex)."""

    def __init__(self) -> None:
        self.spans: dict[str, list] = {}
        self._arrived = threading.Condition()
        self.server = grpc.server(ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):
        with self._arrived:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self.spans.setdefault(span.trace_id.hex(), []).append(span)
            self._arrived.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, count: int) -> dict[str, object]:
        """Once ``count`` spans of the trace have arrived: them, by name."""
        with self._arrived:
            assert self._arrived.wait_for(lambda: len(self.spans.get(trace_id, ())) >= count, 30), self.spans.keys()
            return {span.name: span for span in self.spans[trace_id]}


@pytest.fixture()
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")  # the batch processor exports every 20 ms, not 5 s
    made = Receiver()
    yield made
    made.server.stop(0)


def traceparent(sampled: bool) -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


def classify(target: str, header: str, request: pb.ClassifyRequest = REQUEST):
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.ClassifierStub(channel).Classify.with_call(request, metadata=[("traceparent", header)],
                                                                  timeout=30)


def attributes(span) -> dict[str, object]:
    return {item.key: getattr(item.value, item.value.WhichOneof("value")) for item in span.attributes}


def milliseconds(span) -> float:
    return (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6


def test_a_call_continues_its_callers_trace_with_its_path_as_child_spans(make_server, receiver):
    running = make_server(otlp_endpoint=f"127.0.0.1:{receiver.port}")
    trace_id, header = traceparent(sampled=True)
    response, call = classify(running.target, header)
    spans = receiver.trace(trace_id, 5)
    assert set(spans) == {CLASSIFY, "decode", "queue", "compute", "answer"}
    server = spans[CLASSIFY]
    assert server.parent_span_id.hex() == header.split("-")[2]  # the caller's span is its parent
    assert all(span.parent_span_id == server.span_id for name, span in spans.items() if name != CLASSIFY)
    (result,) = response.results
    assert abs(milliseconds(spans["queue"]) - result.queue_ms) < 1
    assert abs(milliseconds(spans["compute"]) - result.compute_ms) < 1
    seen = attributes(server)
    assert seen["rpc.system"] == "grpc" and seen["rpc.service"] == "resnet.v1.Classifier"
    assert seen["rpc.method"] == "Classify" and seen["rpc.grpc.status_code"] == 0
    assert seen["resnet.images"] == 1 and seen["resnet.top_k"] == 3 and seen["resnet.device"] == "cpu"
    assert seen["resnet.weights.version"] == 1 and seen["resnet.temperature"] == 1.0
    batch = attributes(spans["compute"])  # what describes the batch, on its compute span
    assert batch["resnet.batch.size"] == 1 and "fp32" in batch["resnet.runner"]
    parts = batch["resnet.compute.input_ms"] + batch["resnet.compute.infer_ms"] + batch["resnet.compute.output_ms"]
    assert abs(parts - result.compute_ms) < 0.01
    # The answer names the server span.
    assert ("traceparent", f"00-{trace_id}-{server.span_id.hex()}-01") in call.trailing_metadata()


def test_the_sampled_flag_is_honoured_and_a_refused_call_has_its_code(make_server, receiver):
    running = make_server(otlp_endpoint=f"127.0.0.1:{receiver.port}", trace_rate=0.0)
    unsampled, header = traceparent(sampled=False)
    classify(running.target, header)
    refused, header = traceparent(sampled=True)  # sampled by its caller, though the rate is 0
    with pytest.raises(grpc.RpcError) as caught:
        classify(running.target, header, pb.ClassifyRequest(images=[pb.Image(encoded=b"not an image")]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    server = receiver.trace(refused, 1)[CLASSIFY]
    assert attributes(server)["rpc.grpc.status_code"] == 3 and server.status.code == 2  # STATUS_CODE_ERROR
    assert server.status.message.startswith("INVALID_ARGUMENT: ")
    assert unsampled not in receiver.spans  # exported in order: the refused call's spans came after


def test_calls_batched_together_share_a_batch_id_and_are_linked(make_server, receiver):
    running = make_server(otlp_endpoint=f"127.0.0.1:{receiver.port}", max_batch_delay_ms=500.0)
    headers = [traceparent(sampled=True) for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        for done in [pool.submit(classify, running.target, header) for _, header in headers]:
            done.result()
    computes = [receiver.trace(trace_id, 5)["compute"] for trace_id, _ in headers]
    assert len({attributes(span)["resnet.batch.id"] for span in computes}) == 1
    assert {attributes(span)["resnet.batch.size"] for span in computes} == {3}
    # On the CPU every size up to 8 is a bucket: a batch of 3 runs as one of 3.
    assert [value.int_value for value in attributes(computes[0])["resnet.batch.buckets"].values] == [3]
    # The first call answered is the batch's anchor; the others' compute spans link to its compute span.
    anchors = [span for span in computes if not span.links]
    assert len(anchors) == 1
    for span in computes:
        if span.links:
            (link,) = span.links
            assert (link.trace_id, link.span_id) == (anchors[0].trace_id, anchors[0].span_id)


def test_a_receiver_that_is_down_fails_no_call_and_is_told_once_a_minute(make_server, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    running = make_server(otlp_endpoint=f"127.0.0.1:{free_port()}")
    for _ in range(3):
        response, _ = classify(running.target, traceparent(sampled=True)[1])
        assert response.results[0].top_k
        wait_for(lambda: any("tracing: " in record.getMessage() for record in caplog.records))
    told = [record for record in caplog.records if record.name.startswith("opentelemetry.exporter")]
    assert len(told) == 1 and told[0].levelname == "WARNING" and "spans are dropped" in told[0].getMessage()


@pytest.mark.parametrize("formatter", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_a_log_line_written_in_a_calls_span_carries_its_ids(formatter):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    span = TracerProvider().get_tracer("test").start_span("call")
    record = logging.LogRecord("server", logging.INFO, __file__, 1, "about the call", None, None)
    with trace.use_span(span, end_on_exit=True):
        assert TraceIds().filter(record)
    line = formatter.format(record)
    context = span.get_span_context()
    assert f"{context.trace_id:032x}" in line and f"{context.span_id:016x}" in line


async def classify_async(target: str, caller) -> str:
    """The trace id the server names for an AsyncClient's call, in ``caller``'s span (None: with trace=True)."""
    from opentelemetry import trace

    async with AsyncClient(target, trace=caller is None) as client:
        if caller is None:
            (result,) = await client.classify([PIXELS])
        else:
            with trace.use_span(caller):
                (result,) = await client.classify([PIXELS])
    return result.trace_id


def test_the_client_passes_its_callers_context_and_names_the_servers_trace(make_server, receiver, capsys, tmp_path):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    running = make_server(otlp_endpoint=f"127.0.0.1:{receiver.port}", trace_rate=0.0)
    caller = TracerProvider().get_tracer("caller").start_span("caller")
    with trace.use_span(caller, end_on_exit=True), Client(running.target) as client:
        (result,) = client.classify([PIXELS])
    context = caller.get_span_context()
    assert result.trace_id == f"{context.trace_id:032x}"
    server = receiver.trace(result.trace_id, 5)[CLASSIFY]
    assert server.parent_span_id.hex() == f"{context.span_id:016x}"
    # The asyncio client alike: the caller's context, else with trace=True a new sampled trace.
    assert asyncio.run(classify_async(running.target, caller)) == f"{context.trace_id:032x}"
    assert asyncio.run(classify_async(running.target, None)) not in ("", f"{context.trace_id:032x}")
    # The CLI, with no context of its own: --trace starts a sampled trace per call and prints its id.
    image = tmp_path / "image.jpg"
    image.write_bytes(encode(PIXELS))
    assert main(["--server", running.target, "classify", str(image), "--trace"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    (traced,) = [part.removeprefix("trace ") for part in printed.rstrip(")").split(", ") if part.startswith("trace ")]
    assert CLASSIFY in receiver.trace(traced, 5)


@pytest.mark.slow
def test_trace_settings_change_on_every_front_end_at_once(weights_file, receiver):
    workers = Workers(str(weights_file[0]), "--otlp-endpoint", f"127.0.0.1:{receiver.port}",
                      env={"OTEL_BSP_SCHEDULE_DELAY": "20"})
    try:
        port, _ = workers.serving()
        target = f"127.0.0.1:{port}"
        triton = tc.InferenceServerClient(target)
        assert "trace" in triton.get_server_metadata().extensions
        settings = triton.get_trace_settings(as_json=True)["settings"]
        assert settings["trace_level"]["value"] == ["TIMESTAMPS"] and settings["trace_rate"]["value"] == ["1"]
        triton.update_trace_settings(settings={"trace_level": ["OFF"], "log_frequency": "0"})
        silent = [traceparent(sampled=True) for _ in range(8)]
        for _, header in silent:  # new connections: the kernel spreads them over both front-ends
            classify(target, header)
            level = tc.InferenceServerClient(target).get_trace_settings(as_json=True)["settings"]["trace_level"]
            assert level["value"] == ["OFF"]
        triton.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        traced, header = traceparent(sampled=True)
        classify(target, header)
        assert CLASSIFY in receiver.trace(traced, 5)
        assert not any(trace_id in receiver.spans for trace_id, _ in silent)
        wrong = refused_setting(triton, {"trace_level": ["TENSORS"]})
        assert "trace_level must be one value, OFF or TIMESTAMPS" in wrong
        workers.process.send_signal(signal.SIGTERM)
        assert workers.process.wait(timeout=60) == 0
    finally:
        workers.close()


def refused_setting(triton, settings: dict) -> str:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        triton.update_trace_settings(settings=settings)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    return caught.value.message()


def test_trace_settings_need_a_receiver(server):
    triton = tc.InferenceServerClient(server.target)
    assert triton.get_trace_settings(as_json=True)["settings"]["trace_level"]["value"] == ["OFF"]
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        triton.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
    assert caught.value.status() == "StatusCode.FAILED_PRECONDITION" and "--otlp-endpoint" in caught.value.message()


def test_a_span_status_quotes_a_clients_value_cut(make_server, receiver):
    running = make_server(otlp_endpoint=f"127.0.0.1:{receiver.port}")
    trace_id, header = traceparent(sampled=True)
    request = oip.ModelInferRequest(model_name="m" * 250)
    with grpc.insecure_channel(running.target) as channel, pytest.raises(grpc.RpcError) as caught:
        oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, metadata=[("traceparent", header)], timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    server = receiver.trace(trace_id, 1)["inference.GRPCInferenceService/ModelInfer"]
    assert server.status.message.startswith("NOT_FOUND: unknown model") and len(server.status.message) <= 256


def test_the_batch_processors_warning_per_dropped_span_is_said_once_a_minute(caplog):
    """The review's N12: with the collector down and the queue full, the SDK logs "Queue full, dropping span."
    for every span, on the event loop; it goes through the same once-a-minute filter as failed exports."""
    from resnet_server.frontend.tracing import Tracing

    tracing = Tracing.start("127.0.0.1:9", 1.0, "127.0.0.1:1")
    try:
        sdk = logging.getLogger("opentelemetry.sdk._shared_internal")
        with caplog.at_level(logging.WARNING, logger="opentelemetry.sdk._shared_internal"):
            for _ in range(100):
                sdk.warning("Queue full, dropping %s.", "span")
        assert [record.getMessage() for record in caplog.records if record.name == sdk.name] == [
            "tracing: Queue full, dropping span. (spans are dropped; the next such line in 60s at the earliest)"]
    finally:
        tracing.shutdown()


def test_an_http_call_continues_its_callers_trace(make_server, receiver):
    """A traceparent header over HTTP continues the caller's trace as gRPC metadata does; the answer names the
    server's span in its own traceparent header."""
    import json
    import urllib.request

    from tests.helpers import free_port

    running = make_server(otlp_endpoint=f"127.0.0.1:{receiver.port}", http_port=free_port())
    trace_id, header = traceparent(sampled=True)
    body = {"inputs": [{"name": "input", "datatype": "UINT8", "shape": [1, 8, 8, 3], "data": [7] * 192}]}
    call = urllib.request.Request(f"http://{running.http_target}/v2/models/resnet18/infer",
                                  json.dumps(body).encode(), {"traceparent": header})
    with urllib.request.urlopen(call, timeout=30) as answer:
        assert answer.status == 200
        answered = answer.headers["traceparent"]
    spans = receiver.trace(trace_id, 5)
    server = spans["inference.GRPCInferenceService/ModelInfer"]
    assert server.parent_span_id.hex() == header.split("-")[2]
    assert attributes(server)["resnet.protocol"] == "http"
    assert answered == f"00-{trace_id}-{server.span_id.hex()}-01"
