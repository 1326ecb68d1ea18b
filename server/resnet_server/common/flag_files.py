"""The files flags name for the front-ends (--temperature-file, --auth-token-file): read once when the flags are
checked, so that a bad one is a usage error before any process starts, and again by each front-end, which
uses what they hold."""

from __future__ import annotations

import json
import math
from pathlib import Path


def read_temperature(path: str | Path) -> float:
    """The temperature in a file ``resnet-client calibrate`` wrote (JSON ``{"temperature": T}``), finite and > 0;
    ValueError saying what is wrong otherwise."""
    try:
        value = float(json.loads(Path(path).read_text())["temperature"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read a temperature from {path}: {exc} (expected JSON like "
                         '{"temperature": 1.3})') from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"the temperature in {path} must be finite and > 0, got {value}")
    return value


def read_tokens(path: str | Path) -> list[bytes]:
    """The bearer tokens, one a line (blank lines and # comments skipped); ValueError if it holds none or cannot
    be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read tokens from {path}: {exc}") from None
    tokens = [line.strip().encode() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not tokens:
        raise ValueError(f"{path} holds no token (one a line; blank lines and # comments are skipped)")
    return tokens
