"""The server's processes: one engine per device, several gRPC front-ends, and this supervisor.

One asyncio process cannot feed a GPU (its serving path answers a fraction of the calls a GPU computes:
docs/performance.md, "Figures behind the code"), and several whole servers each with its own replica split the
batches. So the network and the devices get processes of their own:

- an **engine** per device (``server.engine.core``): the model, warmed at every batch size it will run, and the
  one dynamic batcher of that device, across all front-ends; no asyncio, no gRPC;
- **front-ends** (``--frontends N``): each a gRPC server on the same port (SO_REUSEPORT: the kernel spreads
  connections over them) running both APIs, TLS and tokens, validation and decoding, with the images
  handed to the engines through shared memory (``server.boundary.slab``);
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
above all) starts without importing torch again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from resnet_server.boundary.protocol import EngineLink
from resnet_server.boundary.slab import SLOT_INPUT_BYTES, SlabLayout, create_slab_memory
from resnet_server.common.config import ServerConfig, host_port
from resnet_server.common.devices import replica_names
from resnet_server.common.sections import engine_config, frontend_config
from resnet_server.common.statistics import SharedRow, shared_rows
from resnet_server.engine.main import engine_main
from resnet_server.frontend.main import frontend_main

log = logging.getLogger("server.supervisor")
# What the fork server imports before it forks any child; importing them must touch no device and start no thread.
FORK_SERVER_PRELOAD = ["resnet_server.engine.main", "resnet_server.frontend.main"]
_children = multiprocessing.get_context("forkserver")
_children.set_forkserver_preload(FORK_SERVER_PRELOAD)
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
    """One child process and the receiving end of its reports: a front-end's ("bound", port) then
    ("serving", 0), an engine's ("ready", info), and either's ("metrics", port) where its /metrics listens."""

    name: str  # the key it is supervised by: "frontend-N" or "engine-N"
    process: BaseProcess
    reports: Connection | None  # None once the child has closed its end (it has ended)
    port: int = 0
    metrics_port: int = 0
    serving: bool = False
    quick_ends: int = 0  # how many children before it under this name ended soon after their start, in a row
    started: float = dataclasses.field(default_factory=time.monotonic)
    owner: int = 0  # a front-end's number in the engines' slabs
    # A front-end started in place of one that had served: ending before it serves says nothing of the
    # configuration (it may have been waiting for an engine's warm-up), so it is replaced too.
    replacement: bool = False

    def quick_ends_now(self) -> int:
        """``quick_ends`` counting this child, which has just ended: one more if it ended soon after starting."""
        return self.quick_ends + 1 if time.monotonic() - self.started < STABLE_SECONDS else 0

    def read_reports(self) -> None:
        """Take every report waiting; at end-of-file, stop listening (the child has ended)."""
        try:
            while self.reports is not None and self.reports.poll():
                kind, value = self.reports.recv()
                self.serving |= kind in ("serving", "ready")
                self.port = value if kind == "bound" else self.port
                self.metrics_port = value if kind == "metrics" else self.metrics_port
        except EOFError:
            self.reports.close()
            self.reports = None


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
        self._owners = itertools.count(1)
        self.port = 0
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

    def run(self) -> bool:
        """Start everything and keep it running; False when a signal comes, True when a child ended before it
        first served (the set then stops)."""
        self._start_engines()
        # The front-ends start beside the engines: waiting for the engines first adds a front-end's own start
        # (imports, gRPC, the port) to the time to SERVING. An engine or front-end that ends before it is ready
        # ends the set, as before.
        first = self._start_frontend(0, self.config.port)
        if (failed := self._wait_until(lambda: bool(first.port))) is not None:
            return failed
        self.port = first.port
        for index in range(1, self.frontends):
            self._start_frontend(index, self.port)
        if (failed := self._wait_until(self._engines_warm)) is not None:
            return failed
        if self.config.metrics_port:
            log.info("metrics of every process on http://%s/metrics",
                     host_port(self.config.metrics_host, self.config.metrics_port))
        return self._supervise()

    def start_engines(self) -> bool | None:
        """Start an engine per device and wait until each is warm: None then, else as _wait_until."""
        self._start_engines()
        return self._wait_until(self._engines_warm)

    def _start_engines(self) -> None:
        for index in range(len(self.links)):
            self._start_engine(index)

    def _engines_warm(self) -> bool:
        return all(self.children[f"engine-{index}"].serving for index in range(len(self.links)))

    def _wait_until(self, done: Callable[[], bool]) -> bool | None:
        """Wait for start-up reports until ``done()``; None then, False on a signal, True if a child ended."""
        while not done():
            ready = self._wait(None)
            if self._signalled(ready):
                return False
            for child in list(self.children.values()):
                child.read_reports()
                if child.process.sentinel in ready and not done():
                    return self._ended_before_serving(child)
        return None

    def _wait(self, timeout: float | None) -> list:
        listening = [child.reports for child in self.children.values() if child.reports is not None]
        sentinels = [child.process.sentinel for child in self.children.values()]
        signals = [self.stop_signal.reader] if self.stop_signal is not None else []
        return wait([*signals, *listening, *sentinels], timeout)

    def _signalled(self, ready: list) -> bool:
        return self.stop_signal is not None and self.stop_signal.reader in ready

    def _supervise(self) -> bool:
        """Replace every child that ends after it served, after restart_delay when it is crash-looping; a
        first front-end that ends before serving ends the set (a replacement is replaced). False when a signal
        comes, True in that case."""
        due: dict[str, tuple[float, int]] = {}  # name -> (when to start its replacement, its quick ends)
        while True:
            pause = max(0.0, min(when for when, _ in due.values()) - time.monotonic()) if due else None
            ready = self._wait(pause)
            if self._signalled(ready):
                log.info("signal received: stopping %d front-ends, then %d engines", self.frontends, len(self.links))
                return False
            for child in list(self.children.values()):
                child.read_reports()
                if child.process.sentinel not in ready:
                    continue
                if not child.serving and child.name.startswith("frontend") and not child.replacement:
                    return self._ended_before_serving(child)
                due[child.name] = self._ended(child)
            for name, (when, quick_ends) in list(due.items()):
                if when <= time.monotonic():
                    del due[name]
                    kind, index = name.split("-")
                    if kind == "engine":
                        self._start_engine(int(index), quick_ends)
                    else:
                        self._start_frontend(int(index), self.port, load_first=True, quick_ends=quick_ends)

    def _ended_before_serving(self, child: _Child) -> bool:
        child.process.join()
        self.failure = f"{child.process.name} (pid {child.process.pid}) ended with code {child.process.exitcode} " \
                       "before serving"
        log.error("%s; stopping the others", self.failure)
        return True

    def _ended(self, child: _Child) -> tuple[float, int]:
        """A child has ended: when to start its replacement, and its quick ends."""
        child.process.join()
        del self.children[child.name]
        quick_ends = child.quick_ends_now()
        delay = restart_delay(quick_ends)
        looping = f" (ended {quick_ends} times in a row within {STABLE_SECONDS:.0f} s of starting)" if delay else ""
        log.error("%s (pid %d) ended with code %s; starting a new one in %.0f s%s", child.process.name,
                  child.process.pid, child.process.exitcode, delay, looping)
        return time.monotonic() + delay, quick_ends

    def _start_engine(self, index: int, quick_ends: int = 0) -> _Child:
        link, config = self.links[index], self.config
        receiver, sender = _children.Pipe(duplex=False)
        live_owners = [child.owner for child in self.children.values() if child.owner]
        process = _children.Process(target=engine_main, name=f"resnet-engine-{link.name}", args=(
            link, str(self.devices[index]), engine_config(config), live_owners,
            SharedRow(self.statistics, self.frontends + index), bool(config.metrics_port), sender))
        return self._started(f"engine-{index}", process, receiver, sender, quick_ends)

    def _start_frontend(self, index: int, port: int, load_first: bool = False, quick_ends: int = 0) -> _Child:
        """Start front-end ``index``; it writes its statistics into row ``index`` (a replacement goes on from
        its predecessor's counts)."""
        receiver, sender = _children.Pipe(duplex=False)
        owner = next(self._owners)
        process = _children.Process(target=frontend_main, name=f"resnet-frontend-{index}", args=(
            frontend_config(self.config, port, self.frontends), index, self.links, owner,
            SharedRow(self.statistics, index), sender, load_first, bool(self.config.metrics_port)))
        child = self._started(f"frontend-{index}", process, receiver, sender, quick_ends)
        child.owner, child.replacement = owner, load_first
        return child

    def _started(self, name: str, process: BaseProcess, receiver: Connection, sender: Connection,
                 quick_ends: int) -> _Child:
        process.start()
        sender.close()  # the child holds the only sending end now: when it ends, ours reads end-of-file
        log.info("started %s (pid %d)", process.name, process.pid)
        self.children[name] = child = _Child(name, process, receiver, quick_ends=quick_ends)
        return child

    def stop(self) -> bool:
        """Front-ends first (they drain within the grace period), engines last; True if all exited cleanly."""
        children = list(self.children.values())
        frontends = [child.process for child in children if child.name.startswith("frontend")]
        engines = [child.process for child in children if child.name.startswith("engine")]
        frontends_clean = _stop_all(frontends, self.config.grace_period)
        return _stop_all(engines, self.config.grace_period) and frontends_clean


def _stop_all(children: list[BaseProcess], grace: float) -> bool:
    """SIGTERM every live child and wait for each to drain (within its grace period; one still alive 5 s
    after that is killed). True if every child exited 0."""
    for child in children:
        if child.is_alive():
            child.terminate()
    for child in children:
        child.join(grace + 5)
        if child.is_alive():
            child.kill()
            child.join()
    # A child ended by this SIGTERM before it could take it as a drain signal was still starting: it had
    # accepted no call, so nothing was lost.
    return all(child.exitcode in (0, -signal.SIGTERM) for child in children)


class SignalPipe:
    """SIGTERM and SIGINT made readable: a socket that becomes ready when either arrives, to wait on beside
    the children's sentinels."""

    def __init__(self) -> None:
        self.reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno())
        self._previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_fd)
        self.reader.close()
        self._writer.close()
