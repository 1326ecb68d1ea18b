"""Fair share of a device between callers: the engine's queue (resnet_server.engine.fair_queue) taken round robin
over callers, in order within each, by priority first; and through real engine processes, a polite caller's one
request answered before a greedy caller's backlog, as long as callers are told apart (by token, by peer)."""

from __future__ import annotations

import asyncio

import pytest

from resnet_client import AsyncClient, ClassifierError
from resnet_server.common.config import ConfigError, parse_config
from resnet_server.common.flag_files import TokenEntry, read_token_entries
from resnet_server.common.work import WorkItem
from resnet_server.engine.fair_queue import FairQueue
from resnet_server.frontend.fair_share import EVERYONE, CallerId, callers_by, peer_host, resolved_mode
from tests.helpers import encode, random_rgb, wait_for

IMAGE = encode(random_rgb(31, 64, 48))


class Waiting:
    """A caller that stays (never cancelled)."""

    def done(self) -> bool:
        return False


def item(client: str, name: str, priority: int = 0, weight: int = 1) -> WorkItem:
    return WorkItem(None, 1.0, 5, None, Waiting(), name, client=client, weight=weight, priority=priority)


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


def test_weights_give_turns_of_as_many_images_and_a_cut_turn_goes_on_in_the_next_batch():
    queue: FairQueue[WorkItem] = FairQueue()
    queue.extend([item("heavy", f"h{i}", weight=3) for i in range(8)])
    queue.extend([item("light", f"l{i}") for i in range(3)])
    assert names(queue.take(5)) == ["h0", "h1", "h2", "l0", "h3"]
    assert names(queue.take(4)) == ["h4", "h5", "l1", "h6"]  # heavy's turn, cut after h3, took two more
    queue.remove(queue_item := next(queued for queued in queue if queued.request_id == "h7"))
    assert queue_item not in queue and names(queue.take(4)) == ["l2"]


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


def test_a_token_file_names_and_weighs_its_tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# team tokens\nalpha-secret name=team-a weight=3\n\nbeta-secret\n  gamma-secret weight=2  \n")
    assert read_token_entries(path) == [TokenEntry(b"alpha-secret", "team-a", 3), TokenEntry(b"beta-secret", "token-2"),
                                        TokenEntry(b"gamma-secret", "token-3", 2)]


@pytest.mark.parametrize(("text", "problem"), [
    ("sekrit weight=0\n", "line 1: a token's weight is a whole number from 1 to 1000"),
    ("sekrit weight=1001\n", "weight is a whole number"),
    ("sekrit\nsekrit2 colour=red\n", "line 2: expected name=NAME or weight=N after the token, got 'colour=red'"),
    ("sekrit name=a/b\n", "a token's name is 1-64 letters"),
    ("sekrit name=x\nother name=x\n", "the name x is given to two tokens"),
    ("# none\n", "holds no token"),
])
def test_a_bad_token_file_line_is_named_and_its_token_is_not(tmp_path, capsys, text, problem):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as caught:
        read_token_entries(path)
    assert "sekrit" not in str(caught.value)
    with pytest.raises(SystemExit) as usage:  # the flag's check: a usage error before anything starts
        parse_config(["--auth-token-file", str(path)], env={})
    assert usage.value.code == 2 and problem.split(": ")[-1] in capsys.readouterr().err


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
    tokens = [TokenEntry(b"alice", "team-a", 3), TokenEntry(b"bob", "token-2")]
    by_token, by_peer, off = callers_by("token", tokens), callers_by("peer", tokens), callers_by("off", tokens)
    assert by_token(alice) == CallerId("team-a", "team-a", 3) and by_token(bob) == CallerId("token-2", "token-2", 1)
    assert by_token(Context("alice", "ipv4:10.9.9.9:1")) == by_token(alice)
    assert by_token(Context("mallory", "ipv4:10.0.0.1:1")).label == "unknown"
    assert by_peer(alice) == by_peer(bob) == CallerId("10.0.0.1", "peer")  # an address is never a label
    assert off(alice) == off(bob) == EVERYONE
    assert resolved_mode("auto", tokens_on=True) == "token" and resolved_mode("auto", tokens_on=False) == "peer"
    assert parse_config([], env={}).fair_share == "auto"
    with pytest.raises(ConfigError, match="--fair-share token .* needs --auth-token-file"):
        parse_config(["--fair-share", "token"], env={})


