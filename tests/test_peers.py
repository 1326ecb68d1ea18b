"""A peer or a fault must not stop a device silently: a connection that never finishes its handshake, a front-end
that stops reading, an answer that fails, a call whose image cannot be written, a front-end that dies with its
engine. Real engine processes, real slabs; the front-ends' side through the real EngineClient."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Listener

import grpc
import numpy as np
import pytest
import torch
import torchvision

from resnet_client import ClassifierError, Client
from resnet_server.boundary.link import accept_hello, connect
from resnet_server.boundary.protocol import (
    Answer,
    Done,
    EngineInfo,
    EngineLink,
    ImageKind,
    Ready,
    SlotEntry,
    Submit,
    frame,
    receive_at_engine,
    send,
)
from resnet_server.boundary.slab import SLOT_INPUT_BYTES, Slab, SlabLayout, connection_owner, create_slab_memory
from resnet_server.common.metrics import Metrics
from resnet_server.common.preprocess import RawImage
from resnet_server.common.statistics import BatchTiming
from resnet_server.common.work import WorkItem
from resnet_server.engine.batcher import Answers, Batcher
from resnet_server.engine.core import Ticket
from resnet_server.engine.runners import FreeRunner
from resnet_server.frontend.engine_client import EngineClient
from tests.helpers import EngineSet, base_config, free_port, random_rgb, scraped_value, wait_for

PIXELS = random_rgb(51, 224, 224)


@pytest.fixture()
def engines(weights_file):
    started: list[EngineSet] = []

    def start(**overrides) -> EngineSet:
        started.append(EngineSet(base_config(str(weights_file[0]), metrics_port=free_port(), **overrides)))
        return started[-1]

    yield start
    for engine_set in started:
        engine_set.stop()


def start_within(engine_set: EngineSet, seconds: float):
    """A front-end of ``engine_set`` started on a thread, or AssertionError if it is not serving in time."""
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(engine_set.frontend)
        return started.result(timeout=seconds)


def test_peers_that_close_at_once_or_never_speak_do_not_stop_front_ends_connecting(engines):
    engine_set = engines()
    address = engine_set.links[0].address
    with socket.socket(socket.AF_UNIX) as closes_at_once:
        closes_at_once.connect(address)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(address)  # says nothing, and stays
    try:
        frontend = start_within(engine_set, 15)
        with Client(frontend.target, timeout=30) as client:
            assert client.classify([PIXELS])[0].device == "cpu"
    finally:
        silent.close()


def raw_entry(slot: int, top_k: int) -> SlotEntry:
    return SlotEntry(slot, ImageKind.RAW, "uint8", PIXELS.shape, PIXELS.nbytes, 1.0, top_k, None, 0)


@pytest.mark.slow
def test_a_front_end_that_stops_reading_holds_up_no_one_else_and_is_cut_off(engines):
    engine_set = engines(max_batch_size=8)
    link = engine_set.links[0]
    frontend = engine_set.frontend()
    slab = Slab(link.slab_fd, link.layout)
    owner = connection_owner(4242, 0)
    slow, _ = connect(link, owner)  # a front-end that submits and never reads an answer
    try:
        slots = slab.take(128, owner)
        for slot in slots:
            slab.input(slot, PIXELS.nbytes)[:] = PIXELS.tobytes()
        # 16 batches of 8 answers of 1000 scores each
        send(slow, Submit([raw_entry(slot, 1000) for slot in slots], ["slow-reader"], [""], [0], [1]))
        wait_for(lambda: scraped_value(engine_set.engine_metrics_port(),
                                       'resnet_batch_size_sum{device="cpu"}') >= 128, timeout=120)
        with Client(frontend.target, timeout=5, attempts=1) as client:  # answered while those lie unread
            for _ in range(3):
                assert client.classify([PIXELS])[0].top_k
        # Unread past the engine's bound on a write, the slow one is cut off: its socket closes, its slots free.
        started = time.monotonic()
        wait_for(lambda: engine_set.taken_slots() == 0, timeout=30)
        assert time.monotonic() - started < 30
        assert slow.poll(5)
        with pytest.raises((EOFError, OSError)):
            while True:
                slow.recv_bytes()  # what was sent before the cut, then the end
    finally:
        slow.close()
        slab.close()


def test_an_answer_that_fails_fails_its_batch_and_the_batcher_goes_on():
    delivered, failed = [], []

    def deliver(items, output):
        if not delivered:
            delivered.append(None)
            raise TypeError("a connection closed under its sender")
        delivered.extend(items)

    batcher = Batcher("cpu", lambda: FreeRunner(0.0, torchvision.models.resnet18(), torch.device("cpu")),
                      Metrics(8), max_batch_size=1, max_batch_delay_ms=0, failures_before_eviction=3,
                      probe_interval=0, on_rejoin=lambda: None,
                      answers=Answers(deliver, lambda items, exc: failed.extend((item, exc) for item in items),
                                      lambda items: None))
    batcher.start()
    try:
        items = [WorkItem(torch.zeros((3, 224, 224)), 1.0, 5, None, Ticket(None, slot)) for slot in range(2)]
        batcher.submit(items[:1])
        wait_for(lambda: len(failed) == 1)
        batcher.submit(items[1:])
        wait_for(lambda: items[1] in delivered)
    finally:
        batcher.stop(5)
    (item, error), = failed
    assert item is items[0] and "answering failed on cpu" in str(error)


def test_a_call_whose_image_cannot_be_written_gives_back_its_slots_and_later_calls_go_on(engines):
    engine_set = engines()

    async def calls():
        handle = EngineClient(engine_set.links[0], 3001, on_lost=lambda: None, on_back=lambda: None)
        await handle.open()
        loop = asyncio.get_running_loop()

        def item(data) -> WorkItem:
            return WorkItem(RawImage("uint8", PIXELS.shape, data), 1.0, 5, None, loop.create_future())

        unwritable = memoryview(np.zeros(PIXELS.nbytes // 4, np.float32))  # bytes enough, of floats
        with pytest.raises(ValueError):
            handle.submit([item(PIXELS.tobytes()), item(unwritable)])
        assert engine_set.taken_slots() == 0
        good = item(PIXELS.tobytes())
        handle.submit([good])
        answer = await asyncio.wait_for(good.caller, 60)
        handle.stop()
        return answer

    assert len(asyncio.run(calls()).top_k) == 5
    wait_for(lambda: engine_set.taken_slots() == 0)


def test_each_connection_owns_slots_under_a_number_of_its_own():
    first, second = connection_owner(7, 0), connection_owner(7, 1)
    assert first == 7 and second != first and second % (1 << 20) == 7
    assert connection_owner(7, 2048) == first and connection_owner((1 << 20) - 1, 2047) == (1 << 31) - 1


@pytest.mark.slow
def test_a_front_end_reconnected_to_a_new_engine_takes_slots_as_a_new_owner(engines):
    engine_set = engines(max_batch_delay_ms=20_000, max_batch_size=8)
    link = engine_set.links[0]
    slab = Slab(link.slab_fd, link.layout)
    frontend = engine_set.frontend()
    process_owner = frontend.app.owner
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(Client(frontend.target, timeout=60, attempts=1).classify, [PIXELS])
            wait_for(lambda: set(slab.owners.tolist()) == {0, connection_owner(process_owner, 0)})
            os.kill(engine_set.engine_pid(), signal.SIGKILL)
            with pytest.raises(ClassifierError):
                waiting.result(timeout=30)
        engine_set.restart_engine()
        with Client(frontend.target, timeout=60) as client:
            wait_for(lambda: client.health() == "SERVING")
            calling = threading.Thread(target=client.classify, args=([PIXELS],))
            calling.start()
            seen: set[int] = set()
            wait_for(lambda: bool(seen.update(set(slab.owners.tolist()) - {0}) or seen))
            calling.join(60)
        (new_owner,) = seen
        assert new_owner != connection_owner(process_owner, 0) and new_owner % (1 << 20) == process_owner
    finally:
        slab.close()


@pytest.mark.slow
def test_slots_of_a_front_end_that_died_with_its_engine_are_freed(engines, faults):
    engine_set = engines(runner=faults.runner)
    port = engine_set.start_frontend(0)
    frontend_process = engine_set.supervisor.children["frontend-0"].process
    faults.set("hold")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(Client(f"127.0.0.1:{port}", timeout=60, attempts=1).classify, [PIXELS] * 3)
        wait_for(lambda: engine_set.taken_slots() == 3)
        os.kill(frontend_process.pid, signal.SIGKILL)
        os.kill(engine_set.engine_pid(), signal.SIGKILL)
        with pytest.raises(ClassifierError):
            held.result(timeout=30)
    frontend_process.join(10)
    faults.clear()
    # The new engine starts while the dead front-end is still among the children (its end not yet seen): the
    # engine's start leaves those slots, as the front-end's owner is live to it.
    supervisor = engine_set.supervisor
    supervisor.forget("engine-0")
    supervisor.start_engine(0)
    supervisor.forget("frontend-0")  # now seen to have ended
    assert supervisor.wait_until(lambda: supervisor.children["engine-0"].serving) is None
    assert engine_set.taken_slots() == 3
    wait_for(lambda: engine_set.taken_slots() == 0, timeout=30)


@pytest.mark.slow
def test_a_stuck_batch_ends_its_engine(engines, faults):
    engine_set = engines(runner=faults.runner, stuck_batch_timeout=2.0)
    frontend = engine_set.frontend()
    engine = engine_set.supervisor.children["engine-0"].process
    faults.set("hold")  # a batch that never lands: a hung device
    with Client(frontend.target, timeout=60, attempts=1) as client, pytest.raises(ClassifierError) as lost:
        client.classify([PIXELS])
    assert lost.value.code == grpc.StatusCode.UNAVAILABLE  # its engine ended: the caller may retry elsewhere
    engine.join(10)
    assert engine.exit_code() == 1


def test_one_message_the_front_end_cannot_handle_leaves_the_others_read_with_it_handled():
    """An engine stand-in (the protocol's real messages, by hand) answers a slot the front-end never sent, then
    the front-end's own call, in one write: the call is answered."""
    layout = SlabLayout(4, SLOT_INPUT_BYTES)
    key, address = secrets.token_bytes(32), f"\0resnet-test-{secrets.token_hex(6)}"
    listener = Listener(address, "AF_UNIX")
    link = EngineLink("cpu", address, key, layout, create_slab_memory(layout))
    no_time = BatchTiming(0.0, 0.0, 0.0)
    info = EngineInfo(name="cpu", device="cpu", weights="test", warning="", max_batch_size=8, decode_on_device=False,
                      in_rotation=True, switch_interval_ms=5.0, torch_threads=1, runs="a stand-in", takes_crops=False)

    def stand_in() -> None:
        connection = listener.accept()
        accept_hello(connection, key)
        send(connection, Ready(info))
        (entry,) = receive_at_engine(connection).entries
        unknown = Done(answers=[Answer(entry.slot + 1, [(0, 1.0)], 0.0)], timing=no_time, in_rotation=True,
                       weights_version=1)
        answer = Done(answers=[Answer(entry.slot, [(3, 0.5)], 0.0)], timing=no_time, in_rotation=True,
                      weights_version=1)
        os.write(connection.fileno(), frame(unknown) + frame(answer))
        with contextlib.suppress(EOFError):
            connection.recv_bytes()  # until the front-end closes
        connection.close()

    engine = threading.Thread(target=stand_in, daemon=True)
    engine.start()

    async def call():
        handle = EngineClient(link, 3002, on_lost=lambda: None, on_back=lambda: None)
        await handle.open()
        item = WorkItem(RawImage("uint8", PIXELS.shape, PIXELS.tobytes()), 1.0, 1, None,
                        asyncio.get_running_loop().create_future())
        handle.submit([item])
        try:
            return await asyncio.wait_for(item.caller, 30)
        finally:
            handle.stop()

    try:
        assert asyncio.run(call()).top_k == [(3, 0.5)]
    finally:
        listener.close()
