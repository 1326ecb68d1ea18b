"""A front-end's side of what the supervisor holds for every front-end: it asks the supervisor to reload the
weights (which runs the reload over every engine, resnet_server.supervisor.reloads) and hears which weights every engine
serves; Triton's trace settings and the clients' shared-memory regions likewise, set through any front-end and
applied on all.

Requests go up the front-end's report pipe (Load, Unload, SetTrace, Register, Unregister, each with a call id);
the supervisor's orders come down a pipe of their own (Answer to a call id, WeightsServed, Trace, RegionOpened,
RegionsClosed), read on the event loop: the messages of resnet_server.boundary.control. Writes never block the loop:
what the pipe cannot take waits in an outbox, written when the pipe has room. Each order reaches every front-end
before the answer to the request that caused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path

from resnet_server.boundary.control import (
    Answer,
    Bound,
    FrontendOrder,
    FrontendReport,
    Inbox,
    Load,
    MetricsPort,
    Outbox,
    PeerStopped,
    RegionOpened,
    RegionsClosed,
    Register,
    Serving,
    SetTrace,
    Stopped,
    Trace,
    Unload,
    Unregister,
    WeightsServed,
)
from resnet_server.common.errors import ErrorKind, ServingError, Unavailable
from resnet_server.common.served import ServedWeights
from resnet_server.common.shared_regions import RegionSpec


class SupervisorClient:
    """What this front-end knows of the weights served, and its requests to change them."""

    def __init__(self, served: ServedWeights, uploads: str, reports: Outbox | None = None,
                 orders: Inbox[FrontendOrder] | None = None, trace_settings: dict[str, list[str]] | None = None,
                 regions: list[RegionSpec] | None = None) -> None:
        self.served = served
        self.connected_source = served.source  # the weights served when this process connected to its engines
        self.trace_settings = dict(trace_settings or {})  # those set while serving, as the supervisor keeps them
        self.regions = list(regions or [])  # those registered when this front-end started
        self._region_listeners: list[tuple[Callable[[RegionSpec], None], Callable[[list[RegionSpec]], None]]] = []
        self._trace_listeners: list[Callable[[dict[str, list[str]]], None]] = []
        self.uploads = Path(uploads) if uploads else None  # where a client's weights are written for the engines
        self._reports, self._orders = reports, orders
        self._calls = itertools.count(1)  # a request's call id, never reused in this process
        self._waiting: dict[int, asyncio.Future[tuple[str, str]]] = {}
        self._listeners: list[Callable[[ServedWeights], None]] = []

    def sent_by_a_client(self, source: str) -> bool:
        """Whether weights come from a file a client sent (one in the supervisor's folder for them)."""
        return self.uploads is not None and Path(source).parent == self.uploads

    def weights_shown(self, described: str) -> str:
        """What the served weights are called: a client's file as such; those served when this process connected
        as its engines described them (``described``: "imagenet:IMAGENET1K_V1", say); any later ones by source."""
        source = self.served.source
        if self.sent_by_a_client(source):
            return "a file a client sent (RepositoryModelLoad)"
        return described if source == self.connected_source else source

    def on_change(self, listener: Callable[[ServedWeights], None]) -> None:
        self._listeners.append(listener)

    def on_trace(self, listener: Callable[[dict[str, list[str]]], None]) -> None:
        self._trace_listeners.append(listener)

    def on_regions(self, opened: Callable[[RegionSpec], None], closed: Callable[[list[RegionSpec]], None]) -> None:
        self._region_listeners.append((opened, closed))

    @property
    def supervised(self) -> bool:
        """False for a front-end run alone: what it is asked to set, it sets for itself."""
        return self._reports is not None

    def listen(self) -> None:
        """Read the supervisor's orders on the running event loop from now on."""
        if self._orders is not None:
            asyncio.get_running_loop().add_reader(self._orders.fd, self._read)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # no loop any more, or closed already
            loop = asyncio.get_running_loop()
            if self._orders is not None:
                loop.remove_reader(self._orders.fd)
            if self._reports is not None:
                loop.remove_writer(self._reports.fd)
        for waiting in self._waiting.values():
            waiting.cancel()

    def report(self, message: Bound | Serving | MetricsPort | Stopped) -> None:
        """Tell the supervisor how this process stands (none to tell for a front-end run alone)."""
        if self._reports is not None:
            with contextlib.suppress(PeerStopped):  # the supervisor has gone: this process ends with it
                self._send(message)

    def stopped(self, code: int, timeout: float = 5.0) -> None:
        """The last report, as the process exits: written within ``timeout`` seconds or not at all."""
        if self._reports is not None:
            self.report(Stopped(code))
            self._reports.drain(timeout)

    async def load(self, source: str | None) -> None:
        """Reload every engine from ``source`` (None: --weights); returns once all serve it. If none does,
        ServingError with the supervisor's status code says why."""
        await self._ask(lambda call: Load(call, source))

    async def unload(self) -> None:
        await self._ask(Unload)

    async def set_trace(self, settings: dict[str, list[str]]) -> None:
        """Triton's trace settings, on every front-end (on this one alone where it has no supervisor)."""
        if self._reports is None:
            self._apply_trace(settings)
        else:
            await self._ask(lambda call: SetTrace(call, settings))

    async def register_region(self, spec: RegionSpec) -> None:
        """A client's region, opened on every front-end; the supervisor's refusal (a name taken, a limit) raised."""
        await self._ask(lambda call: Register(call, spec))

    async def unregister_region(self, owner: str, name: str) -> None:
        """``owner``'s region ``name`` (every one of its regions for ""), closed on every front-end."""
        await self._ask(lambda call: Unregister(call, owner, name))

    async def _ask(self, request: Callable[[int], FrontendReport]) -> None:
        """Ask the supervisor; its answer, unless OK, raised as a ServingError with its status code."""
        if self._reports is None:
            raise Unavailable("this front-end runs without a supervisor: nothing can reload its engines")
        call = next(self._calls)
        answered = self._waiting[call] = asyncio.get_running_loop().create_future()
        try:
            self._send(request(call))
            code, message = await answered
        except PeerStopped:
            raise Unavailable("the supervisor does not answer; retry") from None
        finally:
            del self._waiting[call]
        if code != "OK":
            raise ServingError(message, ErrorKind[code] if code in ErrorKind.__members__ else ErrorKind.INTERNAL)

    def _send(self, message: FrontendReport) -> None:
        """Written now if the pipe takes it, else when it has room (the loop watches it while bytes wait)."""
        assert self._reports is not None
        self._reports.send(message)
        if self._reports.waiting:
            with contextlib.suppress(RuntimeError):  # no loop runs (before it starts): the next write takes it
                asyncio.get_running_loop().add_writer(self._reports.fd, self._flush)

    def _flush(self) -> None:
        assert self._reports is not None
        try:
            done = self._reports.flush()
        except PeerStopped:
            done = True
        if done:
            asyncio.get_running_loop().remove_writer(self._reports.fd)

    def _read(self) -> None:
        assert self._orders is not None
        try:
            orders = self._orders.read()
        except (EOFError, OSError, PeerStopped):  # the supervisor has gone: this process ends with it
            asyncio.get_running_loop().remove_reader(self._orders.fd)
            return
        for order in orders:
            self._follow(order)

    def _follow(self, order: object) -> None:
        """One order of the supervisor's."""
        if isinstance(order, Answer):
            if (waiting := self._waiting.get(order.call)) is not None and not waiting.done():
                waiting.set_result((order.code, order.message))
        elif isinstance(order, WeightsServed):
            self.served = order.weights
            for listener in self._listeners:
                listener(order.weights)
        elif isinstance(order, Trace):
            self._apply_trace(order.settings)
        elif isinstance(order, RegionOpened):
            for opened, _ in self._region_listeners:
                opened(order.region)
        elif isinstance(order, RegionsClosed):
            for _, closed in self._region_listeners:
                closed(order.regions)

    def _apply_trace(self, settings: dict[str, list[str]]) -> None:
        self.trace_settings.update(settings)
        for listener in self._trace_listeners:
            listener(settings)
