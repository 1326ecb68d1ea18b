"""The benchmark scripts (scripts/ and scripts/benchmarks/) end to end, each briefly, as their drivers run them:
the lab's tests. They start servers and peers by the dozen, so they run apart from the suite CI runs:
``python -m pytest -m lab`` (scripts/benchmarks/README.md). CI runs each script's short path only, its ``--help``
(tests/test_help.py)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tritonclient.grpc as tc

from resnet_client import Client
from resnet_client.cli import main as client_main
from resnet_server.cli import main as server_main
from tests.helpers import (
    ROOT,
    free_port,
    load_script,
    needs_perf_analyzer,
    serving,
    small_onnx_model,
    wait_for,
)

pytestmark = pytest.mark.lab


def run_benchmark(name: str, *argv: str) -> dict:
    """A probe of scripts/benchmarks/ run as its drivers run it, a command; the JSON it prints."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / f"{name}.py"), *argv],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)



def test_latency_pairs_interleaves_in_process_and_served_windows(make_server):
    running = make_server()
    result = run_benchmark("latency_pairs", "--server", running.target, "--image-size", "64x48", "--windows", "3",
                           "--window", "0.3")
    assert len(result["pairs_ms"]) == 3 and all(local > 0 and served > 0 for local, served in result["pairs_ms"])
    differences = sorted(served - local for local, served in result["pairs_ms"])
    assert result["difference_median_ms"] == differences[1]
    assert result["difference_range_ms"] == [differences[0], differences[-1]]
    assert 0 < result["outside_compute_median_ms"] < result["served_p50_ms"]  # compute is part of each answer
    assert result["empty_call_p50_ms"] > 0
    assert running.sample("resnet_batch_size_count", device="cpu") >= 3  # every served window reached the server



def test_throughput_pairs_interleaves_in_process_and_served_windows(make_server):
    running = make_server()
    batches_before = running.sample("resnet_batch_size_count", device="cpu")
    # Windows of 3 s: in CI, with the image building beside the tests, a window of 1.5 s once held one answer.
    result = run_benchmark("throughput_pairs", "--server", running.target, "--image-size", "64x48", "--windows", "2",
                           "--window", "3", "--ramp", "0.4", "--concurrency", "4", "--batch-size", "2")
    assert len(result["pairs_images_per_s"]) == 2
    assert all(local > 0 and served > 0 for local, served in result["pairs_images_per_s"])
    ratios = sorted(served / local for local, served in result["pairs_images_per_s"])
    assert result["ratio_range"] == ratios and result["ratio_median"] == pytest.approx(sum(ratios) / 2)
    # Three closed loops (warm-up and two windows) of four callers, each answered in batches.
    assert running.sample("resnet_batch_size_count", device="cpu") - batches_before >= 3



@needs_perf_analyzer
def test_gpu_carry_gathers_a_perf_analyzer_that_runs_on_the_libraries_it_carried(make_server, tmp_path):
    """scripts/gpu_carry.py without the wheels (only their download needs the network): the perf_analyzer it
    gathers measures a server with no library path but the folder it filled, as on a lent GPU machine."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_carry.py"), "--out", str(tmp_path),
                           "--no-wheels"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(path.name for path in (tmp_path / "lib").iterdir()) == ["libb64.so.0d", "libcudart.so.12"]
    perf_analyzer = load_script("perf_analyzer")
    running = make_server()
    _, *args = perf_analyzer.command(running.target, 2, None, 10, False, "uint8")
    report = subprocess.run([str(tmp_path / "bin" / "perf_analyzer"), *args], capture_output=True, text=True,
                            timeout=120, env={"PATH": os.defpath, "LD_LIBRARY_PATH": str(tmp_path / "lib")})
    assert report.returncode == 0, report.stdout + report.stderr
    figures = perf_analyzer.parse(report.stdout)
    assert figures["requests"] >= 10 and figures["successes"] >= figures["requests"]



@needs_perf_analyzer
def test_perf_analyzer_pairs_interleave_it_with_the_in_process_pass(make_server):
    running = make_server()
    # perf_analyzer's windows a count of requests: in CI, beside the image's build, a window of 300 ms held none.
    result = run_benchmark("perf_analyzer_pairs", "--server", running.target, "--pairs", "2", "--window-ms", "300",
                           "--window-requests", "8", "--concurrency", "4", "--batch-size", "2")
    assert len(result["pairs_ms"]) == 2 and all(local > 0 and served > 0 for local, served in result["pairs_ms"])
    differences = sorted(served - local for local, served in result["pairs_ms"])
    assert result["c1_difference_range_ms"] == differences
    assert result["c1_difference_median_ms"] == pytest.approx(sum(differences) / 2)
    ratios = sorted(served / local for local, served in result["pairs_images_per_s"])
    assert result["ratio_range"] == ratios and all(ratio > 0 for ratio in ratios)
    split = result["c1_server_split_median_ms"]
    assert split["compute_infer"] > 0 and split["queue"] >= 0
    assert result["c1_outside_server_median_ms"] > 0  # the client's mean holds the server's request time
    # Every perf_analyzer run (a warm-up and two of each concurrency) reached the server.
    with tc.InferenceServerClient(running.target) as triton:
        (model,) = triton.get_inference_statistics("resnet18", as_json=True)["model_stats"]
    assert int(model["inference_count"]) >= 5 * 3



def test_grpc_floor_times_both_minimal_servers():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "grpc_floor.py"), "--calls", "5"],
                          capture_output=True, text=True, timeout=120, check=True)
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["grpc.aio server", "thread-pool server"]
    for line in lines:
        empty, image = (float(ms) for ms in re.findall(r"([\d.]+) ms", line))
        assert empty > 0 and image > 0



def test_grpc_floor_measures_what_receiving_one_large_message_costs_each_server():
    """--message-mb: each bare server's RSS rises by at least the one copy of the message it must hold."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmarks" / "grpc_floor.py"), "--calls", "5",
                           "--message-mb", "16"], capture_output=True, text=True, timeout=120, check=True)
    rises = [line for line in done.stdout.splitlines() if "MiB message" in line]
    assert [line.split(":")[0] for line in rises] == ["grpc.aio server", "thread-pool server"]
    for line in rises:
        assert float(re.search(r"\(([\d.]+) copies\)", line).group(1)) >= 0.9



