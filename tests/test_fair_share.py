"""Fair share of a device between callers: the engine's queue (resnet_server.engine.fair_queue) taken round robin
over callers, in order within each, by priority first; and through real engine processes, a polite caller's one
request answered before a greedy caller's backlog, as long as callers are told apart (by token, by peer)."""

from __future__ import annotations

import asyncio

import pytest

from resnet_client import AsyncClient
from resnet_server.common.config import ConfigError, parse_config
from resnet_server.common.work import WorkItem
from resnet_server.engine.fair_queue import FairQueue
from resnet_server.frontend.fair_share import caller_keys, peer_host, resolved_mode
from tests.helpers import encode, random_rgb, wait_for

IMAGE = encode(random_rgb(31, 64, 48))


class Waiting:
    """A caller that stays (never cancelled)."""

    def done(self) -> bool:
        return False


def item(client: str, name: str, priority: int = 0) -> WorkItem:
    return WorkItem(None, 1.0, 5, None, Waiting(), name, client=client, priority=priority)


def names(items: list[WorkItem]) -> list[str]:
    return [queued.request_id for queued in items]


def test_batches_take_callers_in_turn_and_each_callers_images_in_order():
    queue: FairQueue[WorkItem] = FairQueue()
    queue.extend([item("greedy", f"g{i}") for i in range(6)])
    queue.extend([item("polite", "p0")])
    queue.extend([item("third", "t0"), item("third", "t1")])
    assert len(queue) == 9 and queue.callers() == 3
    assert names(queue.take(4)) == ["g0", "p0", "t0", "g1"]
    queue.extend([item("polite", "p1")])  # back in the queue: behind the turns under way
    assert names(queue.take(10)) == ["t1", "g2", "p1", "g3", "g4", "g5"]
    assert not queue and queue.callers() == 0


def test_one_caller_is_first_come_first_served():
    queue: FairQueue[WorkItem] = FairQueue()
    queue.extend([item("", f"i{i}") for i in range(5)])
    assert names(queue.take(3)) == ["i0", "i1", "i2"]
    queue.extend([item("", "i5")])
    assert names(queue.take(8)) == ["i3", "i4", "i5"]


def test_priority_orders_a_callers_own_images_never_ahead_of_another_caller():
    queue: FairQueue[WorkItem] = FairQueue()
    queue.extend([item("a", "a-none"), item("a", "a-2", 2), item("a", "a-1", 1), item("a", "a-1b", 1)])
    queue.extend([item("b", "b-none")])
    assert names(queue.take(5)) == ["a-1", "b-none", "a-1b", "a-2", "a-none"]


def test_withdrawn_items_leave_and_the_queue_answers_about_what_is_left():
    queue: FairQueue[WorkItem] = FairQueue()
    first, second, other = item("a", "a0"), item("a", "a1"), item("b", "b0")
    queue.extend([first, second, other])
    assert first in queue and item("a", "stranger") not in queue
    queue.remove(other)
    assert other not in queue and queue.callers() == 1
    with pytest.raises(ValueError):
        queue.remove(other)
    assert queue.oldest_arrival() == first.enqueued
    assert queue.arrived_since(second.enqueued) == 1 + (first.enqueued >= second.enqueued)
    assert names(queue.take(5)) == ["a0", "a1"]


@pytest.mark.parametrize(("peer", "host"), [("ipv4:10.0.0.5:43122", "10.0.0.5"), ("ipv6:[::1]:50051", "::1"),
                                            ("unix:/tmp/socket", "unix:/tmp/socket")])
def test_a_peer_is_its_address_without_the_port(peer, host):
    assert peer_host(peer) == host


def test_the_modes_and_what_tells_callers_apart():
    class Context:
        def __init__(self, token: str, peer: str) -> None:
            self.token, self._peer = token, peer

        def invocation_metadata(self):
            return [("authorization", f"Bearer {self.token}")]

        def peer(self) -> str:
            return self._peer

    alice, bob = Context("alice", "ipv4:10.0.0.1:1000"), Context("bob", "ipv4:10.0.0.1:2000")
    by_token, by_peer, off = caller_keys("token"), caller_keys("peer"), caller_keys("off")
    assert by_token(alice) != by_token(bob) and by_token(alice) == by_token(Context("alice", "ipv4:10.9.9.9:1"))
    assert "alice" not in by_token(alice)  # a digest, not the token
    assert by_peer(alice) == by_peer(bob) == "10.0.0.1"
    assert off(alice) == off(bob) == ""
    assert resolved_mode("auto", tokens_on=True) == "token" and resolved_mode("auto", tokens_on=False) == "peer"
    assert parse_config([], env={}).fair_share == "auto"
    with pytest.raises(ConfigError, match="--fair-share token .* needs --auth-token-file"):
        parse_config(["--fair-share", "token"], env={})


