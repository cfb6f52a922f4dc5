"""One error root: every exception class of the four packages derives from ``MidflightError``.

The test imports every module of ``protocols``, ``participants``, ``coordinator`` and ``e2e``,
collects each exception class defined there, and checks it against the root and against the two
drawings of the tree (the docstring of ``protocols._errors`` and ``docs/errors.md``): same classes,
same parents, same standard bases, and for a wire error the code, status and retryable flag of its
row in the error table.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

import protocols._errors
from protocols import MidflightError, WireError
from protocols._errors import ERROR_CLASSES

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "participants", "coordinator", "e2e")


NEEDS_A_GPU = frozenset({"vllm"})
"""Packages of an optional extra that cannot be installed on a machine without a GPU: a module
that imports one at its top (``e2e._worker.vllm_engine``) is left out where it is missing. It
defines no exception class of its own (its errors are ``EngineError``)."""


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in NEEDS_A_GPU:
            return None
        raise


def exception_classes(package: str) -> list[type[BaseException]]:
    """Every exception class defined in a module of ``package`` (``__main__`` is not imported)."""
    root = importlib.import_module(package)
    imported = [
        _import(info.name)
        for info in pkgutil.walk_packages(root.__path__, f"{package}.")
        if not info.name.endswith(".__main__")  # running it starts the command line
    ]
    modules = [root] + [module for module in imported if module is not None]
    return [
        value
        for module in modules
        for value in vars(module).values()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == module.__name__
    ]


def every_exception_class() -> list[type[BaseException]]:
    return [cls for package in PACKAGES for cls in exception_classes(package)]


@dataclass(frozen=True)
class Drawn:
    """One line of a drawn tree."""

    parent: str | None
    other_bases: tuple[str, ...]
    wire: tuple[int, str, bool] | None


_LINE = re.compile(
    r"^(?P<indent>[ │]*)(?:[├└]── )?(?P<name>[A-Z]\w*)(?: \((?P<bases>[\w, ]+)\))?"
    r"(?: +(?P<status>\d{3}) (?P<code>[a-z_]+)(?P<retryable> +retryable)?)?"
)


def parse_tree(drawing: str) -> dict[str, Drawn]:
    """Class name → what the drawing says of it, from the indentation of each branch."""
    drawn: dict[str, Drawn] = {}
    path: list[str] = []
    for line in textwrap.dedent(drawing).strip("\n").splitlines():
        match = _LINE.match(line)
        assert match, f"not a line of the tree: {line!r}"
        has_branch = "──" in line[: match.start("name")]
        depth = len(match["indent"]) // 4 + 1 if has_branch else 0
        path[depth:] = [match["name"]]
        bases = tuple(b.strip() for b in match["bases"].split(",")) if match["bases"] else ()
        wire = None
        if match["status"]:
            wire = (int(match["status"]), match["code"], bool(match["retryable"]))
        drawn[match["name"]] = Drawn(path[depth - 1] if depth else None, bases, wire)
    return drawn


def docstring_tree() -> str:
    doc = protocols._errors.__doc__ or ""
    return doc.split("Exception tree::\n", 1)[1].strip("\n").split("\n\n", 1)[0]


def docs_page_tree() -> str:
    page = (ROOT / "docs" / "errors.md").read_text()
    blocks = [b for b in re.findall(r"```text\n(.*?)```", page, re.S) if "MidflightError" in b]
    assert len(blocks) == 1, "docs/errors.md draws the tree in one text block"
    return str(blocks[0])


def actual(cls: type[BaseException]) -> Drawn:
    """What the class itself says: its parent in the tree, its other bases, its wire row."""
    in_tree = [b for b in cls.__bases__ if issubclass(b, MidflightError)]
    others = tuple(b.__name__ for b in cls.__bases__ if not issubclass(b, MidflightError))
    wire = None
    if issubclass(cls, WireError) and cls is not WireError:
        wire = (cls.spec.http_status, cls.spec.code, cls.spec.retryable)
    if cls is MidflightError:
        return Drawn(None, (), None)
    assert len(in_tree) == 1, f"{cls.__name__} has one parent in the tree"
    return Drawn(in_tree[0].__name__, others, wire)


def test_the_search_finds_the_classes_of_every_package() -> None:
    found = {package: {c.__name__ for c in exception_classes(package)} for package in PACKAGES}
    assert {"MidflightError", "WireError", "StaleCheckpointError"} <= found["protocols"]
    assert {"CaptureError", "StreamingUnsupportedError"} <= found["participants"]
    assert {"CoordinationError", "NotAParticipantError"} <= found["coordinator"]
    assert {"ContinuationRefused", "DrillStalledError", "PortInUseError"} <= found["e2e"]


def test_every_exception_class_derives_from_the_one_root() -> None:
    outside = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in every_exception_class()
        if not issubclass(cls, MidflightError)
    ]
    assert outside == [], "derive these from protocols.MidflightError (and draw them in the tree)"


def test_every_wire_error_has_its_row_and_only_wire_errors_do() -> None:
    wire = {cls for cls in every_exception_class() if issubclass(cls, WireError)}
    assert wire - {WireError} == set(ERROR_CLASSES.values())
    for cls in every_exception_class():
        if not issubclass(cls, WireError):
            assert not hasattr(cls, "spec"), f"{cls.__name__} has a row but no wire base"


@pytest.mark.parametrize("where", ["docstring", "docs/errors.md"])
def test_the_drawn_tree_is_the_tree_of_the_classes(where: str) -> None:
    drawing = docstring_tree() if where == "docstring" else docs_page_tree()
    drawn = parse_tree(drawing)
    classes = {cls.__name__: cls for cls in every_exception_class()}
    assert sorted(drawn) == sorted(classes), "the drawing names every class, and only those"
    for name, cls in classes.items():
        assert drawn[name] == actual(cls), name


def test_the_tree_parser_sees_a_wrong_parent() -> None:
    wrong = "MidflightError\n├── WireError\n│   └── CaptureError\n└── StaleCheckpointError\n"
    drawn = parse_tree(wrong)
    assert drawn["CaptureError"].parent == "WireError"
    assert drawn["StaleCheckpointError"].parent == "MidflightError"
