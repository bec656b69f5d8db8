"""Session-wide: the test report's header says which GPU, if any, the GPU tests ran on; ``--slow``;
``--skip-passed``; compiled code kept for the session's processes; and ``cp``, the fake CuPy with the
fake NCCL (tests/doubles), for the tests of backend "nccl"."""
import os
import shutil
import sys
import tempfile

import pytest


def pytest_report_header(config):
    from minidist.device import gpu_count
    if gpu_count() == 0:
        return "GPU: none (tests/test_gpu.py skips; the fake-CuPy tests cover the device code paths)"
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return f"GPU: {gpu_count()} x {name}, CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}"


def pytest_configure(config):
    """Where Python may not write its compiled code (``PYTHONDONTWRITEBYTECODE``, set in some CI and
    sandbox shells), every process the suite starts (a lesson, a trainer, each rank of an MPI job:
    about 500) would compile minidist again from source, ~0.2 s of CPU each: about a tenth of the
    suite. Then the session's processes keep their compiled code in a folder of their own
    (``PYTHONPYCACHEPREFIX``), removed at the end: nothing is written beside the sources, as the
    setting asks. Set in the main process, before pytest-xdist starts its workers, which inherit it."""
    if sys.dont_write_bytecode and not os.environ.get("PYTHONPYCACHEPREFIX") and not hasattr(config, "workerinput"):
        config.pycache_made = tempfile.mkdtemp(prefix="minidist-pycache-")
        os.environ["PYTHONPYCACHEPREFIX"] = config.pycache_made
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def pytest_unconfigure(config):
    if getattr(config, "pycache_made", None):
        shutil.rmtree(config.pycache_made, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (the full matrices)")
    parser.addoption("--skip-passed", action="append", default=[], metavar="LOG",
                     help="deselect the tests a LOG of an earlier `-v` run reports PASSED (repeatable): how a "
                          "long --slow grid goes on, on the same commit, where earlier runs stopped")


def passed_in(log: str) -> set[str]:
    """The node ids a ``pytest -v`` log reports PASSED (xdist's lines: ``[gw0] [ 5%] PASSED nodeid``)."""
    with open(log, encoding="utf-8", errors="replace") as f:
        return {line.split(" PASSED ", 1)[1].strip() for line in f if " PASSED " in line}


# The modules whose tests take longest (pytest --durations): run first, so that pytest-xdist's workers,
# which take the tests in this order, end together instead of one running the lessons while the other
# waits (the longest first: a greedy schedule's last test is a short one).
LONGEST_FIRST = ("test_tutorials.py", "test_composition.py", "test_mpi_pipeline.py", "test_train_parallel_mpi.py",
                 "test_labels.py", "test_train_zero.py", "test_train_checkpoint_mpi.py", "test_mpi.py")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (the full composition grid) are deselected unless ``--slow``; with
    ``--skip-passed LOG``, so are the tests LOG reports passed. The modules of :data:`LONGEST_FIRST` run
    first, in that order (the rest keep theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order kept
    done = set().union(*map(passed_in, config.getoption("--skip-passed")))
    slow = not config.getoption("--slow")
    skip = [item.nodeid in done or (slow and "slow" in item.keywords) for item in items]
    if any(skip):
        config.hook.pytest_deselected(items=[item for item, s in zip(items, skip) if s])
        items[:] = [item for item, s in zip(items, skip) if not s]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A folder holding the generated default corpus (``--data-dir``), made once per session, before
    any thread ranks read it. Tests write their own files under ``tmp_path``, not here."""
    from minidist.train.build import load_data
    from minidist.train.config import TrainConfig
    path = str(tmp_path_factory.mktemp("data"))
    load_data(TrainConfig(data_dir=path))
    return path


@pytest.fixture(scope="module")
def cp():
    """The fake-CuPy module with the fake NCCL installed, for one test module (uninstalled after)."""
    from tests.doubles import fake_cupy, fake_nccl
    try:
        yield fake_cupy.install(nccl=fake_nccl)
    finally:
        fake_cupy.uninstall()
