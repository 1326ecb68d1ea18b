"""The engine process's entry point: one per device, started by the supervisor."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from multiprocessing.connection import Connection

import torch

from resnet_server.boundary.protocol import EngineLink
from resnet_server.common.errors import StartupError
from resnet_server.common.lifetime import die_with_supervisor, exit_at_once, report_stopped
from resnet_server.common.logs import configure_logging
from resnet_server.common.metrics import Metrics, serve_child_metrics
from resnet_server.common.sections import EngineConfig
from resnet_server.common.statistics import SharedRow
from resnet_server.common.threads import in_the_background, use_torch_threads
from resnet_server.engine.core import Engine

log = logging.getLogger("server.engine")


def engine_main(link: EngineLink, device: str, config: EngineConfig, live_owners: list[int],
                statistics: SharedRow | None, with_metrics: bool, reports: Connection, orders: Connection) -> None:
    """An engine process: report where its /metrics listens (``with_metrics``), load, report ("ready", info) to
    the supervisor, serve until SIGTERM, then drain."""
    die_with_supervisor()
    configure_logging(config.observability.log_level, config.observability.log_format)
    # Ctrl-C reaches every process of the group; the supervisor stops the engines last, with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_torch_threads(1)  # the replica's own thread sets its team; the socket threads compute nothing
    # The batcher's thread gives the GIL up at every torch call and must win it back from the socket readers and
    # the finisher: the flag bounds that wait here, where the forward pass is launched (Python's own is 5 ms).
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    metrics = Metrics(config.largest_batch, statistics)
    http = serve_child_metrics(metrics.registry) if with_metrics else None
    if http is not None:
        reports.send(("metrics", http.server_port))
    engine = Engine(link, torch.device(device), config, metrics)
    try:
        engine.start(live_owners)
    except StartupError as exc:
        print(f"resnet-server: error: engine {link.name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    # Until now SIGTERM ends the engine at once (it holds no call; a load may take minutes); from now, it drains.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reports.send(("ready", engine.info()))
    log.info("engine %s ready on %s", link.name, device)
    threading.Thread(target=follow_orders, args=(engine, orders, reports), name="engine-orders", daemon=True).start()
    exit_code = watch(engine, config, stop)
    engine.stop(config.grace_period)
    if http is not None:
        http.shutdown()
    log.info("engine %s stopped", link.name)
    report_stopped(reports, exit_code)
    if exit_code:
        raise SystemExit(exit_code)


def follow_orders(engine: Engine, orders: Connection, reports: Connection) -> None:
    """The supervisor's reload, in two steps on every engine: ("prepare", version, source) loads the weights
    beside those served and answers ("prepared", (version, sha256)) or ("prepare-failed", (version, why));
    then ("commit", version) swaps them in between two batches and answers ("committed", version) (or
    "commit-failed"), or ("abort", version) drops them. Preparing runs in the background (threads): it takes the
    CPU the batches leave."""
    in_the_background()
    while True:
        try:
            kind, version, *rest = orders.recv()
        except (EOFError, OSError):  # the supervisor has gone: die_with_supervisor ends the process
            return
        try:
            if kind == "prepare":
                reports.send(("prepared", (version, engine.stage(rest[0]))))
            elif kind == "commit":
                engine.commit(version)
                reports.send(("committed", version))
            else:
                engine.abort()
        except Exception as exc:  # noqa: BLE001 - told to the supervisor, which fails the reload saying why
            log.warning("engine %s: %s of weights version %d failed: %s: %s", engine.link.name, kind, version,
                        type(exc).__name__, exc)
            reports.send((f"{kind}-failed", (version, f"{type(exc).__name__}: {engine.link.name}: {exc}")))


def watch(engine: Engine, config: EngineConfig, stop: threading.Event) -> int:
    """Until SIGTERM (0), once a second: end the process at once if a launched batch has gone unanswered for
    --stuck-batch-timeout (a hung device or thread: nothing could drain it), or return 1 once the device has been
    out of rotation for --unhealthy-exit-after; the supervisor then starts a fresh engine (only a new process
    gets a new CUDA context). And free the slots of front-ends gone without a word (Engine.sweep)."""
    while not stop.wait(1.0):
        if config.stuck_batch_timeout and (waited := engine.stuck_for()) >= config.stuck_batch_timeout:
            log.critical("engine %s: a batch has waited %.0fs for its answer (--stuck-batch-timeout %gs); ending "
                         "the engine so that a new one replaces it", engine.link.name, waited,
                         config.stuck_batch_timeout)
            exit_at_once(1)
        if config.unhealthy_exit_after and (out := engine.out_of_rotation_for()) >= config.unhealthy_exit_after:
            log.error("engine %s: out of rotation for %.0fs (--unhealthy-exit-after %gs); ending the engine so that "
                      "a new one replaces it", engine.link.name, out, config.unhealthy_exit_after)
            return 1
        engine.sweep()
    return 0
