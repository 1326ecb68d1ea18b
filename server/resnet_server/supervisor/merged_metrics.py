"""The supervisor's ``/metrics``: every child process's metrics in one scrape, each sample labelled ``worker``
(a front-end's index, or ``engine-DEVICE``), so one scrape target per server (a container's port 8000, a pod's
metrics port) sees all of its processes: the engines' per-device queue, compute and batch-size histograms,
and the front-ends' per-call series.

Each child serves its own ``/metrics`` on 127.0.0.1, on a port the system picks (so that the server listens only on
the ports its user chose), and reports that port to the supervisor; at every scrape of the supervisor's endpoint
this collector reads them all at once and merges their families. A child that does not answer (being replaced,
or still starting) is left out of that scrape, and ``resnet_worker_up`` says so.
The supervisor's own ``process_*`` samples (its memory, CPU, open files) join them, labelled
``worker="supervisor"``.
"""

from __future__ import annotations

import http.client
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from resnet_server.common.metrics import CHILD_METRICS_HOST, PREFIX, serve_registry

SCRAPE_TIMEOUT = 5.0  # seconds per child, below Prometheus's default scrape timeout (10 s)


# Each child's ``worker`` label and its /metrics port on CHILD_METRICS_HOST (0: none yet, or it has ended).
Endpoints = Callable[[], list[tuple[str, int]]]


class WorkersCollector(Collector):
    """Collects the children's /metrics, read at scrape time, as one set of families with a ``worker`` label."""

    def __init__(self, endpoints: Endpoints) -> None:
        """``endpoints``: read at each scrape, as children come and go."""
        self._endpoints = endpoints
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="worker-metrics")
        self._supervisor = ProcessCollector(registry=None)

    def collect(self):
        up = GaugeMetricFamily(PREFIX + "worker_up", "1 if the worker answered this scrape of the supervisor's "
                               "/metrics, else 0 (being replaced, or still starting)", labels=["worker"])
        merged: dict[str, Metric] = {}
        endpoints = self._endpoints()
        for (worker, _), families in zip(endpoints, self._pool.map(_scrape, [port for _, port in endpoints]),
                                         strict=True):
            up.add_metric([worker], 0 if families is None else 1)
            for family in families or ():
                _merge(merged, family, worker)
        for family in self._supervisor.collect():
            _merge(merged, family, "supervisor")
        yield up
        yield from merged.values()


def _merge(merged: dict[str, Metric], family: Metric, worker: str) -> None:
    """Add ``family``'s samples, labelled with their child's ``worker``, to the family of the same name in ``merged``.
    The text format's ``_created`` samples are left out: the parser turns them into families of their own."""
    if family.name.endswith("_created"):
        return
    into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
    into.samples += [sample._replace(labels={**sample.labels, "worker": worker})
                     for sample in family.samples if not sample.name.endswith("_created")]


def _scrape(port: int) -> list[Metric] | None:
    """The child's families, or None where it did not answer whole: a child dying mid-scrape cuts its answer
    short (IncompleteRead, BadStatusLine) or leaves text that does not parse, and costs only its own series."""
    if not port:
        return None
    try:
        with urllib.request.urlopen(f"http://{CHILD_METRICS_HOST}:{port}/metrics", timeout=SCRAPE_TIMEOUT) as response:
            return list(text_string_to_metric_families(response.read().decode()))
    except (OSError, http.client.HTTPException, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def serve_merged_metrics(host: str, metrics_port: int, endpoints: Endpoints):
    """The supervisor's /metrics on ``host:metrics_port`` (None when the port is 0); raises StartupError if it
    cannot bind."""
    if not metrics_port:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WorkersCollector(endpoints))
    return serve_registry(registry, host, metrics_port)
