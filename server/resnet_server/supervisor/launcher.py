"""The server's processes: one engine per device, several gRPC front-ends, and this supervisor.

One asyncio process cannot feed a GPU (its serving path answers a fraction of the calls a GPU computes:
docs/performance.md, "Figures behind the code"), and several whole servers each with its own replica split the
batches. So the network and the devices get processes of their own:

- an **engine** per device (``resnet_server.engine.core``): the model, warmed at every batch size it will run, and the
  one dynamic batcher of that device, across all front-ends; no asyncio, no gRPC;
- **front-ends** (``--frontends N``): each a gRPC server on the same port (SO_REUSEPORT: the kernel spreads
  connections over them) running both APIs, TLS and tokens, validation and decoding, with the images
  handed to the engines through shared memory (``resnet_server.boundary.slab``);
- this **supervisor**: starts the engines and, while they warm up, the front-ends (each binds the port,
  answers health NOT_SERVING, and reports SERVING once its engines answer); serves the
  one ``/metrics`` of the whole server (each child's series, labelled ``worker``: a front-end's index, or
  ``engine-DEVICE``); replaces a child that ends; and on SIGTERM/SIGINT stops the front-ends first (they
  drain within ``--grace-period``) and the engines last.

An engine that ends (a crash, the kernel's OOM killer) is restarted at once; meanwhile its calls in flight
have failed UNAVAILABLE and the front-ends route around it (health goes NOT_SERVING while no engine is
left), reconnecting once the new one is warm. A front-end that ends after it served is replaced, and the
engines only see its socket close. A child that keeps ending soon after its start (a crash loop) is
replaced after a growing pause (``restart_delay``). A child that ends before it first served (it cannot
bind or load, and a new one would fail the same way) makes the supervisor stop the rest and exit 1.
Children are forked from multiprocessing's fork server, a fresh process that imported torch and the engine's and
front-end's modules once but never touched a device: none inherits CUDA state, and a child (a replacement
above all) starts without importing torch again. The children's lives do not hang on the fork server's: each is
watched on a pidfd of its own (``resnet_server.supervisor.child_process``), and a fork server that has ended is started
again by the next child's start. A start that fails (the fork server ended mid-request, no memory to fork) is
logged in one line and tried again after ``restart_delay``, as a child that ended would be.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import secrets
import select
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

from resnet_server.boundary.control import (
    Answer,
    Bound,
    Committed,
    EngineOrder,
    FrontendOrder,
    Inbox,
    Load,
    MetricsPort,
    Outbox,
    PeerStopped,
    Prepared,
    Ready,
    RegionOpened,
    RegionsClosed,
    Register,
    ReloadFailed,
    Report,
    Serving,
    SetTrace,
    Stopped,
    TooLarge,
    Trace,
    Unload,
    Unregister,
    WeightsServed,
    report_inbox,
    short,
)
from resnet_server.boundary.protocol import EngineLink
from resnet_server.boundary.slab import SLOT_INPUT_BYTES, SlabLayout, create_slab_memory
from resnet_server.common.config import ServerConfig, host_port
from resnet_server.common.devices import replica_names
from resnet_server.common.errors import ServingError
from resnet_server.common.sections import engine_config, frontend_config
from resnet_server.common.served import ServedWeights
from resnet_server.common.shared_regions import RegionLimits, RegionTable
from resnet_server.common.statistics import SharedRow, shared_rows
from resnet_server.engine.main import EngineArgs, engine_main
from resnet_server.frontend.main import FrontendArgs, frontend_main
from resnet_server.supervisor.child_process import ChildProcess
from resnet_server.supervisor.reloads import Outcome, Reloads

log = logging.getLogger(__name__)
# What the fork server imports before it forks any child; importing them must touch no device and start no thread.
FORK_SERVER_PRELOAD = ["resnet_server.engine.main", "resnet_server.frontend.main"]
_children = multiprocessing.get_context("forkserver")
_children.set_forkserver_preload(FORK_SERVER_PRELOAD)
Request = Load | Unload | SetTrace | Register | Unregister | Prepared | Committed | ReloadFailed
STABLE_SECONDS = 60.0  # a child that ends later than this after its start was not crash-looping
MOST_RESTART_DELAY = 30.0


def frontend_count(config: ServerConfig, devices: int, cores: int | None = None) -> int:
    """--frontends, or for auto (0) half the cores left after one per engine, from 1 to 8: on the 2-core
    VM one front-end beside the engine; on a 16-core GPU box seven."""
    if config.frontends:
        return config.frontends
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, min(8, (cores - devices) // 2))


def restart_delay(quick_ends: int) -> float:
    """Seconds before replacing a child that has ended ``quick_ends`` times in a row, each within
    STABLE_SECONDS of its start: none the first time, then 1, 2, 4 ... up to MOST_RESTART_DELAY."""
    return 0.0 if quick_ends <= 1 else min(2.0 ** (quick_ends - 2), MOST_RESTART_DELAY)


@dataclasses.dataclass
class _Child:
    """One child process and its two pipes with the supervisor (resnet_server.boundary.control): its reports, a
    front-end's Bound then Serving, an engine's Ready, either's MetricsPort and Stopped, and requests and answers;
    and the supervisor's orders to it, written through an outbox that never blocks."""

    name: str  # the key it is supervised by: "frontend-N" or "engine-N"
    process: ChildProcess
    pipes: tuple[Connection, Connection]  # the supervisor's ends: its reports, our orders (kept open with it)
    reports: Inbox[Report] | None  # None once the child has closed its end (it has ended)
    orders: Outbox
    port: int = 0
    http_port: int = 0
    metrics_port: int = 0
    serving: bool = False
    quick_ends: int = 0  # how many children before it under this name ended soon after their start, in a row
    started: float = dataclasses.field(default_factory=time.monotonic)
    owner: int = 0  # a front-end's number in the engines' slabs
    # A front-end started in place of one that had served: ending before it serves says nothing of the
    # configuration (it may have been waiting for an engine's warm-up), so it is replaced too.
    replacement: bool = False
    stopped_with: int | None = None  # the code it said it would exit with, after its drain

    def ended_cleanly(self) -> bool:
        """It exited 0, or ended by SIGTERM before it could take it as a drain signal (still starting: it had
        accepted no call); where the fork server could not say, by what the child said as it stopped."""
        code = self.process.exit_code()
        return code in (0, -signal.SIGTERM) if code is not None else self.stopped_with == 0

    def quick_ends_now(self) -> int:
        """``quick_ends`` counting this child, which has just ended: one more if it ended soon after starting."""
        return self.quick_ends + 1 if time.monotonic() - self.started < STABLE_SECONDS else 0

    def read_reports(self) -> list[Request]:
        """Take every report that has come; at end-of-file, stop listening (the child has ended), and a child
        that sends what is not a control message is cut off. Its requests and answers, in order, for the
        supervisor to act on."""
        if self.reports is None:
            return []
        try:
            reports = self.reports.read()
        except (EOFError, PeerStopped) as exc:
            if isinstance(exc, PeerStopped):
                log.error("%s (pid %d) is cut off: %s", self.process.name, self.process.pid, exc)
                self.process.send(signal.SIGKILL)
            self.reports = None
            return []
        requests: list[Request] = []
        for report in reports:
            if isinstance(report, Bound):
                self.port, self.http_port = report.port, report.http_port
            elif isinstance(report, MetricsPort):
                self.metrics_port = report.port
            elif isinstance(report, Serving | Ready):
                self.serving = True
            elif isinstance(report, Stopped):
                self.stopped_with = report.code
            else:
                requests.append(report)
        return requests

    def order(self, message: FrontendOrder | EngineOrder) -> None:
        """Written now, or once its pipe has room; a child that has let MOST_OUTBOX_BYTES wait is cut off."""
        try:
            self.orders.send(message)
        except TooLarge:  # every order is bounded where it is made: this is a bug, not the child's fault
            log.exception("an order too large for %s was not sent", self.process.name)
        except PeerStopped as exc:
            if self.process.alive():
                log.error("%s (pid %d) reads no orders (%s): ending it", self.process.name, self.process.pid, exc)
                self.process.send(signal.SIGKILL)

    def close(self) -> None:
        for end in self.pipes:
            end.close()


