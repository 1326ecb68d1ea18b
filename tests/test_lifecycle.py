"""Health transitions; SIGTERM with requests in flight: every one answered, exit 0; exit 1 when no replica
comes back into rotation in time; connections closed at --max-connection-age; and a client reconnecting to a
server back on its port."""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from resnet_client import AsyncClient, ClassifierError, Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc
from resnet_client.channel import ChannelConfig
from resnet_server.common.metrics import Metrics
from resnet_server.common.sections import frontend_config
from resnet_server.engine.replicas import FAILURES_BEFORE_EVICTION
from resnet_server.frontend import server as frontend_server
from tests.helpers import (
    DEVICE_FELL_OFF,
    EngineSet,
    ServerThread,
    base_config,
    encode,
    free_port,
    random_rgb,
    scraped_value,
    serving,
    wait_for,
)
from tests.server_process import Workers, gone, pid_in

IMAGE = encode(random_rgb(21))


def test_health_not_serving_until_loaded_and_while_draining(weights_file):
    engines = EngineSet(base_config(str(weights_file[0])))
    running = engines.frontend(start=False)
    running.run(running.app.bind())
    with Client(running.target, timeout=30) as client:
        assert client.health() == "NOT_SERVING"
        with pytest.raises(ClassifierError) as caught:
            client.classify([IMAGE])
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        running.run(running.app.load())
        assert client.health() == "SERVING"
        assert client.classify([IMAGE])[0].top_k
        running.run(running.app.begin_drain())
        assert client.health() == "NOT_SERVING"
        assert client.health("resnet.v1.Classifier") == "NOT_SERVING"
    engines.stop()


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["auto", "asyncio"])
def test_sigterm_answers_every_accepted_request_then_exits_zero(weights_file, loop):
    metrics_port = free_port()
    env = {**os.environ, "RESNET_SERVER_METRICS_PORT": str(metrics_port), "RESNET_SERVER_HOST": "127.0.0.1"}
    # A long batch delay keeps the requests queued, so SIGTERM surely finds them in flight.
    process = subprocess.Popen(
        [sys.executable, "-m", "resnet_server", "--port", "0", "--device", "cpu", "--weights", str(weights_file[0]),
         "--max-batch-size", "64", "--max-batch-delay-ms", "3000", "--grace-period", "20", "--event-loop", loop],
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        port, serving_line = _port_from_log(process)
        # auto is uvloop here: the server extra installs it, and the front-end says which loop it runs.
        assert f"event loop {'uvloop' if loop == 'auto' else 'asyncio'}" in serving_line
        results: list = []

        def send_all() -> None:
            async def run() -> list:
                async with AsyncClient(f"127.0.0.1:{port}", timeout=60) as client:
                    return await asyncio.gather(*(client.classify([IMAGE]) for _ in range(6)),
                                                return_exceptions=True)
            results.extend(asyncio.run(run()))

        sender = threading.Thread(target=send_all)
        sender.start()
        wait_for(lambda: scraped_value(metrics_port, 'resnet_queue_depth{device="cpu",worker="engine-cpu"}') == 6)
        process.send_signal(signal.SIGTERM)
        sender.join(60)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert len(results) == 6
    assert all(isinstance(result, list) and result[0].top_k for result in results), results


def test_the_server_drains_and_exits_1_when_no_replica_comes_back_in_time(weights_file, faults, monkeypatch):
    config = base_config(str(weights_file[0]), replica_probe_interval=0.05, unhealthy_exit_after=0.3,
                         switch_interval_ms=0.25, runner=faults.runner)
    intervals: list[float] = []
    monkeypatch.setattr(sys, "setswitchinterval", intervals.append)  # serve() sets it, for the whole process
    ports: queue.Queue[int] = queue.Queue()
    codes: list[grpc.StatusCode] = []
    returned = threading.Event()

    def call_until_unavailable() -> None:
        with Client(f"127.0.0.1:{ports.get(timeout=60)}", timeout=30) as client:
            wait_for(lambda: serving(client))
            faults.set(DEVICE_FELL_OFF)  # from now, every batch and probe fails
            while not codes or codes[-1] != grpc.StatusCode.UNAVAILABLE:
                with pytest.raises(ClassifierError) as caught:
                    client.classify([IMAGE])
                codes.append(caught.value.code)
        if not returned.wait(30):  # bounded: a server that does not stop by itself is stopped (and returns 0)
            os.kill(os.getpid(), signal.SIGTERM)

    engines = EngineSet(config)
    caller = threading.Thread(target=call_until_unavailable, daemon=True)
    caller.start()
    try:  # a front-end's serve() on this (the main) thread, signals and all
        code = frontend_server.run(frontend_config(config, 0, 1), 0, engines.links, 999,
                                   Metrics(config.largest_batch), on_bound=lambda bound: ports.put(bound[0]))
    finally:
        engines.stop()
    returned.set()
    caller.join(30)
    assert code == 1
    assert intervals == [0.00025]
    assert codes == [grpc.StatusCode.INTERNAL] * FAILURES_BEFORE_EVICTION + [grpc.StatusCode.UNAVAILABLE]


def test_a_connection_past_max_connection_age_is_closed_once_its_call_is_answered(make_server):
    # A lone image waits a second for a fuller batch: each call is still in flight when the server's
    # GOAWAY comes (at 0.3 s, +-10%), and is answered within the grace period all the same.
    running = make_server(max_connection_age=0.3, max_batch_delay_ms=1000.0)
    states: list[grpc.ChannelConnectivity] = []
    changed = threading.Condition()

    def record(state: grpc.ChannelConnectivity) -> None:
        with changed:
            states.append(state)
            changed.notify_all()

    def closed_since(start: int) -> bool:
        seen = states[start:]
        ready = grpc.ChannelConnectivity.READY
        return ready in seen and grpc.ChannelConnectivity.IDLE in seen[seen.index(ready):]

    request = pb.ClassifyRequest(images=[pb.Image(encoded=IMAGE)], top_k=1)
    with grpc.insecure_channel(running.target) as channel:
        channel.subscribe(record)
        stub = pb_grpc.ClassifierStub(channel)
        for _ in range(2):  # each time a new connection: the call on it answered, then the connection closed
            with changed:
                start = len(states)
            (result,) = stub.Classify(request, timeout=30).results
            assert result.queue_ms >= 900 and result.top_k
            with changed:
                assert changed.wait_for(functools.partial(closed_since, start), timeout=30), states
        channel.unsubscribe(record)


@pytest.mark.slow
def test_a_client_gets_through_again_once_a_stopped_server_is_back_on_its_port(weights_file):
    port = free_port()
    first = EngineSet(base_config(str(weights_file[0]), port=port))
    first.frontend()
    with Client(f"127.0.0.1:{port}", timeout=10, attempts=1) as client:
        assert client.classify([IMAGE])[0].top_k
        first.stop()
        with pytest.raises(ClassifierError) as caught:
            client.classify([IMAGE])
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        second = EngineSet(base_config(str(weights_file[0]), port=port))
        try:
            second.frontend()
            wait_for(lambda: serving(client), timeout=30)  # the same channel: its reconnect backoff (0.1 s to 5 s)
            assert client.classify([IMAGE])[0].top_k
        finally:
            second.stop()
    assert ("grpc.max_reconnect_backoff_ms", 5000) in ChannelConfig().options()


def _port_from_log(process: subprocess.Popen) -> tuple[int, str]:
    """The server logs 'serving resnet18 on HOST:PORT (...)' once it is SERVING: the port, and that line."""
    for line in process.stderr:
        if "serving resnet18 on" in line:
            port = int(line.split("serving resnet18 on ")[1].split()[0].rsplit(":", 1)[1])
            threading.Thread(target=process.stderr.read, daemon=True).start()  # keep draining the pipe
            return port, line
    raise AssertionError("server exited before serving")


def test_unavailable_is_retried_on_the_next_server(make_server, weights_file):
    serving = make_server()
    loading = ServerThread(base_config(str(weights_file[0])), serving.app.engines, owner=999)
    loading.run(loading.app.bind())  # answers UNAVAILABLE: its model is "still loading"
    targets = [serving.target, loading.target]
    try:
        with Client(targets, timeout=30, attempts=1) as no_retries:
            codes = [_code_of(no_retries, IMAGE) for _ in range(20)]
        # Both servers get calls: the client's balancer sends some to the loading one.
        assert "UNAVAILABLE" in codes and "OK" in codes, codes
        served_before = serving.sample("resnet_requests_total", device="cpu", code="OK")
        with Client(targets, timeout=30) as retrying:  # the same balancer, now with retries: every call answered
            assert [_code_of(retrying, IMAGE) for _ in range(20)] == ["OK"] * 20
        assert serving.sample("resnet_requests_total", device="cpu", code="OK") - served_before == 20
    finally:
        loading.stop()


def _code_of(client: Client, image: bytes) -> str:
    try:
        client.classify([image])
        return "OK"
    except ClassifierError as error:
        return error.code.name


# Engine cpu#0 loads for ever (a GPU's compile, say); cpu#1 fails: start-up must end with cpu#1's error
# without waiting for cpu#0. Both go through the real engine process, load_replica and Batcher; only the weights
# loading is swapped, at import: the engines, spawned, import the script again (as __mp_main__).
ONE_REPLICA_FAILS = """
import sys, threading
from resnet_server import cli
from resnet_server.engine import replicas

def load_weights(*args):
    if threading.current_thread().name == "batcher-cpu#0":
        threading.Event().wait()
    raise RuntimeError("disk read error")

replicas.load_weights = load_weights
if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_replica_that_fails_to_start_ends_start_up_without_waiting_for_the_others(weights_file, tmp_path):
    script = tmp_path / "one_replica_fails.py"
    script.write_text(ONE_REPLICA_FAILS)
    done = subprocess.run(
        [sys.executable, str(script), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--device", "cpu,cpu", "--weights", str(weights_file[0])],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert ("resnet-server: error: engine cpu#1: replica cpu#1 failed to start on cpu: RuntimeError: disk read "
            "error") in done.stderr.splitlines()
    assert "serving resnet18" not in done.stderr  # the front-end started beside the engines never served


def _server(weights_file, metrics_port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", "0", "--metrics-host", "127.0.0.1",
         "--metrics-port", str(metrics_port), "--device", "cpu", "--weights", str(weights_file[0]), *flags],
        stderr=subprocess.PIPE, text=True)


def _started(metrics_port: int, worker: str) -> float:
    """When the server's child ``worker`` started (0 while it does not answer)."""
    try:
        return scraped_value(metrics_port, f'process_start_time_seconds{{worker="{worker}"}}')
    except (OSError, AssertionError):
        return 0.0


@pytest.mark.slow
def test_a_device_that_stays_broken_gets_a_new_engine_and_the_server_serves_on(weights_file, faults):
    metrics_port = free_port()
    process = _server(weights_file, metrics_port, "--frontends", "1", "--runner", faults.runner,
                      "--replica-probe-interval", "0.2", "--unhealthy-exit-after", "2")
    try:
        port, _ = _port_from_log(process)
        first_engine = _started(metrics_port, "engine-cpu")
        assert first_engine > 0
        with Client(f"127.0.0.1:{port}", timeout=30, attempts=1) as client:
            faults.set("broken device fell off the bus")  # this engine's batches and probes fail for good
            codes = [_code_of(client, IMAGE) for _ in range(FAILURES_BEFORE_EVICTION)]
            assert codes == ["INTERNAL"] * FAILURES_BEFORE_EVICTION
            # Out of rotation for 2 s, the engine ends and the supervisor starts another; its device works.
            wait_for(lambda: _started(metrics_port, "engine-cpu") not in (0.0, first_engine), timeout=60)
            wait_for(lambda: serving(client), timeout=60)
            assert _code_of(client, IMAGE) == "OK"
        assert process.poll() is None  # the server itself never stopped
    finally:
        process.terminate()
        process.wait(60)


class _Log:
    """A server's log lines as they come (its stderr, read on a thread of their own)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(process.stderr), daemon=True).start()

    def pids(self, child: str) -> list[int]:
        """The pid of every ``child`` (resnet-frontend-1, say) the supervisor has started, in order."""
        marker = f"started {child} (pid "
        return [int(line.split(marker)[1].split(")")[0]) for line in list(self.lines) if marker in line]

    def serving(self, frontend: int, of: int) -> bool:
        return any(f"front-end {frontend} of {of})" in line for line in list(self.lines))


@pytest.mark.slow
def test_a_replacement_front_end_that_ends_before_serving_is_replaced_not_the_server_ended(weights_file):
    process = _server(weights_file, free_port(), "--frontends", "2")
    log = _Log(process)
    try:
        wait_for(lambda: log.serving(1, 2), timeout=120)  # the first front-end 1 has served
        (first,) = log.pids("resnet-frontend-1")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: len(log.pids("resnet-frontend-1")) == 2, timeout=60)
        os.kill(log.pids("resnet-frontend-1")[1], signal.SIGKILL)  # just started: before it serves
        wait_for(lambda: len(log.pids("resnet-frontend-1")) == 3, timeout=60)
        assert process.poll() is None  # not "ended before serving; stopping the others"
        assert not any("before serving; stopping the others" in line for line in log.lines)
    finally:
        process.terminate()
        process.wait(60)


@pytest.mark.slow
def test_a_supervised_front_end_keeps_its_port_while_its_engine_is_replaced(weights_file, faults):
    """The review's N17: every front-end used to give up at the moment its broken engine did, and the port
    refused connections until the new engine was warm. Now the engine alone is replaced; the same front-end answers
    health (NOT_SERVING, then SERVING) throughout."""
    workers = Workers(str(weights_file[0]), "--frontends", "1", "--runner", faults.runner,
                      "--replica-probe-interval", "0.05", "--unhealthy-exit-after", "1")
    try:
        port, (frontend,) = workers.serving(1)
        (engine,) = workers.engine_pids(1)
        statuses: list[str] = []
        with Client(f"127.0.0.1:{port}", timeout=30, attempts=1) as client:
            faults.set(DEVICE_FELL_OFF)
            wait_for(lambda: _refused_unavailable(client))
            workers.engine_pids(2)  # the engine ended after --unhealthy-exit-after; a new one starts
            faults.clear()  # so that the new one (or the next) warms up and serves
            wait_for(lambda: statuses.append(client.health()) or statuses[-1] == "SERVING", timeout=120)
            (result,) = client.classify([IMAGE])
        assert result.top_k and "NOT_SERVING" in statuses
        assert workers.count("started resnet-frontend") == 1 and not gone(frontend)
        replacements = [pid_in(line) for line in workers.lines if "started resnet-engine" in line][1:]
        workers.terminate([frontend, *replacements])
        assert gone(engine)
    finally:
        workers.close()


def _refused_unavailable(client: Client) -> bool:
    try:
        client.classify([IMAGE])
    except ClassifierError as exc:
        return exc.code == grpc.StatusCode.UNAVAILABLE
    return False
