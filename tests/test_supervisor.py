"""The whole server as users run it: a supervisor, an engine process and two front-end processes on one port,
each front-end answering its own connections; the supervisor's signals, exit codes, replacements and merged
/metrics (a real Prometheus scraping it); and a lone front-end refusing a port that is already taken."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc

from resnet_client import ClassifierError, Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.bench import LoadSpec, closed_loop, scrape, server_cpu
from resnet_server.common.config import ServerConfig
from resnet_server.common.errors import StartupError
from resnet_server.common.metrics import Metrics, serve_child_metrics
from resnet_server.common.sections import engine_config, frontend_config
from resnet_server.supervisor.launcher import (
    FORK_SERVER_PRELOAD,
    MOST_RESTART_DELAY,
    frontend_count,
    restart_delay,
)
from resnet_server.supervisor.merged_metrics import serve_merged_metrics
from tests.helpers import (
    ServerThread,
    base_config,
    encode,
    ephemeral_ports,
    free_port,
    listening_ports,
    load_script,
    needs_promtool,
    random_rgb,
    scraped_value,
    serving,
    wait_for,
)
from tests.helpers import scrape as scrape_port
from tests.prom import ALERT_RULES, Prometheus
from tests.server_process import Workers, gone

IMAGE = encode(random_rgb(31))


def served_by(worker: int) -> str:
    """The sample of worker ``worker``'s answered requests on the supervisor's merged /metrics."""
    return f'resnet_requests_total{{code="OK",device="cpu",protocol="grpc",worker="{worker}"}}'


def statistics_while(triton: tc.InferenceServerClient, done: threading.Event) -> list[int]:
    """ModelStatistics' inference_count, asked again and again until ``done``; each answer checked whole."""
    counts = []
    while not done.is_set():
        (model,) = triton.get_inference_statistics("resnet18").model_stats
        stats = model.inference_stats
        assert stats.success.count == stats.queue.count == stats.compute_infer.count
        assert model.execution_count == sum(batch.compute_infer.count for batch in model.batch_stats)
        counts.append(model.inference_count)
    return counts


class TwoWorkers:
    """One server, as ``resnet-server`` runs it, with two front-ends on one port; the tests below take it in turn
    (module order), the last draining it with SIGTERM."""

    def __init__(self, weights: str) -> None:
        self.workers = Workers(weights)
        self.port, self.frontends = self.workers.serving()
        self.workers.read_until(1, f"metrics of every process on http://0.0.0.0:{self.workers.metrics_port}/metrics")
        self.target = f"127.0.0.1:{self.port}"
        self.metrics_port = self.workers.metrics_port

    def served(self) -> list[int]:
        """Each front-end's answered requests, from the supervisor's merged /metrics."""
        return [int(scraped_value(self.metrics_port, served_by(i))) for i in range(2)]


@pytest.fixture(scope="module")
def two_workers(weights_file):
    running = TwoWorkers(str(weights_file[0]))
    yield running
    running.workers.close()


@pytest.mark.slow
def test_the_ports_chosen_are_served_and_each_childs_metrics_listens_on_loopback(two_workers):
    """The server listens on the two ports its user chose; its children's own /metrics on loopback ports that the
    system picked (from its ephemeral range), one each."""
    workers = two_workers.workers
    ports = listening_ports([workers.process.pid, *two_workers.frontends, *workers.engine_pids()])
    # (gRPC's own listener is not always found among the front-ends' fds in /proc: seen once on a clean clone;
    # clients reach it in the next test, and it must not be among the others.)
    chosen = {("127.0.0.1", two_workers.port), ("0.0.0.0", two_workers.metrics_port)}
    assert ("0.0.0.0", two_workers.metrics_port) in ports
    assert len(ports - chosen) == 3 and all(host == "127.0.0.1" and port >= ephemeral_ports()[0]
                                              for host, port in ports - chosen)


