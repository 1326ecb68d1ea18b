"""Fast checks of the deployment files: compose validates, Prometheus accepts its config, and every
Grafana dashboard query evaluates with data in a real Prometheus scraping a real server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resnet_client import Client
from tests.helpers import IN_CI, break_until_evicted, encode, free_port, needs_promtool, random_rgb, wait_for
from tests.prom import ALERT_RULES, ROOT, Prometheus


def compose_binary() -> list[str] | None:
    local = Path(sys.executable).parent / "docker-compose"
    if local.exists():
        return [str(local)]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def dashboard_queries() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/resnet.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.mark.skipif(compose_binary() is None and not IN_CI, reason="docker compose v2 binary not installed")
@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]])
def test_compose_file_is_valid(files):
    args = [*compose_binary(), *sum((["-f", name] for name in files), []), "config", "--format", "json"]
    defaults = {name: value for name, value in os.environ.items() if not name.startswith("RESNET_SERVER_")}
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60, env=defaults)
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    server = config["services"]["server"]
    assert "ports" not in server  # no fixed host port, so --scale works
    assert server["restart"] == "unless-stopped"  # a server that gives up (--unhealthy-exit-after) comes back
    assert server["environment"]["RESNET_SERVER_UNHEALTHY_EXIT_AFTER"] == "300"
    assert server["environment"]["RESNET_SERVER_MAX_CONNECTION_AGE"] == "0"
    assert server["environment"]["RESNET_SERVER_FRONTENDS"] == "auto"
    assert server["environment"]["RESNET_SERVER_PRECISION"] == "fp32"
    assert config["services"]["prometheus"]["depends_on"]["server"]["condition"] == "service_healthy"
    has_gpu = "deploy" in server and server["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert has_gpu == (len(files) == 1)
    assert "grafana" not in config["services"]  # on request only: a host without its image still starts the rest
    with_grafana = subprocess.run([*args[:-3], "--profile", "grafana", "config", "--format", "json"], cwd=ROOT,
                                  capture_output=True, text=True, timeout=60, env=defaults)
    assert with_grafana.returncode == 0, with_grafana.stderr
    assert "grafana" in json.loads(with_grafana.stdout)["services"]


@needs_promtool
def test_prometheus_config_is_valid():
    done = subprocess.run(["promtool", "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_alert_rules_are_valid_and_pass_their_unit_tests():
    for command in (["promtool", "check", "rules", str(ROOT / "deploy/prometheus/alerts.yml")],
                    ["promtool", "test", "rules", str(ROOT / "tests/prometheus/alerts_test.yml")]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


@needs_promtool
@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(make_server, faults, tmp_path):
    running = make_server(metrics_port=free_port(), runner=faults.runner)
    with Prometheus(f"127.0.0.1:{running.metrics_port}", tmp_path) as prometheus:
        image = encode(random_rgb(3))
        with Client(running.target) as client:
            deadline = time.monotonic() + 60
            # Traffic across several scrapes, so rate() over [1m] has two samples that differ.
            while time.monotonic() < deadline:
                client.classify([image])
                try:
                    up = prometheus.query('count_over_time(resnet_requests_total{code="OK"}[1m])')
                except OSError:
                    continue
                if up and float(up[0]["value"][1]) >= 4:
                    break
            client.classify([image])
        wait_for(lambda: prometheus.query("up"), timeout=30)
        for expr in dashboard_queries():
            result = prometheus.query(expr)
            if "resnet_gpu_" not in expr:  # GPU gauges exist only on CUDA replicas
                assert result, f"no data for {expr}"
        # The alerting rules load and evaluate against the real series, and a healthy server fires none.
        wait_for(prometheus.evaluated_rules, timeout=30)
        rules = prometheus.evaluated_rules()
        assert set(rules) == ALERT_RULES
        for name, rule in rules.items():
            assert (rule["health"], rule["state"]) == ("ok", "inactive"), (name, rule)
        # A replica taken out of rotation: both replica alerts match the real series (pending, for their `for:`).
        break_until_evicted(running, faults)
        wait_for(lambda: prometheus.rule_state("ResnetNoReplicaInRotation") == "pending", timeout=30)
        wait_for(lambda: prometheus.rule_state("ResnetReplicaOutOfRotation") == "pending", timeout=30)
        (alert,) = prometheus.evaluated_rules()["ResnetReplicaOutOfRotation"]["alerts"]
        assert alert["labels"]["device"] == "cpu" and alert["labels"]["severity"] == "warning"
