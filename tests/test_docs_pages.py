"""The README is the landing page and the site (docs/) holds the reference: both stay true without a build.

- the README names the one command that builds the site, and every link in it leads to a file;
- every lesson has its page on the site, named by its two digits, and every page its lesson;
- the README's *Failing well* table lists exactly the exit statuses of the site's full table;
- the README stays a landing page: at most 300 lines, and no run logs in it (no dates, commit ids or
  load averages: those belong in benchmarks/RESULTS.md).

``tests/test_docs_site.py`` checks the built site itself, in a browser.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def code_lines(text: str) -> list[str]:
    """The lines inside the fenced code blocks of a Markdown text."""
    return [line for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S) for line in block.splitlines()]


def test_the_readme_names_one_command_that_builds_the_site():
    commands = [line for line in code_lines(README) if re.search(r"\bsphinx\b", line)]
    assert len(commands) == 1, commands
    assert re.search(r"python -m sphinx .*-W .*\bdocs docs/_build/html$", commands[0]), commands[0]
    assert (ROOT / "docs" / "conf.py").is_file()


def test_every_link_in_the_readme_leads_to_a_file():
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (ROOT / target.split("#")[0]).exists(), f"README.md links to {target}, which does not exist"


def test_every_lesson_has_its_page_and_every_page_its_lesson():
    lessons = {p.stem for p in ROOT.glob("tutorials/[0-9][0-9]_*.py")}
    pages = {p.stem for p in (ROOT / "docs" / "lessons").glob("[0-9][0-9]_*.md")}
    assert len(lessons) >= 19
    assert lessons == pages


def statuses(table_rows: list[str], column: int) -> set[str]:
    """The exit statuses named in one column of a Markdown table's rows: '2', '128 + n', ..."""
    found = set()
    for row in table_rows:
        cell = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]][column]
        found |= set(re.findall(r"128 \+ n|\b\d+\b", re.sub(r"\((?:\d+, )*\d+\)", "", cell)))
    return found


def section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_the_readmes_failing_well_table_lists_the_statuses_of_the_full_table():
    short = [r for r in section(README, "Failing well").splitlines() if r.startswith("| ") and not r.startswith("| exit")]
    full_text = (ROOT / "docs" / "failing_well.md").read_text(encoding="utf-8")
    full = [r for r in full_text.splitlines() if r.startswith("| ") and not r.startswith("| what goes wrong")]
    assert len(full) >= 30
    assert statuses(short, 0) == statuses(full, 2) == {"0", "1", "2", "3", "4", "5", "124", "128 + n"}
    assert "docs/failing_well.md" in section(README, "Failing well")


def test_the_readme_is_a_landing_page_without_run_logs():
    lines = README.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move reference text to a page under docs/"
    months = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*"
    for n, line in enumerate(lines, 1):
        assert not re.search(rf"\b\d{{1,2}} {months}\b|\b{months} \d{{1,2}}\b|\b20\d\d-\d\d-\d\d\b", line), f"a date, line {n}: {line}"
        assert not re.search(r"`[0-9a-f]{7,40}`", line), f"a commit id, line {n}: {line}"
        assert not re.search(r"\bload(?: average)? \d", line), f"a load average, line {n}: {line}"