@pytest.mark.slow
def test_connections_to_either_worker_answer_alike(two_workers, reference):
    answers = []
    for _ in range(6):  # each client its own connection, so the kernel hands them to either worker
        with Client(two_workers.target, timeout=30, own_connection=True) as client:
            answers.append(client.classify([IMAGE], full=True)[0].probabilities)
    expected = reference.probabilities(reference.input_from_bytes(IMAGE))
    for probabilities in answers:
        np.testing.assert_allclose(probabilities, expected, atol=1e-5)


@pytest.mark.slow
def test_a_closed_loop_reaches_both_workers_and_every_count_of_it_agrees(two_workers):
    """The bench's closed loop over sixteen connections of one process reaches both workers, and the supervisor's
    /metrics, both workers' samples labelled by worker, counts every image it sent (its window records the calls
    that ended inside it: all but the sixteen or fewer still in flight as it closed). ModelStatistics, asked over
    and over meanwhile, answers each time whole (no torn row) with counts that never go back."""
    url, target = f"http://127.0.0.1:{two_workers.metrics_port}/metrics", two_workers.target
    request = pb.ClassifyRequest(images=[pb.Image(encoded=IMAGE)], top_k=1).SerializeToString()
    served_before = sum(two_workers.served())
    before, scraped = scrape(url), time.monotonic()
    with tc.InferenceServerClient(target) as triton, ThreadPoolExecutor(1) as pool:
        loading = threading.Event()
        reading = pool.submit(statistics_while, triton, loading)
        records = closed_loop(LoadSpec(target, request, 16, None, 0.0, 1.0, {"timeout": 30}, connections=16))
        loading.set()
        counts = reading.result()
    after = scrape(url)
    cores = server_cpu(before, after, time.monotonic() - scraped)  # the bench's split of the server's CPU
    assert set(cores) == {"frontends", "engines", "supervisor"}
    assert cores["frontends"] > 0 and cores["engines"] > 0 and sum(cores.values()) <= os.cpu_count() + 0.5
    assert len(counts) >= 5 and counts == sorted(counts)
    served = two_workers.served()
    assert all(count > 0 for count in served), served
    # The engine formed the batches of both front-ends' calls: every batch is in its series alone.
    assert scraped_value(two_workers.metrics_port, 'resnet_batch_size_count{device="cpu",worker="0"}') == 0
    computed = after[("resnet_batch_size_sum", "cpu")] - before[("resnet_batch_size_sum", "cpu")]
    assert computed == sum(served) - served_before
    assert len(records) <= computed <= len(records) + 16


@pytest.mark.slow
def test_every_process_reports_on_the_one_metrics_port_and_triton_statistics_count_both_workers(two_workers):
    """Each process is up on the supervisor's /metrics, with its memory (the soak's reading,
    scripts/benchmarks/soak.py), and Triton's ModelStatistics, asked of whichever worker takes the call, counts
    both workers' images and batches (their totals share memory), as Prometheus does."""
    port = two_workers.metrics_port
    assert [scraped_value(port, f'resnet_worker_up{{worker="{worker}"}}')
            for worker in ("0", "1", "engine-cpu")] == [1, 1, 1]
    memory = load_script("soak").rss(port)
    assert set(memory) == {"0", "1", "engine-cpu", "supervisor"} and all(value > 2**20 for value in memory.values())
    with tc.InferenceServerClient(two_workers.target) as triton:
        (model,) = triton.get_inference_statistics("resnet18", as_json=True)["model_stats"]
    assert int(model["inference_count"]) == sum(two_workers.served())
    batches = scrape(f"http://127.0.0.1:{port}/metrics")[("resnet_batch_size_count", "cpu")]
    assert int(model["execution_count"]) == batches


