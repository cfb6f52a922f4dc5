"""Shared test configuration: hypothesis profiles and the soak tier switch."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.s3_server"]

settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "soak", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the soak tier unless MIDFLIGHT_SOAK=1 (``make soak``)."""
    if os.environ.get("MIDFLIGHT_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="soak tier: run with make soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests run on asyncio (the backend uvicorn serves on)."""
    return "asyncio"
