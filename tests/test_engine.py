"""The engine process of a device and the front-ends that feed it through shared memory: real processes, a
real slab, real gRPC. Front-ends here run in the test's process (ServerThread over the engines), so that a test
can reach each one on its own port, or as processes of their own where one is killed."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from resnet_client import ClassifierError, Client
from resnet_server.boundary.protocol import Cancel, Hello, ImageKind, Submit
from tests.helpers import EngineSet, base_config, encode, free_port, random_rgb, scraped_value, serving, wait_for

JPEG = encode(random_rgb(41))
PIXELS = random_rgb(42, 224, 224)
LARGE = random_rgb(43, 720, 960)  # 2 MB of raw pixels: more than a slot takes as it came (preprocessed first)
FLOATS = np.random.default_rng(44).standard_normal((3, 224, 224)).astype(np.float32)


@pytest.fixture()
def engines(weights_file):
    """One CPU engine (its /metrics on a port of its own) for the test's front-ends; stopped at the end."""
    started: list[EngineSet] = []

    def start(**overrides) -> EngineSet:
        config = base_config(str(weights_file[0]), frontends=2, metrics_port=free_port(), **overrides)
        started.append(EngineSet(config))
        return started[-1]

    yield start
    for engine_set in started:
        engine_set.stop()


def engine_sample(engine_set: EngineSet, sample: str) -> float:
    return scraped_value(engine_set.engine_metrics_port(), sample)


def sent_to_engines(caplog, kind: type) -> list:
    """The messages of ``kind`` the front-ends run in this process sent (the protocol's DEBUG trace)."""
    return [record.engine_message for record in caplog.records
            if record.name == "resnet_server.boundary.protocol" and isinstance(record.engine_message, kind)]


@pytest.mark.slow
@pytest.mark.parametrize("crops", [False, True], ids=["floats", "crops"])
def test_a_front_end_in_another_process_answers_as_the_shared_server(engines, server, faults, caplog, crops):
    """Images the front-end preprocesses (the JPEG: a CPU engine decodes none; the one too large for its slot) go
    as the float input to a CPU engine, and as uint8 crops to a GPU one: here a CPU engine whose runner takes
    crops, as a GPU's does (``--runner faulty`` with ``crops``), whose answers are the same."""
    if crops:
        faults.set("crops")
    engine_set = engines(runner=faults.runner)
    frontend = engine_set.frontend()
    images = [JPEG, PIXELS, LARGE, FLOATS]
    caplog.set_level(logging.DEBUG, logger="resnet_server.boundary.protocol")
    with Client(frontend.target, timeout=60) as remote, Client(server.target, timeout=60) as local:
        got = remote.classify(images, full=True, logits=True, temperature=1.7)
        sent = [entry for submit in sent_to_engines(caplog, Submit) for entry in submit.entries]  # how each went
        want = local.classify(images, full=True, logits=True, temperature=1.7)
    preprocessed = (ImageKind.CROP, (224, 224, 3), 224 * 224 * 3) if crops else \
        (ImageKind.FLOAT, FLOATS.shape, FLOATS.nbytes)
    assert [(entry.kind, entry.shape, entry.nbytes) for entry in sent] == [
        preprocessed, (ImageKind.RAW, PIXELS.shape, PIXELS.nbytes), preprocessed,
        (ImageKind.RAW, FLOATS.shape, FLOATS.nbytes)]
    for answer, expected in zip(got, want, strict=True):
        np.testing.assert_allclose(answer.probabilities, expected.probabilities, atol=1e-6, rtol=0)
        np.testing.assert_allclose(answer.logits, expected.logits, atol=1e-5, rtol=0)
        assert [c.index for c in answer.top_k] == [c.index for c in expected.top_k]
        assert answer.device == "cpu"
    assert engine_set.taken_slots() == 0  # every slot given back once its answer was read
    # The engine took the GIL switch interval asked for (Python's own, 5 ms, would leave its batcher waiting).
    engine_info = frontend.app.engines[0].info
    assert engine_info.switch_interval_ms == pytest.approx(engine_set.config.switch_interval_ms) != 5.0
    assert engine_info.torch_threads == len(os.sched_getaffinity(0))  # a CPU engine's forward uses every core
    assert engine_info.takes_crops is crops  # the runner's choice, told to the front-end in Ready


