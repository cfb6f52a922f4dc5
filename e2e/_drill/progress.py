"""What ``midflight drill`` shows while it runs: the stage, rollouts done, checkpoints, crashes.

The drill's processes report through the lines its driver prints (``progress <done>/<total>``
after every accepted result, ``checkpointed <id>``) and those the drill adds (``phase <k>/<n>``
when a driver incarnation starts, ``crash <n>: …``); the baseline's lines come prefixed with
``baseline: ``. The bar is drawn on stderr, and never with ``--json``.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Final

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
)
from rich.text import Text

PROGRESS_PREFIX: Final = "progress "
PHASE_PREFIX: Final = "phase "
BASELINE_PREFIX: Final = "baseline: "


def is_progress_line(line: str) -> bool:
    """Whether ``line`` only moves the bar (other commands leave it out of their output)."""
    text = line.removeprefix(BASELINE_PREFIX)
    return text.startswith((PROGRESS_PREFIX, PHASE_PREFIX))


class _SinceStart(ProgressColumn):
    """Time since the drill started (rich's elapsed column stops when a stage's bar is full)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = time.monotonic()

    def render(self, task: Task) -> Text:
        seconds = int(time.monotonic() - self.started)
        return Text(f"{seconds // 60}:{seconds % 60:02d}", style="progress.elapsed")


class DrillProgress:
    """A live bar of the drill's rollouts, its stage and what it has done so far.

    Args:
        console: Where to draw (stderr: stdout belongs to the figures).
        rollouts: Rollouts per run.
        checkpoints: Checkpoints the run publishes.
        crashes: Crashes the run makes.
    """

    def __init__(self, console: Console, *, rollouts: int, checkpoints: int, crashes: int) -> None:
        self.rollouts = rollouts
        self.planned_checkpoints = checkpoints
        self.planned_crashes = crashes
        self.stage = "baseline"
        self.phase = ""
        self.done = 0
        self.checkpoints = 0
        self.crashes = 0
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TextColumn("rollouts"),
            _SinceStart(),
            console=console,
        )
        self.task = self.progress.add_task(self.description(), total=rollouts)

    def __enter__(self) -> DrillProgress:
        self.progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.progress.stop()

    def description(self) -> str:
        """The stage, and the checkpoints and crashes of the run so far."""
        if self.stage == "baseline":
            return "baseline (uninterrupted)"
        if self.stage == "figures":
            return "computing the figures"
        phase = f"phase {self.phase} · " if self.phase else ""
        return (
            f"run {phase}checkpoints {self.checkpoints}/{self.planned_checkpoints} · "
            f"crashes {self.crashes}/{self.planned_crashes}"
        )

    def on_line(self, line: str) -> None:
        """Take one progress line of the drill; lines that say more than a count are printed."""
        baseline = line.startswith(BASELINE_PREFIX)
        text = line.removeprefix(BASELINE_PREFIX)
        stage = "baseline" if baseline else "run"
        if text.startswith("computing the figures"):
            stage = "figures"
        if stage != self.stage:
            self.stage, self.phase, self.done = stage, "", 0 if stage == "run" else self.done
        if text.startswith(PROGRESS_PREFIX):
            done, _, _total = text.removeprefix(PROGRESS_PREFIX).partition("/")
            self.done = int(done) if done.isdigit() else self.done
        elif text.startswith(PHASE_PREFIX):
            self.phase = text.removeprefix(PHASE_PREFIX)
        else:
            if stage == "run" and text.startswith("checkpointed "):
                self.checkpoints += 1
            if stage == "run" and text.startswith("crash "):
                self.crashes += 1
            self.progress.console.print(f"[dim]{escape(line)}[/dim]")
        self.progress.update(self.task, completed=self.done, description=self.description())
