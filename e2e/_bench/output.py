"""Where a benchmark's results go besides stdout: ``--out DIR``'s JSON, the profile (the
pictures are ``plots``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_json(out: Path, suite: str, payload: dict[str, Any]) -> Path:
    """``<out>/<suite>.json``: the same object ``--json`` prints."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{suite}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
    return path


class Profile:
    """A pyinstrument profile over the timed sections only (``--profile PATH``).

    Writes ``PATH`` as HTML and ``PATH`` with ``.txt`` as the text tree. pyinstrument samples the
    event loop's thread alone, and the bench's servers hand file writes, fsyncs and a worker's
    cut staging to other threads: while those run, the tree shows the loop waiting
    (``epoll.poll``, or the loop's own frames while it waits for the GIL). So the text file
    starts with the CPU seconds of the sections, split between the loop's thread and every other
    thread of the process (at 16,000 parked rollouts, half of a checkpoint's CPU is off the loop).
    """

    def __init__(self, path: Path) -> None:
        from pyinstrument import Profiler

        self.path = path
        # Every server runs on the bench's one event loop, so one thread's samples see them all.
        self.profiler = Profiler(interval=0.001, async_mode="disabled")
        self.loop_cpu_s = 0.0
        """CPU seconds of the thread that entered the sections (the event loop's), summed."""
        self.process_cpu_s = 0.0
        """CPU seconds of the whole process in the sections, every thread, summed."""

    @contextmanager
    def section(self) -> Iterator[None]:
        """Sample while the block runs (sections accumulate into one session)."""
        loop_before, process_before = time.thread_time(), time.process_time()
        self.profiler.start()
        try:
            yield
        finally:
            self.profiler.stop()
            self.loop_cpu_s += time.thread_time() - loop_before
            self.process_cpu_s += time.process_time() - process_before

    def cpu_summary(self) -> str:
        """Where the sections' CPU went: the loop's thread (the tree) and the other threads."""
        others = max(0.0, self.process_cpu_s - self.loop_cpu_s)
        return (
            f"CPU in the timed sections: {self.process_cpu_s:.3f} s in all, "
            f"{self.loop_cpu_s:.3f} s on the event loop's thread (the tree below), "
            f"{others:.3f} s on other threads (not in the tree: there the loop waits)\n"
        )

    def write(self) -> list[Path]:
        """Write the HTML and text renderings; their paths."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.profiler.output_html())
        text = self.path.with_suffix(".txt")
        text.write_text(
            self.cpu_summary() + self.profiler.output_text(unicode=True, show_all=False)
        )
        return [self.path, text]
