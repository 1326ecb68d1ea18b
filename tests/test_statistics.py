"""Triton's ModelStatistics, read by the real tritonclient and by Triton's perf_analyzer binary.

Each test starts its own server, so every count is this test's traffic alone.
"""

from __future__ import annotations

import multiprocessing
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from resnet_client import Client
from resnet_server.common.statistics import (
    SETTLE_SECONDS,
    BatchTotals,
    Duration,
    ModelStatistics,
    SharedRow,
    shared_rows,
)
from tests.helpers import encode, load_script, needs_perf_analyzer, random_rgb
from tests.statistics_writer import record_in_another_process

perf_analyzer = load_script("perf_analyzer")


def uint8_input(count: int) -> tc.InferInput:
    tensor = tc.InferInput("input", [count, 64, 48, 3], "UINT8")
    tensor.set_data_from_numpy(np.stack([random_rgb(700 + i, 64, 48) for i in range(count)]))
    return tensor


def statistics(client: tc.InferenceServerClient, name: str = "resnet18") -> dict:
    (model,) = client.get_inference_statistics(name, as_json=True)["model_stats"]
    return model


def test_every_request_and_batch_is_counted_whichever_api_sent_it(make_server):
    running = make_server()
    started_ms = time.time() * 1000
    with tc.InferenceServerClient(running.target) as triton, Client(running.target, timeout=60) as ours:
        for _ in range(3):  # one at a time: one batch each
            triton.infer("resnet18", [uint8_input(2)])
        ours.classify([encode(random_rgb(710))])
        with pytest.raises(InferenceServerException):  # reaches a replica, then fails validation
            triton.infer("resnet18", [uint8_input(1)], parameters={"temperature": "-1"})
        model = statistics(triton)
        assert statistics(triton, "") == model  # no name: every model, and this server has one
    assert model["name"] == "resnet18" and model["version"] == "1"
    assert int(model["inference_count"]) == 7 and int(model["execution_count"]) == 4
    assert started_ms <= int(model["last_inference"]) <= time.time() * 1000
    stats = model["inference_stats"]
    assert int(stats["success"]["count"]) == 4 and int(stats["fail"]["count"]) == 1
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert int(stats[part]["count"]) == 4, part
    # Sequential requests of one batch each: a request's time holds its queue wait and its batch.
    parts = sum(int(stats[part]["ns"]) for part in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert 0 < parts <= int(stats["success"]["ns"])
    by_size = {int(batch["batch_size"]): batch for batch in model["batch_stats"]}
    assert {size: int(batch["compute_infer"]["count"]) for size, batch in by_size.items()} == {1: 1, 2: 3}
    # The batches' parts add up to what Prometheus's compute histogram saw.
    batch_ns = sum(int(batch[part]["ns"]) for batch in by_size.values()
                   for part in ("compute_input", "compute_infer", "compute_output"))
    assert batch_ns == pytest.approx(running.sample("resnet_batch_compute_seconds_sum", device="cpu") * 1e9, abs=1e3)


def test_an_unknown_model_or_version_is_not_found(make_server):
    running = make_server()
    with tc.InferenceServerClient(running.target) as triton:
        for name, version in (("resnet50", ""), ("resnet18", "2")):
            with pytest.raises(InferenceServerException) as caught:
                triton.get_inference_statistics(name, version)
            assert caught.value.status() == str(grpc.StatusCode.NOT_FOUND)
        assert "statistics" in triton.get_server_metadata(as_json=True)["extensions"]


@needs_perf_analyzer
@pytest.mark.parametrize(("input_kind", "streaming"), [("fp32", False), ("uint8", False), ("uint8", True)])
def test_perf_analyzer_measures_the_server_and_reads_its_statistics(make_server, input_kind, streaming):
    """What each model name declares is what perf_analyzer sends (FP32 to resnet18, UINT8 to resnet18_uint8),
    as ModelInfer calls or ModelStreamInfer messages; the server counts every one."""
    running = make_server()
    figures = perf_analyzer.run(running.target, concurrency=2, window_requests=10, timeout=120,
                                input_kind=input_kind, streaming=streaming)
    assert (figures["input"], figures["streaming"]) == (input_kind, streaming) and figures["client_cores"] >= 0
    # The server's counts over perf_analyzer's window are this run's requests, one image each.
    assert figures["requests"] >= 10 and abs(figures["inferences"] - figures["requests"]) <= 2
    assert figures["successes"] == figures["inferences"]
    # Batches and images counted over the same window, each at its own moment (a batch when it runs, an image when
    # it is answered): one batch more at the window's edge was seen in CI beside the image build.
    assert 1 <= figures["executions"] <= figures["inferences"] + 2
    assert figures["throughput"] > 0 and 0 < figures["p50_us"] <= figures["p99_us"]
    assert figures["compute_infer_us"] > 0 and figures["request_us"] >= figures["compute_infer_us"]
    name = perf_analyzer.INPUTS[input_kind][0]
    with tc.InferenceServerClient(running.target) as triton:
        model = statistics(triton, name)
    assert model["name"] == name and "count" not in model["inference_stats"]["fail"]  # JSON leaves a zero out
    assert int(model["inference_count"]) >= figures["inferences"]


def spawn(target, *args) -> multiprocessing.process.BaseProcess:
    process = multiprocessing.get_context("spawn").Process(target=target, args=args)
    process.start()
    return process


def test_workers_statistics_add_up_across_processes_and_survive_a_replaced_worker():
    """Rows in shared memory, as the --workers supervisor hands them out: any worker's snapshot holds every
    process's counts; a worker's replacement goes on from its counts; one killed in the middle of a write holds
    a snapshot up for at most SETTLE_SECONDS, and not at all once its replacement has started."""
    rows = shared_rows(3, 8)
    answering = ModelStatistics(8, SharedRow(rows, 0))
    answering.record_request(0.01, None)  # one failed request in this process
    for index, requests in ((1, 5), (2, 7), (1, 4)):  # the third: worker 1's replacement
        worker = spawn(record_in_another_process, SharedRow(rows, index), requests)
        worker.join(60)
        assert worker.exitcode == 0
    totals = answering.snapshot()
    assert (totals.inference_count, totals.execution_count) == (2 * 16, 16)
    assert totals.success == Duration(16, 16 * 4_000_000) and totals.fail == Duration(1, 10_000_000)
    assert totals.queue == Duration(16, 16 * 1_000_000)  # each request's slowest image
    assert totals.compute == BatchTotals(Duration(16, 16_000_000), Duration(16, 32_000_000), Duration(16, 8_000_000))
    assert set(totals.batches) == {2} and totals.batches[2] == totals.compute
    # Worker 2 killed inside a write: its row's sequence stays odd until a replacement starts.
    stuck = multiprocessing.get_context("spawn").Event()
    worker = spawn(record_in_another_process, SharedRow(rows, 2), 0, stuck)
    try:
        assert stuck.wait(60)
    finally:
        worker.kill()
        worker.join()
    started = time.monotonic()
    partial = answering.snapshot()
    assert SETTLE_SECONDS <= time.monotonic() - started < 10 * SETTLE_SECONDS
    # The write it died in had counted the request and its image, not yet its queue time: that record alone.
    assert (partial.success.count, partial.inference_count, partial.queue.count) == (17, 33, 16)
    ModelStatistics(8, SharedRow(rows, 2))  # worker 2's replacement
    started = time.monotonic()
    assert answering.snapshot() == partial
    assert time.monotonic() - started < SETTLE_SECONDS
