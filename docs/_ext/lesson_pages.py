"""The lessons' pages, in MyST Markdown, from each lesson's file, its section of the learning path
(tutorials/README.md) and its run (:mod:`lesson_runs`).

A page: the lesson's title and text (its docstring, :mod:`docstring_md`), what you will see and what
to try, the picture, the output, the code (without the docstring, shown above), how long the run
took and a download link, as sphinx-gallery's pages have them. The index: the learning path's
introduction and table, every lesson's picture as a gallery, then the learning path's last sections.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from docstring_md import docstring_of, fence_for, to_markdown
from lesson_runs import LessonRun

# repository files that are pages of the site: (repository path, page source under docs/)
SITE_PAGES = {"ARCHITECTURE.md": "architecture.md", "benchmarks/RESULTS.md": "benchmarks.md",
              "README.md": "index.md", "tutorials/README.md": "lessons/index.md"}


def learning_path(root: Path) -> tuple[str, dict[str, str], str]:
    """tutorials/README.md cut into (introduction, {"04": that lesson's section with its heading line},
    the sections after)."""
    text = (root / "tutorials" / "README.md").read_text(encoding="utf-8")
    parts = re.split(r"^(?=## )", text, flags=re.M)
    intro = re.sub(r"^# .*\n", "", parts[0], count=1)
    lessons, after = {}, []
    for part in parts[1:]:
        number = re.match(r"## (\d\d) ", part)
        if number:
            lessons[number.group(1)] = part
        else:
            after.append(part)
    return intro, lessons, "".join(after)


def rebase_links(markdown: str, source_dir: str, page_dir: str, root: Path) -> str:
    """Markdown links written relative to ``source_dir`` (a repository folder), rewritten for a page in
    ``page_dir`` (under docs/): a file that is a page of the site links to that page, a lesson to its
    page, any other file to itself (a download)."""
    def target(match):
        text, link = match.group(1), match.group(2)
        if re.match(r"[a-z]+:", link) or link.startswith("#"):
            return match.group(0)
        path, _, anchor = link.partition("#")
        repo_path = os.path.normpath(os.path.join(source_dir, path))
        if repo_path in SITE_PAGES:
            new = "docs/" + SITE_PAGES[repo_path]
        elif re.fullmatch(r"tutorials/\d\d_\w+\.py", repo_path):
            new = f"docs/lessons/{Path(repo_path).stem}.md"
        else:
            new = repo_path
        rel = os.path.relpath(root / new, root / "docs" / page_dir)
        return f"[{text}]({rel}{'#' + anchor if anchor else ''})"
    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", target, markdown)


def picture_markdown(run: LessonRun, runs_rel: str, alt: str, without: dict[str, str]) -> str:
    if run.picture is not None:
        return (f"```{{image}} {runs_rel}/{run.picture.name}\n:alt: {alt}\n:class: lesson-picture\n"
                f":target: ../_images/{run.picture.name}\n```\n\n(Click the picture to open it at full size.)\n")
    if run.number in without:
        return f"```{{note}}\nNo picture: {without[run.number]}\nThe lesson's output below says so in one line.\n```\n"
    return "```{error}\nNo picture: the lesson drew none in this run, and that fails the build.\n```\n"


def lesson_page(script: Path, run: LessonRun, notes: str | None, root: Path, runs_rel: str,
                without: dict[str, str]) -> str:
    """The page of one lesson, ``runs_rel`` the folder of the runs relative to docs/lessons/."""
    docstring, end_line = docstring_of(script)
    title, body = to_markdown(docstring)
    code_rel = os.path.relpath(script, root / "docs" / "lessons")
    output = run.output.rstrip("\n") or "(nothing printed)"
    jump = "[what you will see, and what to try](#what-you-will-see-and-what-to-try), " if notes else ""
    fence = fence_for(output)
    parts = [
        f"# {title}\n",
        f"```{{admonition}} Run it\n:class: tip\n`{script.relative_to(root).as_posix()}`, run from the repository "
        f"root. The picture and the output on this page come from the run that built it, "
        f"`{run.command}`, in {run.seconds:.1f} s. {{download}}`Download the lesson <{code_rel}>`\n\n"
        f"On this page: {jump}[the picture](#the-picture), [the output](#the-output), [the code](#the-code).\n```\n",
        body,
    ]
    if notes:
        parts.append("## What you will see, and what to try\n\n"
                     + rebase_links(notes.split("\n", 1)[1].strip() + "\n", "tutorials", "lessons", root))
    parts.append("## The picture\n\n" + picture_markdown(run, runs_rel, title, without))
    parts.append(f"## The output\n\n{fence}text\n{output}\n{fence}\n")
    parts.append(f"## The code\n\n```{{literalinclude}} {code_rel}\n:language: python\n:lines: {end_line + 1}-\n```\n")
    parts.append(f"*Total running time of the lesson: {run.seconds:.1f} s.* "
                 f"{{download}}`Download the lesson: {script.name} <{code_rel}>`\n")
    return "\n".join(parts)


def index_page(runs: dict[str, LessonRun], root: Path, runs_rel: str) -> str:
    """The lessons' index: the learning path's introduction and table, the gallery, its last sections."""
    intro, sections, after = learning_path(root)
    cards = []
    for name, run in runs.items():
        title, _ = to_markdown(docstring_of(root / "tutorials" / f"{name}.py")[0])
        caption = f"[{title}]({name}.md)"
        if run.picture is not None:
            cards.append(f"````{{figure}} {runs_rel}/{run.picture.name}\n:target: {name}.html\n:alt: lesson {run.number}"
                         f"\n:figclass: lesson-thumb\n\n{caption}\n````\n")
        else:
            cards.append(f"````{{container}} lesson-thumb lesson-no-picture\n{caption}\n\n(no picture from this build: "
                         f"its page says why)\n````\n")
    # the sidebar's short names, the learning path's headings ("04 — pipeline parallelism")
    short = {name: sections[run.number].split("\n", 1)[0][3:].strip() if run.number in sections else name
             for name, run in runs.items()}
    toctree = ("```{toctree}\n:hidden:\n:maxdepth: 1\n\n"
               + "\n".join(f"{short[name]} <{name}>" for name in runs) + "\n```\n")
    return ("# Lessons\n\n" + rebase_links(intro, "tutorials", "lessons", root)
            + "\n## Every lesson, in its picture\n\nEach picture was drawn by its lesson when this site was built.\n\n"
            + "`````{container} lesson-gallery\n" + "\n".join(cards) + "`````\n\n" + toctree + "\n"
            + rebase_links(after, "tutorials", "lessons", root))