def test_frontend_cost_measures_both_servers_in_rounds_and_each_process_cpu_a_call():
    """scripts/benchmarks/frontend_cost.py end to end, briefly: both servers answered in each of two rounds, the
    ratios are the medians of the rounds' ratios, and the CPU time a call of the bare server, the front-end and its
    engine, each found by the supervisor's log line."""
    result = run_benchmark("frontend_cost", "--processes", "1", "--concurrency", "4", "--duration", "1", "--rounds",
                           "2", "--json")
    assert result["bare_calls_per_s"] > 0 and result["frontend_calls_per_s"] > 0
    assert len(result["ratios"]) == result["rounds"] == 2 and all(ratio > 0 for ratio in result["ratios"])
    assert result["ratio"] == pytest.approx(sum(result["ratios"]) / 2)  # the median of two
    assert set(result["cpu_us_per_call"]) == {"bare", "engine", "frontend"}
    assert all(us > 0 for us in result["cpu_us_per_call"].values())
    assert len(result["cpu_ratios"]) == 2 and all(ratio > 0 for ratio in result["cpu_ratios"])
    assert result["cpu_ratio"] == pytest.approx(sum(result["cpu_ratios"]) / 2)  # each round's pair, then the median
    assert result["cpu_ratio_target"] == 1.5  # issue 59's; gpu_table.py writes it from here



def test_engine_ceiling_feeds_one_engine_and_reports_its_cpu_an_image():
    """scripts/benchmarks/engine_ceiling.py end to end, briefly: two feeders' images through one engine whose
    batches take 50 ms, so at most the images in flight (2 x 4) pass every 50 ms, in batches of more than one."""
    result = run_benchmark("engine_ceiling", "--feeders", "2", "--in-flight", "4", "--compute-ms", "50", "--duration",
                           "2", "--metrics-port", str(free_port()), "--json")
    assert 0 < result["images_per_s"] <= 8 / 0.050 * 1.05
    assert 1 < result["mean_batch"] <= 8
    assert result["engine_cpu_us_per_image"] > 0



