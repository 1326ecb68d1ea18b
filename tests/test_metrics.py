"""Metric samples after real traffic, the /metrics endpoint, and promtool's lint of the exposition."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from resnet_client import Client
from tests.helpers import encode, free_port, random_rgb, scrape

IMAGE = encode(random_rgb(9))


def test_samples_count_requests_images_and_timings(make_server, weights_file):
    running = make_server(metrics_port=free_port())
    with Client(running.target, timeout=60) as client:
        client.classify([IMAGE, IMAGE, IMAGE])
        client.classify([IMAGE])
    sample = running.sample
    assert sample("resnet_requests_total", device="cpu", code="OK") == 2
    assert sample("resnet_images_total", device="cpu", code="OK") == 4
    assert sample("resnet_request_duration_seconds_count", device="cpu") == 2
    assert sample("resnet_queue_wait_seconds_count", device="cpu") == 4
    assert sample("resnet_batch_size_sum", device="cpu") == 4
    assert 1 <= sample("resnet_batch_compute_seconds_count", device="cpu") <= 4
    assert sample("resnet_batch_compute_seconds_sum", device="cpu") > 0
    parts = [sample("resnet_batch_part_seconds_total", device="cpu", part=part)
             for part in ("input", "infer", "output")]
    assert all(seconds > 0 for seconds in parts)  # JPEGs decoded in preprocessing: input is the stack and copy in
    assert sum(parts) == pytest.approx(sample("resnet_batch_compute_seconds_sum", device="cpu"), rel=1e-9)
    assert sample("resnet_queue_depth", device="cpu") == 0
    assert sample("resnet_requests_in_flight", device="cpu") == 0
    assert sample("resnet_replica_healthy", device="cpu") == 1
    assert sample("resnet_model_load_seconds", device="cpu") > 0
    assert sample("resnet_model_info", device="cpu", model="resnet18", version="1",
                  weights=str(weights_file[0]), server_version="0.1.0", runtime="torch") == 1
    # Buckets run from 0.5 ms to 10 s.
    assert sample("resnet_request_duration_seconds_bucket", device="cpu", le="0.0005") == 0
    assert sample("resnet_request_duration_seconds_bucket", device="cpu", le="10.0") == 2

    text = scrape(running.metrics_port)  # the server's one /metrics: each process's series, labelled by worker
    assert 'resnet_requests_total{code="OK",device="cpu",protocol="grpc",worker="0"} 2.0' in text
    assert 'resnet_batch_size_bucket{device="cpu",le="1.0",worker="engine-cpu"}' in text


@pytest.mark.skipif(shutil.which("promtool") is None and not os.environ.get("CI"),
                    reason="promtool (Debian package prometheus) not installed; CI installs it")
def test_promtool_accepts_the_exposition(server):
    with Client(server.target, timeout=60) as client:
        client.classify([IMAGE])
    exposition = scrape(server.metrics_port).encode()  # the merged /metrics of the front-end and the engine
    checked = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()
