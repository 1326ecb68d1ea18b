"""The GPU fast path on a real CUDA device (skipped without one; scripts/gpu_check.sh runs these).

One synchronisation per batch and none at its launch, answers like the CPU reference in every precision, and
two replicas sharing one GPU each with its own metric label.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from resnet_client import Client
from resnet_server.common.model import build_model, load_weights
from resnet_server.common.preprocess import RawImage
from resnet_server.engine.runner import ModelRunner
from tests.helpers import EngineSet, Reference, base_config, free_port, random_rgb, save_random_weights
from tests.server_process import Workers

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PIXELS = [random_rgb(seed) for seed in (51, 52, 53)]
LARGE = random_rgb(54, 720, 960)  # 2 MB of raw pixels: more than an engine's slot takes as it came


def synchronisations(action) -> int:
    """How many synchronising CUDA calls ``action`` makes, as torch's sync debug mode counts them."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            action()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


def test_a_batch_synchronises_only_when_its_results_come_back(weights_file):
    device = torch.device("cuda:0")
    runner = ModelRunner(build_model(load_weights(str(weights_file[0]), device), device), device, "fp32", True)
    runner.warm_up([4])  # also places the normalisation constants on the device
    images = [RawImage("uint8", pixels.shape, pixels.tobytes()) for pixels in PIXELS]

    def batch() -> None:
        inputs, errors = runner.prepare(images)  # pinned uint8 upload, resize and normalise on the GPU
        assert not errors and inputs.device == device
        runner(inputs, torch.ones(len(images)))

    def one_wait() -> None:  # what a batch waits on: an event recorded on the runner's stream
        landed = torch.cuda.Event()
        landed.record(runner.stream)
        landed.synchronize()

    batch()  # a batch of 3 once, so any autotuning for its shape is done
    explicit = synchronisations(one_wait)  # 1 if torch counts it, else 0
    assert synchronisations(batch) == explicit


def test_a_launch_returns_before_its_batch_is_done_and_two_in_flight_answer_alike(weights_file):
    """The engine's overlap: launching makes no synchronisation at all (the host goes on to the next batch),
    and two batches launched back to back, waited on afterwards, answer as each does alone."""
    device = torch.device("cuda:0")
    runner = ModelRunner(build_model(load_weights(str(weights_file[0]), device), device), device, "fp32", True)
    runner.warm_up([2, 4])
    first = [RawImage("uint8", pixels.shape, pixels.tobytes()) for pixels in PIXELS]
    second = first[:2]
    alone = [runner(runner.prepare(images)[0], torch.ones(len(images)))[0].clone() for images in (first, second)]
    launched = []
    assert synchronisations(lambda: launched.extend(
        runner.launch(runner.prepare(images)[0], torch.ones(len(images))) for images in (first, second))) == 0
    for pending, expected in zip(launched, alone, strict=True):
        torch.testing.assert_close(pending.wait()[0], expected, atol=1e-6, rtol=0)


def test_host_rows_for_a_gpu_are_stacked_into_pinned_memory_and_launched_without_a_sync(weights_file):
    """Images decoded on the CPU (front-ends, float32 clients) reach a GPU runner as host rows: one copy into
    pinned memory in the model's layout, uploaded from as it is."""
    device = torch.device("cuda:0")
    runner = ModelRunner(build_model(load_weights(str(weights_file[0]), device), device), device, "fp32", True)
    runner.warm_up([4])
    rows = [torch.rand(3, 224, 224) for _ in range(3)]
    inputs, errors = runner.prepare(rows)
    assert not errors and inputs.is_pinned() and inputs.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(inputs, torch.stack(rows), atol=0, rtol=0)
    alone = runner(torch.stack(rows), torch.ones(3))[0]
    launched = []
    assert synchronisations(lambda: launched.append(runner.launch(inputs, torch.ones(3)))) == 0
    torch.testing.assert_close(launched[0].wait()[0], alone, atol=1e-6, rtol=0)


@pytest.mark.parametrize("precision, tolerance", [("fp32", 0.02), ("fp16", 0.05), ("bf16", 0.1)])
def test_cuda_answers_match_the_cpu_reference(make_server, reference, precision, tolerance):
    # TF32 convolutions (torch's default for fp32 on Ampere and later), reduced precision and the GPU
    # resize (within one grey level of the CPU's) move the logits by a fraction of their range.
    running = make_server(devices=("cuda:0",), precision=precision)
    float_input = reference.input_from_array(PIXELS[2]).numpy()
    with Client(running.target) as client:
        results = client.classify([PIXELS[0], PIXELS[1], float_input], full=True, logits=True)
    expected = [reference.input_from_array(PIXELS[0]), reference.input_from_array(PIXELS[1]),
                torch.from_numpy(float_input)]
    for result, model_input in zip(results, expected, strict=True):
        want = reference.logits(model_input.unsqueeze(0))[0].numpy()
        assert result.device == "cuda:0"
        np.testing.assert_allclose(result.logits, want, atol=tolerance * np.abs(want).max(), rtol=0)


