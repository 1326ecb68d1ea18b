"""How batches form: --wait-for-callers-ms holds a replica for the callers it just answered, and no longer."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from client import AsyncClient, Client
from server.batcher import BATCHES_WITHOUT_WAIT_AFTER_TIMEOUT
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


def test_callers_a_batch_answered_share_the_next_batch_however_they_straggle(make_server, reference):
    # The limit is far longer than the test: the batch must close because all four came back.
    running = make_server(max_batch_size=4, wait_for_callers_ms=600_000.0)
    with Client(running.target, timeout=60) as client:
        client.classify(IMAGES)  # one batch of four answered: four callers are expected back
    before = batches(running)

    async def straggle():
        async with AsyncClient(running.target, timeout=60) as aclient:
            first = asyncio.ensure_future(aclient.classify([IMAGES[0]], full=True))
            # The first caller is back alone; without the wait its batch would run now, with one image.
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for, lambda: running.sample("resnet_queue_depth", device="cpu") == 1)
            rest = [aclient.classify([image], full=True) for image in IMAGES[1:]]
            return await asyncio.gather(first, *rest)

    results = asyncio.run(straggle())
    after = batches(running)
    assert (after[0] - before[0], after[1] - before[1]) == (1, 4)
    assert waits(running) == (1, 0)  # the first batch had no answer before it to wait for
    for image, (result,) in zip(IMAGES, results, strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=TOLERANCE, rtol=0)


def test_the_wait_ends_at_its_limit_and_then_rests_for_some_batches(make_server, reference):
    running = make_server(max_batch_size=4, wait_for_callers_ms=1000.0)

    def waited(client, images) -> float:
        """Seconds the call's images waited in the queue, in all."""
        before = queue_seconds(running)
        client.classify(images)
        return queue_seconds(running) - before

    with Client(running.target, timeout=60) as client:
        client.classify(IMAGES)
        before, waited_before = batches(running), queue_seconds(running)
        (result,) = client.classify([IMAGES[0]], full=True)  # one of the four comes back; the others never do
        after = batches(running)
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
        # It waited for the limit after the answer, less the moment the caller took to send again.
        assert 0.5 <= queue_seconds(running) - waited_before < 1.0
        assert waits(running) == (0, 1)
        # The callers did not come back, so the next batches start at once, even where one would wait...
        client.classify(IMAGES)
        assert waited(client, [IMAGES[0]]) < 0.5
        for _ in range(BATCHES_WITHOUT_WAIT_AFTER_TIMEOUT - 2):
            assert waited(client, [IMAGES[1]]) < 0.5
        # ...and after that many batches the replica waits again.
        client.classify(IMAGES)
        assert 0.5 <= waited(client, [IMAGES[0]]) < 1.0
        assert waits(running) == (0, 2)
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
    batcher = running.app.core.router.replicas[0].batcher
    with Client(running.target, timeout=60) as client:
        client.classify(IMAGES)
        # Idle past the limit: the next call finds the wait over before it began, and held nothing back.
        wait_for(lambda: time.monotonic() > batcher._answered_at + 1.0, timeout=10)
        client.classify([IMAGES[0]])
        assert waits(running) == (0, 0)
        client.classify(IMAGES)
        before = queue_seconds(running)
        client.classify([IMAGES[1]])  # so the replica still waits for the other three
        assert 0.5 <= queue_seconds(running) - before < 1.0
        assert waits(running) == (0, 1)
