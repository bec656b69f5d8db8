"""A lesson's docstring, plain text, as Markdown that reads as the author laid it out.

The docstrings are written for a terminal: prose paragraphs start at the left margin; commands,
formulas, aligned tables and numbered lists are indented or start with a list marker, and their
columns matter. So a paragraph all at the margin becomes prose (its lines joined, every character
Markdown would read as markup escaped, ````code```` kept as code); a plain list (each item a ``-`` or
``1.`` line, its other lines indented to the item's text, no columns inside) becomes a list of such
prose; every other paragraph becomes a literal block, exactly as written. The first line is the title.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

LIST_START = re.compile(r"^(?:[-*+]\s|\d+[.)]\s)")
SPECIAL = re.compile(r"([\\`*_\[\]<>#|~!$])")  # characters that are markup somewhere in MyST


def docstring_of(path: Path) -> tuple[str, int]:
    """The module docstring of ``path`` (as written, not dedented) and the line its statement ends on."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        raise ValueError(f"{path}: no module docstring")
    return first.value.value, first.end_lineno


def escape(text: str) -> str:
    """Plain text as Markdown that shows exactly that text: ````x```` stays a code span."""
    parts = re.split(r"(``[^`]+``)", text)
    out = [p if p.startswith("``") and p.endswith("``") and len(p) > 4 else SPECIAL.sub(r"\\\1", p) for p in parts]
    text = "".join(out)
    return re.sub(r"^(\d+)([.)])", r"\1\\\2", text)  # "2. ..." at a paragraph's start is not a list


def joined(lines: list[str]) -> str:
    """Lines of one paragraph as one line; a word cut at a hyphen ("data-" / "parallel") stays whole."""
    out = ""
    for line in (line.strip() for line in lines):
        out += ("" if not out or re.search(r"[A-Za-z]-$", out) else " ") + line
    return out


def is_prose(lines: list[str]) -> bool:
    """A paragraph all at the left margin that does not start a list: prose."""
    return all(line[:1] not in (" ", "\t") for line in lines) and not LIST_START.match(lines[0])


def list_items(lines: list[str]) -> list[tuple[str, str]] | None:
    """A plain list's items as (marker, text), or None when the paragraph is not one."""
    indent = min(len(line) - len(line.lstrip()) for line in lines)
    items = []
    for line in (line[indent:] for line in lines):
        start = LIST_START.match(line)
        if start and not line.startswith(("* ", "+ ")):
            items.append([start.group(0).strip(), line[start.end():], len(start.group(0))])
        elif items and line.startswith(" " * items[-1][2]) and not line[items[-1][2]:].startswith(" "):
            items[-1][1] = joined([items[-1][1], line])
        else:
            return None
    if not items or any(re.search(r"\S {3,}\S", text) for _, text, _ in items):  # columns: keep the layout
        return None
    return [(marker, text) for marker, text, _ in items]


def fence_for(text: str) -> str:
    """A backtick fence longer than any run of backticks inside ``text``."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def to_markdown(docstring: str) -> tuple[str, str]:
    """(title, body): the docstring's first line, and the rest as Markdown (prose and literal blocks)."""
    lines = docstring.strip("\n").splitlines()
    title, rest = lines[0].strip(), lines[1:]
    paragraphs, current = [], []
    for line in rest + [""]:
        if line.strip():
            current.append(line.rstrip())
        elif current:
            paragraphs.append(current)
            current = []
    blocks = []
    for para in paragraphs:
        items = None if is_prose(para) else list_items(para)
        if is_prose(para):
            blocks.append(escape(joined(para)))
        elif items:
            blocks.append("\n".join(f"{marker} {escape(text)}" for marker, text in items))
        else:
            indent = min(len(line) - len(line.lstrip()) for line in para)
            text = "\n".join(line[indent:] for line in para)
            fence = fence_for(text)
            blocks.append(f"{fence}text\n{text}\n{fence}")
    return title, "\n\n".join(blocks) + "\n"
