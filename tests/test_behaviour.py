"""The architecture change changed no number: every layout of tests/behaviour.py gives bitwise the
losses, gradient norms, final weights and per-rank collective bytes recorded before it
(tests/golden/behaviour.json)."""
import json

import pytest

from tests.behaviour import GOLDEN, LAYOUTS, key, snapshot

RECORDED = json.loads(GOLDEN.read_text())


def test_every_layout_is_recorded():
    assert sorted(RECORDED) == sorted(key(cell, opt) for cell, opt in LAYOUTS)


@pytest.mark.parametrize("cell,optimizer", LAYOUTS, ids=[key(c, o) for c, o in LAYOUTS])
def test_layout_unchanged(cell, optimizer, data_dir):
    now, before = snapshot(cell, optimizer, data_dir), RECORDED[key(cell, optimizer)]
    assert now["steps"] == before["steps"]
    assert now["weights"] == before["weights"]
    for rank, (calls, recorded) in enumerate(zip(now["calls"], before["calls"])):
        assert calls == recorded, f"rank {rank}"
