"""What a long bench shows while it measures: its suite, its stage, and the time since it began.

The suites say what they do now through ``e2e._bench.common.stage`` ("16,000 rollouts ·
restoring"). On a terminal that is one live line on stderr. Anywhere else (a file, a pipe, a CI
log) each stage is a line of its own with the minutes since the start, so the log of a
half-hour ``bench scale`` says how far it got. Nothing is shown with ``--json``.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class BenchProgress:
    """The stage of one bench run, on ``console`` (stderr: stdout belongs to the figures).

    Args:
        console: Where to draw.
        suite: The suite's name (``restore``), the start of every line.
    """

    def __init__(self, console: Console, suite: str) -> None:
        self.console = console
        self.suite = suite
        self.started = time.monotonic()
        self.live = console.is_terminal
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,  # the figures follow on stdout; the line has done its job
        )
        self.task = self.progress.add_task(self.line("starting"), total=None)

    def line(self, text: str) -> str:
        """``bench <suite> · <text>``, markup escaped."""
        return escape(f"bench {self.suite} · {text}")

    def __enter__(self) -> BenchProgress:
        if self.live:
            self.progress.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.live:
            self.progress.stop()

    def on_stage(self, text: str) -> None:
        """Show that the bench is now at ``text``."""
        if self.live:
            self.progress.update(self.task, description=self.line(text))
            return
        seconds = int(time.monotonic() - self.started)
        self.console.print(
            self.line(f"{seconds // 60}:{seconds % 60:02d} · {text}"), soft_wrap=True
        )
