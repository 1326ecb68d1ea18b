"""A front-end's side of what the supervisor holds for every front-end: it asks the supervisor to reload the
weights (which runs the reload over every engine, server.supervisor.reloads) and hears which weights every engine
serves; Triton's trace settings and the clients' shared-memory regions likewise, set through any front-end and
applied on all.

Requests go up the front-end's report pipe, ("load", (ticket, source or None)), ("unload", (ticket, None)),
("trace", (ticket, settings)) and ("shm", (ticket, ("register", RegionSpec) or ("unregister", owner, name)));
the supervisor's orders come down a pipe of their own: ("answer", (ticket, status code, message)), ("weights",
ServedWeights), ("trace", settings), ("shm_open", RegionSpec) and ("shm_close", [RegionSpec]), read on the event
loop. Each order reaches every front-end before the answer to the request that caused it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc

from resnet_server.common.errors import ServingError, Unavailable
from resnet_server.common.model import ServedWeights
from resnet_server.common.shared_regions import RegionSpec

log = logging.getLogger("server.model_control")


class ModelControl:
    """What this front-end knows of the weights served, and its requests to change them."""

    def __init__(self, served: ServedWeights, uploads: str, reports: Connection | None = None,
                 orders: Connection | None = None, trace_settings: dict[str, list[str]] | None = None,
                 regions: list[RegionSpec] | None = None) -> None:
        self.served = served
        self.trace_settings = dict(trace_settings or {})  # those set while serving, as the supervisor keeps them
        self.regions = list(regions or [])  # those registered when this front-end started
        self._region_listeners: list[tuple[Callable[[RegionSpec], None], Callable[[list[RegionSpec]], None]]] = []
        self._trace_listeners: list[Callable[[dict[str, list[str]]], None]] = []
        self.uploads = Path(uploads) if uploads else None  # where a client's weights are written for the engines
        self._reports, self._orders = reports, orders
        self._tickets = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[str, str]]] = {}
        self._listeners: list[Callable[[ServedWeights], None]] = []

    def sent_by_a_client(self, source: str) -> bool:
        """Whether weights come from a file a client sent (one in the supervisor's folder for them)."""
        return self.uploads is not None and Path(source).parent == self.uploads

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
            asyncio.get_running_loop().add_reader(self._orders.fileno(), self._read)

    def close(self) -> None:
        if self._orders is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError):  # no loop any more, or closed already
                asyncio.get_running_loop().remove_reader(self._orders.fileno())
        for waiting in self._waiting.values():
            waiting.cancel()

    async def load(self, source: str | None) -> None:
        """Reload every engine from ``source`` (None: --weights); returns once all serve it. If none does,
        ServingError with the supervisor's status code says why."""
        await self._ask("load", source)

    async def unload(self) -> None:
        await self._ask("unload", None)

    async def set_trace(self, settings: dict[str, list[str]]) -> None:
        """Triton's trace settings, on every front-end (on this one alone where it has no supervisor)."""
        if self._reports is None:
            self._apply_trace(settings)
        else:
            await self._ask("trace", settings)

    async def register_region(self, spec: RegionSpec) -> None:
        """A client's region, opened on every front-end; the supervisor's refusal (a name taken, a limit) raised."""
        await self._ask("shm", ("register", spec))

    async def unregister_region(self, owner: str, name: str) -> None:
        """``owner``'s region ``name`` (every one of its regions for ""), closed on every front-end."""
        await self._ask("shm", ("unregister", owner, name))

    async def _ask(self, kind: str, payload: object) -> None:
        """Ask the supervisor; its answer, unless OK, raised as a ServingError with its status code."""
        if self._reports is None:
            raise Unavailable("this front-end runs without a supervisor: nothing can reload its engines")
        ticket = next(self._tickets)
        answered = self._waiting[ticket] = asyncio.get_running_loop().create_future()
        try:
            self._reports.send((kind, (ticket, payload)))
            code, message = await answered
        finally:
            del self._waiting[ticket]
        if code != "OK":
            error = ServingError(message)
            error.code = grpc.StatusCode[code]
            raise error

    def _read(self) -> None:
        assert self._orders is not None
        try:
            kind, value = self._orders.recv()
        except (EOFError, OSError):  # the supervisor has gone: this process ends with it
            asyncio.get_running_loop().remove_reader(self._orders.fileno())
            return
        self._follow(kind, value)

    def _follow(self, kind: str, value: Any) -> None:
        """One order of the supervisor's."""
        if kind == "answer":
            ticket, code, message = value
            if (waiting := self._waiting.get(ticket)) is not None and not waiting.done():
                waiting.set_result((code, message))
        elif kind == "weights":
            self.served = value
            for listener in self._listeners:
                listener(value)
        elif kind == "trace":
            self._apply_trace(value)
        elif kind in ("shm_open", "shm_close"):
            for opened, closed in self._region_listeners:
                opened(value) if kind == "shm_open" else closed(value)

    def _apply_trace(self, settings: dict[str, list[str]]) -> None:
        self.trace_settings.update(settings)
        for listener in self._trace_listeners:
            listener(settings)
