"""What runs an engine's batches, chosen by name (``--runner``): the model, or an instrument in its place.

- ``model``: the ModelRunner, the only one that serves real answers;
- ``free[:MS]``: no forward pass: each batch's scores are ready-made (every probability 0.001), landing MS
  milliseconds after the launch as a GPU's do, so that what is measured is the serving path's own cost;
- ``faulty:FILE``: the model, its batches failing as FILE says when each is launched, warm-up's too (a test's fault
  injection, across processes: the test writes the file, the engine reads it). A line, ``@REPLICA `` first for
  one replica's batches only (``@cpu#1 fail ...``), then one of:
  ``fail MESSAGE`` (the launch raises RuntimeError), ``fail-late MESSAGE`` (the forward pass runs, then
  waiting for its scores raises), ``oom`` or ``oom-above N`` (out of memory, for every batch or for batches
  of more than N images), ``hold`` (the batch's scores land only once the file no longer says so), ``slow
  SECONDS`` (each forward pass takes at least that long, as on a slower device),
  ``broken MESSAGE`` (this engine process's device is broken for good, as a CUDA context an illegal address has
  poisoned: every batch and probe fails as ``fail`` does, in an engine that was running when the line was
  written; one started after it is healthy, as a fresh process's context is); empty or missing: no fault. A
  first line ``pipeline`` in the file when the engine starts makes it launch batches while others compute,
  and ``crops`` makes it take the uint8 crops front-ends send a GPU, as on CUDA (the pipeline's order and the
  crops' path then show on the CPU).

The instruments keep the model's loading and warm-up (the same start-up, the same log), and are named in
the engine's ready line.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from resnet_server.engine.runner import CUDA_BATCHES_IN_FLIGHT, ModelRunner, PendingScores


def build_runner(spec: str, replica: str, *args, **kwargs) -> ModelRunner:
    """The runner ``spec`` (``--runner``, checked by resnet_server.common.config.runner_spec) names, for the replica
    ``replica``, built with ModelRunner's arguments."""
    kind, _, argument = spec.partition(":")
    if kind == "free":
        return FreeRunner(float(argument or 0) / 1000, *args, **kwargs)
    if kind == "faulty":
        return FaultyRunner(Path(argument), replica, *args, **kwargs)
    return ModelRunner(*args, **kwargs)


@functools.cache
def _ready_made(size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of ``size``'s inputs, probabilities and logits, made once a size: a torch call a batch would be
    the instrument's own cost."""
    return (torch.zeros((size, 3, 224, 224)), torch.full((size, 1000), 1e-3), torch.zeros((size, 1000)))


class _Landing(PendingScores):
    """Ready-made scores that land ``seconds`` after the launch (waited for with the GIL released)."""

    def __init__(self, size: int, seconds: float) -> None:
        super().__init__(*_ready_made(size)[1:])
        self._landed_at = time.monotonic() + seconds

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(max(0.0, self._landed_at - time.monotonic()))
        return super().wait()


class FreeRunner(ModelRunner):
    """No conversion and no forward pass: a batch's inputs and scores are ready-made."""

    def __init__(self, compute_seconds: float, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.compute_seconds = compute_seconds

    def describe(self) -> str:
        return f"{self.device} runs no model (--runner free: ready-made scores, answers meaningless)"

    def prepare(self, images):
        return _ready_made(len(images))[0], {}

    def launch(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> PendingScores:
        return _Landing(len(inputs), self.compute_seconds)


class _FailingLate(PendingScores):
    def __init__(self, message: str) -> None:
        super().__init__(torch.empty(0), torch.empty(0))
        self._message = message

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError(self._message)


class _Held(PendingScores):
    """Scores that land once ``held()`` is false (asked every few milliseconds)."""

    def __init__(self, scores: PendingScores, held) -> None:
        super().__init__(*scores.wait())
        self._held = held

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        while self._held():
            time.sleep(0.005)
        return super().wait()


class _Slow(PendingScores):
    """Scores that land no sooner than ``landing`` (a time.monotonic() value)."""

    def __init__(self, scores: PendingScores, landing: float) -> None:
        super().__init__(*scores.wait())
        self._landing = landing

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(max(0.0, self._landing - time.monotonic()))
        return super().wait()


class FaultyRunner(ModelRunner):
    """The model, failing as the file at ``path`` says when a batch is launched (see the module's docstring)."""

    def __init__(self, path: Path, replica: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.path, self.replica = path, replica
        self._started = time.time()  # a ``broken`` line written before this is not this process's fault
        shape = self._fault()[0]  # how the engine works on CUDA, asked for at start-up
        if shape == "pipeline":
            self.batches_in_flight = CUDA_BATCHES_IN_FLIGHT
        self.takes_crops = self.takes_crops or shape == "crops"

    def describe(self) -> str:
        return f"{super().describe()}, failing as {self.path} says (--runner faulty)"

    def _fault(self) -> tuple[str, str]:
        """The file's first line for this replica: one that names none (every replica's), or ``@NAME ...``."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return "", ""
        for line in lines:
            if line.startswith("@"):
                replica, _, line = line[1:].partition(" ")
                if replica != self.replica:
                    continue
            kind, _, argument = line.strip().partition(" ")
            if kind:
                return kind, argument
        return "", ""

    def _written_since_start(self) -> bool:
        try:
            return self.path.stat().st_mtime >= self._started
        except FileNotFoundError:
            return False

    def launch(self, inputs: torch.Tensor, temperatures: torch.Tensor) -> PendingScores:
        kind, argument = self._fault()
        if kind == "fail" or (kind == "broken" and self._written_since_start()):
            raise RuntimeError(argument or "injected fault")
        if kind == "oom" or (kind == "oom-above" and len(inputs) > int(argument)):
            raise torch.cuda.OutOfMemoryError(f"injected: out of memory with a batch of {len(inputs)}")
        if kind == "fail-late":
            super().launch(inputs, temperatures).wait()
            return _FailingLate(argument or "injected fault after the forward pass")
        if kind == "hold":
            return _Held(super().launch(inputs, temperatures), lambda: self._fault()[0] == "hold")
        if kind == "slow":
            return _Slow(super().launch(inputs, temperatures), time.monotonic() + float(argument))
        return super().launch(inputs, temperatures)
