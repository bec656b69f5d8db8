"""minidist: see and run how large-language-model training is distributed.

``import minidist`` initialises nothing: MPI starts only in :func:`init`, CuPy is imported only when
an array asks for it.
"""
from minidist.comm.launch import init, run_anywhere, run_local

__all__ = ["init", "run_local", "run_anywhere"]
__version__ = "0.1.0"
