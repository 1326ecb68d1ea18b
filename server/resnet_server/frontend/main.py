"""A front-end process's entry point: several share the gRPC port, started by the supervisor."""

from __future__ import annotations

from dataclasses import dataclass
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
from resnet_server.frontend.server import run
from resnet_server.frontend.supervisor_client import SupervisorClient


@dataclass(frozen=True)
class FrontendArgs:
    """What the supervisor hands a front-end process it starts."""

    config: FrontendConfig
    index: int  # its place among the front-ends (its statistics row, its name in logs)
    engines: list[EngineLink]
    owner: int  # the number its slots carry in every engine's slab
    statistics: SharedRow
    reports: Connection  # the pipe to the supervisor (resnet_server.boundary.control's reports)
    orders: Connection  # the pipe from it (its orders)
    load_first: bool  # a replacement: connect to the engines before binding, so its siblings serve until then
    with_metrics: bool  # serve /metrics (on a port of its own, reported)
    served: ServedWeights  # the weights every engine serves now
    trace_settings: dict[str, list[str]]  # Triton's trace settings as set while serving
    regions: list[RegionSpec]  # the clients' shared-memory regions registered now


def frontend_main(args: FrontendArgs) -> None:
    """A front-end process: a gRPC server (resnet_server.frontend.server.run) over the engines, reporting where its
    /metrics listens, its port once bound, then that it serves."""
    config = args.config
    die_with_supervisor()
    map_huge_blocks()
    configure_logging(config.observability.log_level, config.observability.log_format)
    metrics = Metrics(config.largest_batch, args.statistics)
    # The pipes stay open as long as the process: their ends are read and written by descriptor.
    control = SupervisorClient(args.served, config.uploads, Outbox(args.reports.fileno()),
                           frontend_order_inbox(args.orders.fileno()), args.trace_settings, args.regions)
    if args.with_metrics:
        control.report(MetricsPort(serve_child_metrics(metrics.registry).server_port))
    code = run(config, args.index, args.engines, args.owner, metrics,
               on_bound=lambda ports: control.report(Bound(*ports)), on_serving=lambda: control.report(Serving()),
               load_first=args.load_first, control=control)
    control.stopped(code)
    raise SystemExit(code)