def test_an_engine_process_on_cuda_answers_like_the_cpu_reference(weights_file, reference):
    """The served path: a front-end hands raw images (and the crop of one too large for a slot) to an engine
    process on the GPU through the slab (gathered from their slots a batch at once, uploaded from pinned memory,
    normalised there), as every server does."""
    engine_set = EngineSet(base_config(str(weights_file[0]), devices=("cuda:0",), frontends=1,
                                       metrics_port=free_port()))
    try:
        frontend = engine_set.frontend()
        images = [*PIXELS, LARGE]  # LARGE is over a slot: the front-end crops it, the engine normalises it
        with Client(frontend.target) as client:
            results = client.classify(images, full=True, logits=True)
        for result, pixels in zip(results, images, strict=True):
            want = reference.logits(reference.input_from_array(pixels).unsqueeze(0))[0].numpy()
            assert result.device == "cuda:0"
            np.testing.assert_allclose(result.logits, want, atol=0.02 * np.abs(want).max(), rtol=0)
        assert engine_set.taken_slots() == 0
        # The engine copies bytes on one host thread: an OpenMP team would spin beside the front-ends.
        assert frontend.app.engines[0].info.torch_threads == 1
    finally:
        engine_set.stop()


def test_two_replicas_share_one_gpu_with_their_own_labels(make_server):
    running = make_server(devices=("cuda:0", "cuda:0"))
    names = [replica.name for replica in running.app.engines]
    assert len(set(names)) == 2
    with Client(running.target) as client:
        for _ in range(4):
            client.classify([PIXELS[0]])
    for name in names:  # least-queued routing, ties in turn: sequential calls alternate
        assert running.sample("resnet_batch_size_count", device=name) == 2
        assert running.sample("resnet_gpu_memory_allocated_bytes", device=name) > 0


@pytest.mark.parametrize("precision, tolerance", [("fp32", 0.02), ("fp16", 0.05)])  # as the eager test's
def test_torchscript_on_cuda_matches_the_cpu_reference(make_server, reference, precision, tolerance):
    running = make_server(devices=("cuda:0",), torchscript=True, precision=precision, max_batch_size=4)
    with Client(running.target) as client:
        batched = client.classify(PIXELS, full=True, logits=True)  # a batch of 3: no warm-up size (1, 2, 4)
        alone = client.classify(PIXELS[:1], full=True, logits=True)
    runs = running.app.engines[0].info.runs
    assert runs == f"cuda:0 runs {precision} as a TorchScript graph at batch sizes 1, 2, 4"
    assert running.sample("resnet_padded_images_total", device="cuda:0") == 1  # the batch of 3 ran as the warmed 4
    for result, pixels in zip([*batched, *alone], [*PIXELS, PIXELS[0]], strict=True):
        want = reference.logits(reference.input_from_array(pixels).unsqueeze(0))[0].numpy()
        assert result.device == "cuda:0"
        np.testing.assert_allclose(result.logits, want, atol=tolerance * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("precision, tolerance", [("fp32", 0.02), ("fp16", 0.05)])  # as the eager test's
def test_cuda_graphs_replay_padded_batches_as_the_cpu_reference(make_server, reference, precision, tolerance):
    running = make_server(devices=("cuda:0",), cuda_graphs="true", precision=precision, max_batch_size=4)
    # The served engine captured a graph at every warmed size (the sizes named are those of its graphs).
    runs = running.app.engines[0].info.runs
    assert runs == f"cuda:0 runs {precision} as CUDA graphs at batch sizes 1, 2, 4"
    with Client(running.target) as client:
        first = client.classify(PIXELS, full=True, logits=True, temperature=2.0)  # padded to the graph of 4
        alone = client.classify(PIXELS[:1], full=True, logits=True)  # the graph of 1, sharing the pool with 4's
        again = client.classify(PIXELS[1:], full=True, logits=True)  # 2: the graph of 4's rows left behind
    assert running.sample("resnet_padded_images_total", device="cuda:0") == 1  # only the 3 ran padded (to 4)
    for result, pixels, temperature in zip([*first, *alone, *again], [*PIXELS, PIXELS[0], *PIXELS[1:]],
                                           [2.0, 2.0, 2.0, 1.0, 1.0, 1.0], strict=True):
        want = reference.logits(reference.input_from_array(pixels).unsqueeze(0))[0].numpy()
        np.testing.assert_allclose(result.logits, want, atol=tolerance * np.abs(want).max(), rtol=0)
        logits = np.asarray(result.logits, dtype=np.float64)
        scaled = np.exp((logits - logits.max()) / temperature)  # the softmax replayed with the call's T
        assert result.temperature == temperature
        np.testing.assert_allclose(result.probabilities, scaled / scaled.sum(), atol=1e-5, rtol=0)


def test_cuda_graph_replays_launch_without_a_sync_and_two_in_flight_answer_alike(weights_file):
    device = torch.device("cuda:0")
    model = build_model(load_weights(str(weights_file[0]), device), device)
    runner = ModelRunner(model, device, "fp16", True, cuda_graphs=True)
    runner.warm_up([4])
    batches = [(torch.rand((3, 3, 224, 224), device=device), torch.full((3,), temperature))
               for temperature in (1.0, 2.0)]
    alone = [runner(*batch)[0].clone() for batch in batches]
    launched = []  # the same graph twice, the second replay queued before the first's scores are read
    assert synchronisations(lambda: launched.extend(runner.launch(*batch) for batch in batches)) == 0
    for pending, expected in zip(launched, alone, strict=True):  # each copy back was queued before the next replay
        torch.testing.assert_close(pending.wait()[0], expected, atol=1e-6, rtol=0)


# max-autotune times several kernels for every convolution of every batch size before it keeps one: minutes on a
# GPU, so it has the marker scripts/gpu_check.sh runs after its measurements, and more time than the default.
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead",
                                          pytest.param("max-autotune", marks=(pytest.mark.autotune,
                                                                              pytest.mark.timeout(900)))])