def test_gpu_table_turns_the_checks_json_into_the_readme_table(make_server, capsys, tmp_path, monkeypatch):
    """scripts/gpu_table.py on files written as scripts/gpu_check.sh writes them, by CPU runs of the same
    commands (one ceiling, served with batching on and off), so the GPU run's last step is known to work."""
    running = make_server(max_batch_size=2, metrics_port=free_port())
    assert server_main(["bench-model", "--batch-sizes", "1,2", "--duration", "0.3", "--image-size", "64x48",
                        "--json"]) == 0
    (tmp_path / "ceiling_fp32.json").write_text(capsys.readouterr().out)
    assert server_main(["bench-model", "--batch-sizes", "1", "--duration", "0.3", "--image-size", "64x48",
                        "--precision", "fp16", "--fold-batch-norms", "false", "--json"]) == 0
    (tmp_path / "ceiling_fp16_unfolded.json").write_text(capsys.readouterr().out)
    assert server_main(["bench-model", "--batch-sizes", "2", "--duration", "0.3", "--image-size", "64x48",
                        "--torchscript", "--json"]) == 0
    (tmp_path / "ceiling_fp32_torchscript.json").write_text(capsys.readouterr().out)
    assert server_main(["bench-model", "--batch-sizes", "2", "--duration", "0.3", "--image-size", "64x48",
                        "--precision", "fp16", "--torchscript", "--json"]) == 0
    (tmp_path / "ceiling_fp16_torchscript.json").write_text(capsys.readouterr().out)
    assert server_main(["bench-model", "--batch-sizes", "2", "--duration", "0.3", "--image-size", "64x48",
                        "--precision", "fp16", "--cuda-graphs", "--json"]) == 0
    graphs_ceiling = json.loads(capsys.readouterr().out)
    assert graphs_ceiling["cuda_graphs"] is False  # a CPU runs it eager, and says so; a GPU's JSON says true
    (tmp_path / "ceiling_fp16_cuda_graphs.json").write_text(json.dumps({**graphs_ceiling, "cuda_graphs": True}))
    for name, concurrency in (("served_batched", "1,4"), ("served_nobatch", "4")):
        assert client_main(["bench", "--server", running.target, "--sweep", concurrency, "--duration", "1.5",
                            "--warmup", "0", "--input", "uint8", "--image-size", "64x48", "--json", "--quiet",
                            "--metrics", f"http://127.0.0.1:{running.metrics_port}/metrics"]) == 0
        (tmp_path / f"{name}.json").write_text(capsys.readouterr().out)
    # The one-front-end run's JSON has the same shape (the bench sums the server's processes): a copy stands in.
    (tmp_path / "served_one_frontend.json").write_text((tmp_path / "served_batched.json").read_text())
    for stand_in in ("served_fp16_torchscript", "served_fp16_cuda_graphs", "served_fp16_cuda_graphs_stream"):
        (tmp_path / f"{stand_in}.json").write_text((tmp_path / "served_batched.json").read_text())
    cost = {"bare_calls_per_s": 1800.0, "frontend_calls_per_s": 990.0, "ratio": 0.55,  # frontend_cost.py's shape
            "cpu_us_per_call": {"bare": 650.0, "engine": 350.0, "frontend": 1020.0}, "cpu_ratio": 1020.0 / 650.0,
            "cpu_ratio_target": 1.5}
    (tmp_path / "frontend_cost.json").write_text(json.dumps(cost))
    engine = {"images_per_s": 14975.2, "engine_cpu_us_per_image": 20.84, "mean_batch": 67.7,  # engine_ceiling.py's
              "feeders": 4, "in_flight": 96, "compute_ms": 5.0, "rounds": 1}
    (tmp_path / "engine_ceiling.json").write_text(json.dumps(engine))
    triton = {"concurrency": 256, "input": "uint8", "streaming": False, "throughput": 9876.4,  # perf_analyzer.py's
              "p50_us": 25100, "p99_us": 40200, "queue_us": 6100, "compute_infer_us": 9900, "client_cores": 1.04}
    (tmp_path / "served_fp16_cuda_graphs_perf_analyzer.json").write_text(json.dumps(triton))
    streamed = {**triton, "streaming": True, "throughput": 12001.0}
    (tmp_path / "served_fp16_cuda_graphs_perf_analyzer_streaming.json").write_text(json.dumps(streamed))
    (tmp_path / "ceiling_fp16_compiled_default.json").write_text("")  # a step that failed before writing
    (tmp_path / "compile_start.json").write_text('{"cold_s": 40.8, "warm_s": 20.5, "max_batch_size": 2}\n')
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when run as a script: it imports bench_table
    load_script("gpu_table").main(tmp_path, 2, 2)
    table = capsys.readouterr().out
    ceiling = json.loads((tmp_path / "ceiling_fp32.json").read_text())["forward_images_per_s"]["2"]
    batched = json.loads((tmp_path / "served_batched.json").read_text().splitlines()[-1])["images_per_s"]
    assert f"| in-process forward, fp32, batch 2 | {ceiling:.0f} |" in table
    assert "| in-process forward, fp16, batch norms not folded, batch 1 |" in table
    assert "| served batched, c=4 |" in table and "| served nobatch, c=4 |" in table
    assert "(buckets up to 2): 41 s with an empty --compile-cache, 20 s from the cache the first start filled" in table
    last = json.loads((tmp_path / "served_batched.json").read_text().splitlines()[-1])
    view = last["server"]["cpu"]
    split = f"{view['mean_input_ms']:.1f} / {view['mean_infer_ms']:.1f}"  # where the batches' time went
    cores = last["server_cpu_cores"]  # from the process series of the merged /metrics, by worker
    assert set(cores) == {"frontends", "engines", "supervisor"} and cores["engines"] > 0
    assert f"| {batched:.0f} |" in table
    server_cores = f"{cores['frontends']:.1f} / {cores['engines']:.1f}"
    assert f"| {split} | {last['client_cpu_cores']:.1f} | {server_cores} |  |" in table
    assert f"- served_batched c=4: {batched:.0f} images/s = {batched / ceiling:.2f} x the in-process fp32" in table
    assert "| served one frontend, c=4 |" in table
    assert f"- served_one_frontend c=4: {batched:.0f} images/s = {batched / ceiling:.2f} x the in-process fp32" in table
    assert "batching on / off at c=4" in table
    scripted = json.loads((tmp_path / "ceiling_fp32_torchscript.json").read_text())["forward_images_per_s"]["2"]
    assert f"| in-process forward, fp32 TorchScript, batch 2 | {scripted:.0f} |" in table
    scripted16 = json.loads((tmp_path / "ceiling_fp16_torchscript.json").read_text())["forward_images_per_s"]["2"]
    assert "| served fp16 torchscript, c=4 |" in table
    assert (f"- served_fp16_torchscript c=4: {batched:.0f} images/s = {batched / scripted16:.2f} x the in-process "
            f"fp16 torchscript forward at batch 2 ({scripted16:.0f})") in table
    graphed = json.loads((tmp_path / "ceiling_fp16_cuda_graphs.json").read_text())["forward_images_per_s"]["2"]
    assert f"| in-process forward, fp16 CUDA graphs, batch 2 | {graphed:.0f} |" in table
    assert (f"- served_fp16_cuda_graphs c=4: {batched:.0f} images/s = {batched / graphed:.2f} x the in-process "
            f"fp16 cuda graphs forward at batch 2 ({graphed:.0f})") in table
    assert "| served fp16 cuda graphs stream, c=4 |" in table
    assert (f"- served_fp16_cuda_graphs_stream c=4: {batched:.0f} images/s = {batched / graphed:.2f} x the "
            "in-process fp16 cuda graphs forward") in table
    for calls, rate in (("ModelInfer calls", 9876), ("ModelStreamInfer messages", 12001)):
        assert (f"- served fp16 CUDA graphs under perf_analyzer (C++, UINT8 requests as {calls}) c=256: {rate} "
                "images/s, p50 25.1 ms, p99 40.2 ms; the server's own split of a request: queue 6.1 ms, compute "
                "9.9 ms; perf_analyzer's CPU 1.0 cores") in table
    assert ("- one front-end with a free model: 990 calls/s = 0.55 x bare grpc.aio (1800); "
            "CPU a call: bare 650 us, engine 350 us, frontend 1020 us = 1.57 x bare; target <= 1.5") in table
    assert ("- one engine's own ceiling (free model, scores 5 ms after launch, 4 feeders x 96 in flight): 14975 "
            "images/s at 20.8 us of its CPU an image, mean batch 67.7") in table



