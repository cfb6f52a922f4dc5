"""Shared test configuration: hypothesis profiles, the soak tier switch, shared fixtures."""

from __future__ import annotations

import os
from typing import Any

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


@pytest.fixture
def ledger_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The item count of every ``conversation_digest`` the ledger's rows compute from now on
    (``protocols._ledger``: the custody row's ``context_digest``, D429)."""
    import protocols
    import protocols._ledger as ledger_module

    counts: list[int] = []
    real = protocols.conversation_digest

    def counted(items: Any) -> str:
        counts.append(len(items))
        return real(items)

    monkeypatch.setattr(ledger_module, "conversation_digest", counted)
    return counts