@needs_promtool
@pytest.mark.slow
def test_a_real_prometheus_counts_both_workers_and_no_alert_fires(two_workers, tmp_path):
    """A real Prometheus scraping the one metrics port sees both workers, counts the same requests, and evaluates
    every alerting rule against their series, none firing."""
    served = two_workers.served()
    with Prometheus(f"127.0.0.1:{two_workers.metrics_port}", tmp_path) as prometheus:
        wait_for(prometheus.started, timeout=30)
        counted = 'sum by (worker) (resnet_requests_total{code="OK"})'
        wait_for(lambda: {int(r["metric"]["worker"]): float(r["value"][1]) for r in prometheus.query(counted)}
                 == dict(enumerate(served)), timeout=30)
        assert [float(r["value"][1]) for r in prometheus.query("sum(resnet_worker_up)")] == [3]
        wait_for(prometheus.evaluated_rules, timeout=30)
        rules = prometheus.evaluated_rules()
        assert set(rules) == ALERT_RULES
        assert all((rule["health"], rule["state"]) == ("ok", "inactive") for rule in rules.values()), rules


@pytest.mark.slow
def test_sigterm_drains_the_server_and_ends_every_child(two_workers):
    """The last of the tests on ``two_workers``: the supervisor exits 0 and every child has ended."""
    workers = two_workers.workers
    workers.terminate([*two_workers.frontends, *workers.engine_pids()])


@pytest.mark.slow
def test_a_front_end_that_dies_after_serving_is_replaced_while_the_other_keeps_serving(weights_file):
    workers = Workers(str(weights_file[0]))
    try:
        port, pids = workers.serving()
        before_kill = 0  # calls on connections of their own until worker 1 has answered some (bounded: 64)
        while not scraped_value(workers.metrics_port, served_by(1)) and before_kill < 64:
            with Client(f"127.0.0.1:{port}", timeout=30, own_connection=True) as client:
                client.classify([IMAGE])
            before_kill += 1
        assert scraped_value(workers.metrics_port, served_by(1)) > 0
        os.kill(pids[1], signal.SIGKILL)
        workers.read_until(1, f"resnet-frontend-1 (pid {pids[1]}) ended with code -9; starting a new one")
        # The replacement loads before it binds, so every new connection meanwhile reaches worker 0: calls on
        # new connections, one try each, all answered until the replacement serves (bounded: 2,000 calls).
        answered = 0
        while workers.count("serving resnet18") < 3 and answered < 2000:
            with Client(f"127.0.0.1:{port}", timeout=30, own_connection=True, attempts=1) as client:
                assert client.classify([IMAGE])[0].top_k
            answered += 1
        same_port, pids_now = workers.serving(3)
        assert answered > 0
        assert same_port == port and pids_now[:2] == pids and pids_now[2] not in pids
        # The replacement serves on the shared port, and its metrics are in the supervisor's again, as worker
        # 1's (sixteen connections miss it with odds of 2^-16).
        for _ in range(16):
            with Client(f"127.0.0.1:{port}", timeout=30, own_connection=True) as client:
                client.classify([IMAGE])
        assert scraped_value(workers.metrics_port, served_by(1)) > 0
        # ModelStatistics still counts the images the killed worker answered: its replacement took over its row.
        with tc.InferenceServerClient(f"127.0.0.1:{port}") as triton:
            (model,) = triton.get_inference_statistics("resnet18", as_json=True)["model_stats"]
        assert int(model["inference_count"]) == before_kill + answered + 16
        # The replacement ends soon after it started too: the next one comes after a pause (a crash loop).
        os.kill(pids_now[2], signal.SIGKILL)
        workers.read_until(1, f"(pid {pids_now[2]}) ended with code -9; starting a new one in 1 s "
                              "(ended 2 times in a row within 60 s of starting)")
        _, pids_now = workers.serving(4)
        assert workers.count("started resnet-engine") == 1  # the engine never noticed
        workers.terminate([*pids_now, *workers.engine_pids()])
    finally:
        workers.close()