def link_distributions(site: Path, names: list[str]) -> None:
    """Fill ``site`` with links to this environment's distributions ``names``: a Python whose only PYTHONPATH entry
    it is has those and no others (the editable install's .pth file, in site-packages, does not run from a
    PYTHONPATH entry)."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    for name in names:
        try:
            files = importlib.metadata.distribution(name).files or ()
        except importlib.metadata.PackageNotFoundError:  # not installed here: py-spy (a program, imported by none)
            continue
        for top in {file.parts[0] for file in files if file.parts[0] != ".."}:
            if (purelib / top).exists() and not (site / top).exists():
                (site / top).symlink_to(purelib / top)



def test_gpu_check_runs_on_a_lent_machines_python_with_what_gpu_carry_carries(tmp_path, monkeypatch):
    """A lent GPU machine's Python has torch, torchvision, numpy, pillow and pytest; the checkout and what
    scripts/gpu_carry.py gathers travel to it. With only those, scripts/gpu_check.sh imports the project (the
    packages in server/ and client/) and collects the CUDA tests. On 2026-11-28 a lent machine's
    call ended in 19 s: every step's ModuleNotFoundError (the project), and prometheus_client and msgspec were
    not carried."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # as when run as a script: it imports perf_analyzer
    gpu_carry = load_script("gpu_carry")
    site = tmp_path / "site"
    site.mkdir()
    link_distributions(site, [*gpu_carry.closure(list(gpu_carry.LENT)), *gpu_carry.carried_packages()])
    checkout = tmp_path / "checkout"  # what travels (no virtual environment)
    for folder in ("server", "client", "scripts", "tests"):
        shutil.copytree(ROOT / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", checkout)  # pytest's options
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys._base_executable)  # this interpreter, outside the virtual environment
    env = {"HOME": str(tmp_path), "PATH": f"{bare}:/usr/bin:/bin", "PYTHONPATH": str(site)}
    imported = subprocess.run(["python", "-c", "import resnet_server"], env=env, cwd=tmp_path, capture_output=True)
    assert imported.returncode != 0, "this interpreter finds the project outside the checkout: nothing to check"
    served = ("served_fp16_cuda_graphs served_fp16_cuda_graphs_stream served_fp16_cuda_graphs_16_per_request "
              "served_fp16_cuda_graphs_perf_analyzer served_fp16_cuda_graphs_perf_analyzer_streaming")
    out = tmp_path / "out"
    result = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "first"], cwd=checkout, capture_output=True,
                            text=True, timeout=240, env={**env, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_SKIP": served})
    assert result.returncode == 0, result.stderr
    assert "Error" not in result.stdout + result.stderr, result.stdout + result.stderr
    for tests in ("cuda_tests", "cuda_autotune_tests"):  # collected (every one skipped on the CPU), no error
        assert re.search(r"^\d+ skipped, \d+ deselected in ", (out / f"{tests}.txt").read_text(), re.MULTILINE)
    assert (out / "gpu_table.md").read_text().startswith("Measured ")  # gpu_table.py ran, importing the client



def test_cpu_table_sets_each_served_point_against_its_ceiling(make_server, capsys, tmp_path, monkeypatch):
    """scripts/bench_table.py on files written as scripts/bench_cpu.sh writes them, by short CPU runs of the
    same commands: the JPEG ratio is over the JPEG run's own ceiling (the best forward pass in series with
    decode), and the alternating rounds give the JPEG point its own line."""
    running = make_server(max_batch_size=2, metrics_port=free_port())
    metrics = f"http://127.0.0.1:{running.metrics_port}/metrics"  # the mean batch size served

    def ceiling(name: str, kind: str, sizes: str) -> dict:
        assert server_main(["bench-model", "--batch-sizes", sizes, "--duration", "0.2", "--image-size", "64x48",
                            "--input", kind, "--json"]) == 0
        (tmp_path / f"{name}.json").write_text(output := capsys.readouterr().out)
        return json.loads(output)

    def served(name: str, kind: str, sweep: str) -> list[dict]:
        assert client_main(["bench", "--server", running.target, "--sweep", sweep, "--duration", "1",
                            "--warmup", "0", "--input", kind, "--image-size", "64x48", "--json", "--quiet",
                            "--metrics", metrics]) == 0
        (tmp_path / f"{name}.json").write_text(output := capsys.readouterr().out)
        return [json.loads(line) for line in output.splitlines()]

    ceiling("ceiling_uint8", "uint8", "1,2")
    jpeg = ceiling("ceiling_jpeg", "jpeg", "1,2")
    served("served_uint8", "uint8", "1,16")
    jpeg_c16 = served("served_jpeg", "jpeg", "1,16")[-1]
    served("served_uint8_nobatch", "uint8", "16")
    rounds = [ceiling("round_ceiling", "jpeg", "1,2") for _ in range(2)]
    (tmp_path / "rounds_ceiling.json").write_text("".join(json.dumps(one) + "\n" for one in rounds))
    served("rounds_served", "uint8", "1,16")  # a copy stands in for the second round's uint8 points
    (tmp_path / "rounds_served.json").write_text((tmp_path / "rounds_served.json").read_text() * 2)
    jpeg_rounds = [served("round_jpeg", "jpeg", "16")[0] for _ in rounds]
    (tmp_path / "rounds_served_jpeg.json").write_text("".join(json.dumps(one) + "\n" for one in jpeg_rounds))
    (tmp_path / "server_flags.txt").write_text("--max-batch-size 2\n")  # BENCH_SERVER_FLAGS, as the script keeps it
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    load_script("bench_table").main(tmp_path, "64x48")
    table = capsys.readouterr().out
    assert "device cpu, fp32, torch threads" in table.splitlines()[0]
    assert "scripts/bench_cpu.sh, server flags --max-batch-size 2, 64x48 images" in table.splitlines()[0]
    jpeg_ceiling = jpeg["ceiling_with_preprocess_images_per_s"]
    assert jpeg_ceiling == pytest.approx(1 / (1 / max(jpeg["forward_images_per_s"].values())
                                              + 1 / jpeg["preprocess_images_per_s"]))
    assert f"| in-process ceiling with JPEG decode | {jpeg_ceiling:.1f} |" in table
    assert f"{jpeg_c16['images_per_s'] / jpeg_ceiling:.2f} x ceiling |" in table
    ratios = sorted(point["images_per_s"] / ceiling["ceiling_with_preprocess_images_per_s"]
                    for point, ceiling in zip(jpeg_rounds, rounds, strict=True))
    pairs = ", ".join(f"{point['images_per_s']:.1f}/{ceiling['ceiling_with_preprocess_images_per_s']:.1f}"
                      for point, ceiling in zip(jpeg_rounds, rounds, strict=True))
    assert (f"Alternating rounds, served JPEG c=16 / in-process ceiling with JPEG decode: {pairs} images/s; "
            f"ratio median {sum(ratios) / 2:.2f} (range {ratios[0]:.2f}-{ratios[1]:.2f})") in table
    assert "Alternating rounds, served uint8 c=16 / in-process forward ceiling:" in table
    # Against the forward pass at the batch the server formed (a cap of 2: batch 2 of the measured 1 and 2).
    uint8_c16 = json.loads((tmp_path / "served_uint8.json").read_text().splitlines()[-1])
    at_batch_2 = json.loads((tmp_path / "ceiling_uint8.json").read_text())["forward_images_per_s"]["2"]
    assert (f"; {uint8_c16['images_per_s'] / at_batch_2:.2f} x the forward pass at batch 2, the batch served) |"
            in table)
    assert "Alternating rounds, served uint8 c=16 / in-process forward at batch 2, the batch served: " in table



def test_cpu_split_reads_the_server_threads_and_this_process(weights_file, capsys, tmp_path, monkeypatch):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(port),
                                "--metrics-port", "0", "--device", "cpu", "--weights", str(weights_file[0]),
                                "--log-level", "WARNING"])
    try:
        with Client(f"127.0.0.1:{port}", timeout=5) as client:
            wait_for(lambda: serving(client), timeout=120)
        result = run_benchmark("cpu_split", "--server", f"127.0.0.1:{port}", "--server-pid", str(process.pid),
                               "--concurrency", "2", "--image-size", "64x48", "--ramp", "0.5", "--window", "1.5",
                               "--team", "2")
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert result["images"] > 0 and result["images_per_s"] == pytest.approx(result["images"] / result["window_s"])
    per_image = result["cpu_ms_per_image"]
    # The forward pass (ResNet18 at 224x224) dwarfs the event loop's share of a request; the client is the probe.
    assert per_image["forward_team"] > 5 * per_image["event_loop"] > 0 and per_image["client"] > 0
    assert sum(result["share_of_cores"].values()) == pytest.approx(1.0)
    # The table's line on it: the forward team's share bounds what serving can reach of the in-process ceiling.
    (tmp_path / "cpu_split.json").write_text(json.dumps(result))
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    load_script("bench_table").print_cpu_split(tmp_path)
    bound = result["share_of_cores"]["forward_team"]
    assert 0 < bound < 1
    assert (f"Most that served c=2 can reach of the in-process forward ceiling on these cores: {bound:.3f} "
            "(the forward team's share") in capsys.readouterr().out



