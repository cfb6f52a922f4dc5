"""Counting the ``TypeAdapter``s a block builds: how a test sees FastAPI build a route (D440)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from pydantic import type_adapter


@contextmanager
def adapters_built() -> Iterator[list[object]]:
    """Yield a list that gets the type of every ``TypeAdapter`` built inside the block."""
    built: list[object] = []
    real_init = type_adapter.TypeAdapter.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(args[0] if args else None)
        real_init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type_adapter.TypeAdapter, "__init__", counted)
        yield built
