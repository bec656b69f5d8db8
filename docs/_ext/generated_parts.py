"""The parts of reference pages that the code itself says, made when the site is built.

A page marks where such a part goes with a comment line, ``<!-- generated: NAME -->``:

- ``trainer-flags``: every flag of ``python -m minidist.train``, from its argument parser
  (``minidist.train.cli.argument_parser()``), by group, with its help and default as ``--help`` gives them;
- ``support-matrix``: the output of ``python -m minidist.support_matrix --markdown``, run as typed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

MARK = re.compile(r"^<!-- generated: ([\w-]+) -->$", re.M)


def cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, no line breaks."""
    return " ".join(text.split()).replace("|", "\\|")


def trainer_flags() -> str:
    """A table per group of the trainer's parser: the flag as ``--help`` spells it, and its help."""
    from minidist.train.cli import argument_parser

    parser = argument_parser()
    formatter = argparse.HelpFormatter(parser.prog)
    out = []
    for group in parser._action_groups:  # argparse keeps its groups here; --help walks the same list
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]  # not --help
        if not actions:
            continue
        out += [f"## {group.title}", "", "| flag | what it sets |", "|---|---|"]
        for action in actions:
            spelled = formatter._format_action_invocation(action)  # "--steps N", as --help prints it
            out.append(f"| `{cell(spelled)}` | {cell(formatter._expand_help(action))} |")
        out.append("")
    return "\n".join(out)


def support_matrix(root: Path) -> str:
    """``python -m minidist.support_matrix --markdown``'s output, run from the repository root."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "minidist.support_matrix", "--markdown"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"python -m minidist.support_matrix --markdown exited {done.returncode}:\n{done.stderr}")
    return done.stdout


def fill(text: str, parts: dict[str, str]) -> tuple[str, list[str]]:
    """``text`` with every marked part filled from ``parts``; and the names marked but not known."""
    unknown = [name for name in MARK.findall(text) if name not in parts]
    return MARK.sub(lambda m: parts.get(m.group(1), m.group(0)), text), unknown