@pytest.mark.parametrize("fair_share", ["token", "off"])
def test_a_polite_callers_request_is_not_queued_behind_a_greedy_callers(make_server, faults, tmp_path, fair_share):
    """Real engine processes, batches of one: while the engine holds a batch, a greedy caller queues six
    requests and a polite one its one; once released, by token the polite one is answered second, where first
    come, first served (off) answers it last."""
    running = held_server(make_server, faults, tmp_path, "greedy-token\npolite-token\n", fair_share=fair_share)

    async def race() -> list[str]:
        answered: list[str] = []
        async with AsyncClient(running.target, token="greedy-token", timeout=60) as greedy, \
                AsyncClient(running.target, token="polite-token", timeout=60) as polite:
            call = recording(answered)
            calls = [asyncio.ensure_future(call(greedy, f"greedy-{i}")) for i in range(7)]
            await until(lambda: queued(running) == 6)
            calls.append(asyncio.ensure_future(call(polite, "polite")))
            await until(lambda: queued(running) == 7)
            faults.clear()
            await asyncio.gather(*calls)
        return answered

    answered = asyncio.run(race())
    # One greedy request was held when the others came; by token the polite one goes after one more of them.
    assert answered.index("polite") == (2 if fair_share == "token" else 7), answered


@pytest.mark.parametrize("fair_share", ["token", "off"])
def test_a_batch_waits_a_moment_for_the_turn_of_a_caller_just_answered(make_server, faults, tmp_path, fair_share):
    """Batches of two, each forward pass two seconds long: the polite caller's first call computes alone while the
    greedy one queues four. The polite caller sends again as soon as it is answered; by token the next batch waits
    for it (a twentieth of the last forward pass at most) and takes it beside one greedy call, where off takes the
    greedy calls two by two and the polite call comes last, alone. Answers are compared by batch (the first alone,
    then pairs two seconds apart): within a batch, and among the greedy calls, the order is the network's."""
    (tmp_path / "tokens").write_text("greedy-token\npolite-token\n")
    running = make_server(auth_token_file=str(tmp_path / "tokens"), fair_share=fair_share, max_batch_size=2,
                          runner=faults.runner)
    faults.set("slow 2")

    async def race() -> list[str]:
        answered: list[str] = []
        async with AsyncClient(running.target, token="greedy-token", timeout=60) as greedy, \
                AsyncClient(running.target, token="polite-token", timeout=60) as polite:
            call = recording(answered)

            async def polite_twice() -> None:
                await call(polite, "polite-0")
                await call(polite, "polite-1")

            calls = [asyncio.ensure_future(polite_twice())]
            await until(lambda: running.sample("resnet_batches_in_flight", device="cpu") == 1)
            calls += [asyncio.ensure_future(call(greedy, f"greedy-{i}")) for i in range(4)]
            await until(lambda: queued(running) == 4)
            await asyncio.gather(*calls)
        return answered

    answered = asyncio.run(race())
    waited = running.sample("resnet_caller_waits_total", device="cpu", outcome="came_back")
    batch_of_polite_1 = (answered.index("polite-1") + 1) // 2 + 1
    expected = (2, 1) if fair_share == "token" else (4, 0)
    assert (batch_of_polite_1, waited) == expected, answered


def held_server(make_server, faults, tmp_path, tokens: str, **flags):
    """A server with these bearer tokens and batches of one, its batch held (by ``faults``) until cleared."""
    path = tmp_path / "tokens"
    path.write_text(tokens)
    running = make_server(auth_token_file=str(path), max_batch_size=1, runner=faults.runner, **flags)
    faults.set("hold")
    return running


def recording(answered: list[str]):
    """A call of one image that adds its name to ``answered`` once answered."""
    async def call(client: AsyncClient, name: str) -> None:
        await client.classify([IMAGE])
        answered.append(name)
    return call


