"""Several replicas (two on the CPU here): routing by least queued work, per-replica metrics, failure isolation."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import subprocess
import sys
import threading
import weakref

import grpc
import numpy as np
import pytest
import torch

from resnet_client import AsyncClient, ClassifierError, Client
from resnet_server.common.config import ServerConfig
from resnet_server.common.devices import cpu_bf16_unit
from resnet_server.common.metrics import Metrics
from resnet_server.common.sections import engine_config
from resnet_server.engine.batcher import Answers
from resnet_server.engine.inductor import cuda_graph_state_for_this_thread
from resnet_server.engine.replicas import (
    FAILURES_BEFORE_EVICTION,
    load_replica,
    max_batch_size,
    replica_torch_threads,
)
from resnet_server.engine.runner import ModelRunner, bucket_sizes, split_into_buckets
from tests.helpers import (
    DEVICE_FELL_OFF,
    base_config,
    break_until_evicted,
    encode,
    free_port,
    random_rgb,
    scraped_value,
    serving,
    wait_for,
)

IMAGE = encode(random_rgb(77))


def classify_concurrently(target: str, count: int) -> list:
    async def run():
        async with AsyncClient(target, timeout=120) as client:
            return await asyncio.gather(*(client.classify([IMAGE], full=True) for _ in range(count)))
    return asyncio.run(run())


def test_two_replicas_on_one_device_share_the_load_with_their_own_labels(make_server, reference):
    running = make_server(devices=("cpu", "cpu"))
    with Client(running.target) as client:
        assert list(client.model_info().devices) == ["cpu#0", "cpu#1"]
    results = classify_concurrently(running.target, 12)
    devices = [result[0].device for result in results]
    assert set(devices) == {"cpu#0", "cpu#1"}
    per_replica = {name: running.sample("resnet_images_total", device=name, code="OK") for name in ("cpu#0", "cpu#1")}
    assert sum(per_replica.values()) == 12 and min(per_replica.values()) >= 3, per_replica
    assert per_replica["cpu#0"] == devices.count("cpu#0")
    expected = reference.probabilities(reference.input_from_bytes(IMAGE))
    for (result,) in results:
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


def test_max_batch_size_zero_picks_by_device():
    assert max_batch_size(ServerConfig(max_batch_size=0), torch.device("cpu")) == 8
    assert max_batch_size(ServerConfig(max_batch_size=0), torch.device("cuda", 1)) == 128
    assert max_batch_size(ServerConfig(max_batch_size=5), torch.device("cuda")) == 5
    assert max_batch_size(ServerConfig(max_queue=64), torch.device("cuda")) == 64  # no batch holds more


def test_the_cpu_default_splits_twelve_queued_images_into_batches_of_eight_and_four(make_server):
    running = make_server(max_batch_size=0)
    with Client(running.target) as client:
        assert client.model_info().batching.max_batch_size == 8
        results = client.classify([IMAGE] * 12)  # queued at once, all twelve before the worker looks
    assert len(results) == 12
    assert running.sample("resnet_batch_size_count", device="cpu") == 2
    assert running.sample("resnet_batch_size_sum", device="cpu") == 12
    assert running.sample("resnet_batch_size_bucket", device="cpu", le="4.0") == 1  # the other one is 8


def test_sequential_requests_alternate_when_replicas_are_idle(make_server):
    running = make_server(devices=("cpu", "cpu"))
    with Client(running.target) as client:
        devices = [client.classify([IMAGE])[0].device for _ in range(4)]
    assert devices in (["cpu#1", "cpu#0", "cpu#1", "cpu#0"], ["cpu#0", "cpu#1", "cpu#0", "cpu#1"])


def test_a_failing_replica_leaves_the_rotation_and_the_other_keeps_serving(make_server, faults):
    running = make_server(devices=("cpu", "cpu"), runner=faults.runner)
    faults.set(DEVICE_FELL_OFF, "cpu#0")
    codes = []
    with Client(running.target) as client:
        for _ in range(2 * FAILURES_BEFORE_EVICTION + 4):
            try:
                codes.append(client.classify([IMAGE])[0].device)
            except ClassifierError as exc:
                codes.append(exc.code)
    assert codes.count(grpc.StatusCode.INTERNAL) == FAILURES_BEFORE_EVICTION
    assert codes[-4:] == ["cpu#1"] * 4
    assert running.sample("resnet_replica_healthy", device="cpu#0") == 0
    assert running.sample("resnet_replica_healthy", device="cpu#1") == 1


def test_all_replicas_failing_is_unavailable(make_server, faults):
    running = make_server(runner=faults.runner)
    break_until_evicted(running, faults)  # its first probe is a probe interval (30 s) away
    with Client(running.target) as client, pytest.raises(ClassifierError) as caught:
        client.classify([IMAGE])
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_health_says_not_serving_once_the_last_replica_leaves_the_rotation(make_server, faults):
    running = make_server(runner=faults.runner)
    faults.set(DEVICE_FELL_OFF)
    with Client(running.target) as client:
        for _ in range(FAILURES_BEFORE_EVICTION):
            assert client.health() == "SERVING"
            with pytest.raises(ClassifierError) as caught:
                client.classify([IMAGE])
            assert caught.value.code == grpc.StatusCode.INTERNAL
        wait_for(lambda: client.health() == "NOT_SERVING")
        assert client.health("resnet.v1.Classifier") == "NOT_SERVING"
        with pytest.raises(ClassifierError) as caught:
            client.classify([IMAGE])
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_an_evicted_replica_is_probed_and_rejoins_once_a_probe_passes(make_server, faults):
    running = make_server(devices=("cpu", "cpu"), replica_probe_interval=0.05, runner=faults.runner)
    break_until_evicted(running, faults, "cpu#0")

    def probes(result: str) -> float:
        return running.sample("resnet_replica_probes_total", device="cpu#0", result=result)

    # Still broken: probes fail, and no caller's request is sent there meanwhile.
    wait_for(lambda: probes("failed") >= 3)
    with Client(running.target) as client:
        assert {client.classify([IMAGE])[0].device for _ in range(4)} == {"cpu#1"}
    assert running.sample("resnet_replica_healthy", device="cpu#0") == 0
    assert running.sample("resnet_requests_total", device="cpu#0", code="INTERNAL") == FAILURES_BEFORE_EVICTION
    assert probes("passed") == 0

    faults.clear()
    wait_for(lambda: running.sample("resnet_replica_healthy", device="cpu#0") == 1)
    assert probes("passed") == 1
    with Client(running.target) as client:
        assert {client.classify([IMAGE])[0].device for _ in range(4)} == {"cpu#0", "cpu#1"}
    assert running.sample("resnet_requests_total", device="cpu#0", code="OK") >= 1


def test_health_is_serving_again_when_the_last_replica_rejoins(make_server, faults):
    running = make_server(replica_probe_interval=0.05, runner=faults.runner)
    break_until_evicted(running, faults)
    with Client(running.target) as client:
        wait_for(lambda: client.health() == "NOT_SERVING")
        faults.clear()
        wait_for(lambda: client.health() == "SERVING")
        assert client.health("resnet.v1.Classifier") == "SERVING"
        (result,) = client.classify([IMAGE])
    assert result.device == "cpu"


def test_no_replica_back_within_unhealthy_exit_after_stops_the_server_with_exit_code_1(make_server, faults):
    running = make_server(replica_probe_interval=0.05, unhealthy_exit_after=0.5, runner=faults.runner)
    break_until_evicted(running, faults)
    wait_for(running.app.stop_requested.is_set)
    assert running.app.exit_code == 1
    assert "--unhealthy-exit-after" in running.app.stop_reason
    assert running.sample("resnet_replica_probes_total", device="cpu", result="failed") >= 1
    with Client(running.target) as client:
        assert client.health() == "NOT_SERVING"


def test_a_replica_back_in_rotation_in_time_keeps_the_server_running(make_server, faults):
    running = make_server(replica_probe_interval=0.05, unhealthy_exit_after=600, runner=faults.runner)
    break_until_evicted(running, faults)
    with Client(running.target) as client:
        wait_for(lambda: client.health() == "NOT_SERVING")
        assert running.app.gives_up_at is not None  # due, ten minutes on
        faults.clear()
        wait_for(lambda: client.health() == "SERVING")
    assert running.app.gives_up_at is None  # called off
    assert not running.app.stop_requested.is_set()


def test_without_probes_an_evicted_replica_stays_out(make_server, faults):
    running = make_server(devices=("cpu", "cpu"), replica_probe_interval=0, runner=faults.runner)
    break_until_evicted(running, faults, "cpu#0")
    faults.clear()
    with Client(running.target) as client:
        assert {client.classify([IMAGE])[0].device for _ in range(4)} == {"cpu#1"}
    assert running.sample("resnet_replica_probes_total", device="cpu#0", result="failed") == 0


def test_cpu_runner_returns_probabilities_and_logits_and_bucket_sizes(weights_file):
    from torchvision.models import resnet18

    model = resnet18()
    model.load_state_dict(weights_file[1])
    fp32 = ModelRunner(model, torch.device("cpu"))
    batch = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    probabilities, logits = fp32(batch, torch.ones(4))
    assert probabilities.shape == logits.shape == (4, 1000)
    np.testing.assert_allclose(probabilities.sum(1).numpy(), 1.0, atol=1e-5)
    assert bucket_sizes(128, cuda=True) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert bucket_sizes(40, cuda=True) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert bucket_sizes(8, cuda=False) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert bucket_sizes(32, cuda=False) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32]
    assert split_into_buckets(13, [1, 2, 4, 8]) == [8, 4, 1] and split_into_buckets(3, [1, 4]) == [1, 1, 1]
    assert fp32.run_sizes(13) == [13]  # not warmed: no buckets
    fp32.buckets = [1, 2, 4, 8]  # the sizes a batch runs at (tracing's resnet.batch.buckets), as after warm-up
    assert fp32.run_sizes(13) == [8, 4, 1] and fp32.padding_for(13) == 0


def test_the_runner_folds_every_batch_norm_into_its_convolution_and_computes_the_same_function():
    import copy

    from torchvision.models import resnet18

    model = resnet18().eval()
    generator = torch.Generator().manual_seed(2)
    for norm in (module for module in model.modules() if isinstance(module, torch.nn.BatchNorm2d)):
        # Statistics far from their initial values, so that a wrong fold would show in the logits.
        for tensor, low, high in ((norm.running_mean, -0.5, 0.5), (norm.running_var, 0.5, 2.0),
                                  (norm.weight.data, 0.5, 1.5), (norm.bias.data, -0.2, 0.2)):
            tensor.copy_(torch.empty(tensor.shape).uniform_(low, high, generator=generator))
    reference = copy.deepcopy(model)
    unfolded = ModelRunner(copy.deepcopy(model), torch.device("cpu"), channels_last=False, fold_batch_norms=False)
    runner = ModelRunner(model, torch.device("cpu"), channels_last=False)
    assert not any(isinstance(module, torch.nn.BatchNorm2d) for module in runner.model.modules())
    assert sum(isinstance(module, torch.nn.BatchNorm2d) for module in unfolded.model.modules()) == 20
    batch = torch.randn(2, 3, 224, 224, generator=generator)
    with torch.inference_mode():
        expected = reference(batch)
    _, logits = runner(batch, torch.ones(2))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(unfolded(batch, torch.ones(2))[1], expected, rtol=0, atol=1e-5)


def test_cpu_runner_is_channels_last_by_default_with_the_plain_layouts_answers(weights_file):
    from torchvision.models import resnet18

    def runner(**options) -> ModelRunner:
        model = resnet18()
        model.load_state_dict(weights_file[1])
        return ModelRunner(model, torch.device("cpu"), **options)

    default, plain = runner(), runner(channels_last=False)
    assert default.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not plain.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    batch = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    probabilities, logits = default(batch, torch.ones(3))
    expected_probabilities, expected_logits = plain(batch, torch.ones(3))
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(probabilities, expected_probabilities, rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_a_captured_bucket_input_is_zeros_in_the_network_layout(precision, dtype):
    """What a CUDA graph is captured on (server.runner.graph_input), made here on the CPU: the network's dtype
    and memory layout, all zeros (on the H100 its first version failed every capture)."""
    runner = ModelRunner(torch.nn.Identity(), torch.device("cpu"), precision)
    inputs = runner.graph_input(3)
    assert inputs.shape == (3, 3, 224, 224) and inputs.dtype == dtype
    assert inputs.is_contiguous(memory_format=torch.channels_last) and not inputs.is_contiguous()
    assert torch.count_nonzero(inputs) == 0


@pytest.mark.slow
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])  # on the CPU: no CUDA graphs, same answers
def test_compiled_model_runs_a_warmed_graph_and_matches_torchvision(make_server, reference, compile_mode):
    running = make_server(compile=True, compile_mode=compile_mode, max_batch_size=4)
    # On the CPU a frozen graph holds oneDNN's prepacked weights: inductor caches its kernels, not the graph.
    assert running.app.engines[0].info.runs.startswith(
        f"cpu runs fp32 compiled by inductor ({compile_mode}) at batch sizes 1, 2, 3, 4; graphs from inductor's "
        f"cache at ")
    assert running.app.engines[0].info.runs.endswith(
        ": 0 loaded, 0 compiled, 4 not cacheable (their kernels are)")
    images = [encode(random_rgb(seed)) for seed in (1, 2, 3)]
    with Client(running.target) as client:
        results = client.classify(images, full=True)
    # One batch of 3, run by the graph compiled for 3 at warm-up.
    assert running.sample("resnet_batch_size_count", device="cpu") == 1
    assert running.sample("resnet_batch_size_sum", device="cpu") == 3
    for image, result in zip(images, results, strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_compiled_kernels_stay_in_the_compile_cache_for_the_next_start(make_server, reference, tmp_path):
    """A second server with the same --compile-cache builds no kernel: each is loaded from the folder."""
    cache = tmp_path / "compile-cache"
    first = make_server(compile=True, max_batch_size=2, compile_cache=str(cache))
    assert first.app.engines[0].info.runs.endswith(
        f"graphs from inductor's cache at {cache}: 0 loaded, 0 compiled, 2 not cacheable (their kernels are)")
    kernels = sorted(path.relative_to(cache) for path in cache.rglob("*.so"))
    assert kernels  # C++ kernels built for this CPU, kept
    second = make_server(compile=True, max_batch_size=2, compile_cache=str(cache))
    assert sorted(path.relative_to(cache) for path in cache.rglob("*.so")) == kernels  # none built anew
    images = [encode(random_rgb(seed)) for seed in (1, 2)]
    for running in (first, second):
        with Client(running.target) as client:
            results = client.classify(images, full=True)
        for image, result in zip(images, results, strict=True):
            expected = reference.probabilities(reference.input_from_bytes(image))
            np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


def test_torchscript_replicas_trace_at_once_and_answer_any_batch_size_as_torchvision(make_server, reference):
    # Two replicas load at once, each tracing its own model: tracing shares process-wide state (a lock).
    running = make_server(devices=("cpu", "cpu"), torch_threads=1, torchscript=True, max_batch_size=4)
    replicas = running.app.engines
    assert [replica.info.runs for replica in replicas] == \
        [f"{name} runs fp32 as a TorchScript graph at batch sizes 1, 2, 3, 4" for name in ("cpu", "cpu")]
    images = [encode(random_rgb(seed)) for seed in (1, 2, 3)]
    with Client(running.target) as client:
        batched = client.classify(images, full=True)  # one batch of 3
        alone = client.classify(images[:1], full=True)  # the other replica (ties go in turn)
    assert sorted(running.sample("resnet_batch_size_sum", device=replica.name) for replica in replicas) == [1, 3]
    for image, result in zip([*images, images[0]], [*batched, *alone], strict=True):
        expected = reference.probabilities(reference.input_from_bytes(image))
        np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


def test_cuda_graphs_change_nothing_on_the_cpu(make_server, reference):
    running = make_server(cuda_graphs="true", max_batch_size=4)
    # The eager network runs, split into the warmed sizes.
    assert running.app.engines[0].info.runs == "cpu runs fp32 eagerly at batch sizes 1, 2, 3, 4"
    image = encode(random_rgb(5))
    with Client(running.target) as client:
        [result] = client.classify([image], full=True)
    expected = reference.probabilities(reference.input_from_bytes(image))
    np.testing.assert_allclose(result.probabilities, expected, atol=1e-5, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("saved_on", ["cuda:0", "cpu"])
def test_checkpoint_saved_on_any_device_loads_on_cuda_and_cpu(tmp_path, weights_file, saved_on):
    from resnet_server.common.model import load_state_dict_file

    state = {key: value.to(saved_on) for key, value in weights_file[1].items()}
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, tmp_path / "w.pth")
    for target in ("cuda:0", "cpu"):
        loaded = load_state_dict_file(tmp_path / "w.pth", torch.device(target))
        assert all(tensor.device == torch.device(target) for tensor in loaded.values())


@pytest.mark.slow
def test_client_round_robin_spreads_calls_over_three_server_processes(weights_file):
    ports = [(free_port(), free_port()) for _ in range(3)]
    processes = [subprocess.Popen(
        [sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(port), "--metrics-port",
         str(metrics), "--device", "cpu", "--weights", str(weights_file[0]), "--log-level", "WARNING"])
        for port, metrics in ports]
    try:
        targets = [f"127.0.0.1:{port}" for port, _ in ports]
        for target in targets:
            with Client(target, timeout=5) as probe:
                wait_for(lambda probe=probe: serving(probe), timeout=120, interval=0.2)
        with Client(targets, timeout=60) as client:
            for _ in range(12):
                assert client.classify([IMAGE])[0].top_k
        counts = [scraped_value(metrics, 'resnet_requests_total{code="OK",device="cpu",protocol="grpc",worker="0"}')
                  for _, metrics in ports]
        assert sum(counts) == 12 and min(counts) >= 2, counts
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            assert process.wait(timeout=60) == 0


def test_every_worker_thread_gets_its_own_cuda_graph_state():
    """A thread other than the one that imported inductor's CUDA graph trees has no state for them until the
    runner sets it up (older torch then failed an assertion on the first reduce-overhead call)."""
    from torch._inductor import cudagraph_trees

    main_state = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
    seen = {}

    def worker() -> None:
        seen["before"] = hasattr(cudagraph_trees.local, "tree_manager_containers")
        cuda_graph_state_for_this_thread()
        cuda_graph_state_for_this_thread()  # a second call keeps the first one's state
        seen["state"] = cudagraph_trees.local.tree_manager_containers
        seen["lock"] = cudagraph_trees.local.tree_manager_locks[0]

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["before"] is False
    assert seen["state"] == {} and seen["state"] is not main_state
    assert hasattr(seen["lock"], "acquire")
    cuda_graph_state_for_this_thread()  # the importing thread keeps what it has
    assert cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers") is main_state


@pytest.mark.parametrize("flags, expected", [
    ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", "AMX (amx_bf16): --precision bf16 runs the model about 3x"),
    ("fpu avx512f avx512_bf16 avx512_vnni", "AVX-512 BF16 (avx512_bf16): --precision bf16 runs the model about 1.8x"),
    ("fpu avx512f amx_tile avx512_vnni", None),
])
def test_the_bf16_unit_is_read_from_the_cpu_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: amx_bf16 in a name is not a flag\nflags\t\t: {flags}\n")
    unit = cpu_bf16_unit(cpuinfo)
    assert unit == expected if expected is None else unit.startswith(expected)
    assert cpu_bf16_unit(tmp_path / "absent") is None


def test_an_fp32_cpu_server_on_a_bf16_cpu_logs_the_bf16_hint_once(make_server, caplog):
    def hints() -> int:
        return sum("--precision bf16" in record.getMessage() for record in caplog.records)

    caplog.set_level(logging.INFO, logger="resnet_server.frontend.server")
    make_server(devices=("cpu", "cpu"))
    assert hints() == (1 if cpu_bf16_unit() else 0)  # this machine's own /proc/cpuinfo decides
    caplog.clear()
    make_server(precision="bf16")
    assert hints() == 0


@pytest.mark.slow
def test_random_batch_sizes_run_only_warmed_shapes_and_match_the_unsplit_answer(weights_file):
    """Past warm-up the network sees no shape it was not warmed with: a batch whose size is no bucket is split
    into buckets on the CPU, and its answers equal one pass over the whole batch."""
    from torchvision.models import resnet18

    model = resnet18()
    model.load_state_dict(weights_file[1])
    runner = ModelRunner(model, torch.device("cpu"))
    plain = ModelRunner(resnet18().eval(), torch.device("cpu"))
    plain.model.load_state_dict(runner.model.state_dict())
    runner.warm_up(bucket_sizes(24, cuda=False)[5:])  # [1, 6, 7, 8, 16, 24]: 2 to 5 and 9 to 15 are no bucket
    assert runner.buckets == [1, 6, 7, 8, 16, 24] and not runner.sizes_run
    generator = torch.Generator().manual_seed(3)
    for size in torch.randint(1, 25, (6,), generator=generator).tolist():
        batch = torch.randn(size, 3, 224, 224, generator=generator)
        probabilities, logits = runner(batch, torch.full((size,), 2.0))
        expected_probabilities, expected_logits = plain(batch, torch.full((size,), 2.0))
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(probabilities, expected_probabilities, rtol=0, atol=1e-6)
        assert runner.padding_for(size) == 0  # the CPU splits, never pads
    assert runner.sizes_run and runner.sizes_run <= set(runner.buckets)


def test_a_replica_uses_every_core_on_the_cpu_and_one_host_thread_for_a_gpu_unless_told():
    cores = len(os.sched_getaffinity(0))
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert [replica_torch_threads(ServerConfig(), device) for device in (cpu, gpu)] == [cores, 1]
    assert [replica_torch_threads(ServerConfig(torch_threads=3), device) for device in (cpu, gpu)] == [3, 3]


@pytest.mark.slow
def test_a_rebuilt_runner_replaces_the_first_one_which_nothing_keeps(weights_file):
    """A TorchScript (or compiled) replica builds a new runner for new weights: once it serves, the first runner,
    its graph and its tensors, are freed, not kept for the life of the engine."""
    config = engine_config(base_config(str(weights_file[0]), torchscript=True, max_batch_size=1))
    ignore = Answers(lambda *_: None, lambda *_: None, lambda *_: None)
    replica = load_replica("cpu", torch.device("cpu"), config, Metrics(1), lambda: None, ignore)
    try:
        first = weakref.ref(replica.runner)
        replica.stage(str(weights_file[0]))
        replica.commit(2)
        gc.collect()
        assert first() is None and replica.batcher.weights_version == 2
    finally:
        replica.batcher.stop()