@pytest.mark.slow
def test_an_engine_killed_under_load_fails_its_calls_unavailable_is_restarted_and_rejoins(weights_file):
    shared_memory = set(os.listdir("/dev/shm"))
    workers = Workers(str(weights_file[0]), "--max-batch-delay-ms", "200")
    try:
        port, pids = workers.serving()
        (engine,) = workers.engine_pids()
        target = f"127.0.0.1:{port}"
        with Client(target, timeout=30, attempts=1) as client, ThreadPoolExecutor(4) as pool:
            calls = [pool.submit(client.classify, [IMAGE]) for _ in range(4)]
            wait_for(lambda: scraped_value(workers.metrics_port, 'resnet_queue_depth{device="cpu",worker="engine-cpu"}')
                     >= 1)
            os.kill(engine, signal.SIGKILL)
            codes = set()
            for call in calls:
                try:
                    call.result(timeout=30)
                    codes.add(grpc.StatusCode.OK)
                except ClassifierError as exc:
                    codes.add(exc.code)
            assert grpc.StatusCode.UNAVAILABLE in codes and codes <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}
            workers.read_until(1, f"resnet-engine-cpu (pid {engine}) ended with code -9; starting a new one in 0 s")
            _, restarted = workers.engine_pids(2)
            wait_for(lambda: serving(client), timeout=120)
            assert client.classify([IMAGE])[0].top_k
        assert workers.serving()[1] == pids  # the front-ends went on
        # SIGTERM with calls in flight: each is answered, then every process ends and nothing is left in /dev/shm.
        with ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(Client(target, timeout=30, own_connection=True).classify, [IMAGE]) for _ in range(8)]
            wait_for(lambda: scraped_value(workers.metrics_port, 'resnet_requests_in_flight{device="cpu",worker="0"}')
                     + scraped_value(workers.metrics_port, 'resnet_requests_in_flight{device="cpu",worker="1"}') >= 1)
            workers.process.send_signal(signal.SIGTERM)
            assert all(call.result(timeout=60)[0].top_k for call in calls)
        assert workers.process.wait(timeout=60) == 0
        assert all(gone(pid) for pid in [*pids, engine, restarted])
        assert set(os.listdir("/dev/shm")) == shared_memory
    finally:
        workers.close()


@pytest.mark.slow
def test_no_child_outlives_a_supervisor_killed_with_sigkill(weights_file):
    shared_memory = set(os.listdir("/dev/shm"))
    workers = Workers(str(weights_file[0]))
    try:
        _, pids = workers.serving()
        children = [*pids, *workers.engine_pids()]
        workers.process.kill()
        workers.process.wait()
        wait_for(lambda: all(gone(pid) for pid in children), timeout=60)  # each drains (nothing in flight), ends
        assert set(os.listdir("/dev/shm")) == shared_memory  # the slab was a memfd: nothing to clean up
    finally:
        workers.close()