async def until(predicate) -> None:
    """wait_for, off the event loop the test's clients run on."""
    await asyncio.get_running_loop().run_in_executor(None, wait_for, predicate)


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
        await until(lambda: queued(running) == 3)
        calls.append(asyncio.ensure_future(call("urgent", 1)))
        await until(lambda: queued(running) == 4)
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
            await until(lambda: queued(running) == 3)
            calls += [asyncio.ensure_future(call("second", 2)), asyncio.ensure_future(call("first", 1))]
            await until(lambda: queued(running) == 5)
            faults.clear()
            await asyncio.gather(*calls)
        return answered

    answered = asyncio.run(race())
    assert answered[1:3] == ["first", "second"], answered


def test_token_weights_give_turns_of_as_many_images_and_metrics_count_by_token_name(make_server, faults, tmp_path):
    """Real engine processes, batches of one: behind a held batch (the heavy token's first request), a token of
    weight 3 queues seven requests and one of weight 1 four; released, each turn of the heavy token answers three
    before the light one's one."""
    running = held_server(make_server, faults, tmp_path, "heavy-token name=heavy weight=3\nlight-token name=light\n")

    async def race() -> list[str]:
        answered: list[str] = []
        async with AsyncClient(running.target, token="heavy-token", timeout=60) as heavy, \
                AsyncClient(running.target, token="light-token", timeout=60) as light:
            call = recording(answered)
            calls = [asyncio.ensure_future(call(heavy, "h0"))]  # held alone: the next turn starts afresh
            await until(lambda: running.sample("resnet_batches_in_flight", device="cpu") == 1)
            calls += [asyncio.ensure_future(call(heavy, f"h{i}")) for i in range(1, 8)]
            await until(lambda: queued(running) == 7)
            calls += [asyncio.ensure_future(call(light, f"l{i}")) for i in range(4)]
            await until(lambda: queued(running) == 11)
            assert running.sample("resnet_caller_images_in_flight", caller="heavy") == 8
            faults.clear()
            await asyncio.gather(*calls)
        return answered

    answered = asyncio.run(race())
    assert [index for index, name in enumerate(answered) if name.startswith("l")] == [4, 8, 10, 11], answered
    assert running.sample("resnet_caller_images_total", caller="heavy", code="OK") == 8
    assert running.sample("resnet_caller_images_total", caller="light", code="OK") == 4
    assert running.sample("resnet_caller_images_in_flight") == 0


def test_a_caller_holding_its_share_of_a_full_queue_is_refused_and_the_others_are_not(make_server, faults,
                                                                                       tmp_path, caplog):
    """--max-queue 16 (a floor of one slot): a token alone fills 15 of them and its 16th call is refused; the
    other token, holding nothing, takes the slot kept free, and the first token's next call is refused for its
    share of two callers (8); every call accepted is answered, and the refusals are counted and logged."""
    running = held_server(make_server, faults, tmp_path, "greedy-token name=greedy\npolite-token name=polite\n",
                          max_queue=16)

    async def race() -> tuple[list[str], list[str]]:
        refusals: list[str] = []
        async with AsyncClient(running.target, token="greedy-token", timeout=60) as greedy, \
                AsyncClient(running.target, token="polite-token", timeout=60) as polite:
            async def call(client: AsyncClient) -> str:
                try:
                    await client.classify([IMAGE])
                except ClassifierError as exc:
                    refusals.append(f"{exc.code.name}: {exc.message}")
                    return "refused"
                return "answered"

            calls = [asyncio.ensure_future(call(greedy)) for _ in range(15)]
            await until(lambda: queued(running) == 14)
            assert await call(greedy) == "refused"
            polite_call = asyncio.ensure_future(call(polite))
            await until(lambda: queued(running) == 15)
            assert await call(greedy) == "refused"
            faults.clear()
            outcomes = await asyncio.gather(*calls, polite_call)
        return outcomes, refusals

    outcomes, refusals = asyncio.run(race())
    assert outcomes == ["answered"] * 16
    assert refusals[0].startswith("RESOURCE_EXHAUSTED: this caller holds 15 images, all one caller may: the "
                                  "queue's last 1 kept for other callers on cpu (--max-queue 16)"), refusals
    assert "over its share of 8 with 2 callers queued" in refusals[1], refusals
    assert running.sample("resnet_caller_images_total", caller="greedy", code="RESOURCE_EXHAUSTED") == 2
    assert running.sample("resnet_caller_images_total", caller="polite", code="OK") == 1
    assert "refusing calls of caller greedy on cpu" in caplog.text
