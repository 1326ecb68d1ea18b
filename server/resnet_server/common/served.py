"""What the supervisor tells every process about the weights served (no torch: the control plane carries it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedWeights:
    """The weights the server serves, as the supervisor tells the front-ends: where they come from, their version
    and SHA-256, and whether the model is loaded at all (an unload makes it not ready until the next load)."""

    source: str  # --weights (a path, imagenet or random), or a file of weights a client sent
    version: int
    sha256: str = ""  # "" until an engine has loaded them
    loaded: bool = True
