"""``python -m minidist.support_matrix`` prints a summary that fits a terminal (100 columns); the README's
Markdown table (220 columns) with ``--markdown``. Both say the same of every pair of features.

Issue 36: the command printed the 220-column table into a terminal. The matrix here is made from a
sample of the grid (every 97th cell: seconds, not the whole grid's 10-40 s); tests/test_readme.py
holds the README to the whole one.
"""
import re

import pytest

import minidist.train.support_matrix as matrix
from minidist.support_matrix import main


@pytest.fixture(scope="module")
def verdicts():
    """The matrix of every 97th cell of the grid (made when a test asks, not at collection)."""
    return matrix.verdicts(matrix.grid()[::97])


def marks_of(text: str, row: str, split) -> dict:
    """{(row feature, column feature): mark} read back from ``text``: ``row`` matches a row, its
    group 1 the row's feature, group 2 its marks, which ``split`` cuts into one per column."""
    names = list(matrix.FEATURES)
    return {(m[1], b): mark for m in re.finditer(row, text, flags=re.M) for b, mark in zip(names, split(m[2]))}


def test_the_summary_fits_100_columns_and_names_every_feature(verdicts):
    text = matrix.summary(verdicts)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert max(len(line) for line in matrix.markdown(verdicts).splitlines()) > 100  # why it is not the default
    for i, name in enumerate(matrix.FEATURES, 1):
        assert re.search(rf"^ *{i}  {re.escape(name)} ", text, flags=re.M), name
    assert "--markdown" in text.splitlines()[0]
    assert " ".join(matrix.counts_line(verdicts).split()) in " ".join(text.split())  # wrapped, not cut


def test_the_summary_and_the_table_say_the_same_of_every_pair(verdicts):
    summary = marks_of(matrix.summary(verdicts), r"^ *\d+  (.+?) +((?:[✓✗·] *)+)$", str.split)
    table = marks_of(matrix.markdown(verdicts), r"^\| \*\*(.+?)\*\* \| (.*) \|$", lambda marks: marks.split(" | "))
    assert summary == table == verdicts.marks and len(summary) == len(matrix.FEATURES) ** 2


def test_the_command_prints_the_summary_and_the_table_with_markdown(monkeypatch, capsys, verdicts):
    monkeypatch.setattr(matrix, "verdicts", lambda cells=None: verdicts)  # the sample's, not the whole grid's
    assert main([]) == 0
    assert capsys.readouterr().out.strip() == matrix.summary(verdicts).strip()
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out.strip() == matrix.markdown(verdicts).strip()