def test_tracing_cost_measures_the_three_settings_and_the_traced_ones_export():
    """scripts/benchmarks/tracing_cost.py end to end, briefly: each setting served, its ratio to tracing off, and
    the spans of the traced servers at the receiver."""
    result = run_benchmark("tracing_cost", "--concurrency", "2", "--duration", "1", "--rounds", "1", "--json")
    assert all(result[name]["images_per_s"] > 0 for name in ("off", "rate 0.01", "rate 1.0"))
    assert result["off"]["ratio_to_off"] == 1.0 and result["rate 1.0"]["frontend_cpu_ms_a_call"] > 0
    assert result["spans_received"] > 0  # flushed as the servers stop, at the latest



@needs_perf_analyzer
def test_shared_memory_cost_measures_each_load_by_value_and_by_reference():
    """scripts/benchmarks/shared_memory_cost.py end to end, briefly: perf_analyzer and our bench, FP32 and UINT8,
    each by value and by reference against one server, with the front-end's CPU a request; and gRPC alone, a bare
    server sent the same requests' bytes, whose 602 KB FP32 image inline costs it more than the image's region; and
    the same bare server with the least handler there can be."""
    result = run_benchmark("shared_memory_cost", "--concurrency", "2", "--duration", "1.5", "--rounds", "1", "--json")
    loads, kinds = ("perf_analyzer", "bench", "grpc", "handler"), ("fp32", "uint8")
    assert set(result) == {f"{load} {kind}" for load in loads for kind in kinds}
    for row in result.values():
        assert row["by_value_requests_per_s"] > 0 and row["by_reference_requests_per_s"] > 0
        assert row["by_value_frontend_cpu_ms"] > 0 and row["by_reference_frontend_cpu_ms"] > 0
    assert result["grpc fp32"]["by_value_frontend_cpu_ms"] > result["grpc fp32"]["by_reference_frontend_cpu_ms"]
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("handler-floor-")]  # its regions removed



