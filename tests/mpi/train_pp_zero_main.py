"""``python -m minidist.train ARGS`` for ``run_mpi``, which starts scripts by path: the trainer's own
entry point, run as a module (a path to minidist/train.py would put minidist/ first on sys.path)."""
import runpy

runpy.run_module("minidist.train", run_name="__main__", alter_sys=True)
