"""New weights while serving: one reload at a time, all engines or none, coordinated by the supervisor.

A reload runs in two steps over every engine. *Prepare*: each engine loads the weights beside those it serves
(its batches go on) and answers prepared, or why it could not. If any could not, every engine drops what it
staged and the reload fails saying why: nothing changed anywhere. *Commit*: once all are prepared, each swaps
the weights in between two batches (no batch mixes versions) and answers committed; the reload succeeds once
all have. From the moment it commits, the new weights are the ones a replaced engine or front-end starts with.

An engine that ends while its peers prepare fails the reload (its replacement starts with the old weights, as
its peers keep); one that ends while they commit does not (its replacement starts with the new ones).

Every reload has an id never used before, named in each of its orders and answers: an answer that comes late
(an engine still preparing a reload that has already failed) is told apart from the next reload's and dropped.
Unloads wait in the same queue, so an unload is never undone by a reload that was preparing when it came; at
most MOST_QUEUED wait.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from resnet_server.boundary.control import Abort, Commit, Committed, EngineOrder, Prepare, Prepared, ReloadFailed
from resnet_server.common.served import ServedWeights

log = logging.getLogger(__name__)
MOST_QUEUED = 4  # reloads and unloads waiting behind the one running; more are refused RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class Outcome:
    """A reload's answer to whoever asked: a gRPC status code's name, and what it says."""

    code: str
    message: str


@dataclass
class _Unload:
    reply: Callable[[Outcome], None]


@dataclass
class _Reload:
    source: str
    reply: Callable[[Outcome], None]
    id: int = 0
    started: float = field(default_factory=time.monotonic)
    waiting: set[str] = field(default_factory=set)  # engines not yet prepared (committing: not yet committed)
    committing: bool = False
    sha256: str = ""


class Reloads:
    """The weights served and the reloads asked for, run one at a time in the order they came.

    ``engines()`` names the engines running now; ``order(engine, message)`` sends one of them an order;
    ``restart(engine)`` ends one so that a new one replaces it; ``announce(weights)`` tells every front-end what
    is served. A file a client sent (under ``uploads``) is removed once it is served no longer, or if its
    reload fails."""

    def __init__(self, served: ServedWeights, configured: str, uploads: Path, engines: Callable[[], list[str]],
                 order: Callable[[str, EngineOrder], None], restart: Callable[[str], None],
                 announce: Callable[[ServedWeights], None]) -> None:
        self.served = served
        self._configured = configured
        self._uploads = uploads
        self._engines, self._order, self._restart, self._announce = engines, order, restart, announce
        self._queue: collections.deque[_Reload | _Unload] = collections.deque()
        self._running: _Reload | None = None
        self._ids = itertools.count(1)

    def load(self, source: str | None, reply: Callable[[Outcome], None]) -> None:
        """Reload from ``source`` (None: from --weights, even if that file did not change)."""
        self._enqueue(_Reload(source or self._configured, reply))

    def unload(self, reply: Callable[[Outcome], None]) -> None:
        """The model is not ready until the next load (the engines keep their weights meanwhile); after the reloads
        asked for before it."""
        self._enqueue(_Unload(reply))

    def _enqueue(self, item: _Reload | _Unload) -> None:
        if len(self._queue) >= MOST_QUEUED:
            item.reply(Outcome("RESOURCE_EXHAUSTED", f"{MOST_QUEUED} loads and unloads wait already; retry later"))
            if isinstance(item, _Reload):
                self._forget(item.source)
            return
        self._queue.append(item)
        self._next()

    def _unloaded(self, unload: _Unload) -> None:
        self.served = ServedWeights(self.served.source, self.served.version, self.served.sha256, loaded=False)
        log.info("model unloaded: not ready until the next load (weights version %d kept)", self.served.version)
        self._announce(self.served)
        unload.reply(Outcome("OK", "unloaded"))

    def on_report(self, engine: str, report: Prepared | Committed | ReloadFailed) -> None:
        """An engine's answer to an order of the reload running; any other reload's is dropped."""
        reload = self._running
        if reload is None or report.reload != reload.id or engine not in reload.waiting:
            return  # an answer to an order of a reload that has ended
        if isinstance(report, Prepared) and not reload.committing:
            reload.sha256 = report.sha256
            self._answered(engine, reload)
        elif isinstance(report, Committed) and reload.committing:
            self._answered(engine, reload)
        elif isinstance(report, ReloadFailed) and report.step == "prepare" and not reload.committing:
            self._fail(reload, Outcome(report.code, report.message))
        elif isinstance(report, ReloadFailed) and reload.committing:
            log.error("%s could not swap in weights version %d (%s); ending it, so that its replacement starts "
                      "with them", engine, self.served.version, report.message)
            self._restart(engine)
            self._answered(engine, reload)

    def engine_ended(self, engine: str) -> None:
        reload = self._running
        if reload is None or engine not in reload.waiting:
            return
        if reload.committing:  # its replacement starts with the new weights
            self._answered(engine, reload)
        else:
            self._fail(reload, Outcome("UNAVAILABLE", f"{engine} ended while the new weights were being prepared; "
                                                      "every engine keeps the old ones: retry"))

    def _next(self) -> None:
        """Start what waits first, once nothing runs: an unload at once, a reload's prepare on every engine."""
        while self._running is None and self._queue:
            item = self._queue.popleft()
            if isinstance(item, _Unload):
                self._unloaded(item)
            else:
                self._start(item)

    def _start(self, reload: _Reload) -> None:
        self._running = reload
        reload.id = next(self._ids)
        reload.waiting = set(self._engines())
        version = self.served.version + 1
        log.info("reloading weights from %s as version %d on %d engines", self._shown(reload.source), version,
                 len(reload.waiting))
        for engine in reload.waiting:
            self._order(engine, Prepare(reload.id, reload.source))
        if not reload.waiting:
            self._fail(reload, Outcome("UNAVAILABLE", "no engine is running; retry"))

    def _answered(self, engine: str, reload: _Reload) -> None:
        reload.waiting.discard(engine)
        if reload.waiting:
            return
        if not reload.committing:
            self._commit(reload)
        else:
            self._succeeded(reload)

    def _commit(self, reload: _Reload) -> None:
        reload.committing = True
        previous = self.served
        self.served = ServedWeights(reload.source, previous.version + 1, reload.sha256)
        reload.waiting = set(self._engines())
        for engine in reload.waiting:
            self._order(engine, Commit(reload.id, self.served.version))
        self._forget(previous.source)
        if not reload.waiting:
            self._succeeded(reload)

    def _succeeded(self, reload: _Reload) -> None:
        seconds = time.monotonic() - reload.started
        log.info("reload succeeded: weights version %d from %s (sha256 %s) served by every engine, %.2f s after "
                 "it was asked for", self.served.version, self._shown(reload.source), self.served.sha256[:12], seconds)
        self._announce(self.served)
        self._finish(reload, Outcome("OK", f"version {self.served.version}"))

    def _fail(self, reload: _Reload, outcome: Outcome) -> None:
        for engine in self._engines():
            self._order(engine, Abort(reload.id))
        log.warning("reload failed after %.2f s: %s; every engine serves weights version %d as before",
                    time.monotonic() - reload.started, outcome.message, self.served.version)
        self._forget(reload.source)
        self._finish(reload, outcome)

    def _finish(self, reload: _Reload, outcome: Outcome) -> None:
        self._running = None
        reload.reply(outcome)
        self._next()

    def _forget(self, source: str) -> None:
        """Remove a client's file of weights that is no longer served (nor being loaded)."""
        waiting = {queued.source for queued in self._queue if isinstance(queued, _Reload)}
        if self._uploaded(source) and source != self.served.source and source not in waiting:
            Path(source).unlink(missing_ok=True)

    def _uploaded(self, source: str) -> bool:
        return Path(source).parent == self._uploads

    def _shown(self, source: str) -> str:
        return f"a file a client sent ({Path(source).name})" if self._uploaded(source) else source
