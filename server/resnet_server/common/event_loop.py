"""The front-ends' event loop: uvloop where it is installed, else Python's own asyncio loop.

A front-end's event loop runs every call's Python: gRPC's completion callbacks, the handler's task, the
engine's answers (``add_reader``) and the futures they settle. uvloop (libuv, in Cython) does that loop's own
part for 7-21% less CPU a call (docs/performance.md, "Figures behind the code"). The engines have no event loop.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import TypeVar

T = TypeVar("T")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolved(choice: str) -> str:
    """The loop that ``choice`` (one of EVENT_LOOPS) runs: auto is uvloop where installed."""
    if choice == "auto":
        return "uvloop" if uvloop_installed() else "asyncio"
    return choice


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    if resolved(choice) == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[object, object, T], choice: str) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` (one of EVENT_LOOPS) names."""
    if resolved(choice) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
