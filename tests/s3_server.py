"""The S3 fixtures: one real S3 API server (moto's, on 127.0.0.1) per test process.

``local_s3`` starts it once and points every S3 client of the process, and of the processes it
starts, at it through the ``AWS_*`` environment; ``s3_root`` gives each test its own prefix.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from e2e._launch.object_store import LocalS3


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    """The running server; its environment is set for the whole session."""
    with LocalS3() as server, pytest.MonkeyPatch.context() as patch:
        for name, value in server.environment().items():
            patch.setenv(name, value)
        yield server


@pytest.fixture
def s3_root(local_s3: LocalS3) -> str:
    """``s3://midflight/<fresh prefix>``: an empty store root for one test."""
    return local_s3.url(f"test-{uuid.uuid4().hex[:12]}")
