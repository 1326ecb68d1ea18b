"""The request-handling ceiling: how many calls a second the server answers when its model costs nothing.

Runs resnet-server (every flag) with each engine's input conversion and forward pass replaced by ready-made
tensors, so all that is left of a call is what the serving path itself costs: gRPC, the handler, the slab,
the engine's queue and hand-offs, and the answer. Load it with ``resnet-client bench`` and set the figure
beside ``resnet-server bench-model``'s ceiling for your device: a GPU that computes more images a second than
the front-ends can hand it needs more ``--frontends``. scripts/frontend_cost.py runs it beside bare grpc.aio.
Its answers are meaningless (every probability 0.001): a measuring instrument, never a server.

Usage: python scripts/handling_ceiling.py [resnet-server flags]
"""

from __future__ import annotations

import functools
import sys

import torch

import server.runner

MOST_IMAGES = 1024  # more than any batch: --max-batch-size caps them
_INPUTS = torch.zeros((MOST_IMAGES, 3, 224, 224))
_PROBABILITIES = torch.full((MOST_IMAGES, 1000), 1e-3)
_LOGITS = torch.zeros((MOST_IMAGES, 1000))
_NONE_REJECTED: dict = {}


@functools.cache
def _ready_made(size: int) -> tuple[torch.Tensor, server.runner.PendingScores]:
    """A batch of ``size``'s inputs and scores, made once per size: any torch call a batch would be the
    instrument's own cost."""
    return _INPUTS[:size], server.runner.PendingScores(_PROBABILITIES[:size], _LOGITS[:size])


def _prepare(runner, images):
    return _ready_made(len(images))[0], _NONE_REJECTED


def _launch(runner, inputs, temperatures):
    return _ready_made(len(inputs))[1]


# At import, not in main: the server spawns its engines, which import this module again (as __mp_main__).
server.runner.ModelRunner.prepare = _prepare
server.runner.ModelRunner.launch = _launch

if __name__ == "__main__":
    from server.app import main

    sys.exit(main(sys.argv[1:]))
