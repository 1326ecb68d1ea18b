"""How batches form: --wait-for-callers-ms holds a replica for the callers it just answered, and no longer; on
CUDA the next batch is launched while one computes."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from resnet_client import AsyncClient, Client
from tests.helpers import encode, random_rgb, wait_for

IMAGES = [encode(random_rgb(900 + i)) for i in range(4)]
TOLERANCE = 1e-5


def batches(running) -> tuple[float, float]:
    """(batches, images) the CPU replica has computed so far."""
    return (running.sample("resnet_batch_size_count", device="cpu"),
            running.sample("resnet_batch_size_sum", device="cpu"))


def queue_seconds(running) -> float:
    return running.sample("resnet_queue_wait_seconds_sum", device="cpu")


def waits(running) -> tuple[float, float]:
    """Waits that held a batch back so far: (the callers came back, the wait ran out)."""
    return tuple(running.sample("resnet_caller_waits_total", device="cpu", outcome=outcome)
                 for outcome in ("came_back", "ran_out"))


def straggle(running) -> list:
    """IMAGES' callers come back one by one, the first alone in the queue for a moment; their results."""
    async def calls():
        async with AsyncClient(running.target, timeout=60) as aclient:
            first = asyncio.ensure_future(aclient.classify([IMAGES[0]], full=True))
            # The first caller is back alone; without the wait its batch would run now, with one image.
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: running.sample("resnet_queue_depth", device="cpu") == 1)
            rest = [aclient.classify([image], full=True) for image in IMAGES[1:]]
            return await asyncio.gather(first, *rest)

    return asyncio.run(calls())


