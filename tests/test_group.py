"""What a ProcessGroup adds to the algorithms: the all-reduce algorithm choice, "avg", numbering and
tracing of every call, and point-to-point messages."""
import json

import numpy as np
import pytest

import minidist
from minidist import run_local
from minidist.comm.dispatch import DEFAULT_THRESHOLD_BYTES


def test_auto_picks_by_size_and_group_size():
    small, large = DEFAULT_THRESHOLD_BYTES // 8 - 1, DEFAULT_THRESHOLD_BYTES // 8  # float64 elements

    def fn(g):
        for n in (small, large):
            g.all_reduce(np.ones(n))
        g.all_reduce(np.ones(4), algorithm="ring")
        g.reduce_scatter(np.ones(8))
        g.all_gather(np.ones(2))
        return [e.algorithm for e in g.trace.events]

    # doubling below the threshold; then Rabenseifner's on a power-of-two group, else the ring
    assert run_local(fn, 3)[0] == ["doubling", "ring", "ring", "ring", "ring"]
    assert run_local(fn, 4)[0] == ["doubling", "halving", "ring", "halving", "doubling"]
    assert run_local(fn, 4, threshold_bytes=0, ring_from_bytes=0)[0] == ["ring"] * 5
    assert run_local(fn, 3, threshold_bytes=0)[0] == ["ring", "ring", "ring", "ring", "ring"]


@pytest.mark.parametrize("dtype, want", [("float32", [-3.5, 3.5, 0.5]), ("int64", [-3, 3, 0])])
def test_avg_divides_the_sum_and_truncates_integers_toward_zero(dtype, want):
    contributions = {0: [-3, 3, 1], 1: [-4, 4, 0]}  # sums -7, 7, 1 over 2 ranks
    results = run_local(lambda g: g.all_reduce(np.array(contributions[g.rank], dtype), op="avg"), 2)
    for got in results:
        np.testing.assert_array_equal(got, np.array(want, dtype))


def test_every_call_is_numbered_and_traced():
    def fn(g):
        x = np.zeros(10, np.float32)
        g.all_reduce(x)
        g.reduce_scatter(x)
        g.all_gather(np.zeros(5, np.float32))
        if g.rank == 0:
            g.send(x, dst=1, tag=3)
        else:
            g.recv(x, src=0, tag=3)
        g.barrier()
        return [(e.op, e.group, e.algorithm, e.nbytes, e.seq, e.peer, e.kind) for e in g.trace.events], g.seq

    (events0, seq0), (events1, seq1) = run_local(fn, 2)
    assert events0 == [("all_reduce", "world", "doubling", 40, 1, None, "collective"),
                       ("reduce_scatter", "world", "halving", 40, 2, None, "collective"),
                       ("all_gather", "world", "doubling", 40, 3, None, "collective"),
                       ("send", "world", "", 40, 1, 1, "p2p"),
                       ("barrier", "world", "binomial", 0, 4, None, "collective")]
    assert events1[3] == ("recv", "world", "", 40, 1, 0, "p2p")
    assert seq0 == seq1 == 4  # point-to-point calls are counted apart, so collectives stay in step


def test_non_blocking_point_to_point_exchange():
    def fn(g):
        peer = 1 - g.rank
        got = np.empty(3)
        receive = g.irecv(got, src=peer)
        send = g.isend(np.full(3, float(g.rank)), dst=peer)
        send.wait()
        receive.wait()
        return got, g.sendrecv(np.array([g.rank]), peer, np.empty(1, np.int64), peer)

    (got0, swapped0), (got1, swapped1) = run_local(fn, 2)
    np.testing.assert_array_equal(got0, [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(got1, [0.0, 0.0, 0.0])
    assert (swapped0[0], swapped1[0]) == (1, 0)


def test_a_trace_saved_as_json_lines_loads_back_equal(tmp_path):
    from minidist.comm.trace import Trace, write_chrome_trace
    traces = minidist.run_local(lambda g: (g.all_reduce(np.ones(5)), g.barrier(), g.trace)[-1], 2)
    for t in traces:
        t.save(tmp_path / f"rank{t.rank}.jsonl")
    loaded = [Trace.load(tmp_path / f"rank{r}.jsonl") for r in range(2)]
    assert [t.events for t in loaded] == [t.events for t in traces]
    assert [e.op for e in loaded[1].events] == ["all_reduce", "barrier"] and loaded[1].rank == 1
    write_chrome_trace(loaded, tmp_path / "trace.json", shared_clock=True)
    chrome = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert sorted((e["pid"], e["tid"]) for e in chrome if e["ph"] == "X") == [(0, 1), (0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dst", ["first", "last"])
def test_gather_bytes_brings_uneven_and_empty_payloads_to_dst_in_rank_order(world, dst):
    dst = 0 if dst == "first" else world - 1
    payload = [bytes(range(r % 3 * 7)) + f"rank {r}".encode() * (r % 2) for r in range(world)]  # some empty

    def fn(g):
        got = g.gather_bytes(payload[g.rank], dst=dst)
        return got, [(e.op, e.nbytes, e.seq) for e in g.trace.events]

    results = run_local(fn, world)
    assert b"" in payload
    for rank, (got, events) in enumerate(results):
        assert got == (payload if rank == dst else None)
        assert events == [("gather_bytes", len(payload[rank]), 1)]  # one numbered collective per rank


def test_gather_bytes_rejects_what_is_not_bytes_before_sending():
    with pytest.raises(ValueError, match="data must be bytes"):
        run_local(lambda g: g.gather_bytes("text"), 2)
    with pytest.raises(ValueError, match="dst"):
        run_local(lambda g: g.gather_bytes(b"x", dst=2), 2)


def test_format_summary_has_one_row_per_op_and_group_in_order_of_first_call():
    def fn(g):
        g.all_reduce(np.ones(4, np.float32))           # 16 bytes
        g.barrier()
        g.all_reduce(np.ones(8, np.float32))           # 32 bytes
        return g.trace.format_summary()

    rows = [line.split() for line in run_local(fn, 2)[1].splitlines()]
    assert rows[0] == ["rank", "1:", "op", "group", "calls", "bytes", "ms"]
    assert [r[:6] for r in rows[1:]] == [["rank", "1:", "all_reduce", "world", "2", "48"],
                                          ["rank", "1:", "barrier", "world", "1", "0"]]
    assert all(float(r[6]) >= 0 for r in rows[1:])
