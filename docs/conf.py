"""Sphinx configuration of minidist's site. Build it from the repository root (the README's command):

    python -m sphinx -W --keep-going -b html docs docs/_build/html

Every lesson runs while the site is built (docs/_ext/minidist_docs.py says how and what stops the build).
"""
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # this tree's minidist, installed or not

project = "minidist"
author = "the minidist developers"
copyright = "the minidist developers, MIT license"
extensions = ["myst_parser", "minidist_docs"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # links to a page's sections: [text](failing_well.md#what-goes-wrong)
suppress_warnings = ["myst.header"]  # the included benchmark notes start at level-3 headings in places

html_theme = "pydata_sphinx_theme"
html_title = "minidist"
html_static_path = ["_static"]
html_css_files = ["minidist.css"]
html_show_sourcelink = False
# the left sidebar lists a section's pages: only the lessons are a section; the other pages stand alone
html_sidebars = {page.stem: [] for page in DOCS.glob("*.md")}
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 4,
    # a lesson's page gives its width to the output's 100-column lines; its sections are linked at its top
    "secondary_sidebar_items": {"**": ["page-toc"],
                                **{f"lessons/{page.stem}": [] for page in (DOCS / "lessons").glob("[0-9][0-9]_*.md")}},
    "footer_start": ["copyright"],
    "footer_end": [],
}

# the lessons (docs/_ext/lesson_runs.py): how many run at once, the longest first, and each one's limit
lesson_jobs = 2
lessons_first = ("04", "11", "18", "12", "06", "17")
lesson_timeout = 600
# a lesson that may end without a picture, and what its page says instead
lessons_without_picture = {
    "08": "this lesson needs CuPy and an NVIDIA GPU, and the machine that built this site has none. "
          "It then says so in one line and exits 0 without drawing (on a GPU machine its page shows "
          "the times of part 2 as bars).",
    "21": "this lesson needs Open MPI 5's fault-tolerance interface (ULFM), and the site was built under an MPI "
          "without it (MPICH). It then says so in one line and exits 0 without drawing (under Open MPI its page "
          "shows the world before the death, after the drop and after the join).",
}
