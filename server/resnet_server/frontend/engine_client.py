"""A front-end's handle on one engine process: the replica that ``Dispatcher`` routes calls to.

``submit`` takes a slot of the engine's slab per image (none free: RESOURCE_EXHAUSTED at once, since the
slab is the whole server's queue for that device), writes the image into it and sends the slot numbers.
Answers come back on the event loop (``add_reader`` on the engine's socket: no thread of ours between the
socket and the futures), are copied out of the slab, and their slots freed. When the engine's socket
closes (it ended or was killed), every call waiting on it fails UNAVAILABLE at once, the client's retry
goes to another engine or waits for this one, and the handle reconnects once the supervisor has started
a new engine and its model is warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection
from types import SimpleNamespace

import torch

from resnet_server.boundary.link import connect
from resnet_server.boundary.protocol import (
    Cancel,
    Done,
    EngineInfo,
    EngineLink,
    Failed,
    Health,
    ImageKind,
    MessageReader,
    Released,
    SlotEntry,
    Submit,
    ToEngine,
    ToFrontEnd,
    frame,
    frontend_messages,
)
from resnet_server.boundary.queue_share import ShareExceeded, caller_tag
from resnet_server.boundary.slab import Slab, connection_owner
from resnet_server.common import errors
from resnet_server.common.device_decode import DeferredJpeg
from resnet_server.common.errors import Overloaded, OverShare, ServingError, StartupError, Unavailable
from resnet_server.common.preprocess import ImageBytes, RawImage, SlotBytes, copy_into
from resnet_server.common.shapes import CROP_SHAPE, FLOAT_SHAPE
from resnet_server.common.work import ImageOutput, WorkItem

log = logging.getLogger(__name__)
RECONNECT_INTERVAL = 0.1  # seconds between tries to reach an engine that is starting or restarting
OUTGOING_BYTES = 16 << 20  # messages the engine has not read yet: more, and it has stopped reading
SHARE_LOG_INTERVAL = 10.0  # seconds between two log lines about one caller refused for its share
SHARE_LOG_CALLERS = 1024  # callers remembered for that: past it, the memory starts again


class _Outgoing:
    """Messages to the engine, written without ever blocking the event loop: what the socket does not take at
    once waits here and goes when it can take more (``add_writer``). An engine that leaves OUTGOING_BYTES
    unread has stopped reading (it is wedged): ``write`` then raises OSError, as for a socket that has closed,
    and the connection is dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, on_failed: Callable[[], None]) -> None:
        self._loop, self._fd, self._on_failed = loop, fd, on_failed
        self._waiting = bytearray()

    def write(self, message: ToEngine) -> None:
        data = frame(message)
        if self._waiting:
            self._waiting += data
        else:
            sent = self._write_now(data)
            if sent < len(data):
                self._waiting += data[sent:]
                self._loop.add_writer(self._fd, self._flush)
        if len(self._waiting) > OUTGOING_BYTES:
            raise OSError(f"the engine has {len(self._waiting)} bytes of messages unread")

    def _write_now(self, data: bytes | bytearray) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0

    def _flush(self) -> None:
        try:
            sent = self._write_now(self._waiting)
        except OSError:
            self._on_failed()
            return
        del self._waiting[:sent]
        if not self._waiting:
            self._loop.remove_writer(self._fd)

    def close(self) -> None:
        if self._waiting:
            self._loop.remove_writer(self._fd)
            self._waiting.clear()
@dataclasses.dataclass
class _Session:
    """One connection to the engine and what reads and writes it on the front-end's event loop."""

    connection: Connection
    messages: MessageReader[ToFrontEnd]  # the engine's messages after Ready
    loop: asyncio.AbstractEventLoop  # the loop that reads them (kept: see Dispatcher)
    outgoing: _Outgoing

    def close(self) -> None:
        self.loop.remove_reader(self.connection.fileno())
        self.outgoing.close()
        self.connection.close()


_ERRORS = {cls.__name__: cls for cls in vars(errors).values()
           if isinstance(cls, type) and issubclass(cls, ServingError)}