HANDLER_FLOOR_CALLS = """
import json, os
import grpc
from frontend_cost import bare_server
from handler_floor import serve_handler
from shared_memory_cost import infer_request
from resnet_client.api import grpc_predict_v2_pb2 as oip

with bare_server("uvloop", serve_handler) as server, grpc.insecure_channel(server.target) as channel:
    call = channel.unary_unary(server.method, response_deserializer=oip.ModelInferResponse.FromString)
    prefix = f"handler-floor-{server.processes['bare']}-"
    regions = sorted(name[len(prefix):] for name in os.listdir("/dev/shm") if name.startswith(prefix))
    by_value = call(infer_request("fp32", False), timeout=30)
    by_reference = call(infer_request("fp32", True), timeout=30)
    nan = bytearray(infer_request("fp32", False))
    nan[-4:] = bytes.fromhex("0000c07f")  # the last float a NaN
    try:
        call(bytes(nan), timeout=30)
        refused = ""
    except grpc.RpcError as error:
        refused = error.code().name
print(json.dumps({"regions": regions, "refused": refused,
                  "by_value": [len(data) for data in by_value.raw_output_contents],
                  "by_reference": {output.name: [output.parameters["shared_memory_region"].string_param, len(data)]
                                   for output, data in zip(by_reference.outputs, by_reference.raw_output_contents)}}))
"""



