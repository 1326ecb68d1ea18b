"""A real Prometheus for the tests: started on 127.0.0.1 with a scrape config of one target, queried over
its HTTP API, and stopped by its PID."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parent.parent
ALERT_RULES = {"ResnetServerDown", "ResnetNoReplicaInRotation", "ResnetReplicaOutOfRotation",
               "ResnetRequestsFailing", "ResnetSlowRequests", "ResnetServerRestarting"}


class Prometheus:
    """``prometheus`` scraping ``target`` every second as job resnet-server, with the shipped alerting rules."""

    def __init__(self, target: str, data_dir: Path) -> None:
        config = data_dir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{ROOT / 'deploy/prometheus/alerts.yml'}']\n"
            "scrape_configs:\n  - job_name: resnet-server\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.port = free_port()
        self._process = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={data_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *_exc) -> None:
        self._process.terminate()
        self._process.wait(30)

    def api(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.loads(response.read())

    def started(self) -> bool:
        try:
            return self.api("status/buildinfo")["status"] == "success"
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The result vector of an instant query (raises OSError while Prometheus is still starting)."""
        answer = self.api("query", query=expr)
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def evaluated_rules(self) -> dict[str, dict]:
        """The loaded alerting rules by name, once every one has been evaluated at least once."""
        groups = self.api("rules")["data"]["groups"]
        rules = {rule["name"]: rule for group in groups for rule in group["rules"]}
        evaluated = all(not rule["lastEvaluation"].startswith("0001") for rule in rules.values())
        return rules if rules and evaluated else {}

    def rule_state(self, name: str) -> str:
        return self.evaluated_rules().get(name, {}).get("state", "")
