"""The files flags name for the front-ends (--temperature-file, --auth-token-file): read once when the flags are
checked, so that a bad one is a usage error before any process starts, and again by each front-end, which
uses what they hold."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TokenEntry:
    """One line of a token file: ``TOKEN [name=NAME] [weight=N]``. The name labels the token's caller in metrics
    and logs (default ``token-K`` for the K-th token); the weight is its share of a device beside other tokens'
    (``--fair-share token``; default 1)."""

    token: bytes
    name: str
    weight: int = 1


MAX_WEIGHT = 1000
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def read_token_entries(path: str | Path) -> list[TokenEntry]:
    """The token file's entries, one a line (blank lines and # comments skipped); ValueError, naming the line but
    never a token, if it holds none, cannot be read, or has a line that does not parse."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read tokens from {path}: {exc}") from None
    entries: list[TokenEntry] = []
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        try:
            entries.append(_entry(fields, len(entries) + 1))
        except ValueError as exc:
            raise ValueError(f"{path}, line {number}: {exc}") from None
    if not entries:
        raise ValueError(f"{path} holds no token (one a line; blank lines and # comments are skipped)")
    names = [entry.name for entry in entries]
    if len(set(names)) < len(names):
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"{path}: the name {twice} is given to two tokens")
    return entries


def _entry(fields: list[str], position: int) -> TokenEntry:
    options: dict[str, str] = {}
    for option in fields[1:]:
        key, equals, value = option.partition("=")
        if key not in ("name", "weight") or not equals:
            raise ValueError(f"expected name=NAME or weight=N after the token, got {option[:20]!r}")
        options[key] = value
    name = options.get("name", f"token-{position}")
    if not _NAME.fullmatch(name):
        raise ValueError("a token's name is 1-64 letters, digits, '_', '.' or '-'")
    weight = options.get("weight", "1")
    if not weight.isdigit() or not 1 <= int(weight) <= MAX_WEIGHT:
        raise ValueError(f"a token's weight is a whole number from 1 to {MAX_WEIGHT}")
    return TokenEntry(fields[0].encode(), name, int(weight))
