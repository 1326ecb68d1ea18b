"""Which engine a front-end's call goes to."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from resnet_server.common.errors import Unavailable
from resnet_server.common.work import WorkItem


class Weights(Protocol):
    source: str  # what GetModelInfo reports, e.g. "imagenet:IMAGENET1K_V1" or the file's path
    warning: str


class EngineHandle(Protocol):
    """The front-end's view of one device's engine (resnet_server.frontend.engine_client.EngineClient)."""

    name: str
    pending: int  # images routed here and not yet answered; kept by the core, on the event loop
    inline_bytes: int  # the most bytes an image goes as it came; larger ones are preprocessed first

    def room_for(self, count: int, client: str = "") -> AbstractContextManager[None]:
        """Room held for ``count`` images while they are decoded; Overloaded if the engine has none (its
        --max-queue, less what is being decoded for it)."""

    def submit(self, items: Sequence[WorkItem]) -> None:
        """Queue ``items`` on the engine, all or none (Overloaded); each item's future is settled with its answer."""

    def withdraw(self, items: Sequence[WorkItem]) -> None:
        """Take back items whose call was cancelled, freeing their queue places at once."""

    def stop(self, timeout: float | None = None) -> None: ...

    @property
    def max_batch_size(self) -> int: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def runs(self) -> str:
        """How its batches run: device, precision, runner and batch sizes (for traces)."""

    @property
    def weights(self) -> Weights: ...

    @property
    def takes_crops(self) -> bool: ...

    @property
    def decode_on_device(self) -> bool: ...

    @property
    def device(self) -> str: ...


class Router:
    """Sends each request to the healthy replica with the least queued work, ties in turn."""

    def __init__(self, replicas: Sequence[EngineHandle]) -> None:
        self.replicas = replicas
        self._turn = 0

    def choose(self) -> EngineHandle:
        healthy = [replica for replica in self.replicas if replica.healthy]
        if not healthy:
            raise Unavailable("no healthy model replica is left to serve the request")
        least = min(replica.pending for replica in healthy)
        candidates = [replica for replica in healthy if replica.pending == least]
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def any_healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas)

    def stop(self, timeout: float | None = None) -> None:
        for replica in self.replicas:
            replica.stop(timeout)
