"""Argument types for the command lines of the client and the server (``argparse`` ``type=`` callables).

Here, in the client package, because the client installs without torch and the server already depends on
it. A value a command cannot run with is refused while parsing: exit code 2 and one line saying why.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Number = TypeVar("Number", int, float)


def _number(text: str, kind: type[Number]) -> Number:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'a whole number' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535 (what 0 means is the flag's to say): gRPC would take 99999 as 99999 mod 65536."""
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {value}")
    return value


# The model's classes (ImageNet's): the server refuses a larger top_k as well.
CLASSES = 1000


def int_between(low: int, high: int) -> Callable[[str], int]:
    """A flag's type: a whole number from ``low`` to ``high`` (argparse's choices=range() would list them all)."""
    def checked(text: str) -> int:
        value = _number(text, int)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value

    checked.__name__ = f"int_between_{low}_{high}"
    return checked


top_k = int_between(1, CLASSES)


def positive_float(text: str) -> float:
    """Finite as well: a duration, rate or timeout of infinity never ends, NaN compares false to everything."""
    value = _number(text, float)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """A type for 'a,b,c', each part checked by ``item``."""
    def parse(text: str) -> list[T]:
        return [item(part) for part in text.split(",")]

    return parse


# The image both benchmarks use unless told: bench sends it, bench-model times its decode, so their figures
# compare as they stand.
DEFAULT_IMAGE_SIZE = (640, 480)


def size_text(size: tuple[int, int]) -> str:
    """(width, height) as 'WxH', the form ``image_size`` reads."""
    return f"{size[0]}x{size[1]}"


def image_size(text: str) -> tuple[int, int]:
    """'WxH' as (width, height), both positive."""
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
        raise argparse.ArgumentTypeError(f"must be WxH in pixels, e.g. 224x224, got {text!r}")
    return int(width), int(height)


def existing_path(text: str) -> str:
    """A file or folder that exists: a wrong path is a usage error before anything connects or loads."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"no such file or folder: {text!r}")
    return text
