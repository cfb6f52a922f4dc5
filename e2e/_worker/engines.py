"""The engines ``midflight serve worker --engine NAME`` knows: a name → where its factory lives.

An entry names its factory as ``"module:attribute"``, imported only when that engine is chosen,
so an engine whose packages are an optional extra costs nothing to the others and adding one
touches neither the worker app nor the command line: one row of :data:`ENGINES`. An engine
whose packages are missing is refused with one line naming the extra to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

from protocols import MidflightError

from .engine_api import EngineOptions, GenerationEngine

EngineFactory = Callable[[EngineOptions], GenerationEngine]
"""Builds an engine from the worker's options (it may load a model: this runs before serving)."""

DEFAULT_ENGINE: Final = "deterministic"


@dataclass(frozen=True)
class EngineEntry:
    """One engine of the registry.

    Attributes:
        factory: ``"module:attribute"`` of its :data:`EngineFactory`.
        extra: The optional extra that installs its packages (``None``: needs none).
        summary: One line on what it is, for ``--help``.
    """

    factory: str
    extra: str | None
    summary: str


ENGINES: Final[dict[str, EngineEntry]] = {
    DEFAULT_ENGINE: EngineEntry(
        factory="e2e._worker.deterministic:build_deterministic_engine",
        extra=None,
        summary="the contract's generation function (no package needed)",
    ),
    "transformers": EngineEntry(
        factory="e2e._worker.transformers_engine:build_transformers_engine",
        extra="engine",
        summary="a transformers causal LM decoding greedily on the CPU (--model DIR)",
    ),
    "vllm": EngineEntry(
        factory="e2e._worker.vllm_engine:build_vllm_engine",
        extra="vllm",
        summary="vLLM's async engine on a GPU, greedy, over --model DIR",
    ),
}
"""Every engine by name; the first is the default."""


class EngineError(MidflightError, ValueError):
    """An engine that cannot be started: an unknown name, or its packages are missing."""


def engine_names() -> list[str]:
    """The known engines' names, sorted."""
    return sorted(ENGINES)


def load_engine_factory(name: str) -> EngineFactory:
    """The factory of engine ``name``, its module imported now.

    Raises:
        EngineError: No engine has that name, or its module (or a package it needs) is missing;
            the message is one line naming the known engines or the extra to install.
    """
    entry = ENGINES.get(name)
    if entry is None:
        raise EngineError(f"unknown engine {name!r}; known engines: {', '.join(engine_names())}")
    module_name, _, attribute = entry.factory.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name or str(exc)
        install = f"pip install -e '.[{entry.extra}]'" if entry.extra else "reinstall midflight"
        raise EngineError(
            f"the {name} engine needs {missing!r}, which is not installed: {install}"
        ) from exc
    return cast(EngineFactory, getattr(module, attribute))


def build_engine(name: str, options: EngineOptions) -> GenerationEngine:
    """Engine ``name`` built with ``options``.

    Raises:
        EngineError: As :func:`load_engine_factory`.
    """
    return load_engine_factory(name)(options)
