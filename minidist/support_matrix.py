"""``python -m minidist.support_matrix``: which of the trainer's features train together (the matrix is
made in minidist/train/support_matrix.py, with the trainer it describes).

    python -m minidist.support_matrix              # a summary that fits a terminal (100 columns)
    python -m minidist.support_matrix --markdown   # the README's Markdown table
"""
import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--markdown`` (the README's table instead of the summary) and ``--help``."""
    p = argparse.ArgumentParser(prog="python -m minidist.support_matrix", description=__doc__.split("\n\n")[0],
                                epilog="Either takes 10-40 s: every cell of the grid is checked as the trainer checks it.")
    p.add_argument("--markdown", action="store_true",
                   help="print the full Markdown table (the README's) instead of the summary")
    return p


def main(argv=None) -> int:
    """Print the summary or the table; 0, or 2 with one line when stdout cannot take it (a full disk).
    A reader that stops early (``| head``) ends it quietly with 0: it had what it wanted."""
    args = build_parser().parse_args(argv)
    from minidist.train import support_matrix  # here: --help and a refusal need not import the trainer
    table = support_matrix.markdown() if args.markdown else support_matrix.summary()
    try:
        print(table, flush=True)
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that Python's last flush succeeds
        if isinstance(e, BrokenPipeError):
            return 0
        print(f"minidist.support_matrix: cannot write the table to stdout: {e.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
