"""What a front-end and an engine both hold of one image: the work queued for it and its result."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from resnet_server.common.device_decode import DeferredJpeg
from resnet_server.common.preprocess import CroppedImage, RawImage
from resnet_server.common.statistics import BatchTiming

# What the batcher hands the runner per image: a ready CPU tensor (decoded in a preprocessing thread),
# a JPEG to decode on the device, a checked raw tensor to convert with its batch, or a front-end's crop to
# normalise with it.
ModelInput = torch.Tensor | DeferredJpeg | RawImage | CroppedImage


@dataclass(frozen=True)
class ImageOutput:
    """One image's result, on the CPU."""

    probabilities: np.ndarray  # float32 [1000], softmax(logits / T)
    logits: np.ndarray  # float32 [1000], before temperature
    top_k: list[tuple[int, float]]
    temperature: float
    queue_seconds: float
    timing: BatchTiming  # its batch's compute, in parts
    device: str
    weights_version: int = 1  # of the weights that computed it
    batch: int = 0  # its batch's number on its device (counted from 1; 0: not known)
    batch_size: int = 0  # the images of its batch, from every caller
    buckets: tuple[int, ...] = ()  # the sizes its batch ran at (padded to a bucket, or split into buckets)


class Caller(Protocol):
    """Whoever awaits an item's answer: on a front-end, its call's asyncio future; in an engine, the Ticket of a
    front-end's slot."""

    def done(self) -> bool:
        """True once the caller has gone (cancelled): the item is then dropped before compute."""


CallerT = TypeVar("CallerT", bound=Caller)


@dataclass(eq=False)
class WorkItem(Generic[CallerT]):
    """One queued image and whoever awaits it."""

    model_input: ModelInput  # a preprocessed image, or one the replica converts with its batch
    temperature: float
    top_k: int
    deadline: float | None  # time.monotonic() value, or None for no deadline
    caller: CallerT
    request_id: str = ""
    client: str = ""  # whose share of the device it takes (resnet_server.engine.fair_queue); "": everyone's
    weight: int = 1  # its client's share beside other clients'
    priority: int = 0  # within its client's: 1 first, then 2, ...; 0 after every numbered level
    enqueued: float = field(default_factory=time.monotonic)

    def is_dead(self, now: float) -> str | None:
        """Why this item must not be computed (cancelled, deadline), or None."""
        if self.caller.done():  # only cancellation completes a queued item's future early
            return "cancelled"
        if self.deadline is not None and now >= self.deadline:
            return "deadline"
        return None
