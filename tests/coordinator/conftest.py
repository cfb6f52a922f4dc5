"""Async tests here run on asyncio through the anyio plugin; ``run_root`` is a directory or S3."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["directory", "s3"])
def run_root(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """A fresh, empty run root: a directory, then an ``s3://`` prefix on the local S3 server."""
    if request.param == "directory":
        return tmp_path / "run"
    return str(request.getfixturevalue("s3_root"))
