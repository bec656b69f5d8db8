"""Session-wide: the test report's header says which GPU, if any, the GPU tests ran on; ``--slow``;
and ``cp``, the fake CuPy with the fake NCCL (tests/doubles), for the tests of backend "nccl"."""
import pytest


def pytest_report_header(config):
    from minidist.device import gpu_count
    if gpu_count() == 0:
        return "GPU: none (tests/test_gpu.py skips; the fake-CuPy tests cover the device code paths)"
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    return f"GPU: {gpu_count()} x {name}, CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (the full matrices)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (the full composition grid) are deselected unless ``--slow``."""
    if config.getoption("--slow"):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


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
