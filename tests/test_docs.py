"""The docs stay true: the error page matches the error table, the decision log is dated."""

from __future__ import annotations

import re
from pathlib import Path

from protocols import ERROR_TABLE

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_error_page_lists_the_table_exactly() -> None:
    rows = re.findall(
        r"^\| `([a-z_]+)` \| (\d{3}) \| (yes|no) \|", (DOCS / "errors.md").read_text(), re.M
    )
    assert rows == [
        (s.code, str(s.http_status), "yes" if s.retryable else "no") for s in ERROR_TABLE
    ]


def test_the_decision_log_has_dated_sections_and_numbered_entries() -> None:
    text = (DOCS / "decisions.md").read_text()
    assert re.findall(r"^## \d{4}-\d{2}-\d{2} — ", text, re.M)
    numbers = [int(n) for n in re.findall(r"^\*\*D(\d+)\.", text, re.M)]
    # A branch's unmerged block may start past the merged entries; the lead renumbers it on merge.
    gap = next((i for i in range(1, len(numbers)) if numbers[i] != numbers[i - 1] + 1), None)
    merged, pending = (numbers, []) if gap is None else (numbers[:gap], numbers[gap:])
    assert merged == list(range(1, len(merged) + 1)), "entries are numbered D1, D2, … in order"
    if pending:
        assert pending[0] > merged[-1], "a pending block starts past the merged entries"
        assert pending == list(range(pending[0], pending[0] + len(pending))), "counts up by one"


def test_python_examples_in_the_docs_run(tmp_path: Path) -> None:
    import shutil

    for page in sorted(DOCS.glob("*.md")):
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            scratch = tmp_path / page.stem
            shutil.rmtree(scratch, ignore_errors=True)
            code = block.replace("/tmp/", f"{scratch}/")
            exec(compile(code, str(page), "exec"), {})  # noqa: S102 - our own docs
