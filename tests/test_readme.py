"""The README says what the code does: its support matrix is the one the code generates."""
from pathlib import Path

from minidist.train.support_matrix import markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_support_matrix_is_the_generated_one():
    text = README.read_text(encoding="utf-8")
    start, end = text.index("<!-- support-matrix -->\n"), text.index("<!-- /support-matrix -->")
    assert text[start + len("<!-- support-matrix -->\n"):end].strip() == markdown().strip(), \
        "README.md's support matrix is stale: paste the output of python -m minidist.support_matrix --markdown"
