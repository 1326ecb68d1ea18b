"""The engine process's entry point: one per device, started by the supervisor."""

from __future__ import annotations

import logging
import select
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from resnet_server.boundary.control import (
    Abort,
    Commit,
    Committed,
    EngineOrder,
    EngineReport,
    Inbox,
    MetricsPort,
    Outbox,
    PeerStopped,
    Prepare,
    Prepared,
    Ready,
    ReloadFailed,
    Stopped,
    engine_order_inbox,
    short,
)
from resnet_server.boundary.protocol import EngineLink
from resnet_server.common.errors import StartupError
from resnet_server.common.lifetime import die_with_supervisor, exit_at_once
from resnet_server.common.logs import configure_logging
from resnet_server.common.metrics import Metrics, serve_child_metrics
from resnet_server.common.model import WeightsError
from resnet_server.common.sections import EngineConfig
from resnet_server.common.statistics import SharedRow
from resnet_server.common.threads import in_the_background, use_torch_threads
from resnet_server.engine.core import Engine

log = logging.getLogger(__name__)
REPORT_SECONDS = 10.0


@dataclass(frozen=True)
class EngineArgs:
    """What the supervisor hands an engine process it starts."""

    link: EngineLink  # the front-ends' way in: the engine's socket and slab
    device: str
    config: EngineConfig
    live_owners: list[int]  # the front-ends alive now (a new engine frees the slots of any other)
    statistics: SharedRow | None  # its row of the statistics every process writes
    with_metrics: bool  # serve /metrics (on a port of its own, reported)
    reports: Connection  # the pipe to the supervisor (resnet_server.boundary.control's reports)
    orders: Connection  # the pipe from it (its orders)


def engine_main(args: EngineArgs) -> None:
    """An engine process: report where its /metrics listens, load, report Ready to the supervisor, serve until
    SIGTERM, then drain."""
    link, device, config = args.link, args.device, args.config
    die_with_supervisor()
    configure_logging(config.observability.log_level, config.observability.log_format)
    # Ctrl-C reaches every process of the group; the supervisor stops the engines last, with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_torch_threads(1)  # the replica's own thread sets its team; the socket threads compute nothing
    # The batcher's thread gives the GIL up at every torch call and must win it back from the socket readers and
    # the finisher: the flag bounds that wait here, where the forward pass is launched (Python's own is 5 ms).
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    to_supervisor = Reports(args.reports.fileno())
    metrics = Metrics(config.largest_batch, args.statistics)
    http = serve_child_metrics(metrics.registry) if args.with_metrics else None
    if http is not None:
        to_supervisor.send(MetricsPort(http.server_port))
    engine = Engine(link, torch.device(device), config, metrics)
    try:
        engine.start(args.live_owners)
    except StartupError as exc:
        print(f"resnet-server: error: engine {link.name}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    # Until now SIGTERM ends the engine at once (it holds no call; a load may take minutes); from now, it drains.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    to_supervisor.send(Ready(engine.info()))
    log.info("engine %s ready on %s", link.name, device)
    threading.Thread(target=follow_orders, args=(engine, engine_order_inbox(args.orders.fileno()), to_supervisor),
                     name="engine-orders", daemon=True).start()
    exit_code = watch(engine, config, stop)
    engine.stop(config.grace_period)
    if http is not None:
        http.shutdown()
    log.info("engine %s stopped", link.name)
    to_supervisor.send(Stopped(exit_code))
    if exit_code:
        raise SystemExit(exit_code)


class Reports:
    """The engine's reports to the supervisor, from its main thread and its orders thread: one message at a time
    (a lock), each written within REPORT_SECONDS or dropped (a supervisor that reads nothing for that long is
    gone or stuck, and the engine does not wait on it)."""

    def __init__(self, fd: int) -> None:
        self._outbox = Outbox(fd)
        self._lock = threading.Lock()

    def send(self, message: EngineReport) -> None:
        with self._lock:
            try:
                self._outbox.send(message)
                if not self._outbox.drain(REPORT_SECONDS):
                    log.error("the supervisor has read nothing for %.0f s; a %s is not yet sent", REPORT_SECONDS,
                              type(message).__name__)
            except PeerStopped:  # the supervisor has gone: die_with_supervisor ends the process
                pass


def follow_orders(engine: Engine, orders: Inbox[EngineOrder], reports: Reports) -> None:
    """The supervisor's reload, in two steps on every engine, each order naming its reload: Prepare loads the
    weights beside those served and answers Prepared (their SHA-256) or ReloadFailed; Commit swaps in what that
    reload staged between two batches and answers Committed (or ReloadFailed); Abort drops it. An order of any
    other reload than the one staged changes nothing. Preparing runs in the background (threads): it takes the
    CPU the batches leave."""
    in_the_background()
    staged: int | None = None  # the reload whose weights are staged
    while True:
        try:
            select.select([orders.fd], [], [])
            received = orders.read()
        except (EOFError, OSError, PeerStopped):  # the supervisor has gone: die_with_supervisor ends the process
            return
        for order in received:
            staged = _follow(engine, order, reports, staged)


def _follow(engine: Engine, order: object, reports: Reports, staged: int | None) -> int | None:
    """One order; which reload's weights are staged after it."""
    if isinstance(order, Prepare):
        engine.abort()  # whatever an earlier reload left staged
        try:
            sha256 = engine.stage(order.source)
        except Exception as exc:  # noqa: BLE001 - told to the supervisor, which fails the reload saying why
            reports.send(_failed(engine, order.reload, "prepare", exc, order.source))
            return None
        reports.send(Prepared(order.reload, sha256))
        return order.reload
    if isinstance(order, Commit):
        if staged != order.reload:
            reports.send(ReloadFailed(order.reload, "commit", "INTERNAL", "nothing is staged for this reload"))
            return staged
        try:
            engine.commit(order.version)
        except Exception as exc:  # noqa: BLE001 - as above
            reports.send(_failed(engine, order.reload, "commit", exc, ""))
            return None
        reports.send(Committed(order.reload))
        return None
    if isinstance(order, Abort) and staged == order.reload:
        engine.abort()
        return None
    return staged


def _failed(engine: Engine, reload: int, step: str, exc: Exception, source: str) -> ReloadFailed:
    """The supervisor's answer for a step that raised: the full reason in this engine's log; to the caller, weights
    that do not fit said in a line without the server's path for them (``source``), anything else only as an
    internal error of this engine."""
    log.warning("engine %s: %s of reload %d failed: %s: %s", engine.link.name, step, reload, type(exc).__name__, exc)
    if isinstance(exc, WeightsError):
        said = str(exc).replace(f"weights {source}: ", "") if source else str(exc)
        return ReloadFailed(reload, step, "INVALID_ARGUMENT", short(said.replace(source, "the weights") if source
                                                                    else said))
    return ReloadFailed(reload, step, "INTERNAL", f"engine {engine.link.name} could not {step} the weights "
                                                  f"({type(exc).__name__}; its log says more)")


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
