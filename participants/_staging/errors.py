"""Errors of the staging helpers: a caller broke the capture lifecycle."""

from __future__ import annotations

from protocols import MidflightError


class CaptureError(MidflightError):
    """A caller broke the capture lifecycle or handed over a prefix that does not belong.

    These are caller bugs, never reasons to poison a call.
    """


class StreamingUnsupportedError(CaptureError):
    """Staging covers whole responses only."""
