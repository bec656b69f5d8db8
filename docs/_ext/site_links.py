"""After the build: every link and every image of every page must lead somewhere.

Each ``href`` and ``src`` in the built HTML that points inside the site must name a file that exists,
and its ``#anchor`` an id on that page. Links to other sites (``http:``, ``https:``, ``mailto:``) are
not followed: the build runs offline.
"""
from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

EXTERNAL = ("http:", "https:", "mailto:", "data:", "javascript:", "//")


class _Page(HTMLParser):
    """The ids of a page, and its links as (tag, attribute, value)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("id", "name") and value:
                self.ids.add(value)
            if value and ((name == "href" and tag in ("a", "link", "area")) or (name == "src" and tag in ("img", "script"))):
                self.links.append((tag, name, value))


def broken_links(site: Path) -> list[str]:
    """Every link or image in ``site``'s pages that leads nowhere, as 'page: tag attr=value (why)'."""
    pages = {}
    for html in sorted(site.rglob("*.html")):
        if html.relative_to(site).parts[0] in ("_static", "_sources"):  # the theme's templates, not pages
            continue
        parser = _Page()
        parser.feed(html.read_text(encoding="utf-8", errors="replace"))
        pages[html.resolve()] = parser
    problems = []
    for html, page in pages.items():
        for tag, attr, value in page.links:
            if value.startswith(EXTERNAL):
                continue
            parts = urlsplit(value)
            target = (html.parent / unquote(parts.path)).resolve() if parts.path else html
            where = f"{html.relative_to(site.resolve())}: <{tag} {attr}={value!r}>"
            if not target.is_file():
                problems.append(f"{where} (no file {target})")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else set()
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{where} (no #{parts.fragment} on that page)")
            elif tag == "img" and target.stat().st_size == 0:
                problems.append(f"{where} (an empty image)")
    return problems