def test_one_batch_holds_calls_from_two_front_ends(engines):
    # Neither call alone fills a batch of two; the engine waits (up to 30 s) until both front-ends' images are in.
    engine_set = engines(max_batch_size=2, max_batch_delay_ms=30_000)
    first, second = engine_set.frontend(), engine_set.frontend()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda running: Client(running.target, timeout=60).classify([PIXELS], full=True)[0],
                                [first, second]))
    assert all(answer.device == "cpu" for answer in answers)
    np.testing.assert_allclose(answers[0].probabilities, answers[1].probabilities, atol=1e-6)
    assert engine_sample(engine_set, 'resnet_batch_size_count{device="cpu"}') == 1
    assert engine_sample(engine_set, 'resnet_batch_size_sum{device="cpu"}') == 2
    assert first.sample("resnet_images_total", device="cpu", code="OK") == 1
    assert second.sample("resnet_images_total", device="cpu", code="OK") == 1


@pytest.mark.slow
def test_overload_from_two_front_ends_is_bounded_by_the_one_queue(engines):
    # A queue of four images for the whole server; batches wait up to 3 s for eight, so images stay queued. The
    # queue's own bound, without fair share (one caller: its last slot would be kept for another).
    engine_set = engines(max_queue=4, max_batch_size=8, max_batch_delay_ms=3000, fair_share="off")
    first, second = engine_set.frontend(), engine_set.frontend()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(Client(first.target, timeout=60).classify, [PIXELS] * 3)
        wait_for(lambda: engine_sample(engine_set, 'resnet_queue_depth{device="cpu"}') == 3)
        with Client(second.target, timeout=60, attempts=1) as client:
            with pytest.raises(ClassifierError) as refused:
                client.classify([PIXELS] * 2)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-queue of 4" in str(refused.value)
            assert client.classify([PIXELS])[0].top_k  # the fourth image fits, and waits with the three
        assert len(waiting.result(timeout=60)) == 3
    assert second.sample("resnet_images_total", device="cpu", code="RESOURCE_EXHAUSTED") == 2
    assert engine_set.taken_slots() == 0


@pytest.mark.slow
def test_deadline_and_cancel_free_their_slots_before_compute(engines):
    engine_set = engines(max_batch_size=8, max_batch_delay_ms=2000)
    frontend = engine_set.frontend()
    with Client(frontend.target, timeout=0.3, attempts=1) as client, pytest.raises(ClassifierError) as late:
        client.classify([PIXELS, PIXELS])
    assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The caller gone, its front-end withdraws the queued images: dropped before any batch, slots free.
    wait_for(lambda: engine_set.taken_slots() == 0)
    wait_for(lambda: engine_sample(engine_set, 'resnet_dropped_images_total{device="cpu",reason="cancelled"}') == 2)
    assert engine_sample(engine_set, 'resnet_batch_size_count{device="cpu"}') == 0
    # A deadline the server sees run out while the image is queued: DEADLINE_EXCEEDED from the engine.
    with Client(frontend.target, timeout=60) as client:
        request_deadline = 1.0
        with pytest.raises(ClassifierError) as expired:
            client.classify([PIXELS], timeout=request_deadline)
    assert expired.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: engine_set.taken_slots() == 0)


@pytest.mark.slow
def test_calls_of_one_loop_turn_reach_the_engine_as_one_message_and_a_withdrawn_one_is_not_answered(engines,
                                                                                                  caplog):
    from resnet_server.common.preprocess import RawImage
    from resnet_server.common.work import WorkItem
    from resnet_server.frontend import engine_client

    engine_set = engines(max_batch_size=8)
    with Client(engine_set.frontend().target, timeout=60) as client:
        want = client.classify([PIXELS], full=True, temperature=1.3)[0].probabilities
    caplog.set_level(logging.DEBUG, logger="resnet_server.boundary.protocol")

    def sent() -> list[str]:
        return [type(message).__name__ for message in sent_to_engines(caplog, (Hello, Submit, Cancel))]

    async def three_calls_and_one_withdrawn():
        handle = engine_client.EngineClient(engine_set.links[0], 3000, on_lost=lambda: None, on_back=lambda: None)
        await handle.open()
        loop = asyncio.get_running_loop()
        items = [WorkItem(RawImage("uint8", PIXELS.shape, PIXELS.tobytes()), 1.3, 5, None, loop.create_future())
                 for _ in range(3)]
        for item in items:  # three calls' submits in one turn of the loop: nothing sent yet but the greeting
            handle.submit([item])
        assert sent() == ["Hello"]
        handle.withdraw(items[2:])  # sends what waits first: the engine must know the slot it is asked to drop
        items[2].caller.cancel()
        answers = await asyncio.wait_for(asyncio.gather(items[0].caller, items[1].caller), 60)
        handle.stop()
        return answers

    answers = asyncio.run(three_calls_and_one_withdrawn())
    assert sent() == ["Hello", "Submit", "Cancel"]
    for answer in answers:
        np.testing.assert_allclose(answer.probabilities, want, atol=1e-6, rtol=0)
    wait_for(lambda: engine_set.taken_slots() == 0)  # the withdrawn one's slot too, whether dropped or computed