@pytest.mark.parametrize("fair_share", ["token", "off"])
def test_a_polite_callers_request_is_not_queued_behind_a_greedy_callers(make_server, faults, tmp_path, fair_share):
    """Real engine processes, batches of one: while the engine holds a batch, a greedy caller queues six
    requests and a polite one its one; once released, by token the polite one is answered second, where first
    come, first served (off) answers it last."""
    tokens = tmp_path / "tokens"
    tokens.write_text("greedy-token\npolite-token\n")
    running = make_server(auth_token_file=str(tokens), fair_share=fair_share, max_batch_size=1,
                          runner=faults.runner)
    faults.set("hold")

    async def race() -> list[str]:
        answered: list[str] = []
        async with AsyncClient(running.target, token="greedy-token", timeout=60) as greedy, \
                AsyncClient(running.target, token="polite-token", timeout=60) as polite:
            async def call(client: AsyncClient, name: str) -> None:
                await client.classify([IMAGE])
                answered.append(name)

            calls = [asyncio.ensure_future(call(greedy, f"greedy-{i}")) for i in range(7)]
            await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: queued(running) == 6)
            calls.append(asyncio.ensure_future(call(polite, "polite")))
            await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: queued(running) == 7)
            faults.clear()
            await asyncio.gather(*calls)
        return answered

    answered = asyncio.run(race())
    # One greedy request was held when the others came; by token the polite one goes after one more of them.
    assert answered.index("polite") == (2 if fair_share == "token" else 7), answered


def queued(running) -> float:
    return running.sample("resnet_queue_depth", device="cpu")


def test_tritons_priority_orders_one_callers_requests(make_server, faults):
    """Triton's priority parameter within one caller: queued behind the held batch, the request asking for level 1
    is answered before the same caller's earlier ones that asked for none."""
    import numpy as np
    import tritonclient.grpc.aio as tc_aio

    running = make_server(fair_share="peer", max_batch_size=1, runner=faults.runner)
    faults.set("hold")
    pixels = np.zeros((1, 16, 16, 3), np.uint8)

    async def race() -> list[str]:
        answered: list[str] = []
        client = tc_aio.InferenceServerClient(running.target)
        tensor = tc_aio.InferInput("input", list(pixels.shape), "UINT8")
        tensor.set_data_from_numpy(pixels)

        async def call(name: str, priority: int) -> None:
            await client.infer("resnet18_uint8", [tensor], priority=priority)
            answered.append(name)

        calls = [asyncio.ensure_future(call(f"plain-{i}", 0)) for i in range(4)]
        await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: queued(running) == 3)
        calls.append(asyncio.ensure_future(call("urgent", 1)))
        await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: queued(running) == 4)
        faults.clear()
        await asyncio.gather(*calls)
        await client.close()
        return answered

    answered = asyncio.run(race())
    assert answered.index("urgent") == 1, answered


def test_the_own_apis_priority_field_orders_one_callers_requests(make_server, faults):
    running = make_server(fair_share="peer", max_batch_size=1, runner=faults.runner)
    faults.set("hold")

    async def race() -> list[str]:
        answered: list[str] = []
        async with AsyncClient(running.target, timeout=60) as client:
            async def call(name: str, priority: int) -> None:
                await client.classify([IMAGE], priority=priority)
                answered.append(name)

            calls = [asyncio.ensure_future(call(f"plain-{i}", 0)) for i in range(4)]
            await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: queued(running) == 3)
            calls += [asyncio.ensure_future(call("second", 2)), asyncio.ensure_future(call("first", 1))]
            await asyncio.get_running_loop().run_in_executor(None, wait_for, lambda: queued(running) == 5)
            faults.clear()
            await asyncio.gather(*calls)
        return answered

    answered = asyncio.run(race())
    assert answered[1:3] == ["first", "second"], answered
