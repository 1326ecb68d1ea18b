"""A front-end process's entry point: several share the gRPC port, started by the supervisor."""

from __future__ import annotations

from multiprocessing.connection import Connection

from resnet_server.boundary.control import Bound, MetricsPort, Outbox, Serving, frontend_order_inbox
from resnet_server.boundary.protocol import EngineLink
from resnet_server.common.lifetime import die_with_supervisor
from resnet_server.common.logs import configure_logging
from resnet_server.common.memory import map_huge_blocks
from resnet_server.common.metrics import Metrics, serve_child_metrics
from resnet_server.common.sections import FrontendConfig
from resnet_server.common.served import ServedWeights
from resnet_server.common.shared_regions import RegionSpec
from resnet_server.common.statistics import SharedRow
from resnet_server.frontend.model_control import ModelControl
from resnet_server.frontend.server import run


def frontend_main(config: FrontendConfig, index: int, engines: list[EngineLink], owner: int, statistics: SharedRow,
                   pipes: tuple[Connection, Connection], load_first: bool, with_metrics: bool,
                   served: ServedWeights, trace_settings: dict[str, list[str]], regions: list[RegionSpec]) -> None:
    """A front-end process: a gRPC server (resnet_server.frontend.server.run) over the engines, reporting where its
    /metrics listens (``with_metrics``), its port once bound, then that it serves. A replacement connects before it
    binds (``load_first``): until then its siblings take every new connection. ``pipes``: its reports to the supervisor
    and the supervisor's orders to it; ``served``: the weights every engine serves now; ``trace_settings``:
    Triton's trace settings as set while serving; ``regions``: the clients' shared-memory regions registered now."""
    reports, orders = pipes
    die_with_supervisor()
    map_huge_blocks()
    configure_logging(config.observability.log_level, config.observability.log_format)
    metrics = Metrics(config.largest_batch, statistics)
    # The pipes stay open as long as the process: their ends are read and written by descriptor.
    control = ModelControl(served, config.uploads, Outbox(reports.fileno()), frontend_order_inbox(orders.fileno()),
                           trace_settings, regions)
    if with_metrics:
        control.report(MetricsPort(serve_child_metrics(metrics.registry).server_port))
    code = run(config, index, engines, owner, metrics, on_bound=lambda ports: control.report(Bound(*ports)),
               on_serving=lambda: control.report(Serving()), load_first=load_first, control=control)
    control.stopped(code)
    raise SystemExit(code)
