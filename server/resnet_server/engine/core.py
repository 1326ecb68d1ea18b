"""The engine process of one device: the model, the batcher and nothing network-side.

It has no asyncio and no gRPC. Front-end processes connect to it over a Unix socket (abstract, so no
file is left behind; authenticated with a key the supervisor makes) and send it small typed messages
(``resnet_server.boundary.protocol``): which slots of the shared slab (``resnet_server.boundary.slab``) hold new images,
with each one's temperature, top-k and deadline. The pixels never go through the socket. The batcher forms
batches across every connected front-end, the runner converts, runs and scores them, and the answers go back
the same way: each image's
probabilities and logits into its slot, then one message per front-end per batch.

A front-end that goes away (it ended, or was killed) is noticed by its socket closing: its queued images
are dropped and its slots freed, and nothing else changes. The engine accepts connections only once its
model is loaded and warmed, so a front-end that could connect can be served.
"""

from __future__ import annotations

import functools
import logging
import queue
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, Listener

import msgspec
import numpy as np
import torch

from resnet_server.boundary.link import SEND_SECONDS, accept_hello, shut_down
from resnet_server.boundary.protocol import (
    Answer,
    Cancel,
    Done,
    EngineInfo,
    EngineLink,
    Failed,
    Health,
    ImageKind,
    Ready,
    Released,
    SlotEntry,
    Submit,
    ToFrontEnd,
    encode,
    engine_messages,
)
from resnet_server.boundary.slab import FREE, Slab
from resnet_server.common.device_decode import DeferredJpeg
from resnet_server.common.errors import ServingError
from resnet_server.common.metrics import Metrics
from resnet_server.common.preprocess import CroppedImage, RawImage, SlotBytes
from resnet_server.common.sections import EngineConfig
from resnet_server.common.shapes import FLOAT_SHAPE
from resnet_server.common.work import ModelInput, WorkItem
from resnet_server.engine.batcher import Answers, BatchOutput
from resnet_server.engine.registered_slab import device_rows, register_slab
from resnet_server.engine.replicas import Replica, load_replica

log = logging.getLogger(__name__)

OUTBOX_BYTES = 64 << 20  # answers queued for one front-end and not yet written: more, and it is cut off
LEAKED_AFTER = 10.0  # seconds an owner holds slots with no connection before they are freed


