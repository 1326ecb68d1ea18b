"""The served default temperature: from --temperature, or from a fitted file (--temperature-file)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from resnet_server.common.errors import StartupError
from resnet_server.common.sections import FrontendConfig


def default_temperature(config: FrontendConfig) -> tuple[float, str]:
    """(T, where it came from). A file written by ``resnet-client calibrate`` wins over the flag."""
    if not config.temperature_file:
        return config.temperature, "flag"
    path = Path(config.temperature_file)
    try:
        value = float(json.loads(path.read_text())["temperature"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StartupError(f"cannot read a temperature from {path}: {exc} (expected JSON like "
                           '{"temperature": 1.3})') from None
    if not math.isfinite(value) or value <= 0:
        raise StartupError(f"temperature in {path} must be finite and > 0, got {value}")
    return value, f"file:{path}"