def test_the_handler_floor_answers_by_value_inline_and_by_reference_in_its_regions():
    """scripts/benchmarks/handler_floor.py does the work it stands for: the probabilities inline by value, each
    output named in its region by reference, a NaN refused; its regions made at its start and removed at its end."""
    done = subprocess.run([sys.executable, "-c", HANDLER_FLOOR_CALLS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT / "scripts" / "benchmarks")
    assert done.returncode == 0, done.stderr
    answered = json.loads(done.stdout)
    outputs = ("probabilities", "top_k_indices", "top_k_probabilities", "top_k_labels")
    assert answered["regions"] == sorted(["input_data", *(f"{name}_data" for name in outputs)])
    assert answered["by_value"] == [4000] and answered["refused"] == "UNKNOWN"
    assert answered["by_reference"] == {name: [f"{name}_data", 0] for name in outputs}
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("handler-floor-")]



@pytest.mark.slow
def test_runtime_cost_serves_each_runtime_in_rounds_against_torch():
    """scripts/benchmarks/runtime_cost.py end to end, briefly: an int8 model made, each runtime served and measured
    once, each rate set against PyTorch's."""
    pytest.importorskip("onnxruntime")
    result = run_benchmark("runtime_cost", "--concurrency", "2", "--duration", "1", "--rounds", "1", "--batch", "2",
                           "--settings", "torch fp32", "onnxruntime int8", "--calibration-images", "6", "--json")
    assert list(result) == ["torch fp32", "onnxruntime int8"]
    torch_row = result["torch fp32"]
    assert torch_row["ratio_to_torch"] == 1.0 and torch_row["in_process_ratio"] == 1.0
    for row in result.values():
        assert row["images_per_s"] > 0 and row["p50_ms"] > 0 and len(row["rounds"]) == 1
        assert row["ratio_to_torch"] == pytest.approx(row["images_per_s"] / torch_row["images_per_s"])
        assert row["in_process_ratio"] == pytest.approx(row["in_process_images_per_s"] /
                                                        torch_row["in_process_images_per_s"])
        assert row["served_of_in_process"] == pytest.approx(row["images_per_s"] / row["in_process_images_per_s"])



LITSERVE_PYTHON = ROOT / ".venv-litserve" / "bin" / "python"  # LitServe apart: its FastAPI would move the server's



