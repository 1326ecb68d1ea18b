"""A hostile client against every field of every RPC, generated from the service descriptors.

For each method of each service the server answers (both APIs, every Triton extension, health, reflection), and
for each field its request can reach (nested messages and maps included), one request carries that field's
worst value within the message limit (scripts/benchmarks/hostile_cases.py: a repeated field, packed field or map of
millions of entries, or a string or bytes of 8 MiB). While they run, a health check on the same front-end is
timed. Each must be refused with an error code (not OK, INTERNAL or UNKNOWN); health must answer within a second
throughout; no process of the server may grow past a bound or be replaced. Streams are also tried with a client
that never reads. An RPC or a field added later is tried without anyone remembering to.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from resnet_client.api import grpc_predict_v2_pb2 as oip
from tests.helpers import HealthProbe, free_port, load_script
from tests.server_process import Workers, gone

HEALTH_WITHIN = 1.0
MOST_GROWTH_MB = 300  # of any server process's peak resident memory over the whole run
hostile = load_script("hostile_cases")
CASES = hostile.cases()
MIB = hostile.MIB


def test_the_cases_cover_every_method_that_takes_a_field():
    covered = {case.method.full_name for case in CASES}
    takes_fields = {method.full_name for service in hostile.SERVICES for method in service.methods
                    if method.input_type.fields}
    assert covered == takes_fields and len(CASES) > 100


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024


@pytest.fixture(scope="module")
def hostile_target(weights_file, tmp_path_factory):
    """One server as users run it (one front-end, so that health is timed where the hostile calls land), with
    every extension on: repository control, client shared memory, tracing."""
    workers = Workers(str(weights_file[0]), "--frontends", "1", "--model-control", "explicit",
                      "--allow-client-shm", "true", "--otlp-endpoint", "127.0.0.1:9", "--http-port", str(free_port()))
    try:
        port, (frontend,) = workers.serving(1)
        pids = [workers.process.pid, frontend, *workers.engine_pids(1)]
        peaks = {pid: peak_rss_mb(pid) for pid in pids}
        yield workers, f"127.0.0.1:{port}", pids, peaks
        workers.terminate(pids)
    finally:
        workers.close()


@pytest.mark.slow
def test_every_fields_worst_value_is_refused_while_health_answers(hostile_target):
    _, target, _, _ = hostile_target
    options = [("grpc.max_send_message_length", 64 * MIB), ("grpc.max_receive_message_length", 64 * MIB)]
    probe = HealthProbe(target)
    answered: dict[str, str] = {}
    try:
        with grpc.insecure_channel(target, options=options) as channel:
            for case in CASES:
                answered[case.name] = hostile.outcome(channel, case)
    finally:
        probe.stop()
    assert_all_refused_and_unharmed(answered, hostile.ALLOWED, probe, hostile_target)


def assert_all_refused_and_unharmed(answered: dict[str, str], allowed: set[str], probe: HealthProbe,
                                    hostile_target) -> None:
    """Every case answered as ``allowed``, health within a second throughout, no process grown past the bound,
    replaced or gone."""
    workers, _, pids, peaks = hostile_target
    wrong = {name: code for name, code in answered.items() if code not in allowed}
    assert not wrong, wrong
    assert probe.times and max(probe.times) < HEALTH_WITHIN, max(probe.times)
    grown = {pid: peak_rss_mb(pid) - peaks[pid] for pid in pids}
    assert max(grown.values()) < MOST_GROWTH_MB, grown
    assert workers.count("started resnet-frontend") == 1 and workers.count("started resnet-engine") == 1
    assert not any(gone(pid) for pid in pids)


@pytest.mark.slow
def test_every_http_routes_worst_values_are_refused_while_health_answers(hostile_target):
    """The same over HTTP: each hostile body, path or header set is refused with a 4xx (or the connection closed
    before it was all sent), health on the gRPC port answers within a second throughout, and no process grows past
    the bound or is replaced."""
    workers, target, _, _ = hostile_target
    probe = HealthProbe(target)
    try:
        answered = {case.name: hostile.http_outcome("127.0.0.1", workers.http_port(), case)
                    for case in hostile.http_cases()}
    finally:
        probe.stop()
    assert_all_refused_and_unharmed(answered, hostile.HTTP_ALLOWED, probe, hostile_target)


@pytest.mark.slow
@pytest.mark.parametrize("model_name, id_, raw_bytes", [
    ("x" * (8 * MIB), "y" * MIB, 0),  # the review's N5: long names echoed in every refusal
    ("x" * 250, "y" * 250, MIB),  # refusals under every bound, each message 1 MiB
], ids=["long names", "large messages"])
def test_a_stream_never_read_costs_the_server_a_bounded_amount(hostile_target, model_name, id_, raw_bytes):
    """ModelStreamInfer messages refused one by one, from a client that never reads its answers: the server holds
    what its window bounds (or ends the stream at once), no process grows past the bound, and health answers."""
    workers, target, pids, peaks = hostile_target
    pulled = [0]  # messages gRPC has taken from the client to send

    def messages() -> Iterator[bytes]:
        request = oip.ModelInferRequest(model_name=model_name, id=id_)
        if raw_bytes:
            request.raw_input_contents.append(bytes(raw_bytes))
        wire = request.SerializeToString()
        for _ in range(300):
            pulled[0] += 1
            yield wire

    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(target, options=options) as channel:
        call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")(messages(), timeout=120)
        started = changed = time.monotonic()
        last = pulled[0]
        # Until the client's sends stop (all sent, flow control holds them, or the stream has ended): at most 60 s.
        while time.monotonic() - changed < 2 and call.is_active():
            assert time.monotonic() - started < 60
            if pulled[0] != last:
                changed, last = time.monotonic(), pulled[0]
            time.sleep(0.05)
        grown = {pid: peak_rss_mb(pid) - peaks[pid] for pid in pids}
        call.cancel()
    assert max(grown.values()) < MOST_GROWTH_MB, grown
    with grpc.insecure_channel(target) as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("config, says", [
    ('{"input": [' * 20_000 + "]}" * 20_000, "bytes"),  # over the bound: refused unread
    ('{"input": ' + "[" * 10_000 + "]" * 10_000 + "}", "not a ModelConfig in JSON"),  # deep, under the bound
])
def test_a_hostile_model_config_is_invalid_not_internal(hostile_target, config, says):
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException

    _, target, _, _ = hostile_target
    with pytest.raises(InferenceServerException) as refused:
        tc.InferenceServerClient(target).load_model("resnet18", config=config)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and says in refused.value.message()
    assert len(refused.value.message()) < 1000


def test_a_reload_that_fails_on_the_engines_says_why_in_one_short_line(hostile_target, tmp_path):
    """The review's N20 and N24: weights holding NaN pass the front-end's check (shapes and kinds) and fail on
    every engine; the caller hears why in one line, not the engine's traceback or the server's paths."""
    import torch
    import tritonclient.grpc as tc
    from torchvision.models import resnet18
    from tritonclient.utils import InferenceServerException

    _, target, _, _ = hostile_target
    state = resnet18().state_dict()
    state["fc.bias"][0] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    triton = tc.InferenceServerClient(target)
    with pytest.raises(InferenceServerException) as refused:
        triton.load_model("resnet18", files={"file:1/nan.pt": (tmp_path / "nan.pt").read_bytes()})
    message = refused.value.message()
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "'fc.bias' holds NaN or infinite values" in \
        message
    assert "\n" not in message and "/tmp" not in message and len(message) < 600
    assert triton.is_model_ready("resnet18")