@pytest.mark.slow
def test_an_engine_killed_mid_batch_fails_its_calls_at_once_and_its_front_end_rejoins_the_new_one(engines):
    engine_set = engines(max_batch_size=8, max_batch_delay_ms=20_000)
    frontend = engine_set.frontend()
    client = Client(frontend.target, timeout=60, attempts=1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.classify, [PIXELS])
        wait_for(lambda: engine_sample(engine_set, 'resnet_queue_depth{device="cpu"}') == 1)
        os.kill(engine_set.engine_pid(), signal.SIGKILL)
        with pytest.raises(ClassifierError) as lost:
            waiting.result(timeout=10)  # at once, not after the 20 s the batch would have waited
    assert lost.value.code == grpc.StatusCode.UNAVAILABLE and "ended with this call in flight" in str(lost.value)
    wait_for(lambda: client.health() == "NOT_SERVING")
    with pytest.raises(ClassifierError) as refused:
        client.classify([PIXELS])
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert engine_set.taken_slots() == 0
    engine_set.restart_engine()
    wait_for(lambda: serving(client))
    with Client(frontend.target, timeout=60) as fresh:
        answer = fresh.classify([JPEG] * 8)  # a full batch: no wait
    assert len(answer) == 8 and all(a.device == "cpu" for a in answer)
    client.close()


@pytest.mark.slow
def test_a_front_end_process_killed_with_calls_queued_leaves_no_slot_taken(engines):
    engine_set = engines(max_batch_size=8, max_batch_delay_ms=20_000, max_queue=8)
    port = engine_set.start_frontend(0)
    pid = engine_set.supervisor.children["frontend-0"].process.pid
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(Client(f"127.0.0.1:{port}", timeout=60, attempts=1).classify, [PIXELS] * 5)
        # Queued in the engine, not only written: a front-end takes slots and writes the pixels, then sends their
        # message at the end of its event loop's turn; killed between the two, the engine never had them.
        wait_for(lambda: engine_sample(engine_set, 'resnet_queue_depth{device="cpu"}') == 5)
        assert engine_set.taken_slots() == 5
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ClassifierError):
            waiting.result(timeout=30)
    # The engine saw its socket close: the five queued images dropped, their slots free, and it serves on.
    wait_for(lambda: engine_set.taken_slots() == 0)
    assert engine_sample(engine_set, 'resnet_dropped_images_total{device="cpu",reason="cancelled"}') == 5
    with Client(engine_set.frontend().target, timeout=60) as client:
        assert len(client.classify([PIXELS] * 8)) == 8  # the whole queue is free again


@pytest.mark.slow
def test_a_front_end_started_while_its_engine_restarts_waits_for_it_then_serves(engines):
    engine_set = engines()
    engine = engine_set.engine_pid()
    os.kill(engine, signal.SIGKILL)
    engine_set.supervisor.children["engine-0"].process.join(30)
    frontend = engine_set.supervisor.start_frontend(0, 0)  # a replacement, started while no engine listens
    engine_set.restart_engine()
    assert engine_set.supervisor.wait_until(lambda: frontend.serving) is None
    with Client(f"127.0.0.1:{frontend.port}", timeout=60) as client:
        assert client.classify([JPEG])[0].device == "cpu"


def test_an_owner_number_a_live_connection_holds_is_refused_until_it_has_gone(engines):
    """The review's N22: owner numbers come round again after 2,048 connections of one front-end; the engine never
    lets two live connections share one (one's clean-up would free the other's slots)."""
    from resnet_server.boundary.link import connect

    (link,) = engines().links
    first, _ = connect(link, 4242)
    with pytest.raises((EOFError, OSError)):  # closed before Ready
        connect(link, 4242)
    first.close()
    second = None

    def reconnected() -> bool:
        nonlocal second
        try:
            second, _ = connect(link, 4242)
        except (EOFError, OSError):
            return False
        return True

    wait_for(reconnected)  # once the engine has seen the first one go
    second.close()
