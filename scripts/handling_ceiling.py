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

import sys

import torch

import server.runner

MOST_IMAGES = 1024  # more than any batch: --max-batch-size caps them
_INPUTS = torch.zeros((MOST_IMAGES, 3, 224, 224))
_PROBABILITIES = torch.full((MOST_IMAGES, 1000), 1e-3)
_LOGITS = torch.zeros((MOST_IMAGES, 1000))
# Made once per batch size, so a batch costs one lookup: any torch call here would be the instrument's own cost.
_PREPARED: dict[int, tuple] = {}
_SCORES: dict[int, server.runner.PendingScores] = {}


def _prepare(runner, images):
    size = len(images)
    if size not in _PREPARED:
        _PREPARED[size] = (_INPUTS[:size], {})
    return _PREPARED[size]


def _launch(runner, inputs, temperatures):
    size = len(inputs)
    if size not in _SCORES:
        _SCORES[size] = server.runner.PendingScores(_PROBABILITIES[:size], _LOGITS[:size])
    return _SCORES[size]


# At import, not in main: the server spawns its engines, which import this module again (as __mp_main__).
server.runner.ModelRunner.prepare = _prepare
server.runner.ModelRunner.launch = _launch

if __name__ == "__main__":
    from server.app import main

    sys.exit(main(sys.argv[1:]))
