"""Tutorial 2 (data parallelism)'s checks against one process do fail on a wrong gradient (the
classic missing 1/N). That it runs both ways and what it prints: tests/test_tutorials.py."""
import importlib.util

import pytest

from minidist import run_local
from tests.mpi.harness import REPO

TUTORIAL = REPO / "tutorials" / "02_data_parallel.py"


def load_tutorial():
    spec = importlib.util.spec_from_file_location("tutorial_02", TUTORIAL)  # the name starts with a digit
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tutorials_check_fails_on_every_rank_when_gradients_are_summed_not_averaged():
    tutorial = load_tutorial()
    reference = tutorial.one_process_gradients()

    def fn(group):
        model = tutorial.GPT(tutorial.CONFIG, seed=0, dtype="float64")
        dp = tutorial.DataParallel(model, group, bucket_bytes=tutorial.BUCKET_BYTES)
        tutorial.forward_backward(model, [tutorial.my_rows(group, 0)], dp.no_sync, group.trace)
        dp.finish()
        summed = {name: group.size * p.grad for name, p in model.named_parameters()}  # forgot the 1/N
        with pytest.raises(AssertionError, match="differs from one process"):
            tutorial.check(group, "summed gradients", tutorial.worst_error(summed, reference))
        averaged = {name: p.grad.copy() for name, p in model.named_parameters()}
        return tutorial.worst_error(averaged, reference)

    assert all(worst < 1e-12 for worst in run_local(fn, world_size=2))
