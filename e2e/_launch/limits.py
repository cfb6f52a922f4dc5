"""A drill the open-file limit cannot carry is refused before it starts (D387)."""

from __future__ import annotations

from participants import OPEN_FILES_TARGET, open_files_needed, raise_open_file_limit


def open_files_problem(in_flight: int, flag: str = "--concurrency") -> str | None:
    """Why ``in_flight`` rollouts at once cannot run under this process's limit, or ``None``.

    Raises the limit first (:func:`raise_open_file_limit`), so only a hard limit too low for the
    run is a problem.
    """
    need = open_files_needed(in_flight)
    limit = raise_open_file_limit(max(OPEN_FILES_TARGET, need))
    if limit.soft is None or need <= limit.soft:
        return None
    hard = "unlimited" if limit.hard is None else f"{limit.hard:,}"
    return (
        f"{flag} {in_flight:,} needs about {need:,} open files in one process, and this session "
        f"allows {limit.soft:,} (ulimit -n; the hard limit, ulimit -Hn, is {hard}): raise the "
        f"hard limit (nofile in /etc/security/limits.conf, LimitNOFILE= for a systemd unit) or "
        f"lower {flag}"
    )
