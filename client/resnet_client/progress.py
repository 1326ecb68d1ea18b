"""A one-line progress bar on stderr for the CLI's long commands (bench, calibrate).

Drawn only when stderr is a terminal: redirected to a file or a CI log, every redraw would be kept, one
after another on a single line.
"""

from __future__ import annotations

import sys


class ProgressBar:
    def __init__(self, label: str, quiet: bool) -> None:
        self.label = label
        self.shown = not quiet and sys.stderr.isatty()

    def update(self, fraction: float, detail: str) -> None:
        if self.shown:
            bar = "#" * int(30 * min(1.0, fraction))
            print(f"\r  {self.label} [{bar:<30}] {detail}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr)
