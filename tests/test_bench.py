"""The load generator and the in-process ceiling, run briefly against a real server."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from resnet_client import Client
from resnet_client.api import classifier_pb2 as pb
from resnet_client.bench import LoadSpec, make_image, print_table, stream_loop
from resnet_client.cli import main as client_main
from resnet_server.cli import main as server_main
from resnet_server.engine.bench_model import Replicas, add_model_arguments
from tests.helpers import (
    ROOT,
    async_methods_seen,
    free_port,
    load_script,
    serving,
    wait_for,
)


def model_arguments(*argv: str) -> argparse.Namespace:
    """bench-model's model flags as parsed from ``argv``, every other one at its default."""
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser.parse_args(argv)



def test_bench_closed_loop_reports_throughput_latency_and_the_server_view(make_server, capsys, tmp_path):
    running = make_server(metrics_port=free_port())
    plot = tmp_path / "bench.png"
    capsys.readouterr()
    code = client_main(["bench", "--server", running.target, "--sweep", "1,4", "--duration", "2", "--warmup", "0.5",
                        "--input", "uint8", "--image-size", "64x48", "--json", "--plot", str(plot),
                        "--metrics", f"http://127.0.0.1:{running.metrics_port}/metrics"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # no progress bar when stderr is not a terminal, even without --quiet; no note
    points = [json.loads(line) for line in captured.out.splitlines()]
    assert [point["concurrency"] for point in points] == [1, 4]
    for point in points:
        assert point["ok"] > 0 and point["errors"] == {} and point["images_per_s"] > 0
        assert 0 < point["p50_ms"] <= point["p99_ms"] <= point["max_ms"]
        view = point["server"]["cpu"]
        assert view["mean_batch_size"] >= 1
        # A batch's compute in its parts (raw uint8 is converted on the replica: input is not zero).
        parts = [view[f"mean_{part}_ms"] for part in ("input", "infer", "output")]
        assert all(ms > 0 for ms in parts) and sum(parts) == pytest.approx(view["mean_compute_ms"], rel=1e-6)
    assert points[1]["server"]["cpu"]["mean_batch_size"] > 1  # four in flight share forward passes
    assert "caller_waits_came_back" not in points[1]["server"]["cpu"]  # this server does not wait for callers
    assert plot.stat().st_size > 0



def test_bench_reports_the_waits_for_callers(make_server, capsys):
    """Four closed-loop callers and a server that waits for them: every wait that held a batch back saw them
    come back, but perhaps the last (a caller's final call, sent as the run ended, waits out the second)."""
    running = make_server(max_batch_size=4, wait_for_callers_ms=1000.0, metrics_port=free_port())
    code = client_main(["bench", "--server", running.target, "--concurrency", "4", "--duration", "2", "--warmup",
                        "0.5", "--input", "uint8", "--image-size", "64x48", "--json", "--quiet",
                        "--metrics", f"http://127.0.0.1:{running.metrics_port}/metrics"])
    assert code == 0
    point = json.loads(capsys.readouterr().out)
    view = point["server"]["cpu"]
    assert view["caller_waits_came_back"] >= 1 and view["caller_waits_ran_out"] in (0, 1)
    print_table([point])
    waits_line = capsys.readouterr().out.splitlines()[-1]
    assert waits_line.split() == ["cpu:", "waits", "for", "callers:", f"{view['caller_waits_came_back']:.0f}",
                                  "came", "back,", f"{view['caller_waits_ran_out']:.0f}", "ran", "out"]



def test_bench_table_gives_the_server_view_of_every_device(make_server, capsys):
    """Two replicas, both busy at c=4: the readable table's server columns, a line for each device."""
    running = make_server(devices=("cpu", "cpu"), torch_threads=1, metrics_port=free_port())
    code = client_main(["bench", "--server", running.target, "--concurrency", "4", "--duration", "2", "--warmup",
                        "0.5", "--input", "uint8", "--image-size", "64x48",
                        "--metrics", f"http://127.0.0.1:{running.metrics_port}/metrics"])
    assert code == 0
    header, first, second = (line.split() for line in capsys.readouterr().out.splitlines())
    assert header == ["load", "req/s", "img/s", "p50", "ms", "p90", "ms", "p99", "ms", "max", "ms", "cli-cores",
                      "device", "batch", "queue", "ms", "compute", "ms", "input", "ms", "errors"]
    assert first[0] == "c=4" and float(first[2]) > 0 and first[8] == "cpu#0"
    assert 0 < float(first[7]) <= os.cpu_count()  # the client process's CPU over the window, in cores
    assert second[0] == "cpu#1" and len(second) == 5
    for view in (first[9:], second[1:]):
        batch, queue_ms, compute_ms, input_ms = map(float, view)
        assert 1 <= batch <= 4 and queue_ms >= 0 and 0 < input_ms < compute_ms



def test_bench_open_loop_counts_errors_by_code(make_server, capsys):
    """Calls refused under load are counted by their code, and the ones answered are still measured: a queue of
    one and batches of one cannot take 200 requests a second. A metrics URL that does not answer: a note says
    the server view is missing, and the run goes on. Three seconds, not one: in CI, with the image building
    beside the tests, the queue's one image once took the whole of a one-second window to be answered. Eight
    connections: on a loaded machine one connection's calls outnumbered the 128 streams the server allows a
    connection (--max-concurrent-streams), and those past it were refused as streams (UNAVAILABLE)."""
    running = make_server(max_queue=1, max_batch_size=1)
    silent = f"http://127.0.0.1:{free_port()}/metrics"
    code = client_main(["bench", "--server", running.target, "--rate", "200", "--duration", "3", "--warmup", "0",
                        "--connections", "8", "--input", "uint8", "--image-size", "64x48", "--json", "--quiet",
                        "--metrics", silent])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.err == (f"resnet-client bench: note: no server view (batch size, queue, compute) from {silent}: "
                            "no answer with this server's metrics; pass --metrics URL, or --metrics '' for none\n")
    point = json.loads(captured.out)
    assert point["server"] == {}
    assert set(point["errors"]) == {"RESOURCE_EXHAUSTED"}
    assert point["ok"] > 0 and point["errors"]["RESOURCE_EXHAUSTED"] > 0
    assert point["ok"] + point["errors"]["RESOURCE_EXHAUSTED"] == point["requests"]



def test_bench_stream_sends_every_request_as_a_message_on_a_stream_per_caller(make_server, capsys):
    running = make_server(metrics_port=free_port())
    code = client_main(["bench", "--server", running.target, "--stream", "--concurrency", "3", "--duration", "1.5",
                        "--warmup", "0.5", "--input", "uint8", "--image-size", "64x48", "--json", "--quiet",
                        "--metrics", f"http://127.0.0.1:{running.metrics_port}/metrics"])
    assert code == 0
    point = json.loads(capsys.readouterr().out)
    assert point["stream"] is True and point["concurrency"] == 3
    assert point["ok"] > 0 and point["errors"] == {} and 0 < point["p50_ms"] <= point["p99_ms"]
    assert 1 <= point["server"]["cpu"]["mean_batch_size"] <= 3



@pytest.mark.parametrize("overloaded", [False, True])
def test_bench_stream_keeps_a_stream_open_per_caller_and_reopens_one_a_failure_ended(make_server, overloaded):
    """Three callers: three ClassifyStream calls carry every request while none fails. A queue of one image
    refuses some (RESOURCE_EXHAUSTED ends that stream): each failure counted by its code, and a new stream
    opened for the caller's next request."""
    running = make_server(**({"max_queue": 1, "max_batch_size": 1} if overloaded else {}))
    opened, interceptors = async_methods_seen()  # the method of every stream the bench opens
    request = pb.ClassifyRequest(images=[make_image("uint8", 64, 48)], top_k=1).SerializeToString()
    # Without failures a window long enough that each stream answers more than one request even beside a
    # container build (a CI machine so loaded answered only each stream's first in 1.5 s).
    spec = LoadSpec(running.target, request, 3, None, 0.0, 1.5 if overloaded else 5.0,
                    {"interceptors": interceptors}, stream=True)
    records = asyncio.run(stream_loop(spec))
    codes = Counter(code for _, code in records)
    assert set(opened) == {"/resnet.v1.Classifier/ClassifyStream"}
    if overloaded:  # both codes, not how many of each: that depends on the machine's speed
        assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}
        assert len(opened) >= 3 + codes["RESOURCE_EXHAUSTED"]  # those in the window, and any ended as it closed
    else:  # more answers than streams: a stream carries one request after another
        assert set(codes) == {"OK"} and codes["OK"] > 3 and len(opened) == 3



def test_bench_refuses_a_stream_at_a_rate(capsys):
    assert client_main(["bench", "--server", "127.0.0.1:1", "--stream", "--rate", "10"]) == 2
    assert "--stream is a closed loop: give --concurrency or --sweep, not --rate" in capsys.readouterr().err



def test_bench_sends_the_connection_flags(make_server, capsys, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("bench-token\n")
    running = make_server(auth_token_file=str(tokens))
    code = client_main(["bench", "--server", running.target, "--token", "bench-token", "--concurrency", "2",
                        "--duration", "1", "--warmup", "0", "--input", "uint8", "--image-size", "64x48",
                        "--json", "--quiet"])
    assert code == 0
    point = json.loads(capsys.readouterr().out)
    assert point["ok"] > 0 and point["errors"] == {}



@pytest.mark.parametrize(("server", "flags", "failure"), [
    ("closed port", [], "UNAVAILABLE: "),
    ("token", ["--token", "wrong-token"], "UNAUTHENTICATED: "),
    ("max_pixels=100", [], "INVALID_ARGUMENT: image has 64x48 = 3072 pixels, over the limit of 100"),
])
def test_bench_stops_at_a_first_call_every_call_would_repeat(server, flags, failure, make_server, capsys, tmp_path):
    """An unreachable server, a refused token or a request the server refuses: one call says so, exit 1, before
    any load (the table is not printed)."""
    if server == "closed port":
        target = f"127.0.0.1:{free_port()}"
    else:
        tokens = tmp_path / "tokens"
        tokens.write_text("bench-token\n")
        target = (make_server(auth_token_file=str(tokens)) if server == "token" else make_server(max_pixels=100)).target
    code = client_main(["bench", "--server", target, *flags, "--concurrency", "4", "--duration", "10",
                        "--input", "uint8", "--image-size", "64x48", "--json", "--quiet"])
    assert code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"resnet-client bench: error: the first call, before any load, failed: {failure}")



@pytest.mark.slow
def test_bench_model_reports_the_ceiling(weights_file, capsys):
    assert server_main(["bench-model", "--weights", str(weights_file[0]), "--batch-sizes", "1,2",
                        "--duration", "0.5", "--input", "jpeg", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["forward_images_per_s"]) == {"1", "2"}  # JSON object keys
    assert result["preprocess_images_per_s"] > 0 and result["ceiling_with_preprocess_images_per_s"] > 0
    assert 0 < result["batch1_latency_p50_ms"] <= 3 * result["batch1_latency_ms"]  # a median call, near the mean
    for calls in result["forward_call_ms"].values():
        assert 0 < calls["p50"] <= calls["p99"]
    assert result["forward_call_ms"]["1"]["p50"] == result["batch1_latency_p50_ms"]
    assert (result["compiled"], result["compile_mode"], result["fold_batch_norms"]) == (False, None, True)
    assert result["torchscript"] is False and result["cuda_graphs"] is False



@pytest.mark.parametrize(("flags", "message"), [
    *((["--" + flag, "0"], f"argument --{flag}: must be > 0, got 0")
      for flag in ("connections", "processes", "concurrency", "images-per-request")),
    (["--sweep", "0,4"], "argument --sweep: must be a finite number > 0, got 0"),
    (["--rate", "0"], "argument --rate: must be a finite number > 0, got 0"),
    (["--rate", "inf"], "argument --rate: must be a finite number > 0, got inf"),
    (["--duration", "0"], "argument --duration: must be a finite number > 0, got 0"),
    (["--warmup", "-1"], "argument --warmup: must be a finite number >= 0, got -1"),
    (["--image-size", "224"], "argument --image-size: must be WxH in pixels, e.g. 224x224, got '224'"),
    (["--image-size", "0x48"], "argument --image-size: must be WxH in pixels, e.g. 224x224, got '0x48'"),
    (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    (["--processes", "two"], "argument --processes: must be a whole number, got 'two'"),
])
def test_bench_refuses_loads_and_sizes_it_cannot_run(flags, message, capsys):
    """Counts below one, and what used to end in a traceback, run forever or measure something else (0 or inf
    requests/s, a zero-length window); argparse's exit code 2 and the reason, before any call."""
    with pytest.raises(SystemExit) as caught:
        client_main(["bench", "--server", "127.0.0.1:1", *flags])
    assert caught.value.code == 2
    assert f"resnet-client bench: error: {message}" in capsys.readouterr().err



def test_bench_refuses_a_fractional_concurrency(capsys):
    assert client_main(["bench", "--server", "127.0.0.1:1", "--sweep", "1.5,4"]) == 2
    assert "resnet-client bench: error: argument --sweep: concurrencies are whole numbers, got 1.5, 4" in (
        capsys.readouterr().err)



@pytest.mark.parametrize(("flags", "message"), [
    (["--batch-sizes", "1,0"], "argument --batch-sizes: must be between 1 and 1024, got 0"),
    (["--batch-sizes", "100000"], "argument --batch-sizes: must be between 1 and 1024, got 100000"),
    (["--weights", "/no/such.pth"], "argument --weights: must be imagenet, random or the path of a state_dict file"),
    (["--duration", "0"], "argument --duration: must be a finite number > 0, got 0"),
    (["--image-size", "3x"], "argument --image-size: must be WxH in pixels, e.g. 224x224, got '3x'"),
])
def test_bench_model_refuses_what_it_cannot_time(flags, message, capsys):
    """Before, a traceback each (division by zero, the median of no calls) after loading the model."""
    with pytest.raises(SystemExit) as caught:
        server_main(["bench-model", *flags])
    assert caught.value.code == 2
    assert f"resnet-server bench-model: error: {message}" in capsys.readouterr().err



def test_bench_model_refuses_a_compile_mode_without_compile(capsys):
    with pytest.raises(SystemExit) as caught:
        server_main(["bench-model", "--compile-mode", "reduce-overhead"])
    assert caught.value.code == 2
    assert "--compile-mode reduce-overhead needs --compile" in capsys.readouterr().err



@pytest.mark.parametrize("flags", [["--compile", "--torchscript"], ["--torchscript", "--cuda-graphs"]])
def test_bench_model_refuses_two_ways_of_running_the_model(capsys, flags):
    with pytest.raises(SystemExit) as caught:
        server_main(["bench-model", *flags])
    assert caught.value.code == 2
    assert f"{flags[0]} and {flags[1]} exclude each other" in capsys.readouterr().err



@pytest.mark.slow
def test_bench_model_times_the_torchscript_graph(capsys):
    assert server_main(["bench-model", "--torchscript", "--batch-sizes", "2", "--duration", "0.3",
                        "--image-size", "64x64", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["torchscript"] is True and result["forward_images_per_s"]["2"] > 0



def test_bench_model_times_several_replicas_at_once(capsys):
    assert server_main(["bench-model", "--device", "cpu,cpu", "--torch-threads", "1", "--batch-sizes", "1",
                        "--duration", "0.5", "--image-size", "64x48", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["device"], result["replicas"], result["torch_threads"]) == ("cpu,cpu", 2, 1)
    # Two replicas side by side: the mean call is two images' worth of the combined rate.
    assert result["batch1_latency_ms"] == pytest.approx(2000.0 / result["forward_images_per_s"]["1"])



def test_a_replica_failing_in_the_ceiling_raises_its_error_and_stops_the_others():
    args = model_arguments("--device", "cpu,cpu", "--torch-threads", "1")

    def broken(inputs, temperatures):
        raise RuntimeError("replica broke")

    with Replicas(args, [1]) as replicas:
        replicas.runners[1] = broken
        with pytest.raises(RuntimeError, match="replica broke"):  # not BrokenBarrierError, and no hang
            replicas.rate(torch.zeros(3, 224, 224), 1, 0.2)



@pytest.mark.slow
def test_the_free_runner_answers_ready_made_scores_through_every_front_end(weights_file):
    """--runner free:MS: the engine runs no model; each batch's scores are ready-made and land MS ms after its
    launch, and both front-ends answer them."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "resnet_server", "--runner", "free:40", "--host", "127.0.0.1",
                                "--port", str(port), "--metrics-port", "0", "--device", "cpu",
                                "--weights", str(weights_file[0]), "--frontends", "2", "--log-level", "WARNING"])
    try:
        answers = []
        for _ in range(6):  # six connections: the kernel hands them to either worker
            with Client(f"127.0.0.1:{port}", timeout=5, own_connection=True) as client:
                wait_for(lambda: serving(client), timeout=120)
                answers.append(client.classify([np.zeros((48, 64, 3), dtype=np.uint8)], full=True)[0])
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
    for answer in answers:
        np.testing.assert_array_equal(answer.probabilities, np.full(1000, 1e-3, dtype=np.float32))
        assert answer.compute_ms >= 40



def test_the_pairs_batch_size_is_the_rounds_best_by_median(tmp_path):
    """bench_cpu.sh times its interleaved c=16 pairs at the batch size the rounds' ceilings favour in the
    median, not at one round's best: here batch 16 wins one round by far and batch 8 the other two."""
    rounds = [{"forward_images_per_s": {"1": 36.0, "8": 53.4, "16": 48.1}},
              {"forward_images_per_s": {"1": 37.0, "8": 50.5, "16": 60.0}},
              {"forward_images_per_s": {"1": 35.0, "8": 52.0, "16": 49.0}}]
    (tmp_path / "rounds_ceiling.json").write_text("".join(json.dumps(one) + "\n" for one in rounds))
    assert load_script("bench_table").rounds_best_batch(tmp_path) == 8
    printed = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_table.py"), "--rounds-best-batch",
                              str(tmp_path)], capture_output=True, text=True, check=True)
    assert printed.stdout == "8\n"



def test_the_table_sets_perf_analyzer_beside_our_bench(tmp_path):
    rows = [{"concurrency": 1, "throughput": 33.7, "p50_us": 28173, "p99_us": 51111, "request_us": 27000,
             "queue_us": 80, "compute_input_us": 683, "compute_infer_us": 25900, "compute_output_us": 70,
             "overhead_us": 267},
            {"concurrency": 16, "throughput": 49.7, "p50_us": 315529, "p99_us": 406036, "request_us": 311004,
             "queue_us": 151260, "compute_input_us": 5538, "compute_infer_us": 151604, "compute_output_us": 106,
             "overhead_us": 2496}]
    ours = {16: {"images_per_s": 48.5, "p50_ms": 328.0}}
    lines = load_script("bench_table").perf_analyzer_lines(rows, ours, batch1_ms=25.0, ceiling=52.0)
    assert lines == [
        "Triton's perf_analyzer, FP32 c=1: 33.7 images/s, p50 28.2 ms, p99 51.1 ms (+3.2 ms over in-process "
        "batch 1); the server's own split of a request (ModelStatistics): queue 0.1 + input 0.7 + infer 25.9 + "
        "output 0.1 + overhead 0.3 = 27.0 ms",
        "Triton's perf_analyzer, FP32 c=16: 49.7 images/s, p50 315.5 ms, p99 406.0 ms (0.96 x the forward "
        "ceiling); the server's own split of a request (ModelStatistics): queue 151.3 + input 5.5 + infer 151.6 + "
        "output 0.1 + overhead 2.5 = 311.0 ms; resnet-client bench --input fp32: 48.5 images/s, p50 328.0 ms"]
    pairs = {"pairs": 8, "window_ms": 1500, "batch_size": 8, "concurrency": 16, "c1_served_p50_ms": 28.57,
             "c1_in_process_p50_ms": 24.21, "c1_difference_median_ms": 3.72, "c1_difference_range_ms": [2.34, 5.65],
             "c1_server_split_median_ms": {"queue": 0.08, "compute_input": 0.64, "compute_infer": 26.7,
                                           "compute_output": 0.07, "overhead": 0.33},
             "c1_infer_minus_in_process_median_ms": 1.71, "c1_outside_server_median_ms": 0.82,
             "served_images_per_s": 48.99, "in_process_images_per_s": 55.18, "ratio_median": 0.885,
             "ratio_range": [0.827, 0.922]}
    table = load_script("bench_table")
    tmp_path.joinpath("perf_analyzer_pairs.json").write_text(json.dumps(pairs) + "\n")
    assert table.perf_analyzer_pairs_line(*table.load_interleaved(tmp_path, "perf_analyzer_pairs")) == (
        "Interleaved (8 pairs of 3 x 1.5 s per side), Triton's perf_analyzer FP32 c=1 p50 / in-process batch-1 p50: "
        "28.6 / 24.2 ms; difference median +3.7 ms (range +2.3 to +5.7); the server's split of a c=1 request "
        "(medians of means, ms): queue 0.08 + input 0.64 + infer 26.70 + output 0.07 + overhead 0.33, its forward "
        "pass less the in-process one +1.71, the round trip outside the server 0.82; c=16 / in-process forward at "
        "batch 8: 49.0 / 55.2 images/s; ratio median 0.89 (range 0.83-0.92)")



def test_bench_fails_when_its_server_stops_answering_mid_run(make_server, capsys):
    """The server goes away once the bench's calls are being answered: the calls after fail UNAVAILABLE, and the
    bench says so and exits 1 instead of reporting a run."""
    running = make_server()
    with ThreadPoolExecutor(1) as pool:
        bench = pool.submit(client_main, ["bench", "--server", running.target, "--concurrency", "2", "--duration",
                                          "4", "--warmup", "0", "--input", "uint8", "--image-size", "64x48",
                                          "--metrics", "", "--json", "--quiet"])
        wait_for(lambda: running.sample("resnet_requests_total", device="cpu", code="OK") >= 3, timeout=60)
        running.stop(grace=0)
        code = bench.result(timeout=120)
    assert code == 1
    captured = capsys.readouterr()
    (point,) = [json.loads(line) for line in captured.out.splitlines()]
    assert point["ok"] >= 1 and point["errors"]["UNAVAILABLE"] >= 1
    assert captured.err.endswith("resnet-client bench: error: the server stopped answering during the run: "
                                 f"{point['errors']['UNAVAILABLE']} calls failed UNAVAILABLE\n")



def test_bench_without_pillow_says_what_to_install():
    done = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['PIL'] = None; from resnet_client.cli import main; "
         "sys.exit(main(['bench', '--server', '127.0.0.1:1']))"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == ("resnet-client bench: error: --input jpeg (the default) and png need Pillow: pip install "
                           "'resnet-grpc[tools]', or send --input uint8 or --image FILE\n")

