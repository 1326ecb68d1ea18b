"""What a torch call costs the replica's worker while another thread holds the GIL.

Every torch call releases the GIL and must win it back; when the event loop is busy (parsing requests), that
takes up to the switch interval. This times the steps of one batch (--batch images) each way, with and without
a thread that keeps the GIL busy, at the switch interval given: the results, per image (three torch calls an
image, as the batcher did before 2026-11-22) and per batch (three in all); the copy of raw uint8 images into
one tensor, per image through NumPy (which gives the GIL up for each, as before) and through a memoryview
(now); and a batch of eight 64x64 images through the runner (forward pass and softmax; short, as a GPU's is,
so the waits show), eager (a GIL round trip per operator) and as the runner's frozen TorchScript graph
(--torchscript: one), and the runner's conversion of eight raw 64x64 uint8 images before it. One torch thread,
so that on two cores the busy thread and the torch calls each have a core and only the GIL is shared.

Usage: python scripts/gil_probe.py [--switch-interval-ms 5] [--batch 64] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

from server.model import LoadedWeights, build_model, random_state_dict
from server.postprocess import top_k
from server.preprocess import RawImage, _stack_bytes
from server.runner import ModelRunner

SHAPE = (224, 224, 3)


def results_per_image(probabilities: torch.Tensor, images: list[bytes]) -> list:
    return [top_k(probabilities[i:i + 1], [5])[0] for i in range(len(probabilities))]


def results_per_batch(probabilities: torch.Tensor, images: list[bytes]) -> list:
    return top_k(probabilities, [5] * len(probabilities))


def copy_per_image_numpy(probabilities: torch.Tensor, images: list[bytes]) -> torch.Tensor:
    batch = torch.empty((len(images), *SHAPE), dtype=torch.uint8)
    for row, data in zip(batch.numpy(), images, strict=True):
        row[...] = np.frombuffer(data, dtype=np.uint8).reshape(SHAPE)
    return batch


def copy_memoryview(probabilities: torch.Tensor, images: list[bytes]) -> torch.Tensor:
    return _stack_bytes(images, "uint8", SHAPE, pinned=False)


def forward_steps() -> list:
    """A runner's batch (forward pass and softmax), eager and as TorchScript, each a step like the ones above."""
    cpu = torch.device("cpu")
    small, temperatures = torch.zeros((8, 3, 64, 64)), torch.ones(8, dtype=torch.float64)
    steps = []
    for torchscript in (False, True):
        runner = ModelRunner(build_model(LoadedWeights(random_state_dict(), "random"), cpu), cpu,
                             torchscript=torchscript)

        def forward(probabilities, images, runner=runner) -> torch.Tensor:
            return runner(small, temperatures)[0]

        forward.__name__ = "forward_torchscript" if torchscript else "forward_eager"
        forward(None, None)
        forward(None, None)  # TorchScript optimises a graph on its second call
        steps.append(forward)
    raw = [RawImage("uint8", (64, 64, 3), bytes(64 * 64 * 3))] * 8

    def prepare_raw(probabilities, images) -> torch.Tensor:
        return runner.prepare(raw)[0]  # what the worker does before either: about 24 torch calls

    return [*steps, prepare_raw]


def hold_the_gil(stop: threading.Event) -> None:
    while not stop.is_set():  # pure Python: gives the GIL up only when the interpreter makes it
        sum(range(1000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switch-interval-ms", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_interval_ms / 1000)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.softmax(torch.randn(args.batch, 1000, generator=generator), 1)
    images = [torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=generator).numpy().tobytes()
              for _ in range(args.batch)]
    steps = [results_per_image, results_per_batch, copy_per_image_numpy, copy_memoryview, *forward_steps()]
    stop = threading.Event()
    for busy in (False, True):
        if busy:
            threading.Thread(target=hold_the_gil, args=(stop,), daemon=True).start()
        for step in steps:
            started = time.perf_counter()
            for _ in range(args.repeats):
                step(probabilities, images)
            elapsed_ms = 1000 * (time.perf_counter() - started) / args.repeats
            print(f"switch interval {args.switch_interval_ms} ms, GIL {'busy' if busy else 'free'}: "
                  f"{step.__name__} {elapsed_ms:.2f} ms a call")
    stop.set()


if __name__ == "__main__":
    main()
