"""``--explain``'s stories, every rank's, printed by rank 0: rank 0's whole, each other's as what differs.

Each rank tells its own story of the step (train/explain.py: ``explain_first_step``). The lines
travel to rank 0 as UTF-8 bytes (``ProcessGroup.gather_bytes``, no pickling), and rank 0 prints them
in rank order. Ranks that play the same part (tp rank 1 of dp replica 0 and of replica 1) tell the
same story but for their groups, partners and times, so after the first story of a kind only the
differences are printed: 8 ranks read as a few stories, not 8 copies.
"""
from __future__ import annotations

import difflib
import re
import sys
from contextlib import contextmanager

from minidist.train.explain import explain_first_step


def gather_lines(group, lines: list[str], dst: int = 0) -> list[list[str]] | None:
    """Every rank's ``lines`` on rank ``dst``, in rank order; None elsewhere. The text travels as
    UTF-8 bytes, one ``group.gather_bytes``."""
    gathered = group.gather_bytes("\n".join(lines).encode(), dst, label="setup: every rank's --explain text, to rank 0")
    if gathered is None:
        return None
    return [data.decode().split("\n") if data else [] for data in gathered]


_RANK_SPECIFIC = [  # what differs between ranks that play the same part: group names, partners, times
    (re.compile(r"\b(\w+)\[[^\]]*\]"), r"\1[.]"),
    (re.compile(r"with ranks? [\d, ]+"), "with ."),
    (re.compile(r"\b(to|from) rank \d+"), r"\1 rank ."),
    (re.compile(r"\d+\.\d ms"), ". ms"),
]


def _same_part(line: str) -> str:
    """``line`` with its rank-specific words blanked: two ranks that play the same part in the step
    (tp rank 1 of dp replica 0 and of replica 1) tell the same blanked story."""
    for pattern, blank in _RANK_SPECIFIC:
        line = pattern.sub(blank, line)
    return line


def differences(story: list[str], like: list[str], rank: int = 0) -> list[str]:
    """``story`` (a rank's lines after its heading and groups) told against ``like`` (rank ``rank``'s):
    one line when they match but for the ranks' own groups, partners and times, else only the lines
    that differ (difflib's opcodes on the blanked lines): ``~`` this rank's version of a line of
    ``rank``'s in the same place, ``+`` a line only this rank has, ``-`` one only ``rank`` has. A call
    both ranks made, only in another order (concurrent calls start in the order the threads and the
    cores let them), is not a difference: it is counted in one closing line."""
    a, b = [_same_part(line) for line in like], [_same_part(line) for line in story]
    blocks = [(tag, list(range(i1, i2)), list(range(j1, j2)))
              for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
              if tag != "equal"]
    only_there = [i for _, removed, _ in blocks for i in removed]
    moved = 0
    for _, _, added in blocks:  # a line of this rank's found among rank's unmatched lines: the same call, moved
        for j in list(added):
            match = next((i for i in only_there if a[i] == b[j]), None)
            if match is not None:
                only_there.remove(match)
                added.remove(j)
                moved += 1
    out = []
    for tag, removed, added in blocks:
        removed = [i for i in removed if i in only_there]
        if tag == "replace" and removed and len(removed) == len(added):
            out += [f"~ {story[j]}" for j in added]
        else:
            out += [f"- {like[i]}" for i in removed] + [f"+ {story[j]}" for j in added]
    order = (f"{moved} of its lines in another order than on rank {rank}: the same calls, started in whichever "
             "order the threads and cores let them") if moved else ""
    if not out:
        return [f"the same step as rank {rank}, with its own groups and partners (above)" + (f"; {order}" if moved else "")]
    return ([f"as rank {rank}, with its own groups and partners (above), except (~: this rank's version of "
             f"rank {rank}'s line, +: only here, -: only on rank {rank}):"] + out + ([f"  ({order})"] if moved else []))


def format_stories(stories: list[list[str]]) -> str:
    """Every rank's story as printed: rank 0's whole; each other rank's heading, groups and its
    :func:`differences` from the most alike story printed whole before it, or its whole story when
    less than half of it is alike (another pipeline stage: a story of its own)."""
    blocks, whole = [], {}  # whole: rank -> its blanked body, for the stories printed whole
    for rank, story in enumerate(stories):
        body = [_same_part(line) for line in story[2:]]
        alike = {r: difflib.SequenceMatcher(None, b, body, autojunk=False).ratio() for r, b in whole.items()}
        best = max(alike, key=alike.get, default=None)
        if best is None or alike[best] < 0.5:
            whole[rank] = body
            blocks.append("\n".join(story))
        else:
            blocks.append("\n".join(story[:2] + differences(story[2:], stories[best][2:], best)))
    return "\n\n".join(blocks)


def print_explanation(mesh, model, events, *, file=None, **details) -> None:
    """Collective over ``mesh.world``: gather every rank's :func:`explain_first_step` and print them
    on global rank 0: rank 0's whole, then per other rank what differs from an alike one
    (:func:`format_stories`;
    ``details``: :func:`explain_first_step`'s keyword arguments)."""
    stories = gather_lines(mesh.world, explain_first_step(mesh, model, events, **details))
    if stories is not None:
        print(format_stories(stories), file=file or sys.stdout, flush=True)


@contextmanager
def explaining(mesh, model, *, file=None, **details):
    """Print the explanation of whatever the ``with`` block does (a tutorial's training step):
    every event ``mesh.world.trace`` records inside it, however few the trace keeps. Collective over
    ``mesh.world`` on exit."""
    with mesh.world.trace.capture() as events:
        yield
    print_explanation(mesh, model, events, file=file, **details)
