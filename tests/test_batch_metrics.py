"""The batcher's recorder (resnet_server.engine.batch_metrics), alone: each fact lands in its device's series and in
Triton's statistics, and nothing in another device's."""

from __future__ import annotations

import pytest

from resnet_server.common.metrics import Metrics
from resnet_server.common.statistics import BatchTiming
from resnet_server.engine.batch_metrics import BatchMetrics


def sample(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"resnet_{name}", labels)


def test_an_answered_batch_is_recorded_once_in_every_series_of_its_device():
    metrics = Metrics(largest_batch=8)
    recorded = BatchMetrics("cuda:1", metrics)
    recorded.answered([0.25, 0.5, 0.75], padding=1, timing=BatchTiming(0.01, 0.02, 0.03))
    assert sample(metrics, "batch_size_count", device="cuda:1") == 1
    assert sample(metrics, "batch_size_sum", device="cuda:1") == 3
    assert sample(metrics, "padded_images_total", device="cuda:1") == 1
    assert sample(metrics, "queue_wait_seconds_count", device="cuda:1") == 3
    assert sample(metrics, "queue_wait_seconds_sum", device="cuda:1") == pytest.approx(1.5)
    assert sample(metrics, "batch_compute_seconds_sum", device="cuda:1") == pytest.approx(0.06)
    parts = [sample(metrics, "batch_part_seconds_total", device="cuda:1", part=part) for part in BatchTiming._fields]
    assert parts == pytest.approx([0.01, 0.02, 0.03])
    totals = metrics.statistics.snapshot()
    assert (totals.execution_count, sorted(totals.batches)) == (1, [3])
    assert sample(metrics, "batch_size_count", device="cpu") is None


def test_the_queue_the_batches_in_flight_drops_probes_and_waits_each_have_their_series():
    metrics = Metrics(largest_batch=8)
    recorded = BatchMetrics("cpu", metrics)
    recorded.queued(5)
    recorded.in_flight(2)
    recorded.dropped("deadline")
    recorded.dropped("cancelled", 3)
    recorded.probed(passed=False)
    recorded.probed(passed=True)
    recorded.wait_came_back.inc()
    assert sample(metrics, "queue_depth", device="cpu") == 5
    assert sample(metrics, "batches_in_flight", device="cpu") == 2
    assert sample(metrics, "dropped_images_total", device="cpu", reason="deadline") == 1
    assert sample(metrics, "dropped_images_total", device="cpu", reason="cancelled") == 3
    assert [sample(metrics, "replica_probes_total", device="cpu", result=result)
            for result in ("passed", "failed")] == [1, 1]
    assert sample(metrics, "caller_waits_total", device="cpu", outcome="came_back") == 1
    assert sample(metrics, "caller_waits_total", device="cpu", outcome="ran_out") == 0
