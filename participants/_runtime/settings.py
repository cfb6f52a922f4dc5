"""The control plane's tunable limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from protocols import (
    DEFAULT_LEASE_GRACE_SECONDS,
    DEFAULT_MAX_DEADLINE_SECONDS,
    is_object_store_url,
    open_store,
)


@dataclass(frozen=True, slots=True)
class ControlSettings:
    """Tunable limits of the control plane.

    Attributes:
        lease_grace_seconds: A lease lasts until ``deadline_ts`` plus this.
        max_deadline_seconds: The horizon: a ``deadline_ts`` further ahead is accepted and treated
            as this far ahead (the call's own work and the lease are bounded by it).
        resume_retry_seconds: After a lease expiry could not reopen, try again this much later.
        readiness_poll_seconds: A waiting prepare re-checks readiness at least this often.
        fence_on_restore: Whether a restore fences its scope (attempt N). Only the
            drill's ``no-restore-fence`` fault turns it off, to show that the drill notices.
        checkpoint_root: Every ``checkpoint_dir`` of a commit or restore must lie under this
            directory once ``..`` and symlinks are resolved, or under this ``s3://bucket/prefix``
            (else ``invalid_request``, nothing changed); ``None`` accepts any absolute directory
            and no URL (a library user's own choice). Every reference server sets it (D240,
            D330). A URL is kept in its canonical form; a string without ``s3://`` is a path.
        pause_collector: Whether Python's cyclic garbage collector is paused while this plane is
            outside ``IDLE`` (D249): a full collection over a large heap would otherwise land
            inside the checkpoint's pause.
    """

    lease_grace_seconds: float = DEFAULT_LEASE_GRACE_SECONDS
    max_deadline_seconds: float = DEFAULT_MAX_DEADLINE_SECONDS
    resume_retry_seconds: float = 30.0
    readiness_poll_seconds: float = 1.0
    fence_on_restore: bool = True
    checkpoint_root: Path | str | None = None
    pause_collector: bool = True

    def __post_init__(self) -> None:
        for name in (
            "lease_grace_seconds",
            "max_deadline_seconds",
            "resume_retry_seconds",
            "readiness_poll_seconds",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        root = self.checkpoint_root
        if isinstance(root, str):
            # A malformed URL, or S3 without the s3 extra, fails here, when the server starts.
            canonical = open_store(root).url if is_object_store_url(root) else Path(root)
            object.__setattr__(self, "checkpoint_root", canonical)