class EngineClient:
    """The front-end's handle on one engine process (resnet_server.frontend.router.EngineHandle)."""

    def __init__(self, link: EngineLink, owner: int, on_lost: Callable[[], None],
                 on_back: Callable[[], None]) -> None:
        self.link = link
        self.name = link.name
        self.owner = owner  # this front-end process's number (the supervisor's)
        self._connections = itertools.count()
        self._slab_owner = owner  # this connection's number in the slab (resnet_server.boundary.slab.connection_owner)
        self.slab = Slab(link.slab_fd, link.layout)
        self.inline_bytes = link.layout.inline_bytes  # larger images are preprocessed here, not sent as they came
        self.pending = 0  # images routed here and not yet answered (Dispatcher keeps it)
        self._decoding = 0  # images of calls routed here being decoded (room_for)
        self._share_logged: dict[str, float] = {}  # a caller refused for its share -> when that was last logged
        self._info: EngineInfo | None = None  # the last connection's: kept while it reconnects
        self._on_lost, self._on_back = on_lost, on_back
        self._session: _Session | None = None  # while connected
        self._in_rotation = False
        self._waiting: dict[int, WorkItem] = {}  # by slot: items sent and not yet answered
        self._unsent: list[SlotEntry] = []  # submitted in this turn of the event loop; sent together at its end
        self._unsent_calls: list[WorkItem] = []  # their calls, by each one's first item (SlotEntry.call)
        self._slot_of: dict[WorkItem, int] = {}
        self._reconnecting: asyncio.Task | None = None
        self._closed = False

    @property
    def healthy(self) -> bool:
        return self._session is not None and self._in_rotation

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise Unavailable(f"the engine of {self.name} has not answered yet")
        return self._info

    @property
    def weights(self) -> SimpleNamespace:
        return SimpleNamespace(source=self.info.weights, warning=self.info.warning)

    @property
    def runs(self) -> str:
        return self.info.runs

    @property
    def max_batch_size(self) -> int:
        return self.info.max_batch_size

    @property
    def takes_crops(self) -> bool:
        """Images preprocessed here go as their uint8 crop (else as the model's float input): the engine's
        runner says which it takes (a GPU's takes crops)."""
        return self.info.takes_crops

    @property
    def device(self) -> str:
        """The engine's device, e.g. cuda:0 or cpu."""
        return self.info.device

    @property
    def decode_on_device(self) -> bool:
        return self.info.decode_on_device

    async def open(self) -> None:
        """Connect, waiting for as long as the engine takes to warm up (compiling every bucket can take minutes):
        the supervisor, not a front-end, decides that an engine has failed, and stops the server then."""
        if not await self._connect_when_up():
            raise StartupError(f"stopped before the engine of {self.name} answered")

    async def _connect_when_up(self) -> bool:
        """Try every RECONNECT_INTERVAL until the engine answers (True) or the handle is closed (False)."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            owner = connection_owner(self.owner, next(self._connections))
            try:
                connection, info = await loop.run_in_executor(None, connect, self.link, owner)
            except (OSError, EOFError, ValueError, AuthenticationError) as exc:  # not listening yet, or it ended
                log.debug("engine of %s not answering: %s", self.name, exc)
                await asyncio.sleep(RECONNECT_INTERVAL)
                continue
            if self._closed:
                connection.close()
                return False
            self._attach(connection, info, owner)
            return True
        return False

    def _attach(self, connection: Connection, info: EngineInfo, owner: int) -> None:
        self._info, self._in_rotation = info, info.in_rotation
        self._slab_owner = owner
        loop = asyncio.get_running_loop()
        os.set_blocking(connection.fileno(), False)  # the loop neither reads nor writes until the socket is ready
        self._session = _Session(connection, frontend_messages(connection), loop,
                                 _Outgoing(loop, connection.fileno(), self._lost))
        loop.add_reader(connection.fileno(), self._read)

    @contextlib.contextmanager
    def room_for(self, count: int, client: str = "") -> Iterator[None]:
        """Room for ``count`` images held while they are decoded: Overloaded now if the engine's slab has fewer
        free slots than those and the images this front-end is decoding for it already, or ``client`` holds its
        share of the queue, so that a call that would be refused is refused before its images are decoded, and
        calls waiting for the decoding threads are bounded as the queue is (submit() then takes the slots)."""
        try:
            self.slab.check_share(count, caller_tag(client))
        except ShareExceeded as exc:
            raise self._over_share(exc, client) from None
        if self.slab.free_count() - self._decoding < count:
            raise self._full()
        self._decoding += count
        try:
            yield
        finally:
            self._decoding -= count

    def _full(self) -> Overloaded:
        # --max-queue is the slab's slot count: the engine-wide limit, across every front-end, held in one place.
        return Overloaded(f"{self.name} has its --max-queue of {self.link.layout.slots} images accepted and not "
                          "yet answered; retry later")

    def _over_share(self, exceeded: ShareExceeded, client: str) -> OverShare:
        """The refusal of a caller that holds its share of the queue; logged at most every SHARE_LOG_INTERVAL
        seconds a caller."""
        now = time.monotonic()
        if now - self._share_logged.get(client, -SHARE_LOG_INTERVAL) >= SHARE_LOG_INTERVAL:
            if len(self._share_logged) >= SHARE_LOG_CALLERS:
                self._share_logged.clear()
            self._share_logged[client] = now
            log.warning("refusing calls of caller %s on %s: it %s (fair share; RESOURCE_EXHAUSTED)", client[:64],
                        self.name, exceeded)
        return OverShare(f"this caller {exceeded} on {self.name} (--max-queue {self.link.layout.slots}); retry "
                         "later")

    def submit(self, items: Sequence[WorkItem]) -> None:
        """Send all items or none; Overloaded when the engine's slab has too few free slots, OverShare when their
        caller holds its share of them."""
        session = self._session
        if session is None:
            raise Unavailable(f"the engine of {self.name} is restarting; retry")
        client = items[0].client  # a call's items share it
        try:
            slots = self.slab.take(len(items), self._slab_owner, caller_tag(client))
        except ShareExceeded as exc:
            raise self._over_share(exc, client) from None
        if slots is None:
            raise self._full()
        try:
            entries = [self._write(slot, item) for slot, item in zip(slots, items, strict=True)]
        except BaseException:  # all or none: the call fails alone, and later calls go on as before
            self.slab.give_back(slots, self._slab_owner)
            raise
        if not self._unsent:  # the first submit of this turn of the loop
            session.loop.call_soon(self._send_unsent)
        self._unsent += entries
        self._unsent_calls.append(items[0])  # a call's items share its id, client, weight and priority
        for slot, item in zip(slots, items, strict=True):
            self._waiting[slot], self._slot_of[item] = item, slot

    def _send_unsent(self) -> None:
        """One message for every call submitted since the last: a message and its wake-up of the engine cost
        about as much as the rest of a call's hand-off, and under load many calls start in one turn of the loop."""
        entries, calls, self._unsent, self._unsent_calls = self._unsent, self._unsent_calls, [], []
        if not entries or self._session is None:  # lost meanwhile: _lost has failed these calls already
            return
        try:
            self._session.outgoing.write(Submit(entries, [call.request_id for call in calls],
                                                [call.client for call in calls], [call.priority for call in calls],
                                                [call.weight for call in calls]))
        except OSError:
            self._lost()  # fails these items too: UNAVAILABLE, and the client retries

    def _write(self, slot: int, item: WorkItem) -> SlotEntry:
        """The image into its slot, as it came (raw pixels, JPEG bytes) or preprocessed here (a uint8 crop for a
        GPU engine, the model's float input for a CPU one)."""
        image = item.model_input
        data: ImageBytes
        if isinstance(image, RawImage):
            if isinstance(image.data, SlotBytes):
                raise TypeError("a front-end's raw image holds its request's bytes")
            kind, dtype, shape, data = ImageKind.RAW, image.dtype, tuple(image.shape), image.data
        elif isinstance(image, DeferredJpeg):
            kind, dtype, shape, data = ImageKind.JPEG, "uint8", (), image.data.numpy().data
        elif not isinstance(image, torch.Tensor):
            raise TypeError(f"a front-end sends no {type(image).__name__}")
        elif image.dtype == torch.uint8:  # preprocess's crop, [224, 224, 3] contiguous
            kind, dtype, shape, data = ImageKind.CROP, "uint8", CROP_SHAPE, image.numpy().data.cast("B")
        else:  # the model's float32 input
            kind, dtype, shape = ImageKind.FLOAT, "float32", FLOAT_SHAPE
            data = image.contiguous().numpy().data.cast("B")
        nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
        copy_into(self.slab.input(slot, nbytes), data)  # a client's region's pixels: read straight into the slot
        return SlotEntry(slot=slot, kind=kind, dtype=dtype, shape=shape, nbytes=nbytes, temperature=item.temperature,
                         top_k=item.top_k, deadline=item.deadline, call=len(self._unsent_calls))

    def withdraw(self, items: Sequence[WorkItem]) -> None:
        """The caller has gone: ask the engine to drop what it has not computed (it answers 'released')."""
        slots = [self._slot_of[item] for item in items if item in self._slot_of]
        self._send_unsent()  # the engine must have them before it is asked to drop them
        if slots and self._session is not None:
            try:
                self._session.outgoing.write(Cancel(slots))
            except OSError:
                self._lost()

    def _read(self) -> None:
        """Every message the socket holds (the loop calls again while it has more)."""
        if self._session is None:
            return
        try:
            messages = self._session.messages.read()
        except BlockingIOError:  # woken with nothing to read after all
            return
        except (EOFError, OSError):
            self._lost()
            return
        for message in messages:
            try:
                self._handle(message)
            except Exception:  # one message's failure must not drop the others read with it
                log.exception("handling %s from the engine of %s failed", type(message).__name__, self.name)

    def _handle(self, message: ToFrontEnd) -> None:
        if isinstance(message, Done):
            self._on_done(message)
        elif isinstance(message, Failed):
            self._on_failed(message)
        elif isinstance(message, Released):
            self._on_released(message)
        elif isinstance(message, Health):
            self._on_health(message)
        else:
            raise ValueError(f"the engine sent {type(message).__name__} after Ready")

    def _take(self, slot: int) -> WorkItem:
        item = self._waiting.pop(slot)
        del self._slot_of[item]
        return item

    def _on_done(self, done: Done) -> None:
        batch_timing = done.timing
        for answer in done.answers:
            item = self._take(answer.slot)
            probabilities, logits = self.slab.output(answer.slot).copy()  # both rows at once: the slot is freed next
            self.slab.give_back([answer.slot], self._slab_owner)
            if not item.caller.done():
                item.caller.set_result(ImageOutput(
                    probabilities=probabilities, logits=logits, top_k=answer.top_k, temperature=item.temperature,
                    queue_seconds=answer.queue_seconds, timing=batch_timing, device=self.name,
                    weights_version=done.weights_version, batch=done.batch, batch_size=done.batch_size,
                    buckets=tuple(done.buckets)))
        self._set_rotation(done.in_rotation)

    def _on_failed(self, failed: Failed) -> None:
        error = _ERRORS.get(failed.error, errors.ComputeFailed)(failed.message)
        for slot in failed.slots:
            item = self._take(slot)
            self.slab.give_back([slot], self._slab_owner)
            if not item.caller.done():
                item.caller.set_exception(error)
        self._set_rotation(failed.in_rotation)

    def _on_released(self, released: Released) -> None:
        for slot in released.slots:
            self._take(slot)
        self.slab.give_back(released.slots, self._slab_owner)

    def _on_health(self, health: Health) -> None:
        self._set_rotation(health.in_rotation)

    def _set_rotation(self, in_rotation: bool) -> None:
        came_back = in_rotation and not self._in_rotation
        self._in_rotation = in_rotation
        if came_back:
            self._on_back()

    def _lost(self) -> None:
        """The engine's socket closed: fail what waits on it, free its slots, and reconnect in the background."""
        session, self._session = self._session, None
        if session is None:
            return
        session.close()
        waiting, self._waiting, self._slot_of, self._unsent, self._unsent_calls = self._waiting, {}, {}, [], []
        self.slab.give_back(list(waiting), self._slab_owner)
        error = Unavailable(f"the engine of {self.name} ended with this call in flight; retry")
        for item in waiting.values():
            if not item.caller.done():
                item.caller.set_exception(error)
        if not self._closed:
            log.error("the engine of %s has gone; %d images in flight failed UNAVAILABLE", self.name, len(waiting))
            self._on_lost()
            self._reconnecting = asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        if await self._connect_when_up():
            log.warning("the engine of %s is back", self.name)
            if self._in_rotation:
                self._on_back()

    def stop(self, timeout: float | None = None) -> None:
        """Close the connection (the engine frees whatever this front-end still held)."""
        self._closed = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        session, self._session = self._session, None
        if session is not None:
            session.close()