@pytest.mark.slow
def test_what_the_fork_server_imports_touches_no_device_and_starts_no_thread():
    """Children are forked from a process that has imported these: one with CUDA initialised, or with a thread
    (an OpenMP team, say) running, would hand its children a state they cannot use."""
    imports = "; ".join(f"import {name}" for name in FORK_SERVER_PRELOAD)
    done = subprocess.run([sys.executable, "-c", f"{imports}; import threading, torch; "
                           "print(torch.cuda.is_initialized(), threading.active_count())"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "1"]


def test_a_crash_looping_child_is_replaced_after_a_growing_pause():
    assert [restart_delay(ends) for ends in range(6)] == [0, 0, 1, 2, 4, 8]  # 0: it had run for a while
    assert restart_delay(50) == MOST_RESTART_DELAY


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "error"), [
    (["--device", "cuda:99"], "resnet-server: error: "),  # refused by the supervisor: no engine starts
    (["--weights", "garbage.pth"], "resnet-server: error: engine cpu: "),  # refused by the engine, loading
])
def test_an_engine_that_cannot_start_ends_the_server_with_its_error_and_no_front_end_serves(flags, error,
                                                                                            weights_file, tmp_path):
    """A device the supervisor refuses starts no process. An engine that fails to load ends the server; a
    front-end started beside it that has bound (its signal handlers are in place by then) waits for it and takes
    the supervisor's SIGTERM at once: it logs that it stopped before serving, rather than being killed after the
    grace period. A front-end still starting when the SIGTERM comes ends by it. Which of the two the first
    front-end is depends on whether the engine fails before it binds; the second starts only once it has."""
    (tmp_path / "garbage.pth").write_text("not a checkpoint")
    done = subprocess.run(
        [sys.executable, "-m", "resnet_server", "--frontends", "2", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--device", "cpu", "--weights", str(weights_file[0]), "--grace-period", "60", *flags],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert error in done.stderr and flags[1] in done.stderr
    assert "serving resnet18" not in done.stderr
    if flags[0] == "--device":
        assert "started resnet-" not in done.stderr
    elif "started resnet-frontend-1" in done.stderr:  # the first front-end had bound: it stopped on the signal
        assert "SIGTERM received before serving: stopped" in done.stderr
    if flags[0] == "--weights":  # the supervisor's last line says why it stopped
        assert done.stderr.splitlines()[-1].endswith("ended with code 1 before serving")
        assert "ERROR resnet_server.supervisor.main: stopped: resnet-engine-cpu (pid" in done.stderr.splitlines()[-1]


@pytest.mark.slow
def test_compile_without_a_cpp_compiler_ends_the_server_saying_why(weights_file, tmp_path):
    """What the image built with COMPILER=false (no g++) does with --compile on a CPU: the engine's warm-up finds
    no C++ compiler for inductor's kernels, and the server ends (exit 1) naming the flag, the cause and the way
    out, before any front-end serves."""
    done = subprocess.run(
        [sys.executable, "-m", "resnet_server", "--frontends", "1", "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--device", "cpu", "--weights", str(weights_file[0]), "--max-batch-size", "2",
         "--compile", "true", "--compile-cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "CXX": str(tmp_path / "no-such-g++")})  # where inductor looks for its compiler
    assert done.returncode == 1, done.stderr
    assert "resnet-server: error: engine cpu: --compile failed on cpu: " in done.stderr
    assert "InvalidCxxCompiler" in done.stderr
    assert "(inductor needs a C++ compiler for CPU devices; or run without --compile)" in done.stderr
    assert "serving resnet18" not in done.stderr


def test_each_process_gets_its_section_of_the_configuration():
    """A front-end: the shared port and how many share it, and no /metrics port (the supervisor's alone) or
    engine setting; an engine: its model and batching, and nothing of the network."""
    config = ServerConfig(frontends=0, metrics_port=9000, port=0, max_batch_size=4, cuda_graphs="false",
                          temperature=1.5)
    frontend = frontend_config(config, 6000, 2)
    assert (frontend.network.port, frontend.frontends, frontend.temperature) == (6000, 2, 1.5)
    engine = engine_config(config)
    assert (engine.max_batch_size, engine.uses_cuda_graphs, engine.largest_batch) == (4, False, 4)
    for field in ("metrics_port", "metrics_host", "devices"):
        assert not hasattr(frontend, field) and not hasattr(engine, field)
    assert not hasattr(engine, "network") and not hasattr(frontend, "weights") and not hasattr(frontend, "worker")


def test_auto_front_ends_take_half_the_cores_left_after_the_engines():
    auto = ServerConfig()
    assert [frontend_count(auto, devices=1, cores=cores) for cores in (1, 2, 4, 16, 64)] == [1, 1, 1, 7, 8]
    assert frontend_count(auto, devices=8, cores=16) == 4
    assert frontend_count(ServerConfig(frontends=3), devices=1, cores=2) == 3


def test_a_lone_server_refuses_a_port_that_is_already_taken(server, weights_file):
    taken = ServerThread(base_config(str(weights_file[0]), port=server.app.port), server.app.engines, owner=999)
    with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{server.app.port}: the port is in use"):
        taken.run(taken.app.bind())
    taken.stop(grace=0)
    with Client(server.target, timeout=30) as client:  # the server holding it is untouched
        assert client.classify([IMAGE])[0].top_k


@needs_promtool
def test_the_supervisors_metrics_merge_its_workers_labelled_and_mark_one_that_does_not_answer():
    supervisor_port = free_port()
    worker_0 = Metrics(largest_batch=8)
    worker_0.requests.labels("cpu", "OK", "grpc").inc(3)
    worker_0.compute.labels("cpu").observe(0.2)
    worker_0_http = serve_child_metrics(worker_0.registry)
    endpoints = [("0", worker_0_http.server_port), ("1", 0)]  # worker 1 has no endpoint (yet)
    supervisor_http = serve_merged_metrics("127.0.0.1", supervisor_port, lambda: endpoints)
    try:
        text = scrape_port(supervisor_port)
        assert scraped_value(supervisor_port, 'resnet_worker_up{worker="0"}') == 1
        assert scraped_value(supervisor_port, 'resnet_worker_up{worker="1"}') == 0
        assert scraped_value(supervisor_port, served_by(0)) == 3
        bucket = 'resnet_batch_compute_seconds_bucket{device="cpu",le="0.25",worker="0"}'
        assert scraped_value(supervisor_port, bucket) == 1
        assert scraped_value(supervisor_port, 'process_start_time_seconds{worker="0"}') > 0
        # The supervisor's own process, in the same families as its workers'.
        assert scraped_value(supervisor_port, 'process_resident_memory_bytes{worker="supervisor"}') > 0
        assert scraped_value(supervisor_port, 'process_start_time_seconds{worker="supervisor"}') == \
            scraped_value(supervisor_port, 'process_start_time_seconds{worker="0"}')  # one process here
        assert [line for line in text.splitlines() if 'worker="1"' in line] == ['resnet_worker_up{worker="1"} 0.0']
        # One HELP and TYPE per family, whatever the number of workers: Prometheus's own linter accepts it.
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        for http in (supervisor_http, worker_0_http):
            http.shutdown()
            http.server_close()


class _DyingChild(threading.Thread):
    """A child's /metrics that dies mid-answer: each connection gets the start of an answer, then a close."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(daemon=True)
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]

    def run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self.listener.accept()
                with connection:
                    connection.recv(65536)
                    connection.sendall(self.answer)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.0 200 OK\r\nContent-Length: 1000\r\n\r\nresnet_req",
    b"garbage, no status line\r\n\r\n",
    b"HTTP/1.0 200 OK\r\nContent-Length: 30\r\n\r\nresnet_requests_total{ 1 2 3 4\n",
], ids=["cut short", "no status line", "text that does not parse"])
def test_a_child_dying_mid_scrape_costs_only_its_own_series(answer):
    worker_0 = Metrics(largest_batch=8)
    worker_0.requests.labels("cpu", "OK", "grpc").inc(3)
    worker_0_http = serve_child_metrics(worker_0.registry)
    dying = _DyingChild(answer)
    dying.start()
    supervisor_port = free_port()
    supervisor_http = serve_merged_metrics("127.0.0.1", supervisor_port,
                                           lambda: [("0", worker_0_http.server_port), ("1", dying.port)])
    try:
        assert scraped_value(supervisor_port, 'resnet_worker_up{worker="1"}') == 0
        assert scraped_value(supervisor_port, 'resnet_worker_up{worker="0"}') == 1
        assert scraped_value(supervisor_port, served_by(0)) == 3
    finally:
        dying.listener.close()
        for http in (supervisor_http, worker_0_http):
            http.shutdown()
            http.server_close()


@pytest.mark.slow
def test_the_server_refuses_a_metrics_port_already_taken_before_starting_any_process(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "resnet_server", "--frontends", "2", "--host", "127.0.0.1", "--port", "0",
             "--metrics-host", "127.0.0.1", "--metrics-port", str(port), "--device", "cpu", "--weights", "random"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert f"resnet-server: error: cannot serve /metrics on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "started resnet-" not in done.stderr
