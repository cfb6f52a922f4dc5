"""The import-linter contracts of ``pyproject.toml`` catch what they promise to.

``make lint`` runs ``lint-imports`` on the tree. These tests run it on a copy of the four packages
with one rule broken on purpose, so a contract that stops seeing its violation (a typo in a
layer name, a contract deleted) fails here instead of passing quietly.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "participants", "coordinator", "e2e")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _copy_tree(into: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, into / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", into / "pyproject.toml")
    return into


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    return _copy_tree(tmp_path)


def test_the_copied_tree_keeps_every_contract(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        pytest.param(
            "participants/_runtime/report.py",
            "import coordinator  # noqa",
            "participants and coordinator independent",
            id="participants-imports-coordinator",
        ),
        pytest.param(
            "protocols/_ids.py",
            "import os  # noqa",
            "protocols is pure",
            id="protocols-does-io",
        ),
        pytest.param(
            "e2e/_servers/cluster.py",
            "from e2e._cli import output  # noqa",
            "the command line on top",
            id="a-server-imports-the-command-line",
        ),
        pytest.param(
            "participants/_storage/durable.py",
            "from participants._runtime import clock  # noqa",
            "the runtime, storage",
            id="storage-imports-the-runtime",
        ),
        pytest.param(
            "e2e/_servers/peer_pool.py",
            "from e2e._servers import evidence  # noqa",
            "no import cycle",
            id="a-cycle-inside-a-subpackage",
        ),
    ],
)
def test_a_broken_rule_fails_its_contract(
    tree: Path, module: str, line: str, contract: str
) -> None:
    if "cycle" in contract:
        # peer_pool -> evidence alone is no cycle; make evidence import peer_pool too.
        _append(tree / "e2e/_servers/evidence.py", "from e2e._servers import peer_pool  # noqa")
    _append(tree / module, line)
    result = _lint(tree)
    assert result.returncode == 1, result.stdout
    assert "Broken contracts" in result.stdout, result.stdout
    broken = " ".join(result.stdout.split("Broken contracts", 1)[1].split())
    assert contract in broken, result.stdout
