"""The dependency rule of DESIGN.md, checked on every import statement of every module.

protocols <- participants, protocols <- coordinator, e2e -> all; participants and coordinator
never import each other; protocols imports none of them (and nothing but pydantic beyond the
standard library).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "participants", "coordinator", "e2e")
ALLOWED = {
    "protocols": set(),
    "participants": {"protocols"},
    "coordinator": {"protocols"},
    "e2e": {"protocols", "participants", "coordinator"},
}
PROTOCOLS_THIRD_PARTY = {"pydantic", "pydantic_core", "typing_extensions"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_packages_import_only_downward(package: str) -> None:
    for path in _modules(package):
        forbidden = (_imports(path) & set(PACKAGES)) - ALLOWED[package] - {package}
        assert not forbidden, f"{path.relative_to(ROOT)} imports {sorted(forbidden)}"


def test_protocols_is_pure() -> None:
    stdlib = set(sys.stdlib_module_names)
    for path in _modules("protocols"):
        foreign = _imports(path) - stdlib - PROTOCOLS_THIRD_PARTY - {"protocols"}
        assert not foreign, f"{path.relative_to(ROOT)} imports {sorted(foreign)}"
        io = _imports(path) & {"os", "io", "socket", "subprocess", "shutil", "tempfile"}
        assert not io, f"{path.relative_to(ROOT)} performs I/O through {sorted(io)}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from coordinator import x\nimport participants.y\n")
    assert _imports(bad) == {"coordinator", "participants"}