def test_compiled_cuda_batches_are_padded_and_match_the_cpu_reference(make_server, reference, compile_mode, tmp_path):
    running = make_server(devices=("cuda:0",), compile=True, compile_mode=compile_mode, max_batch_size=4,
                          compile_cache=str(tmp_path / "cache"))
    runs = running.app.engines[0].info.runs
    assert runs.startswith(f"cuda:0 runs fp32 compiled by inductor ({compile_mode}) at batch sizes 1, 2, 4; graphs "
                           f"from inductor's cache at {tmp_path / 'cache'}: 0 loaded, ")  # an empty cache
    compiled, uncacheable = map(int, re.findall(r"(\d+) compiled, (\d+) not cacheable", runs)[0])
    assert compiled + uncacheable == 3  # one graph a batch size
    with Client(running.target) as client:
        first = client.classify(PIXELS, full=True, logits=True)  # one batch of 3, padded up to the graph of 4
        second = client.classify(PIXELS[:1], full=True, logits=True)  # the graph of 1 (CUDA graphs reuse their memory)
        third = client.classify(PIXELS[1:], full=True, logits=True)  # padded to 2
    assert running.sample("resnet_batch_size_count", device="cuda:0") == 3
    for result, pixels in zip([*first, *second, *third], [*PIXELS, PIXELS[0], *PIXELS[1:]], strict=True):
        want = reference.logits(reference.input_from_array(pixels).unsqueeze(0))[0].numpy()
        np.testing.assert_allclose(result.logits, want, atol=0.02 * np.abs(want).max(), rtol=0)


@pytest.mark.timeout(900)
def test_a_reduce_overhead_reload_serves_the_new_weights_from_the_workers_thread(tmp_path):
    """The review's N10 (b): a reload's compiled runner is built and warmed on the engine's orders thread, and
    inductor keeps CUDA graph trees per thread; read in torch 2.14, a compiled graph is bound to the tree of the
    thread that first ran it, so the worker replays what the warm-up recorded. Served: every answer after the reload
    is the new weights'."""
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    save_random_weights(first, 1)
    second_reference = Reference(save_random_weights(second, 2))
    want = second_reference.probabilities(second_reference.input_from_array(PIXELS[0]))
    workers = Workers(str(first), "--device", "cuda:0", "--model-control", "explicit", "--compile", "--compile-mode",
                      "reduce-overhead", "--max-batch-size", "2", "--frontends", "1")
    try:
        port, _ = workers.serving(1)
        with Client(f"127.0.0.1:{port}", timeout=300) as client:
            client.reload(second.read_bytes())
            for _ in range(3):  # the graph recorded, then replayed
                (result,) = client.classify([PIXELS[0]], full=True)
                assert np.abs(np.asarray(result.probabilities) - want).max() < 1e-3
    finally:
        workers.close()
