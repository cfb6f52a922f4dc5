"""The reference deployment and the process-level harness, and the ``midflight`` command line."""

from ._cli.app import build_app, main

__all__ = ["build_app", "main"]
