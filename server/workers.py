"""``--workers N``: several server processes on one gRPC port, so request handling gets more than one core.

One server process answers every call on one asyncio event loop, and each one-image call costs that loop
about 0.5 ms of CPU on the 2-core CI machine (gRPC's own machinery and the handler; README, Performance):
one process tops out near 2,000 calls a second, however fast its GPU. With ``--workers N`` this process
becomes a supervisor that starts N worker processes, each a whole server (event loop, replicas, batchers),
binding the same port with SO_REUSEPORT, so the kernel spreads incoming connections over them. Connections,
not calls: a client with one channel stays on one worker, so N workers need clients with several
connections (several clients, or ``resnet-client bench --connections``).

Worker ``i`` serves ``/metrics`` on ``--metrics-port + i``. Workers are spawned, not forked, so none inherits
CUDA state; the first binds (and picks the port, for ``--port 0``) before the others start, and all load at
the same time. The supervisor forwards SIGTERM/SIGINT (each worker drains within ``--grace-period``) and, if
a worker ends on its own, stops the rest and exits 1, so an orchestrator restarts the set as a whole.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from .config import ServerConfig

log = logging.getLogger("server.workers")
_spawn = multiprocessing.get_context("spawn")


def worker_config(config: ServerConfig, index: int, port: int) -> ServerConfig:
    """Worker ``index``'s configuration: the shared port, its own metrics port, and its share of the cores."""
    return dataclasses.replace(
        config, port=port, worker=index,
        metrics_port=config.metrics_port + index if config.metrics_port else 0,
        torch_threads=config.torch_threads or max(1, len(os.sched_getaffinity(0)) // config.workers))


def run_workers(config: ServerConfig) -> int:
    """Start ``config.workers`` workers and supervise them until a signal or a worker's own end; the exit code:
    0 once every worker drained and exited 0 after a signal, 1 otherwise."""
    stop_signal = _SignalPipe()
    workers: list[BaseProcess] = []
    try:
        a_worker_failed = _start_and_supervise(config, stop_signal, workers)
    finally:
        all_exited_cleanly = _stop_all(workers, config.grace_period)
        stop_signal.close()
    return 1 if a_worker_failed or not all_exited_cleanly else 0


def _start_and_supervise(config: ServerConfig, stop_signal: _SignalPipe, workers: list[BaseProcess]) -> bool:
    """Start the workers into ``workers``; return False when a signal comes, True when a worker ends by itself."""
    receiver, sender = _spawn.Pipe(duplex=False)
    workers.append(_start(config, 0, config.port, sender))
    sender.close()  # the worker holds the only sending end now: if it ends before binding, ours reads end-of-file
    if stop_signal.reader in wait([receiver, workers[0].sentinel, stop_signal.reader]):
        return False
    try:
        port = receiver.recv()
    except EOFError:  # worker 0 ended before binding; its own error is already on stderr
        return _ended(workers[0])
    workers += [_start(config, index, port, None) for index in range(1, config.workers)]
    ready = wait([stop_signal.reader, *(worker.sentinel for worker in workers)])
    if stop_signal.reader in ready:
        log.info("signal received: stopping %d workers", len(workers))
        return False
    return _ended(next(worker for worker in workers if worker.sentinel in ready))


def _ended(worker: BaseProcess) -> bool:
    worker.join()
    log.error("%s (pid %d) ended with code %s; stopping the others", worker.name, worker.pid, worker.exitcode)
    return True


def _start(config: ServerConfig, index: int, port: int, report_port: Connection | None) -> BaseProcess:
    process = _spawn.Process(target=_worker_main, args=(worker_config(config, index, port), report_port),
                             name=f"resnet-worker-{index}")
    process.start()
    log.info("started worker %d of %d (pid %d)", index, config.workers, process.pid)
    return process


def _worker_main(config: ServerConfig, report_port: Connection | None) -> None:
    """A worker process: a whole server (server.app.run); worker 0 reports the port it bound."""
    from .app import run
    from .logs import configure_logging

    configure_logging(config.log_level, config.log_format)
    raise SystemExit(run(config, on_bound=report_port.send if report_port else None))


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