class Supervisor:
    """The engines and front-ends of one server, and what they share: the slabs and the statistics rows."""

    def __init__(self, config: ServerConfig, devices: list) -> None:
        self.config = config
        self.devices = devices
        self.frontends = frontend_count(config, len(devices))
        self.stop_signal: SignalPipe | None = None  # set by run_server; a test's supervisor has none
        # ModelStatistics: a row per front-end (its calls), then one per engine (its batches).
        self.statistics = shared_rows(self.frontends + len(devices), config.largest_batch)
        layout = SlabLayout(config.max_queue, SLOT_INPUT_BYTES)
        authkey = secrets.token_bytes(32)
        self.links = [EngineLink(name, f"\0resnet-engine-{os.getpid()}-{index}-{secrets.token_hex(4)}", authkey,
                                 layout, create_slab_memory(layout))
                      for index, name in enumerate(replica_names(devices))]
        self.children: dict[str, _Child] = {}
        # Weights a client sends are written here by the front-end that took them (the engines read them here).
        self.uploads = Path(tempfile.mkdtemp(prefix="resnet-weights-"))
        self.reloads = Reloads(ServedWeights(config.weights, 1), config.weights, self.uploads, self._engine_names,
                               self._order, self._restart, self._announce)
        self.trace_settings: dict[str, list[str]] = {}  # Triton's, as set while serving (TraceSetting)
        # The clients' shared-memory regions, which every front-end opens (resnet_server.common.shared_regions).
        self.regions = RegionTable(RegionLimits(config.max_shm_regions, config.max_shm_mb << 20))
        self.due: dict[str, tuple[float, int]] = {}  # a child to start -> (when, its quick ends before it)
        self._owners = itertools.count(1)
        self.port = self.http_port = 0  # those the first front-end bound, which the others share
        self.failure = ""  # why the set stopped, when a child ended before it served

    def metric_endpoints(self) -> list[tuple[str, int]]:
        """Each child's ``worker`` label (front-ends by index, then ``engine-DEVICE``) and the loopback port of its
        /metrics, 0 while it has none (starting, or being replaced). Called from the metrics server's thread."""
        children = dict(self.children)  # a copy: this thread reads while the supervising one adds and removes
        frontends = [(str(index), children.get(f"frontend-{index}")) for index in range(self.frontends)]
        engines = [(f"engine-{link.name}", children.get(f"engine-{index}")) for index, link in enumerate(self.links)]
        return [(label, child.metrics_port if child is not None else 0) for label, child in (*frontends, *engines)]

    def close(self) -> None:
        for link in self.links:
            os.close(link.slab_fd)
        shutil.rmtree(self.uploads, ignore_errors=True)

    def _engine_names(self) -> list[str]:
        return [name for name in self.children if name.startswith("engine")]

    def _order(self, name: str, message: EngineOrder) -> None:
        if (child := self.children.get(name)) is not None:
            child.order(message)

    def _restart(self, name: str) -> None:
        if (child := self.children.get(name)) is not None:
            child.process.send(signal.SIGTERM)

    def _announce(self, served: ServedWeights) -> None:
        self._to_frontends(WeightsServed(served))

    def _to_frontends(self, message: FrontendOrder) -> None:
        for name, child in self.children.items():
            if name.startswith("frontend"):
                child.order(message)

    def reload(self) -> None:
        """SIGHUP's: every engine loads the weights from --weights again (even an unchanged file)."""
        self.reloads.load(None, lambda outcome: None)  # its outcome is logged

    def _act_on(self, child: _Child, requests: list[Request]) -> None:
        """A front-end's request (each answered to its call id), or an engine's answer to an order of a reload."""
        for request in requests:
            if isinstance(request, Prepared | Committed | ReloadFailed):
                self.reloads.on_report(child.name, request)
                continue
            reply = functools.partial(self._reply, child.name, request.call)
            if isinstance(request, Load):
                self.reloads.load(request.source, reply)
            elif isinstance(request, Unload):
                self.reloads.unload(reply)
            elif isinstance(request, SetTrace):
                self.trace_settings.update(request.settings)
                self._to_frontends(Trace(request.settings))  # each applies them before this answer comes
                reply(Outcome("OK", ""))
            else:
                reply(self._change_regions(request))

    def _change_regions(self, change: Register | Unregister) -> Outcome:
        """A client's region registered or unregistered, and every front-end told before the answer goes."""
        try:
            if isinstance(change, Register):
                self.regions.add(change.region)
                self._to_frontends(RegionOpened(change.region))
            else:  # a message a region: however many an owner had, each message stays small
                for region in self.regions.remove(change.owner, change.name):
                    self._to_frontends(RegionsClosed([region]))
        except ServingError as refused:
            return Outcome(refused.kind.name, str(refused))
        return Outcome("OK", "")

    def _reply(self, frontend: str, call: int, outcome: Outcome) -> None:
        if (child := self.children.get(frontend)) is not None:
            child.order(Answer(call, outcome.code, short(outcome.message)))

    def run(self) -> bool:
        """Start everything and keep it running; False when a signal comes, True when a child ended before it
        first served (the set then stops)."""
        self._start_engines()
        # The front-ends start beside the engines: waiting for the engines first adds a front-end's own start
        # (imports, gRPC, the port) to the time to SERVING. An engine or front-end that ends before it is ready
        # ends the set.
        self.start_frontend(0, self.config.port)
        if (failed := self.wait_until(lambda: self._port_of("frontend-0") != 0)) is not None:
            return failed
        self.port = self._port_of("frontend-0")
        self.http_port = self.children["frontend-0"].http_port
        for index in range(1, self.frontends):
            self.start_frontend(index, self.port)
        if (failed := self.wait_until(self._engines_warm)) is not None:
            return failed
        if self.config.metrics_port:
            log.info("metrics of every process on http://%s/metrics",
                     host_port(self.config.metrics_host, self.config.metrics_port))
        return self._supervise()

    def start_engines(self) -> bool | None:
        """Start an engine per device and wait until each is warm: None then, else as wait_until."""
        self._start_engines()
        return self.wait_until(self._engines_warm)

    def _start_engines(self) -> None:
        for index in range(len(self.links)):
            self.start_engine(index)

    def _engines_warm(self) -> bool:
        return all((child := self.children.get(f"engine-{index}")) is not None and child.serving
                   for index in range(len(self.links)))

    def _port_of(self, name: str) -> int:
        child = self.children.get(name)
        return child.port if child is not None else 0

    def forget(self, name: str) -> None:
        """Watch child ``name`` no longer: one that has ended, whose end is not to be acted on."""
        self.children.pop(name, None)

    def replace_engine(self, index: int) -> bool | None:
        """Engine ``index``, which has ended, replaced by a new one and waited for until warm: None then, else as
        wait_until."""
        self.forget(f"engine-{index}")
        self.start_engine(index)
        return self.wait_until(lambda: (child := self.children.get(f"engine-{index}")) is not None and child.serving)

    def wait_until(self, done: Callable[[], bool]) -> bool | None:
        """Wait for start-up reports until ``done()``; None then, False on a signal, True if a child ended. With
        start_engine and start_frontend, the supervisor's public API for starting children and waiting on them
        (its own start-up, and tests that start or replace one child)."""
        while not done():
            ready = self._wait()
            if self._signalled(ready):
                return False
            for child in list(self.children.values()):
                self._act_on(child, child.read_reports())
                if child.process.sentinel in ready and not done():
                    return self._ended_before_serving(child)
            self._start_due()
        return None

    def _wait(self) -> set[int]:
        """Until a report, a child's end, a signal, or the time to start a child that is due: the descriptors ready
        to read. Orders waiting in an outbox are written as their pipes take them."""
        pause = max(0.0, min(when for when, _ in self.due.values()) - time.monotonic()) if self.due else None
        poller = select.poll()
        for child in self.children.values():
            if child.reports is not None:
                poller.register(child.reports.fd, select.POLLIN)
            poller.register(child.process.sentinel, select.POLLIN)
            if child.orders.waiting:
                poller.register(child.orders.fd, select.POLLOUT)
        if self.stop_signal is not None:
            poller.register(self.stop_signal.reader.fileno(), select.POLLIN)
        ready = poller.poll(None if pause is None else pause * 1000)
        writable = {fd for fd, events in ready if events & (select.POLLOUT | select.POLLERR | select.POLLHUP)}
        for child in list(self.children.values()):
            if child.orders.fd in writable:
                with contextlib.suppress(PeerStopped):  # it has ended: its sentinel says so
                    child.orders.flush()
        return {fd for fd, events in ready if events & (select.POLLIN | select.POLLHUP | select.POLLERR)}

    def _start_due(self) -> None:
        for name, (when, quick_ends) in list(self.due.items()):
            if when <= time.monotonic():
                del self.due[name]
                kind, index = name.split("-")
                if kind == "engine":
                    self.start_engine(int(index), quick_ends)
                else:
                    self.start_frontend(int(index), self.port, load_first=bool(self.port), quick_ends=quick_ends)

    def _signalled(self, ready: set[int]) -> bool:
        """Whether SIGTERM or SIGINT has come (stop); a SIGHUP starts a reload of --weights."""
        if self.stop_signal is None or self.stop_signal.reader.fileno() not in ready:
            return False
        received = self.stop_signal.received()
        if signal.SIGHUP in received:
            log.info("SIGHUP received: reloading the weights from %s", self.config.weights)
            self.reload()
        return bool(received & {signal.SIGTERM, signal.SIGINT})

    def _supervise(self) -> bool:
        """Replace every child that ends after it served, after restart_delay when it is crash-looping; a
        first front-end that ends before serving ends the set (a replacement is replaced). False when a signal
        comes, True in that case."""
        while True:
            ready = self._wait()
            if self._signalled(ready):
                log.info("signal received: stopping %d front-ends, then %d engines", self.frontends, len(self.links))
                return False
            for child in list(self.children.values()):
                self._act_on(child, child.read_reports())
                if child.process.sentinel not in ready:
                    continue
                if not child.serving and child.name.startswith("frontend") and not child.replacement:
                    return self._ended_before_serving(child)
                self.due[child.name] = self._ended(child)
            self._start_due()

    def _ended_before_serving(self, child: _Child) -> bool:
        self.failure = f"{child.process.name} (pid {child.process.pid}) {child.process.describe_end()} before serving"
        log.error("%s; stopping the others", self.failure)
        return True

    def _ended(self, child: _Child) -> tuple[float, int]:
        """A child has ended: when to start its replacement, and its quick ends."""
        del self.children[child.name]
        child.process.close()
        child.close()
        self.reloads.engine_ended(child.name)
        quick_ends = child.quick_ends_now()
        delay = restart_delay(quick_ends)
        looping = f" (ended {quick_ends} times in a row within {STABLE_SECONDS:.0f} s of starting)" if delay else ""
        log.error("%s (pid %d) %s; starting a new one in %.0f s%s", child.process.name, child.process.pid,
                  child.process.describe_end(), delay, looping)
        return time.monotonic() + delay, quick_ends

    def start_engine(self, index: int, quick_ends: int = 0) -> _Child | None:
        link, config, served = self.links[index], self.config, self.reloads.served
        receiver, sender = _children.Pipe(duplex=False)
        orders, to_child = _children.Pipe(duplex=False)
        live_owners = [child.owner for child in self.children.values() if child.owner]
        process = _children.Process(target=engine_main, name=f"resnet-engine-{link.name}", args=(EngineArgs(
            link=link, device=str(self.devices[index]), config=engine_config(config, served.source, served.version),
            live_owners=live_owners, statistics=SharedRow(self.statistics, self.frontends + index),
            with_metrics=bool(config.metrics_port), reports=sender, orders=orders),))
        return self._started(f"engine-{index}", process, (receiver, sender), (orders, to_child), quick_ends)

    def start_frontend(self, index: int, port: int, load_first: bool = False, quick_ends: int = 0) -> _Child | None:
        """Start front-end ``index``; it writes its statistics into row ``index`` (a replacement goes on from
        its predecessor's counts)."""
        receiver, sender = _children.Pipe(duplex=False)
        orders, to_child = _children.Pipe(duplex=False)
        owner = next(self._owners)
        process = _children.Process(target=frontend_main, name=f"resnet-frontend-{index}", args=(FrontendArgs(
            config=frontend_config(self.config, port, self.frontends, str(self.uploads), self.http_port or None),
            index=index, engines=self.links, owner=owner, statistics=SharedRow(self.statistics, index),
            reports=sender, orders=orders, load_first=load_first, with_metrics=bool(self.config.metrics_port),
            served=self.reloads.served, trace_settings=self.trace_settings, regions=self.regions.specs()),))
        child = self._started(f"frontend-{index}", process, (receiver, sender), (orders, to_child), quick_ends)
        if child is not None:
            child.owner, child.replacement = owner, load_first
        return child

    def _started(self, name: str, process: BaseProcess, reports: tuple[Connection, Connection],
                 orders: tuple[Connection, Connection], quick_ends: int) -> _Child | None:
        """``process`` started (None if it could not be: it is then due again, as if it had ended at once), with
        ``reports`` from it and ``orders`` to it: pipes (the parent's end, the child's end)."""
        (receiver, sender), (child_orders, to_child) = reports, orders
        try:
            started = ChildProcess(process)
        except (OSError, EOFError) as exc:  # the fork server ended mid-request, or the system is out of processes
            for end in (receiver, sender, child_orders, to_child):
                end.close()
            delay = restart_delay(quick_ends + 1)
            log.error("%s could not start (%s: %s); trying again in %.0f s", process.name, type(exc).__name__, exc,
                      delay)
            self.due[name] = (time.monotonic() + delay, quick_ends + 1)
            return None
        sender.close()  # the child holds the only sending end now: when it ends, ours reads end-of-file
        child_orders.close()
        log.info("started %s (pid %d)", process.name, started.pid)
        self.children[name] = child = _Child(name, started, (receiver, to_child), report_inbox(receiver.fileno()),
                                             Outbox(to_child.fileno()), quick_ends=quick_ends)
        return child

    def stop(self) -> bool:
        """Front-ends first (they drain within the grace period), engines last; True if all exited cleanly."""
        children = list(self.children.values())
        frontends = [child for child in children if child.name.startswith("frontend")]
        engines = [child for child in children if child.name.startswith("engine")]
        frontends_clean = _stop_all(frontends, self.config.grace_period)
        return _stop_all(engines, self.config.grace_period) and frontends_clean


def _stop_all(children: list[_Child], grace: float) -> bool:
    """SIGTERM every live child and wait for each to drain (within its grace period; one still alive 5 s
    after that is killed). True if every child ended cleanly."""
    for child in children:
        if child.process.alive():
            child.process.send(signal.SIGTERM)
    for child in children:
        if not child.process.join(grace + 5):
            child.process.send(signal.SIGKILL)
            child.process.join()
        child.read_reports()
    return all(child.ended_cleanly() for child in children)


class SignalPipe:
    """SIGTERM and SIGINT (stop) and SIGHUP (reload) made readable: a socket that becomes ready when one
    arrives, to wait on beside the children's sentinels; Python writes each signal's number to it."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self.reader.setblocking(False)
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno())
        self._previous = {sig: signal.signal(sig, lambda *_: None)
                          for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def received(self) -> set[int]:
        """The signals that have come since the last call."""
        try:
            return set(self.reader.recv(4096))
        except BlockingIOError:
            return set()

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self.reader.close()
        self._writer.close()
