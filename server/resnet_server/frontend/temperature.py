"""The served default temperature: from --temperature, or from a fitted file (--temperature-file)."""

from __future__ import annotations

from resnet_server.common.errors import StartupError
from resnet_server.common.flag_files import read_temperature
from resnet_server.common.sections import FrontendConfig


def default_temperature(config: FrontendConfig) -> tuple[float, str]:
    """(T, where it came from). A file written by ``resnet-client calibrate`` wins over the flag."""
    if not config.temperature_file:
        return config.temperature, "flag"
    try:
        return read_temperature(config.temperature_file), f"file:{config.temperature_file}"
    except ValueError as exc:
        raise StartupError(str(exc)) from None
