"""Context parallelism under real MPI: the command line with --cp trains to one process's weights
(ring over 4 ranks; zig-zag with tp and sequence parallelism; Ulysses with dp, ZeRO and MPI's own
collectives, ``--backend mpi``, whose all-to-all is MPI_Alltoallv), and a layout it cannot cut is
refused on every rank with one message and exit status 2."""
import numpy as np
import pytest

from tests.mpi.harness import find_mpiexec, run_mpi

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")
TRAIN = ("-m", "minidist.train")
TINY = ["--n-layer", "2", "--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--steps", "3", "--eval-every", "100", "--eval-iters", "1", "--sample-tokens", "0", "--dtype", "float64",
        "--optimizer", "adamw"]


@needs_mpi
def test_context_parallel_layouts_under_mpi_export_the_weights_of_one_process(tmp_path):
    common = TINY + ["--data-dir", str(tmp_path / "data")]
    run_mpi(1, *TRAIN, *common, "--export", tmp_path / "one.npz", timeout=120)
    one = np.load(tmp_path / "one.npz")
    layouts = {"ring": ["--cp", "4"],
               "zigzag": ["--cp", "2", "--cp-algorithm", "zigzag", "--tp", "2", "--sequence-parallel"],
               "ulysses": ["--cp", "2", "--cp-algorithm", "ulysses", "--dp", "2", "--zero", "1", "--backend", "mpi"]}
    for name, flags in layouts.items():
        run_mpi(4, *TRAIN, *common, *flags, "--export", tmp_path / f"{name}.npz", timeout=180)
        got = np.load(tmp_path / f"{name}.npz")
        assert sorted(got.files) == sorted(one.files)
        for key in one.files:
            assert np.abs(got[key] - one[key]).max() <= 1e-10 * np.abs(one[key]).max(), (name, key)


@needs_mpi
def test_ulysses_with_heads_that_do_not_divide_is_refused_on_every_rank(tmp_path):
    run = run_mpi(4, *TRAIN, *TINY, "--cp", "4", "--tp", "1", "--n-head", "2", "--n-embd", "16",
                  "--cp-algorithm", "ulysses", "--data-dir", tmp_path, timeout=60, check=False)
    assert run.returncode == 2, run.output
    assert run.stderr.count("invalid configuration") == 1, run.output  # printed once, by rank 0
    assert "use --cp-algorithm ring or zigzag" in run.stderr
    assert "Traceback" not in run.stderr
