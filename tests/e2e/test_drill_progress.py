"""The drill's live progress: the stage, rollouts done / total, checkpoints and crashes so far."""

from __future__ import annotations

import io

from rich.console import Console

from e2e._drill.progress import DrillProgress, is_progress_line


def _progress() -> tuple[DrillProgress, io.StringIO]:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    return DrillProgress(console, rollouts=8, checkpoints=3, crashes=2), out


def test_the_bar_follows_the_baseline_then_each_phase_of_the_run() -> None:
    progress, out = _progress()
    task = progress.progress.tasks[0]
    with progress:
        for line in ("baseline: phase 1/1", "baseline: progress 0/8", "baseline: progress 5/8"):
            progress.on_line(line)
        assert task.completed == 5 and task.total == 8
        assert progress.description().startswith("baseline")
        for line in ("phase 1/3", "progress 0/8", "checkpointed ckpt-0-0", "progress 2/8"):
            progress.on_line(line)
        assert task.completed == 2  # the run starts over from none done
        assert progress.description() == "run phase 1/3 · checkpoints 1/3 · crashes 0/2"
        progress.on_line("crash 1: every server SIGKILLed")
        progress.on_line("phase 2/3")
        progress.on_line("progress 1/8")  # rolled back to the restored checkpoint
        assert task.completed == 1
        assert progress.description() == "run phase 2/3 · checkpoints 1/3 · crashes 1/2"
        progress.on_line("computing the figures from evidence")
        assert progress.description() == "computing the figures"
    printed = out.getvalue()
    assert "checkpointed ckpt-0-0" in printed and "crash 1: every server SIGKILLed" in printed
    assert "progress 2/8" not in printed and "phase 2/3" not in printed


def test_other_commands_leave_the_bar_lines_out() -> None:
    assert is_progress_line("progress 3/8") and is_progress_line("baseline: phase 1/1")
    assert not is_progress_line("checkpointed ckpt-0-1")
    assert not is_progress_line("seed 3: crash 1 after op 4")
