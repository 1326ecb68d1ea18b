"""The supervisor process's entry point: the ``resnet-server`` command's own process."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from resnet_server.common.config import ConfigError, ServerConfig, parse_config
from resnet_server.common.devices import resolve_devices
from resnet_server.common.errors import StartupError
from resnet_server.common.logs import configure_logging
from resnet_server.supervisor.launcher import SignalPipe, Supervisor
from resnet_server.supervisor.merged_metrics import serve_merged_metrics

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    """``resnet-server`` (but bench-model): parse the flags, then run the server until it is stopped."""
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"resnet-server: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    return run_server(config)


def run_server(config: ServerConfig) -> int:
    """Run the engines and front-ends until a signal, or until a child ends before it first served; the exit
    code: 0 once every child drained and exited 0 after a signal, 1 otherwise."""
    supervisor = None
    try:  # the metrics port is bound first, so a port taken fails before any process starts
        supervisor = Supervisor(config, resolve_devices(config.devices))
        metrics_http = serve_merged_metrics(config.metrics_host, config.metrics_port, supervisor.metric_endpoints)
    except StartupError as exc:
        if supervisor is not None:
            supervisor.close()
        print(f"resnet-server: error: {exc}", file=sys.stderr)
        return 1
    supervisor.stop_signal = stop_signal = SignalPipe()
    try:
        a_child_failed = supervisor.run()
    finally:
        all_exited_cleanly = supervisor.stop()
        supervisor.close()
        stop_signal.close()
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()
    if a_child_failed:
        log.error("stopped: %s", supervisor.failure)
    else:
        log.info("stopped")
    return 1 if a_child_failed or not all_exited_cleanly else 0


