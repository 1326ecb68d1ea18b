"""``--workers N``: several server processes on one gRPC port, so request handling gets more than one core.

One server process answers every call on one asyncio event loop, and each one-image call costs that loop
about 0.5 ms of CPU on the 2-core CI machine (gRPC's own machinery and the handler; README, Performance):
one process tops out near 2,000 calls a second, however fast its GPU. With ``--workers N`` this process
becomes a supervisor that starts N worker processes, each a whole server (event loop, replicas, batchers),
binding the same port with SO_REUSEPORT, so the kernel spreads incoming connections over them. Connections,
not calls: a client with one channel stays on one worker, so N workers need clients with several
connections (several clients, or ``resnet-client bench --connections``).

The supervisor serves ``/metrics`` on ``--metrics-port``: its workers' metrics, each sample labelled
``worker`` (``server.worker_metrics``). The Open Inference Protocol's ``ModelStatistics`` totals lie in
shared memory the supervisor makes, a row per worker, so any worker answers for all (``server.statistics``).
Workers are spawned, not forked, so none inherits
CUDA state; the first binds (and picks the port, for ``--port 0``) before the others start, and all load at
the same time. The supervisor forwards SIGTERM/SIGINT (each worker drains within ``--grace-period``). A
worker that ends on its own after it served (a crash, the kernel's OOM killer, or ``--unhealthy-exit-after``)
is replaced by a fresh process with the same index and ports while the others keep serving; its clients'
connections break and reconnect to the live workers. One that keeps ending soon after it started (a crash
loop) is replaced after a growing pause (``restart_delay``), so a fault that recurs does not keep a core
loading models. One that ends before it served (it cannot bind or load,
and a new one would fail the same way) makes the supervisor stop the rest and exit 1.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from .config import ServerConfig
from .errors import StartupError
from .statistics import SharedRow, shared_rows
from .worker_metrics import WORKER_METRICS_HOST, serve_worker_metrics, worker_metrics_port

log = logging.getLogger("server.workers")
_spawn = multiprocessing.get_context("spawn")
STABLE_SECONDS = 60.0  # a worker that ends later than this after its start was not crash-looping
MOST_RESTART_DELAY = 30.0


def restart_delay(quick_ends: int) -> float:
    """Seconds before replacing a worker whose index has ended ``quick_ends`` times in a row, each within
    STABLE_SECONDS of its start: none the first time, then 1, 2, 4 ... up to MOST_RESTART_DELAY."""
    return 0.0 if quick_ends <= 1 else min(2.0 ** (quick_ends - 2), MOST_RESTART_DELAY)


def worker_config(config: ServerConfig, index: int, port: int) -> ServerConfig:
    """Worker ``index``'s configuration: the shared port, its own metrics port on loopback (the supervisor
    serves them merged), and its share of the cores."""
    return dataclasses.replace(
        config, port=port, worker=index,
        metrics_host=WORKER_METRICS_HOST, metrics_port=worker_metrics_port(config.metrics_port, index),
        torch_threads=config.torch_threads or max(1, len(os.sched_getaffinity(0)) // config.workers))


@dataclasses.dataclass
class _Worker:
    """One worker process and the receiving end of its reports: ("bound", port), then ("serving", 0)."""

    index: int
    process: BaseProcess
    reports: Connection | None  # None once the worker has closed its end (it has ended)
    port: int = 0
    serving: bool = False
    quick_ends: int = 0  # how many workers before it on this index ended soon after their start, in a row
    started: float = dataclasses.field(default_factory=time.monotonic)

    def quick_ends_now(self) -> int:
        """``quick_ends`` counting this worker, which has just ended: one more if it ended soon after starting."""
        return self.quick_ends + 1 if time.monotonic() - self.started < STABLE_SECONDS else 0

    def read_reports(self) -> None:
        """Take every report waiting; at end-of-file, stop listening (the worker has ended)."""
        try:
            while self.reports is not None and self.reports.poll():
                kind, value = self.reports.recv()
                self.serving |= kind == "serving"
                self.port = value if kind == "bound" else self.port
        except EOFError:
            self.reports.close()
            self.reports = None


def run_workers(config: ServerConfig) -> int:
    """Start ``config.workers`` workers and supervise them until a signal, or until a worker ends before it
    served; the exit code: 0 once every worker drained and exited 0 after a signal, 1 otherwise."""
    try:  # the workers' metrics, merged, on --metrics-port; bound first, so a port taken fails at once
        metrics_http = serve_worker_metrics(config.metrics_host, config.metrics_port, config.workers)
    except StartupError as exc:
        print(f"resnet-server: error: {exc}", file=sys.stderr)
        return 1
    stop_signal = _SignalPipe()
    workers: dict[int, _Worker] = {}
    statistics = shared_rows(config.workers, config.largest_batch)
    try:
        a_worker_failed = _start_and_supervise(config, statistics, stop_signal, workers)
    finally:
        all_exited_cleanly = _stop_all([worker.process for worker in workers.values()], config.grace_period)
        stop_signal.close()
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()
    return 1 if a_worker_failed or not all_exited_cleanly else 0


def _start_and_supervise(config: ServerConfig, statistics: ctypes.Array, stop_signal: _SignalPipe,
                         workers: dict[int, _Worker]) -> bool:
    """Start the workers into ``workers`` (worker 0 first: it picks the port for --port 0) and keep them
    running; return False when a signal comes, True when a worker ends before serving."""
    workers[0] = first = _start(config, statistics, 0, config.port)
    while not first.port:
        ready = wait([stop_signal.reader, first.process.sentinel, *([first.reports] if first.reports else [])])
        if stop_signal.reader in ready:
            return False
        first.read_reports()
        if not first.port and first.process.sentinel in ready:  # its own error is already on stderr
            return _ended_before_serving(first)
    workers.update((index, _start(config, statistics, index, first.port)) for index in range(1, config.workers))
    return _supervise(config, statistics, first.port, stop_signal, workers)


def _supervise(config: ServerConfig, statistics: ctypes.Array, port: int, stop_signal: _SignalPipe,
               workers: dict[int, _Worker]) -> bool:
    """Replace every worker that ends after it served (a crash, or --unhealthy-exit-after), so the others keep
    serving meanwhile, after restart_delay when it is crash-looping; a worker that ends before serving (it
    cannot load, and a new one would not either) ends the set. False when a signal comes, True in that case."""
    due: dict[int, tuple[float, int]] = {}  # index -> (when to start its replacement, its quick ends)
    while True:
        listening = [worker.reports for worker in workers.values() if worker.reports is not None]
        pause = max(0.0, min(when for when, _ in due.values()) - time.monotonic()) if due else None
        ready = wait([stop_signal.reader, *listening, *(worker.process.sentinel for worker in workers.values())],
                     pause)
        if stop_signal.reader in ready:
            log.info("signal received: stopping %d workers", len(workers))
            return False
        for worker in list(workers.values()):
            worker.read_reports()
            if worker.process.sentinel not in ready:
                continue
            if not worker.serving:
                return _ended_before_serving(worker)
            worker.process.join()
            quick_ends = worker.quick_ends_now()
            delay = restart_delay(quick_ends)
            looping = f" (ended {quick_ends} times in a row within {STABLE_SECONDS:.0f} s of starting)" if delay else ""
            log.error("%s (pid %d) ended with code %s after serving; starting a new one in %.0f s%s",
                      worker.process.name, worker.process.pid, worker.process.exitcode, delay, looping)
            del workers[worker.index]
            due[worker.index] = (time.monotonic() + delay, quick_ends)
        for index, (when, quick_ends) in list(due.items()):
            if when <= time.monotonic():
                del due[index]
                workers[index] = _start(config, statistics, index, port, load_first=True, quick_ends=quick_ends)


def _ended_before_serving(worker: _Worker) -> bool:
    worker.process.join()
    log.error("%s (pid %d) ended with code %s before serving; stopping the others", worker.process.name,
              worker.process.pid, worker.process.exitcode)
    return True


def _start(config: ServerConfig, statistics: ctypes.Array, index: int, port: int, load_first: bool = False,
           quick_ends: int = 0) -> _Worker:
    """Start worker ``index``; it writes its statistics into row ``index`` of ``statistics`` (a replacement
    goes on from its predecessor's counts)."""
    receiver, sender = _spawn.Pipe(duplex=False)
    worker = worker_config(config, index, port)
    process = _spawn.Process(target=_worker_main, name=f"resnet-worker-{index}",
                             args=(worker, SharedRow(statistics, index), sender, load_first))
    process.start()
    sender.close()  # the worker holds the only sending end now: when it ends, ours reads end-of-file
    log.info("started worker %d of %d (pid %d)", index, config.workers, process.pid)
    return _Worker(index, process, receiver, quick_ends=quick_ends)


def _worker_main(config: ServerConfig, statistics: SharedRow, reports: Connection, load_first: bool) -> None:
    """A worker process: a whole server (server.app.run) that reports its port once bound, then that it serves.
    A replacement loads before it binds (``load_first``): until then its siblings take every new connection."""
    from .app import run
    from .logs import configure_logging
    from .metrics import Metrics

    configure_logging(config.log_level, config.log_format)
    raise SystemExit(run(config, on_bound=lambda port: reports.send(("bound", port)),
                         on_serving=lambda: reports.send(("serving", 0)), load_first=load_first,
                         metrics=Metrics(config.largest_batch, statistics)))


def _stop_all(workers: list[BaseProcess], grace: float) -> bool:
    """SIGTERM every live worker and wait for each to drain (within its grace period; one still alive 5 s
    after that is killed). True if every worker exited 0."""
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(grace + 5)
        if worker.is_alive():
            worker.kill()
            worker.join()
    # A worker ended by this SIGTERM before it could take it as a drain signal was still starting: it had
    # accepted no call, so nothing was lost.
    return all(worker.exitcode in (0, -signal.SIGTERM) for worker in workers)


class _SignalPipe:
    """SIGTERM and SIGINT made readable: a socket that becomes ready when either arrives, to wait on beside
    the workers' sentinels."""

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