@pytest.mark.slow
@pytest.mark.skipif(not LITSERVE_PYTHON.exists(), reason="no .venv-litserve (python -m venv "
                    ".venv-litserve && .venv-litserve/bin/pip install litserve onnxruntime pillow numpy)")
def test_litserve_pairs_serves_the_int8_model_on_both_servers_and_times_it_in_process():
    """scripts/benchmarks/litserve_pairs.py end to end, briefly: LitServe and this server each answer the same int8
    model's requests, each rate set against LitServe's and against the in-process ceiling."""
    pytest.importorskip("onnxruntime")
    result = run_benchmark("litserve_pairs", "--litserve-python", str(LITSERVE_PYTHON), "--concurrency", "2",
                           "--processes", "1", "--duration", "1", "--rounds", "1", "--calibration-images", "6",
                           "--json")
    ceiling = result.pop("in_process_images_per_s")
    assert ceiling > 0 and list(result) == ["ours", "litserve"]
    assert result["litserve"]["ratio_to_litserve"] == 1.0
    for row in result.values():
        assert row["images_per_s"] > 0 and row["p50_ms"] > 0 and len(row["rounds"]) == 1
        assert row["of_in_process"] == pytest.approx(row["images_per_s"] / ceiling)
    assert result["ours"]["ratio_to_litserve"] == pytest.approx(result["ours"]["images_per_s"] /
                                                                result["litserve"]["images_per_s"])



def test_onnx_providers_times_each_provider_installed_against_the_cpus(tmp_path):
    """scripts/benchmarks/onnx_providers.py end to end, briefly, on a small model of ResNet18's input: the CPU
    provider (here, where plain onnxruntime is installed) measured and set against itself."""
    pytest.importorskip("onnxruntime")
    model = small_onnx_model(tmp_path / "small.onnx")
    result = run_benchmark("onnx_providers", "--model", str(model), "--batch", "2", "--threads", "1", "--duration",
                           "0.2", "--rounds", "2", "--json")
    cpu = result["CPUExecutionProvider"]
    assert cpu["images_per_s"] > 0 and cpu["ratio_to_cpu"] == 1.0 and cpu["largest_logit_difference"] == 0.0
    assert len(cpu["rounds"]) == 2 and result["onnxruntime"]



def test_http_cost_measures_each_protocol_against_grpc():
    """scripts/benchmarks/http_cost.py end to end, briefly: gRPC, HTTP binary and HTTP JSON each measured once
    against one server, each set against gRPC's."""
    result = run_benchmark("http_cost", "--concurrency", "2", "--duration", "1", "--rounds", "1", "--runner", "free",
                           "--json")
    assert result["runner"] == "free" and result["grpc"]["rate_to_grpc"] == 1.0
    for protocol in ("grpc", "http binary", "http json"):
        row = result[protocol]
        assert row["images_per_s"] > 0 and row["frontend_cpu_ms"] > 0 and len(row["rounds"]) == 1
        assert row["cpu_to_grpc"] == pytest.approx(row["frontend_cpu_ms"] / result["grpc"]["frontend_cpu_ms"])



def test_fair_share_sets_callers_side_by_side_in_each_scenario():
    """scripts/benchmarks/fair_share.py end to end, briefly: each scenario measured once, each caller's figures
    (the peer scenario, which makes a network namespace, where this runs as root with iproute2)."""
    scenarios = ["polite", "weights", "alone"]
    if os.geteuid() == 0 and shutil.which("ip"):
        scenarios.append("peer")
    result = run_benchmark("fair_share", "--scenario", *scenarios, "--greedy", "4", "--duration", "1", "--rounds",
                           "1", "--json")
    for scenario, fair in (("polite", "token"), ("peer", "peer"))[:1 + ("peer" in scenarios)]:
        for mode in (fair, "off"):
            row = result[scenario][mode]
            assert row["greedy_alone"] > 0 and row["greedy_images_per_s"] > 0 and row["polite_images_per_s"] > 0
            assert row["polite_p50_to_greedy"] == pytest.approx(row["polite_p50_ms"] / row["greedy_p50_ms"])
        assert result[scenario]["polite_images_per_s_to_off"] == pytest.approx(
            result[scenario][fair]["polite_images_per_s"] / result[scenario]["off"]["polite_images_per_s"])
    weights = result["weights"]
    assert weights["heavy_to_light"] == pytest.approx(weights["heavy_images_per_s"] / weights["light_images_per_s"])
    assert all(result["alone"][mode]["images_per_s"] > 0 for mode in ("token", "off"))

