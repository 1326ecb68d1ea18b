"""The control plane between the supervisor and its children: typed messages, writes that never block, bounded
messages and outboxes, reload ids never reused, and unloads queued behind reloads."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc
from resnet_server.boundary import control
from resnet_server.boundary.control import (
    MOST_MESSAGE_BYTES,
    Abort,
    Commit,
    Committed,
    Outbox,
    PeerStopped,
    Prepare,
    Prepared,
    ReloadFailed,
    SetTrace,
    TooLarge,
    report_inbox,
)
from resnet_server.common.served import ServedWeights
from resnet_server.supervisor.reloads import MOST_QUEUED, Outcome, Reloads
from tests.server_process import Workers


@pytest.fixture()
def pipe():
    reader, writer = os.pipe()
    yield reader, writer
    for end in (reader, writer):
        os.close(end)


def test_every_message_kind_has_a_struct_and_round_trips():
    tags = {cls.__struct_config__.tag for cls in control._Message.__subclasses__()}
    assert tags == {int(kind) for kind in control.Control}


def test_a_peer_that_does_not_read_never_blocks_the_writer_and_is_cut_off(pipe):
    _, writer = pipe
    outbox = Outbox(writer)
    started = time.monotonic()
    with pytest.raises(PeerStopped):
        for call in range(1000):  # 60 MB; the pipe holds 64 KiB
            outbox.send(SetTrace(call, {"trace_level": ["x" * 60_000]}))
    assert time.monotonic() - started < 2
    assert call < 100  # cut off once 4 MiB waited


def test_what_waits_is_written_in_order_once_the_peer_reads(pipe):
    reader, writer = pipe
    outbox, inbox = Outbox(writer), report_inbox(reader)
    sent = [SetTrace(call, {"trace_level": ["y" * 30_000]}) for call in range(10)]
    for message in sent:
        outbox.send(message)
    assert outbox.waiting
    received = []
    while len(received) < len(sent):
        outbox.flush()
        received += inbox.read()
    assert received == sent and not outbox.waiting


def test_a_message_over_the_bound_is_not_sent_and_one_said_to_be_larger_is_refused(pipe):
    reader, writer = pipe
    with pytest.raises(TooLarge):
        Outbox(writer).send(SetTrace(1, {"trace_level": ["z" * MOST_MESSAGE_BYTES]}))
    os.write(writer, (10 << 20).to_bytes(4, "big") + b"\0" * 100)  # a length of 10 MiB, as a broken child might
    with pytest.raises(PeerStopped):
        report_inbox(reader).read()


class _Engines:
    """Two engines, as the supervisor's reloads see them: the orders each was sent."""

    def __init__(self) -> None:
        self.orders: dict[str, list] = {"engine-0": [], "engine-1": []}
        self.restarted: list[str] = []
        self.announced: list[ServedWeights] = []

    def reloads(self) -> Reloads:
        return Reloads(ServedWeights("w.pt", 1, "a" * 64), "w.pt", "/nonexistent", lambda: list(self.orders),
                       lambda engine, order: self.orders[engine].append(order), self.restarted.append,
                       self.announced.append)


def test_a_failed_reloads_late_answer_is_not_taken_for_the_next_reloads():
    engines, outcomes = _Engines(), []
    reloads = engines.reloads()
    reloads.load("bad.pt", lambda outcome: outcomes.append(("bad", outcome)))
    reloads.load("good.pt", lambda outcome: outcomes.append(("good", outcome)))
    (first,) = engines.orders["engine-0"]
    assert isinstance(first, Prepare) and first.source == "bad.pt"
    reloads.on_report("engine-0", ReloadFailed(first.reload, "prepare", "INVALID_ARGUMENT", "not a ResNet18"))
    assert outcomes == [("bad", Outcome("INVALID_ARGUMENT", "not a ResNet18"))]
    second = engines.orders["engine-0"][-1]
    assert isinstance(second, Prepare) and second.source == "good.pt" and second.reload != first.reload
    # engine-1 answers the failed reload late, both ways: neither touches the next one.
    reloads.on_report("engine-1", ReloadFailed(first.reload, "prepare", "INVALID_ARGUMENT", "late"))
    reloads.on_report("engine-1", Prepared(first.reload, "b" * 64))
    assert len(outcomes) == 1
    for engine in engines.orders:
        reloads.on_report(engine, Prepared(second.reload, "c" * 64))
    assert all(orders[-1] == Commit(second.reload, 2) for orders in engines.orders.values())
    for engine in engines.orders:
        reloads.on_report(engine, Committed(second.reload))
    assert outcomes[1] == ("good", Outcome("OK", "version 2"))
    assert engines.announced[-1] == ServedWeights("good.pt", 2, "c" * 64)
    assert Abort(first.reload) in engines.orders["engine-1"]


def test_an_unload_waits_for_the_reload_preparing_and_is_not_undone_by_it():
    engines, outcomes = _Engines(), []
    reloads = engines.reloads()
    reloads.load("new.pt", outcomes.append)
    reloads.unload(outcomes.append)
    assert outcomes == []  # the unload waits its turn
    (prepare,) = engines.orders["engine-0"]
    for engine in engines.orders:
        reloads.on_report(engine, Prepared(prepare.reload, "d" * 64))
    for engine in engines.orders:
        reloads.on_report(engine, Committed(prepare.reload))
    assert outcomes == [Outcome("OK", "version 2"), Outcome("OK", "unloaded")]
    assert reloads.served == ServedWeights("new.pt", 2, "d" * 64, loaded=False)


def test_past_the_queue_bound_a_load_is_refused_at_once():
    engines, outcomes = _Engines(), []
    reloads = engines.reloads()
    for _ in range(MOST_QUEUED + 2):  # one runs, MOST_QUEUED wait
        reloads.load("w.pt", outcomes.append)
    assert outcomes == [Outcome("RESOURCE_EXHAUSTED", f"{MOST_QUEUED} loads and unloads wait already; retry later")]


@pytest.mark.slow
def test_concurrent_trace_settings_on_two_frontends_neither_stall_nor_deadlock_the_supervisor(weights_file):
    """The review's N1: concurrent TraceSettings of 200 KB on two front-ends deadlocked the supervisor and a
    front-end for good. Now the large ones are refused unread, and hundreds of valid ones at once pass through the
    pipes without either side blocking; health answers throughout and SIGTERM stops the server cleanly."""
    workers = Workers(str(weights_file[0]), "--otlp-endpoint", "127.0.0.1:9")
    try:
        port, pids = workers.serving()
        target = f"127.0.0.1:{port}"
        huge = oip.TraceSettingRequest()
        huge.settings["trace_level"].value.extend(["OFF"] * 40_000)
        plain = oip.TraceSettingRequest()
        plain.settings["trace_level"].value.append("TIMESTAMPS")
        codes: list[grpc.StatusCode] = []

        def call(request: oip.TraceSettingRequest) -> None:
            with grpc.insecure_channel(target) as channel:  # a channel each: the kernel spreads them
                try:
                    oip_grpc.GRPCInferenceServiceStub(channel).TraceSetting(request, timeout=30)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())

        for request, count in ((huge, 12), (plain, 200)):
            threads = [threading.Thread(target=call, args=(request,)) for _ in range(count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) == 12 and codes.count(grpc.StatusCode.OK) == 200
        with grpc.insecure_channel(target) as channel:
            started = time.monotonic()
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            assert time.monotonic() - started < 1
        workers.terminate(pids)
    finally:
        workers.close()
