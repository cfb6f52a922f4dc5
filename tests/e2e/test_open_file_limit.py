"""D387: every midflight process may open as many files as thousands in flight need, and a run
the hard limit cannot carry is refused before it starts."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from e2e._drill.driver_process import _last_line
from participants import OPEN_FILES_TARGET, open_files_needed

SOFT, HARD = resource.getrlimit(resource.RLIMIT_NOFILE)


def _limited(soft: int, hard: int | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that starts the child under these limits (a child may lower its own)."""

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, HARD if hard is None else hard))

    return lower


_PRINT_LIMIT_AFTER_MAIN = """
import resource, sys
sys.argv = ["midflight", "version"]
from e2e._cli.app import main
try:
    main()
except SystemExit:
    pass
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=sys.stderr)
"""


@pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD < 1024, reason="hard limit too low")
def test_every_midflight_process_raises_its_soft_limit_towards_the_hard_one() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", _PRINT_LIMIT_AFTER_MAIN],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited(256),
        check=True,
    )
    soft = int(completed.stderr.strip().splitlines()[-1])
    want = OPEN_FILES_TARGET if HARD == resource.RLIM_INFINITY else min(OPEN_FILES_TARGET, HARD)
    assert soft == want  # fails when main() leaves the limit the session gave it (256)


def test_a_drill_the_hard_limit_cannot_carry_is_refused_in_one_line_before_it_starts(
    tmp_path: Path,
) -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "e2e",
            "drill",
            "--rollouts",
            "300",
            "--concurrency",
            "300",
            "--keep-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited(256, 256),
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"--concurrency 300 needs about {open_files_needed(300):,} open files" in lines[0]
    assert "allows 256" in lines[0] and "ulimit -Hn" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started


def test_the_default_drill_fits_the_usual_soft_limit() -> None:
    # The quick start's drill (8 rollouts) and the 1,000 (250 at once) need no raise.
    assert open_files_needed(8) < 1024 and open_files_needed(250) < 1024


def test_a_controller_killed_by_an_exception_group_is_reported_by_its_error(
    tmp_path: Path,
) -> None:
    log = tmp_path / "driver-0.log"
    log.write_text(
        "progress 3/300\n"
        "  + Exception Group Traceback (most recent call last):\n"
        "  | exceptiongroup.ExceptionGroup: unhandled errors in a TaskGroup (2 sub-exceptions)\n"
        "  +-+---------------- 1 ----------------\n"
        "    | Traceback (most recent call last):\n"
        '    |   File "e2e/_drill/dispatch.py", line 85, in log\n'
        "    |     raise ValueError('not this one')\n"
        "    | ValueError: not this one\n"
        "    +---------------- 2 ----------------\n"
        "    | Traceback (most recent call last):\n"
        '    |   File "e2e/_servers/evidence.py", line 78, in _write\n'
        "    | OSError: [Errno 24] Too many open files: '/run/evidence/driver.jsonl'\n"
        "    +------------------------------------\n"
    )
    # The old reading gave "+------------------------------------".
    assert (
        _last_line(log) == "OSError: [Errno 24] Too many open files: '/run/evidence/driver.jsonl'"
    )
    plain = tmp_path / "driver-1.log"
    plain.write_text("progress 0/1\nstopping: the servers went away\n\n")
    assert _last_line(plain) == "stopping: the servers went away"
