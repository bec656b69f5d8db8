"""``python -m minidist.support_matrix``: print the README's support matrix (the table is made in
minidist/train/support_matrix.py, with the trainer it describes). It takes no arguments."""
import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--help`` alone (the matrix has no options)."""
    return argparse.ArgumentParser(prog="python -m minidist.support_matrix", description=__doc__.split("\n\n")[0])


def main(argv=None) -> int:
    """Print the matrix; 0, or 2 with one line when stdout cannot take it (a full disk). A reader that
    stops early (``| head``) ends it quietly with 0: it had what it wanted."""
    build_parser().parse_args(argv)
    from minidist.train.support_matrix import markdown  # here: --help and a refusal need not import the trainer
    table = markdown()
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
