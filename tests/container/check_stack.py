"""Checks a running compose stack from the host: classify through the gateway, both replicas in
Prometheus, every dashboard query evaluates with data, the alerting rules are loaded and quiet, and (if
running) Grafana serves the dashboard.
Bounded: every wait gives up after a few minutes. Exit code 0 only when every check passes."""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from PIL import Image

from resnet_client import Client

ROOT = Path(__file__).resolve().parents[2]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def query(prometheus: str, expr: str) -> dict:
    return get_json(f"{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


def wait_until(check, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(2)
    raise SystemExit(f"FAILED: {what} (waited {timeout:.0f}s)")


def classify_over_http(gateway: str, jpeg: bytes) -> None:
    """The gateway's HTTP port: /v1/classify in JSON, as the README's curl line sends it."""
    body = json.dumps({"images": [{"encoded": base64.b64encode(jpeg).decode()}], "top_k": 3}).encode()
    for _ in range(4):
        with urllib.request.urlopen(f"http://{gateway}/v1/classify", body, timeout=60) as answer:
            (result,) = json.loads(answer.read())["results"]
            assert len(result["topK"]) == 3
    print("ok: classified 4 images over HTTP through the gateway")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--http-gateway", required=True, help="the gateway's HTTP HOST:PORT")
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--grafana")
    args = parser.parse_args()

    buffer = io.BytesIO()
    Image.new("RGB", (320, 240), (200, 120, 40)).save(buffer, "JPEG")
    devices = set()
    with Client(args.gateway, timeout=60) as client:
        for _ in range(40):  # the gateway balances per call, so both replicas serve some of these
            (result,) = client.classify([buffer.getvalue()], top_k=3)
            devices.add(result.device)
            assert len(result.top_k) == 3
    print(f"ok: classified 40 images through the gateway (devices: {sorted(devices)})")
    classify_over_http(args.http_gateway, buffer.getvalue())

    def instances() -> list[str]:
        answer = query(args.prometheus, "sum by (instance) (resnet_request_duration_seconds_count)")
        found = sorted(series["metric"]["instance"] for series in answer["data"]["result"]
                       if float(series["value"][1]) > 0)
        return found if len(found) >= args.replicas else []

    found = wait_until(instances, f"latency series from {args.replicas} replicas in Prometheus")
    print(f"ok: Prometheus has per-device latency series from {len(found)} replicas: {found}")

    # Every dashboard query evaluates; those split by instance show every replica (GPU ones may be empty).
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/resnet.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            wanted = 0 if "resnet_gpu_" in expr else args.replicas if "instance" in expr else 1

            def evaluated(e=expr, wanted=wanted):
                answer = query(args.prometheus, e)
                return answer if answer["status"] == "success" and len(answer["data"]["result"]) >= wanted else None

            answer = wait_until(evaluated, f"dashboard query {expr} with {wanted} series", timeout=120)
            print(f"ok: {len(answer['data']['result'])} series  {expr[:90]}")

    # The alerting rules are mounted, loaded, evaluated without error, and quiet on a healthy stack.
    def rules_evaluated():
        groups = get_json(f"{args.prometheus}/api/v1/rules")["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if rules and all(not rule["lastEvaluation"].startswith("0001") for rule in rules) else None

    rules = wait_until(rules_evaluated, "alerting rules loaded and evaluated", timeout=60)
    for rule in rules:
        if (rule["health"], rule["state"]) != ("ok", "inactive"):
            raise SystemExit(f"FAILED: alert {rule['name']} is {rule['health']}/{rule['state']}: {rule}")
    print(f"ok: {len(rules)} alerting rules loaded, evaluated and inactive: {sorted(r['name'] for r in rules)}")

    if args.grafana:
        found = wait_until(lambda: get_json(f"{args.grafana}/api/dashboards/uid/resnet-serving"),
                           "Grafana serves the dashboard")
        print(f"ok: Grafana dashboard {found['dashboard']['title']!r} loads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
