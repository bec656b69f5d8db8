"""Run a script with the fake-CuPy double standing in for a GPU: ``python tests/mpi/on_fake_gpu.py
GPUS SCRIPT [ARGS...]`` (under mpiexec too). The double has GPUS devices; with fewer than ranks, a
script that needs one GPU per rank (NCCL) takes its other path."""
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `tests.`
from tests.doubles import fake_cupy  # noqa: E402

fake_cupy.install(device_count=int(sys.argv[1]))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
