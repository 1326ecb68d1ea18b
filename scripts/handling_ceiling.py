"""The request-handling ceiling: how many calls a second the server answers when its model costs nothing.

Runs resnet-server (every flag) with each engine's input conversion and forward pass replaced by ready-made
tensors, so all that is left of a call is what the serving path itself costs: gRPC, the handler, the slab,
the engine's queue and hand-offs, and the answer. Load it with ``resnet-client bench`` and set the figure
beside ``resnet-server bench-model``'s ceiling for your device: a GPU that computes more images a second than
the front-ends can hand it needs more ``--frontends``. scripts/frontend_cost.py runs it beside bare grpc.aio.
Its answers are meaningless (every probability 0.001): a measuring instrument, never a server.

``--compute-ms N`` makes every batch's scores land N ms after its launch, as a GPU's do: the engine's threads
wait for them with the GIL released and the CPU idle, so the engine is busy between batches as it is on a
device, rather than always waiting for the next message (what the front-ends' messages then cost differs).

Usage: python scripts/handling_ceiling.py [--compute-ms N] [resnet-server flags]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import torch

import server.runner

MOST_IMAGES = 1024  # more than any batch: --max-batch-size caps them
_INPUTS = torch.zeros((MOST_IMAGES, 3, 224, 224))
_PROBABILITIES = torch.full((MOST_IMAGES, 1000), 1e-3)
_LOGITS = torch.zeros((MOST_IMAGES, 1000))
_NONE_REJECTED: dict = {}
COMPUTE_MS = "HANDLING_CEILING_COMPUTE_MS"  # how --compute-ms reaches the engines, which import this module again
_compute_seconds = float(os.environ.get(COMPUTE_MS, "0")) / 1000


@functools.cache
def _ready_made(size: int) -> tuple[torch.Tensor, server.runner.PendingScores]:
    """A batch of ``size``'s inputs and scores, made once per size: any torch call a batch would be the
    instrument's own cost."""
    return _INPUTS[:size], server.runner.PendingScores(_PROBABILITIES[:size], _LOGITS[:size])


def _prepare(runner, images):
    return _ready_made(len(images))[0], _NONE_REJECTED


class _Computing(server.runner.PendingScores):
    """A batch's ready-made scores, waited for until ``--compute-ms`` after its launch."""

    def __init__(self, size: int) -> None:
        super().__init__(_PROBABILITIES[:size], _LOGITS[:size])
        self._landed_at = time.monotonic() + _compute_seconds

    def wait(self):
        time.sleep(max(0.0, self._landed_at - time.monotonic()))
        return super().wait()


def _launch(runner, inputs, temperatures):
    return _Computing(len(inputs)) if _compute_seconds else _ready_made(len(inputs))[1]


# At import, not in main: the server spawns its engines, which import this module again (as __mp_main__).
server.runner.ModelRunner.prepare = _prepare
server.runner.ModelRunner.launch = _launch

if __name__ == "__main__":
    from server.app import main

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    own, server_flags = parser.parse_known_args(sys.argv[1:])
    os.environ[COMPUTE_MS] = str(own.compute_ms)
    _compute_seconds = own.compute_ms / 1000
    sys.exit(main(server_flags))