class _FrontEnd:
    """One connected front-end: its socket, its owner number in the slab, the items the engine holds, and its
    outbox. Messages to it queue there and go out on its own sender thread, so no thread of the engine's (the
    finisher, a reader answering a Cancel) ever waits on a front-end that reads slowly. One that reads nothing
    for SEND_SECONDS, or leaves OUTBOX_BYTES unread, is cut off: its socket is shut down, its reader sees EOF
    and frees what it held, and the front-end fails those calls UNAVAILABLE and reconnects."""

    def __init__(self, connection: Connection, owner: int) -> None:
        self.connection = connection
        self.owner = owner
        self.items: dict[int, Item] = {}  # by slot; guarded by the engine's lock
        self.alive = True
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._queued = 0  # bytes in the outbox; guarded by _lock
        self._cut = False
        self._lock = threading.Lock()
        self._sender = threading.Thread(target=self._send_queued, name="engine-sender", daemon=True)
        self._sender.start()

    def send(self, message: ToFrontEnd) -> None:
        """Queue the message; never blocks."""
        data = encode(message)
        with self._lock:
            if self._cut:
                return
            self._queued += len(data)
            unread = self._queued
        if unread > OUTBOX_BYTES:
            self.cut_off(f"{unread} bytes of its answers are unread")
        else:
            self._outbox.put(data)

    def _send_queued(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self.connection.send_bytes(data)
            except Exception as exc:  # noqa: BLE001 - a time-out, a closed socket: whatever it is, cut it off
                self.cut_off(f"a write failed ({type(exc).__name__}: {exc})")
                return
            with self._lock:
                self._queued -= len(data)

    def cut_off(self, reason: str | None) -> None:
        """Stop writing to it and wake its reader (which then cleans up); ``reason`` is logged if given."""
        with self._lock:
            if self._cut:
                return
            self._cut = True
        if reason is not None:
            log.warning("cut off front-end %d: %s", self.owner, reason)
        shut_down(self.connection)

    def flush(self, timeout: float) -> None:
        """Write what is queued, for at most ``timeout`` seconds, and send nothing after it."""
        self._outbox.put(None)
        self._sender.join(timeout)

    def close(self) -> None:
        """On its reader's thread, once it has gone: end the sender, then close the socket."""
        self.cut_off(None)
        self._outbox.put(None)
        self._sender.join()
        self.connection.close()


class Ticket:
    """An item's caller in another process: no future here, only whether that caller has gone."""

    __slots__ = ("cancelled", "owner", "slot")

    def __init__(self, owner: _FrontEnd, slot: int) -> None:
        self.owner = owner  # who to answer
        self.slot = slot  # where its image and answer lie (resnet_server.boundary.slab)
        self.cancelled = False

    def done(self) -> bool:
        return self.cancelled


# An image queued in this engine: its caller is a front-end's slot.
Item = WorkItem[Ticket]


class Engine:
    def __init__(self, link: EngineLink, device: torch.device, config: EngineConfig, metrics: Metrics) -> None:
        self.link = link
        self.device = device
        self.config = config
        self.metrics = metrics
        self.slab = Slab(link.slab_fd, link.layout)
        self._input_rows = torch.from_numpy(self.slab.input_rows())  # raw images are read from here a batch at once
        self._replica: Replica | None = None
        self._reload_started = 0.0
        self._lock = threading.Lock()
        self._frontends: set[_FrontEnd] = set()
        self._listener: Listener | None = None
        self._closing = False
        self._unconnected: dict[int, float] = {}  # owners seen holding slots with no connection, and since when

    def start(self, live_owners: Iterable[int]) -> None:
        """Load and warm the model, free the slots of front-ends that ended while no engine ran, then listen."""
        self._replica = load_replica(self.link.name, self.device, self.config, self.metrics, self._rejoined,
                                    Answers(self._deliver, self._fail, self._released))
        self.metrics.weights_version.labels(self.replica.name).set(self.config.weights_version)
        freed = self.slab.free_all_but(set(live_owners))
        if freed:
            log.info("freed %d slots of front-ends that have ended", freed)
        # A GPU then reads the images where the front-ends wrote them: gathered in one kernel from the slab seen
        # as a CUDA tensor where it can, else one DMA an image from the registered rows
        # (resnet_server.engine.registered_slab).
        if self.device.type == "cuda" and register_slab(self.slab, self.device):
            on_device = device_rows(self.slab, self.device)
            self._input_rows = self._input_rows if on_device is None else on_device
        # No authkey here: the key's challenge runs on each connection's thread (resnet_server.boundary.link).
        self._listener = Listener(self.link.address, "AF_UNIX")
        threading.Thread(target=self._accept, args=(self._listener,), name="engine-accept", daemon=True).start()

    @property
    def replica(self) -> Replica:
        if self._replica is None:
            raise RuntimeError("the engine has not started")
        return self._replica

    def stage(self, source: str) -> str:
        """Make the weights at ``source`` ready beside those served (the batches go on meanwhile); their SHA-256."""
        self._reload_started = time.monotonic()
        try:
            return self.replica.stage(source).sha256
        except Exception:
            self.metrics.reloads.labels(self.replica.name, "failed").inc()
            raise

    def commit(self, version: int) -> None:
        """Serve the staged weights as ``version`` from the next batch on."""
        replica = self.replica
        replica.commit(version)
        self.metrics.weights_version.labels(replica.name).set(version)
        self.metrics.reloads.labels(replica.name, "loaded").inc()
        self.metrics.reload_time.labels(replica.name).set(time.monotonic() - self._reload_started)

    def abort(self) -> None:
        """Drop the staged weights: the served ones stay."""
        if self.replica.staged is not None:
            self.replica.staged = None
            self.metrics.reloads.labels(self.replica.name, "aborted").inc()

    def info(self) -> EngineInfo:
        replica = self.replica
        return EngineInfo(name=replica.name, device=str(replica.device), weights=replica.weights.source,
                          warning=replica.weights.warning, max_batch_size=replica.batcher.max_batch_size,
                          decode_on_device=replica.decode_on_device, in_rotation=replica.healthy,
                          switch_interval_ms=sys.getswitchinterval() * 1000, torch_threads=replica.torch_threads,
                          runs=replica.runner.describe(), takes_crops=replica.runner.takes_crops,
                          weights_version=replica.batcher.weights_version, weights_sha256=replica.weights.sha256)

    def stop(self, grace: float) -> None:
        """Take no new front-end, finish what is queued, and answer it: the answers written before it returns
        (the senders are daemon threads, which the process's end would cut short)."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        if self._replica is not None:
            self._replica.batcher.stop(grace)
        deadline = time.monotonic() + SEND_SECONDS
        with self._lock:
            frontends = list(self._frontends)
        for frontend in frontends:
            frontend.flush(max(0.0, deadline - time.monotonic()))

    def _accept(self, listener: Listener) -> None:
        """Accept until the listener is closed; each connection's handshake runs on its own thread."""
        while not self._closing:
            try:
                connection = listener.accept()
            except OSError as exc:
                if self._closing:
                    return
                log.warning("accepting a front-end failed: %s", exc)  # out of descriptors, say: try again
                time.sleep(0.1)
                continue
            threading.Thread(target=self._serve, args=(connection,), name="engine-frontend", daemon=True).start()

    def _serve(self, connection: Connection) -> None:
        """Read one front-end's messages until its socket closes."""
        try:
            hello = accept_hello(connection, self.link.authkey)
        except Exception as exc:  # noqa: BLE001 - a peer that failed the handshake, or never finished it
            log.warning("refused a connection: %s: %s", type(exc).__name__, exc)
            connection.close()
            return
        frontend = _FrontEnd(connection, hello.owner)
        with self._lock:
            # Owner numbers come round again after many reconnections (resnet_server.boundary.slab.connection_owner):
            # two live connections must never share one, or one's clean-up would free the other's slots.
            taken = any(other.owner == hello.owner for other in self._frontends)
            if not taken:
                self._frontends.add(frontend)
        if taken:
            log.warning("refused a connection: owner %d is a live connection's; it reconnects under another",
                        hello.owner)
            connection.close()
            return
        try:
            frontend.send(Ready(self.info()))
            self._read(frontend)
        finally:
            self._gone(frontend)
            frontend.close()

    def _read(self, frontend: _FrontEnd) -> None:
        messages = engine_messages(frontend.connection)
        try:
            while True:
                for message in messages.read():
                    if isinstance(message, Submit):
                        self._submit(frontend, message)
                    elif isinstance(message, Cancel):
                        self._cancel(frontend, message)
                    else:
                        raise ValueError(f"{type(message).__name__} after Hello")
        except (EOFError, OSError):
            pass
        except Exception:  # a message it could not handle: this connection ends, the engine goes on
            log.exception("front-end %d sent what the engine could not handle; closing its connection",
                          frontend.owner)

    def _submit(self, frontend: _FrontEnd, message: Submit) -> None:
        items = [self._item(frontend, entry, message) for entry in message.entries]
        with self._lock:
            frontend.items.update((item.caller.slot, item) for item in items)
        try:
            self.replica.batcher.submit(items)
        except ServingError as exc:
            self._fail(items, exc)

    def _item(self, frontend: _FrontEnd, entry: SlotEntry, message: Submit) -> Item:
        slot, nbytes = entry.slot, entry.nbytes
        model_input: ModelInput
        if entry.kind is ImageKind.RAW:
            model_input = RawImage(entry.dtype, entry.shape, SlotBytes(self._input_rows, slot, nbytes))
        elif entry.kind is ImageKind.CROP:
            model_input = CroppedImage(SlotBytes(self._input_rows, slot, nbytes))
        elif entry.kind is ImageKind.FLOAT:
            model_input = torch.frombuffer(self.slab.input(slot, nbytes), dtype=torch.float32).view(FLOAT_SHAPE)
        else:  # ImageKind.JPEG
            model_input = DeferredJpeg(torch.frombuffer(self.slab.input(slot, nbytes), dtype=torch.uint8),
                                       self.config.max_pixels)
        return WorkItem(model_input, entry.temperature, entry.top_k, entry.deadline, Ticket(frontend, slot),
                        message.request_ids[entry.call], client=message.clients[entry.call],
                        weight=message.weights[entry.call], priority=message.priorities[entry.call])

    def _cancel(self, frontend: _FrontEnd, message: Cancel) -> None:
        with self._lock:
            items = [frontend.items[slot] for slot in message.slots if slot in frontend.items]
            for item in items:
                item.caller.cancelled = True  # dropped before compute if a batch has taken it already
        self._released(self.replica.batcher.withdraw(items))

    def _gone(self, frontend: _FrontEnd) -> None:
        """A front-end closed its socket: drop its queued images, free every slot it held that no batch holds."""
        with self._lock:
            frontend.alive = False
            self._frontends.discard(frontend)
            for item in frontend.items.values():
                item.caller.cancelled = True
            held = list(frontend.items.values())
            mine = np.flatnonzero(self.slab.owners == frontend.owner).tolist()
            self.slab.give_back([slot for slot in mine if slot not in frontend.items], frontend.owner)
        self._released(self.replica.batcher.withdraw(held))

    def _answer(self, frontend: _FrontEnd, slots: list[int], message: Callable[[list[int]], ToFrontEnd]) -> None:
        """Send ``message(slots)`` for those of ``slots`` the engine still holds (each slot is answered once,
        whatever else has answered it meanwhile)."""
        with self._lock:
            held = [slot for slot in slots if frontend.items.pop(slot, None) is not None]
            if not held:
                return
            if not frontend.alive:  # no one to read them: the slots are free again
                self.slab.give_back(held, frontend.owner)
                return
        frontend.send(message(held))

    def _deliver(self, items: list[Item], output: BatchOutput) -> None:
        """On the finisher's thread: the batch's scores into its slots, then one message per front-end."""
        slots = [item.caller.slot for item in items]
        self.slab.outputs[slots, 0] = output.probabilities
        self.slab.outputs[slots, 1] = output.logits
        answers: defaultdict[_FrontEnd, dict[int, Answer]] = defaultdict(dict)
        for item, slot, top, queued in zip(items, slots, output.top_k, output.queue_seconds, strict=True):
            answers[item.caller.owner][slot] = Answer(slot, top, queued)
        # What every front-end's Done says of the batch; each front-end's copy takes its own answers.
        batch = Done(answers=[], timing=output.timing, in_rotation=self.replica.healthy,
                     weights_version=output.weights_version, batch=output.number, batch_size=len(items),
                     buckets=list(output.buckets))
        for frontend, answered in answers.items():
            self._answer(frontend, list(answered), functools.partial(_done, answered, batch))

    def _fail(self, items: list[Item], exc: BaseException) -> None:
        error, message, healthy = type(exc).__name__, str(exc), self.replica.healthy
        for frontend, slots in _slots_by_frontend(items).items():
            self._answer(frontend, slots, lambda held: Failed(held, error, message, healthy))

    def _released(self, items: list[Item]) -> None:
        """Items dropped before compute because their caller went: their slots go back to their front-end."""
        for frontend, slots in _slots_by_frontend(items).items():
            self._answer(frontend, slots, Released)

    def sweep(self) -> int:
        """Free the slots of owners that have held some with no connection for LEAKED_AFTER seconds (a
        front-end that died with its engine: the replacement engine's start saw it still alive); how many.
        The wait covers a front-end that has taken slots and not yet sent them."""
        with self._lock:
            connected = {frontend.owner for frontend in self._frontends}
        now = time.monotonic()
        holding = set(np.unique(self.slab.owners).tolist()) - {FREE} - connected
        self._unconnected = {owner: self._unconnected.get(owner, now) for owner in holding}
        leaked = {owner for owner, since in self._unconnected.items() if now - since >= LEAKED_AFTER}
        freed = self.slab.free_owners(leaked) if leaked else 0
        if freed:
            log.warning("freed %d slots of front-ends that are no longer connected", freed)
        return freed

    def stuck_for(self) -> float:
        """Seconds the oldest launched batch has waited for its answer (0 when none waits)."""
        return self.replica.batcher.unanswered_for()

    def out_of_rotation_for(self) -> float:
        return self.replica.batcher.out_of_rotation_for()

    def _rejoined(self) -> None:
        with self._lock:
            frontends = list(self._frontends)
        for frontend in frontends:
            frontend.send(Health(True))


def _done(answered: dict[int, Answer], batch: Done, held: list[int]) -> Done:
    """``batch``'s Done with the answers of those of a front-end's slots that are still held."""
    return msgspec.structs.replace(batch, answers=[answered[slot] for slot in held])


def _slots_by_frontend(items: list[Item]) -> dict[_FrontEnd, list[int]]:
    grouped = defaultdict(list)
    for item in items:
        grouped[item.caller.owner].append(item.caller.slot)
    return grouped


