"""The device mesh: tp varies fastest, then cp; each axis group holds the ranks that share the other
three; dp_cp holds the ranks that share (pp, tp)."""
import numpy as np
import pytest

import minidist
from minidist.parallel.layout import Layout
from minidist.parallel.mesh import DeviceMesh


@pytest.mark.parametrize("dp,pp,tp,cp", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 1, 4, 1), (2, 2, 2, 1), (2, 1, 3, 1),
                                         (1, 4, 2, 1), (1, 1, 1, 4), (2, 1, 2, 2), (1, 2, 1, 3), (2, 2, 1, 2)])
def test_axis_groups_hold_the_ranks_that_share_the_other_coordinates(dp, pp, tp, cp):
    shape = Layout(dp=dp, pp=pp, tp=tp, cp=cp)

    def fn(world):
        mesh = DeviceMesh(world, dp, pp, tp, cp)
        members = {}
        for axis in ("dp", "pp", "cp", "tp", "dp_cp"):
            group = getattr(mesh, f"{axis}_group")
            ranks = np.zeros(group.size, dtype=np.int64)
            ranks[group.rank] = world.rank
            members[axis] = group.all_reduce(ranks).tolist()  # world ranks of the group, in group order
        return mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank, members

    for rank, (d, p, c, t, members) in enumerate(minidist.run_local(fn, shape.world)):
        assert shape.coords(rank) == (d, p, c, t) and shape.rank_of(d, p, t, c) == rank
        assert members["tp"] == [shape.rank_of(d, p, i, c) for i in range(tp)]
        assert members["cp"] == [shape.rank_of(d, p, t, i) for i in range(cp)]
        assert members["pp"] == [shape.rank_of(d, i, t, c) for i in range(pp)]
        assert members["dp"] == [shape.rank_of(i, p, t, c) for i in range(dp)]
        assert members["dp_cp"] == [shape.rank_of(i, p, t, j) for i in range(dp) for j in range(cp)]


def test_tp_ranks_are_adjacent_and_names_are_readable():
    assert [Layout(dp=2, pp=2, tp=2).coords(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]
    names = minidist.run_local(lambda w: DeviceMesh(w, 2, 2, 2).name, 8)
    assert names[5] == "DP(1)-PP(0)-TP(1)-Rank(5)"
    assert [Layout(dp=1, pp=1, tp=2, cp=2).coords(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
    assert minidist.run_local(lambda w: DeviceMesh(w, 1, 1, 2, 2).name, 4)[2] == "DP(0)-PP(0)-CP(1)-TP(0)-Rank(2)"


def test_pipeline_neighbours():
    def fn(world):
        m = DeviceMesh(world, 1, 3, 1)
        return m.prev_stage, m.next_stage, m.is_first_stage, m.is_last_stage
    assert minidist.run_local(fn, 3) == [(None, 1, True, False), (0, 2, False, False), (1, None, False, True)]


def test_a_world_of_the_wrong_size_is_refused_on_every_rank():
    with pytest.raises(ValueError, match=r"world size 4 != dp\*pp\*cp\*tp = 2\*1\*1\*3 = 6"):
        minidist.run_local(lambda w: DeviceMesh(w, 2, 1, 3), 4)