def test_callers_a_batch_answered_share_the_next_batch_however_they_straggle(make_server, reference):
    # The limit is far longer than the test: the batch must close because all four came back.
    running = make_server(max_batch_size=4, wait_for_callers_ms=600_000.0)
    with Client(running.target, timeout=60) as client:
        client.classify(IMAGES)  # one batch of four answered: four callers are expected back
    before = batches(running)
    results = straggle(running)
    after = batches(running)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)
    assert waits(running) == (1, 0)  # the first batch had no answer before it to wait for
    for image, (result,) in zip(IMAGES, results, strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_a_wait_that_runs_out_skips_the_next_waits_more_of_them_while_they_run_out(make_server, reference):
    running = make_server(max_batch_size=4, wait_for_callers_ms=1000.0)

    def lone_caller_back(client) -> float:
        """A batch of four answered, then one of its callers back alone: seconds its image waited in the queue."""
        client.classify(IMAGES)
        before = queue_seconds(running)
        client.classify([IMAGES[0]])
        return queue_seconds(running) - before

    def ran_out(client) -> bool:
        """Whether the lone caller waited out the limit (less the moment it took to send again), or not at all."""
        seconds = lone_caller_back(client)
        assert seconds < 1.0
        return seconds >= 0.5

    with Client(running.target, timeout=60) as client:
        # The other three never come back: the wait runs out, then one wait is skipped...
        assert [ran_out(client) for _ in range(2)] == [True, False]
        # ...then, running out again in a row, two; and so on, up to MOST_WAITS_SKIPPED.
        assert [ran_out(client) for _ in range(4)] == [True, False, False, True]
        assert waits(running) == (0, 3)
        # Callers that come back halve it: after the next wait that runs out four are skipped, not eight.
        for _ in range(4):  # the four skipped
            assert not ran_out(client)
        client.classify(IMAGES)
        straggle(running)
        assert waits(running) == (1, 3)
        assert [ran_out(client) for _ in range(6)] == [True, False, False, False, False, True]
        assert waits(running) == (1, 5)
        (result,) = client.classify([IMAGES[0]], full=True)
    np.testing.assert_allclose(result.probabilities, reference.probabilities(reference.input_from_bytes(IMAGES[0])),
                               atol=TOLERANCE, rtol=0)


def test_a_lone_caller_waits_for_no_one(make_server):
    # Each call is answered alone and comes back alone: already as many as the last batch held.
    running = make_server(max_batch_size=4, wait_for_callers_ms=600_000.0)
    before, waited_before = batches(running), queue_seconds(running)
    with Client(running.target, timeout=60) as client:
        assert client.model_info().batching.wait_for_callers_ms == 600_000.0
        for image in IMAGES:
            client.classify([image])
        client.classify(IMAGES[:3])  # more images than the last batch held: no wait either
    after = batches(running)
    assert (after[0] - before[0], after[1] - before[1]) == (5, 7)
    assert queue_seconds(running) - waited_before < 5.0  # none of the five waited out the ten-minute limit
    assert waits(running) == (0, 0)  # none held back at all


def test_work_after_an_idle_spell_does_not_count_as_callers_that_never_came_back(make_server):
    running = make_server(max_batch_size=4, wait_for_callers_ms=1000.0)
    with Client(running.target, timeout=60) as client:
        client.classify(IMAGES)
        answered_by = time.monotonic()
        # Idle past the limit: the next call finds the wait over before it began, and held nothing back.
        wait_for(lambda: time.monotonic() > answered_by + 1.0, timeout=10)
        client.classify([IMAGES[0]])
        assert waits(running) == (0, 0)
        client.classify(IMAGES)
        before = queue_seconds(running)
        client.classify([IMAGES[1]])  # so the replica still waits for the other three
        assert 0.5 <= queue_seconds(running) - before < 1.0
        assert waits(running) == (0, 1)


def test_the_next_batch_is_launched_while_one_computes_and_no_more(make_server, faults, reference):
    """The CUDA pipeline, driven on the CPU by the faulty runner (``pipeline``: batches launched while others
    compute; ``hold``: their scores kept from landing): two batches are launched while the first one's scores
    have not landed, the third waits in the queue for room, and every answer is still the image's own."""
    faults.set("pipeline")
    running = make_server(max_batch_size=1, runner=faults.runner)
    faults.set("hold")

    def launched_and_queued() -> tuple[float, float]:
        return (running.sample("resnet_batches_in_flight", device="cpu"),
                running.sample("resnet_queue_depth", device="cpu"))

    async def calls():
        async with AsyncClient(running.target, timeout=60) as aclient:
            pending = [asyncio.ensure_future(aclient.classify([image], full=True)) for image in IMAGES[:3]]
            await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: launched_and_queued() == (2, 1))
            assert batches(running) == (0, 0)  # none has been answered while its scores are held
            faults.clear()
            return await asyncio.gather(*pending)

    results = asyncio.run(calls())
    assert batches(running) == (3, 3) and launched_and_queued() == (0, 0)
    for image, (result,) in zip(IMAGES[:3], results, strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_a_batch_whose_only_call_was_cancelled_while_it_filled_leaves_no_empty_batch(make_server):
    """The one caller cancels while its image waits for a fuller batch: the image leaves the queue at once,
    and when the wait ends the batcher waits for work again. Nothing runs for the empty batch (before, it ran
    as a due probe: one blank forward pass), and the next call is one batch of one image."""
    running = make_server(max_batch_size=4, max_batch_delay_ms=1500.0)

    async def cancelled_call() -> float:
        async with AsyncClient(running.target, timeout=60) as aclient:
            call = asyncio.ensure_future(aclient.classify([IMAGES[0]]))
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: running.sample("resnet_queue_depth", device="cpu") == 1)
            queued_by = time.monotonic()
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            return queued_by

    queued_by = asyncio.run(cancelled_call())
    wait_for(lambda: running.sample("resnet_dropped_images_total", device="cpu", reason="cancelled") == 1)
    assert running.sample("resnet_queue_depth", device="cpu") == 0
    # The batcher's own clock: its wait for a fuller batch ends 1.5 s after the image was queued.
    wait_for(lambda: time.monotonic() > queued_by + 1.5 + 0.2)
    with Client(running.target, timeout=60) as client:
        client.classify([IMAGES[1]])
    assert batches(running) == (1, 1)
    assert running.sample("resnet_replica_probes_total", device="cpu", result="passed") == 0
