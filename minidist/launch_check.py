"""Is a script launched the way it runs? Checked before any work, so that a lesson started the easy
wrong way (under mpiexec when it runs in one process, on a world size it is not written for) stops at
once with exit 2 and one line saying how to start it, a lesson for several ranks started alone runs
them as threads in this process (and says so), and a ``--png`` it could not write is refused before
the lesson, not after it.

    args = parser.parse_args()
    check_launch(parser, args, ranks=(2, 4), alone=4)   # 2 or 4 ranks; started alone: 4 threads
"""
from __future__ import annotations

import os
import sys

from minidist.files import file_problems
from minidist.launchers import leave_after_rank_0
from minidist.comm.machines import from_mpi
from minidist.threads import limit_blas_threads


def launched_ranks() -> tuple[int, int]:
    """(rank, size) of this process in the ``mpiexec`` job that started it; (0, 1) when it runs
    alone or without mpi4py. Asking starts MPI (mpi4py's import does), as a rank of the job would."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0, 1
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def check_launch(parser, args, ranks=None, alone: int = 1, mpiexec: bool = True) -> None:
    """Exit 2, with one line on rank 0 of a job (the other ranks leave quietly), when the script was
    launched a way it does not run:

    - under mpiexec when it runs in one process: ``mpiexec=False``, or ``--local N`` (``args.local``:
      N ranks as threads);
    - on a world size outside ``ranks`` (None: any): ``--local``'s, mpiexec's, or ``alone`` (the ranks
      it runs as when started alone without ``--local``: then it says so in one line, and a script
      with a ``--local`` flag has ``args.local`` set to ``alone`` here);
    - with an ``args.png`` it could not draw into (:func:`png_problem`).

    The message says how to start it right: ``mpiexec -n K python SCRIPT``, ``--local K``, alone.
    A launch that runs then takes its share of the machine's cores for BLAS threads, unless
    ``OMP_NUM_THREADS`` is set (:func:`minidist.threads.limit_blas_threads`)."""
    rank, size = launched_ranks()
    script, local = sys.argv[0], getattr(args, "local", None)
    n, problem = local if local is not None else size if size > 1 else alone, None
    if size > 1 and (not mpiexec or local is not None):
        threads = " (--local runs its ranks as threads)" if local is not None else ""
        problem = f"this lesson runs in one process{threads}: start it alone, python {script}, not under mpiexec"
    elif ranks is not None and n not in ranks:
        k = max([r for r in ranks if r <= 4] or ranks)  # a size to suggest: small, for a laptop
        ways = ([f"mpiexec -n {k} python {script}"] * mpiexec + [f"python {script} --local {k}"] * hasattr(args, "local")
                + [f"python {script}"] * (alone in ranks))
        problem = f"the lesson runs on {said(ranks)} ranks, not {n}: start it as {' or as '.join(ways)}"
    if problem is None and getattr(args, "png", None) is not None:
        problem = png_problem(args.png)
    if problem:
        if rank == 0:  # one line, from rank 0 alone: what is wrong and how to start it
            print(f"{parser.prog}: {problem}", file=sys.stderr)
            sys.exit(2)
        leave_after_rank_0(2, os.environ)
    if size == 1 and local is None and alone > 1:  # started alone: its ranks run as threads in this process
        if hasattr(args, "local"):
            args.local = alone
        print(f"{parser.prog}: started alone, so its {alone} ranks run as threads in this process "
              f"(as processes: mpiexec -n {alone} python {script})")
    if size == 1:
        here = n  # its ranks, as threads of this process
    else:  # the job's ranks on this host (MPI's shared-memory split and host names: collective)
        from mpi4py import MPI
        here = from_mpi(MPI.COMM_WORLD).host_size(rank)
    limit_blas_threads(os.environ.get("OMP_NUM_THREADS"), here, announce=rank == 0)  # its share of the cores


def said(ranks) -> str:
    """``range(2, 9)`` as "2 to 8", ``(2, 4)`` as "2 or 4", ``(2, 3, 4, 7)`` as "2, 3, 4 or 7"."""
    ranks = list(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]} to {ranks[-1]}"
    return ", ".join(map(str, ranks[:-1])) + " or " * (len(ranks) > 1) + str(ranks[-1])


def png_problem(path: str) -> str | None:
    """What is wrong with ``path`` as the picture ``--png`` draws into, or None: no name, a link, a
    folder, a FIFO or a device (:func:`minidist.files.file_problems`), a folder that does not exist,
    or a format matplotlib cannot write (``.png``, ``.svg``, ``.pdf``... are fine)."""
    if not path:
        return "--png needs a file name, e.g. --png out.png"
    try:
        problems = file_problems("--png", path)
        folder = os.path.dirname(path) or "."
        if not problems and not os.path.isdir(folder):
            problems = [f"--png {path}: the folder {folder} does not exist"]
    except OSError as e:  # a name too long for the file system
        return f"--png {path[:60]}...: {e.strerror}"
    if problems:
        return problems[0]
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix:  # none: matplotlib adds .png
        from matplotlib.backend_bases import FigureCanvasBase
        if suffix not in FigureCanvasBase.get_supported_filetypes():
            return f"--png {path}: matplotlib cannot draw into a .{suffix} file (give a .png, .svg or .pdf name)"
    return None
