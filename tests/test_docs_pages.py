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


# ---- what fails the site's build, checked without building it (docs/_ext/) --------------------------------

def _ext():
    import sys
    ext = str(ROOT / "docs" / "_ext")
    if ext not in sys.path:
        sys.path.insert(0, ext)


def test_a_lesson_that_fails_or_draws_nothing_fails_the_build_unless_it_may(tmp_path):
    _ext()
    from lesson_runs import run_all, run_problems
    lessons = tmp_path / "tutorials"
    lessons.mkdir()
    (lessons / "97_draws.py").write_text("import sys\nprint('drawn')\nopen(sys.argv[2], 'wb').write(b'png')\n")
    (lessons / "98_fails.py").write_text("print('a check failed')\nraise SystemExit(1)\n")
    (lessons / "99_gpu.py").write_text("print('needs a GPU: draws nothing')\n")
    runs = run_all(tmp_path, tmp_path / "runs", jobs=2, timeout=60)
    assert runs["97_draws"].command == "python tutorials/97_draws.py --png runs/97_draws.png"
    assert runs["97_draws"].picture == tmp_path / "runs" / "97_draws.png" and runs["97_draws"].output == "drawn\n"
    assert (runs["98_fails"].returncode, runs["99_gpu"].picture) == (1, None)
    problems = run_problems(runs, without_picture={})
    assert len(problems) == 2
    assert "lesson 98_fails failed" in problems[0] and "exited 1" in problems[0] and "a check failed" in problems[0]
    assert "lesson 99_gpu drew no picture" in problems[1]
    assert run_problems(runs, without_picture={"99": "it needs a GPU"}) == [problems[0]]


def test_a_link_or_image_that_leads_nowhere_is_found(tmp_path):
    _ext()
    from site_links import broken_links
    (tmp_path / "sub").mkdir()
    (tmp_path / "pic.png").write_bytes(b"png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "index.html").write_text(
        '<a href="sub/page.html#here">ok</a> <a href="#top" id="top">ok</a> <img src="pic.png"> '
        '<a href="https://example.org/x">not followed</a> <a href="sub/page.html#gone">no anchor</a> '
        '<a href="missing.html">no file</a> <img src="empty.png">')
    (tmp_path / "sub" / "page.html").write_text('<h2 id="here">here</h2><img src="../nothing.png">')
    broken = broken_links(tmp_path)
    assert len(broken) == 4, broken
    assert any("#gone" in b for b in broken) and any("missing.html" in b for b in broken)
    assert any("an empty image" in b for b in broken) and any("nothing.png" in b for b in broken)


def test_a_lessons_plain_docstring_reads_as_the_author_laid_it_out():
    _ext()
    from docstring_md import to_markdown
    title, body = to_markdown('''Lesson 9: a title.

    python tutorials/09_x.py --png x.png    (a command)

Prose over two lines with ``code``, a star * and a data-
parallel word <here>.

  1. an item that goes on
     on a second line;
  2. another.

    name    aligned   columns
    other   stay      as written
''')
    assert title == "Lesson 9: a title."
    blocks = body.split("\n\n")
    assert blocks[0] == "```text\npython tutorials/09_x.py --png x.png    (a command)\n```"
    assert blocks[1] == "Prose over two lines with ``code``, a star \\* and a data-parallel word \\<here\\>."
    assert blocks[2] == "1. an item that goes on on a second line;\n2. another."
    assert blocks[3] == "```text\nname    aligned   columns\nother   stay      as written\n```\n"
