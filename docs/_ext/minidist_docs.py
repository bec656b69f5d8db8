"""Sphinx extension: the site built from the lessons and from what the code says.

- Before reading (``builder-inited``): every lesson runs (:mod:`lesson_runs`), and
  ``python -m minidist.support_matrix --markdown`` beside them. A lesson that exits non-zero, or draws
  no picture without being named in ``lessons_without_picture`` (with the reason its page gives),
  fails the build (its page is still written, with what it printed, and every such lesson is named).
  A lesson without its page (``docs/lessons/NN_name.md``) or a page without its lesson stops it at once.
- While reading (``source-read``): a lesson's page and the lessons' index are written from the runs
  (:mod:`lesson_pages`: the committed file only names its lesson), and the marked parts of the reference
  pages are filled in (:mod:`generated_parts`).
- After writing (``build-finished``): a link or an image of any page that leads nowhere fails the
  build (:mod:`site_links`). A failed build exits 1, with or without ``-W``.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sphinx.errors import ExtensionError
from sphinx.util import logging

import generated_parts
import lesson_pages
import lesson_runs
import site_links

logger = logging.getLogger(__name__)


def _paths(app):
    docs = Path(app.srcdir)
    return docs.parent, docs / "_build" / "lessons"  # the repository, the lessons' runs


def fail(app, message: str) -> None:
    """Say what is wrong and let the build go on (its other problems are said too), then exit 1."""
    logger.error(message)
    app.statuscode = 1


def run_everything(app) -> None:
    root, runs = _paths(app)
    pages = {p.stem for p in (Path(app.srcdir) / "lessons").glob("[0-9][0-9]_*.md")}
    lessons = {s.stem for s in lesson_runs.lesson_files(root)}
    problems = [f"tutorials/{n}.py has no page: add docs/lessons/{n}.md (a few lines naming it, as the others do)" for n in sorted(lessons - pages)]
    problems += [f"docs/lessons/{n}.md names no lesson: tutorials/{n}.py does not exist" for n in sorted(pages - lessons)]
    if problems:
        raise ExtensionError("\n".join(problems))
    logger.info(f"running {len(lessons)} lessons, {app.config.lesson_jobs} at a time, and the support matrix ...")
    with ThreadPoolExecutor(max_workers=1) as side:
        matrix = side.submit(generated_parts.support_matrix, root)
        done = lesson_runs.run_all(root, runs, app.config.lesson_jobs, app.config.lesson_timeout,
                                   first=tuple(app.config.lessons_first))
        app.minidist_parts = {"trainer-flags": generated_parts.trainer_flags(), "support-matrix": matrix.result()}
    for run in done.values():
        logger.info(f"  {run.command}: exit {run.returncode}, {run.seconds:.1f} s" + ("" if run.picture else ", no picture"))
    for problem in lesson_runs.run_problems(done, app.config.lessons_without_picture):
        fail(app, problem)
    app.minidist_runs = done


def fill_page(app, docname: str, source: list) -> None:
    root, runs = _paths(app)
    runs_rel = "../_build/lessons"  # from docs/lessons/
    if docname == "lessons/index":
        source[0] = lesson_pages.index_page(app.minidist_runs, root, runs_rel)
    elif docname.startswith("lessons/") and docname[len("lessons/"):] in app.minidist_runs:
        name = docname[len("lessons/"):]
        _, notes, _ = lesson_pages.learning_path(root)
        run = app.minidist_runs[name]
        source[0] = lesson_pages.lesson_page(root / "tutorials" / f"{name}.py", run, notes.get(run.number), root,
                                             runs_rel, app.config.lessons_without_picture)
    else:
        source[0], unknown = generated_parts.fill(source[0], app.minidist_parts)
        for name in unknown:
            logger.warning(f"{docname}: no generated part is called {name!r}", location=docname)


def lessons_outdated(app, env, added, changed, removed):
    """The lessons ran again, so their pages (and the pages with generated parts) are read again."""
    return [d for d in env.found_docs if d.startswith("lessons/")
            or generated_parts.MARK.search(Path(env.doc2path(d)).read_text(encoding="utf-8"))]


def check_links(app, error) -> None:
    if error is not None or app.builder.format != "html":
        return
    broken = site_links.broken_links(Path(app.outdir))
    for problem in broken:
        fail(app, f"a broken link: {problem}")
    if not broken:
        logger.info("every link and image of the site's pages leads somewhere")


def setup(app):
    app.add_config_value("lesson_jobs", 2, "env")
    app.add_config_value("lesson_timeout", 600, "env")
    app.add_config_value("lessons_first", (), "env")
    app.add_config_value("lessons_without_picture", {}, "env")
    app.connect("builder-inited", run_everything)
    app.connect("source-read", fill_page)
    app.connect("env-get-outdated", lessons_outdated)
    app.connect("build-finished", check_links)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
