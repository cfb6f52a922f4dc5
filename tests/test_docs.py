"""The docs stay true: the error page matches the error table, the decision log keeps its ids,
every ``python`` example runs, and the home page's quick start is the README's."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from protocols import ERROR_TABLE

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PINNED_DECISIONS = Path(__file__).parent / "golden" / "decisions.txt"
"""``D<n> <the first 50 characters of its title>`` for every entry up to D273; append new ones."""
ENTRY = re.compile(r"^\*\*D(\d+)\. (.*?)\*\*", re.M | re.S)
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
FENCE = re.compile(r"^```([\w+-]*)", re.M)


def decision_titles(text: str) -> dict[int, str]:
    """Every entry's id → its bolded title, on one line."""
    return {int(number): " ".join(title.split()) for number, title in ENTRY.findall(text)}


def index_ids(text: str) -> set[int]:
    """The ids the topic index lists: ``D44``, or a range ``D255`` en dash ``D259``."""
    index = text[text.index("## Topic index") :]
    index = index[: index.index("\n## ")].split("Revisions so far")[0]
    ids: set[int] = set()
    for first, last in re.findall(r"D(\d+)(?:\u2013D(\d+))?", index):
        ids.update(range(int(first), int(last or first) + 1))
    return ids


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
    assert numbers == list(range(1, len(numbers) + 1)), "entries are numbered D1, D2, … in order"


def test_no_decision_id_is_renumbered_or_retitled() -> None:
    titles = decision_titles((DOCS / "decisions.md").read_text())
    problems = []
    for line in PINNED_DECISIONS.read_text().splitlines():
        number, pinned = line.split(" ", 1)
        title = titles.get(int(number.removeprefix("D")))
        if title is None:
            problems.append(f"{number} is gone (pinned: {pinned!r})")
        elif not title.startswith(pinned):
            problems.append(f"{number} is now {title[:50]!r}, pinned as {pinned!r}")
    assert not problems, "ids are stable: add a new entry instead\n" + "\n".join(problems)


def test_the_pins_cover_the_log_up_to_d273() -> None:
    pinned = [line.split(" ", 1)[0] for line in PINNED_DECISIONS.read_text().splitlines()]
    assert pinned[:273] == [f"D{n}" for n in range(1, 274)]


def test_every_entry_is_in_the_topic_index() -> None:
    text = (DOCS / "decisions.md").read_text()
    entries, indexed = set(decision_titles(text)), index_ids(text)
    assert not sorted(entries - indexed), (
        f"entries missing from the topic index: {sorted(entries - indexed)}"
    )
    assert not sorted(indexed - entries), (
        f"the topic index names no such entry: {sorted(indexed - entries)}"
    )


def test_a_revision_names_an_earlier_entry() -> None:
    titles = decision_titles((DOCS / "decisions.md").read_text())
    revisions = {
        number: [int(n) for n in re.findall(r"\((?:revises|supersedes) D(\d+)", title)]
        for number, title in titles.items()
    }
    assert revisions[216] == [200], "the rule's own example: D216 revises D200"
    late = {n: named for n, named in revisions.items() if any(r >= n for r in named)}
    assert not late, f"a revision must name an earlier entry: {late}"


def test_python_examples_in_the_docs_run(tmp_path: Path) -> None:
    ran: set[str] = set()
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for block in PYTHON_BLOCK.finditer(text):
            scratch = tmp_path / page.stem
            shutil.rmtree(scratch, ignore_errors=True)
            code = block.group(1).replace("/tmp/", f"{scratch}/")
            # Blank lines in front, so that a traceback names the line of the page.
            padding = "\n" * text.count("\n", 0, block.start(1))
            exec(compile(padding + code, str(page), "exec"), {})  # noqa: S102 - our own docs
            ran.add(page.name)
    assert {"coordination.md", "operations.md", "writing-a-participant.md"} <= ran


def test_every_python_example_is_fenced_as_python() -> None:
    """A ``py`` or ``python3`` fence would escape the test above: say ``python`` or ``text``."""
    escaping = [
        f"{page.relative_to(DOCS)}: ```{language}"
        for page in sorted(DOCS.rglob("*.md"))
        for language in FENCE.findall(page.read_text())
        if language.lower() in {"py", "python3", "py3", "pycon", "ipython"}
    ]
    assert not escaping, escaping


def test_the_home_page_opens_with_the_readme_quick_start() -> None:
    def quick_start(text: str) -> str:
        return text.split("```bash\n", 1)[1].split("```", 1)[0]

    assert quick_start((DOCS / "index.md").read_text()) == quick_start(
        (ROOT / "README.md").read_text()
    )
