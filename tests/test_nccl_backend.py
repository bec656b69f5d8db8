"""backend="nccl": the rules of each collective and of point-to-point, on the CPU.

fake_cupy gives "device" arrays in host memory and fake_nccl an NCCL whose ranks are threads: it
really moves the bytes between them (through the arrays' addresses) and, like a GPU, runs a call only
once every rank has launched it, so a missing peer leaves the event undone and the group times out.
Ranks run as threads over LocalTransport (``run_nccl``), which carries the NCCL unique id; every rank
takes its own fake GPU, as ``minidist.init(backend="nccl")`` does. Inputs are integer-valued, so
results must equal NumPy's exactly. tests/test_gpu.py runs the real thing on GPUs.
"""
import dataclasses
import sys
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minidist import run_local
from minidist.comm.group import ProcessGroup
from minidist.comm.local_transport import LocalTransport
from minidist.comm.nccl import select_device
from minidist.comm.transport import CommTimeoutError
from minidist.comm.point_to_point import P2POp
from minidist.data import get_batch
from minidist.model import GPT
from minidist.optim import SGD
from minidist.parallel.mesh import DeviceMesh
from minidist.parallel.pipeline import PipelineEngine, PipelineStage, split_micro_batches
from minidist.parallel.pipeline.actions import RECVS, SENDS, stage_rank
from minidist.parallel.pipeline.interleaved import interleaved_1f1b
from minidist.parallel.pipeline.one_f_one_b import add_communication
from minidist.parallel.pipeline.schedules import build_schedule, placement_of
from minidist.parallel.pipeline.validate import ScheduleError, check_rounds, matching, rounds_of
from minidist.parallel.pipeline.zero_bubble import zbv
from minidist.train import train
from minidist.train.config import TrainConfig
from tests.doubles import fake_nccl
from tests.test_device_training import TINY, run
from tests.test_collectives import SETTINGS, assert_all_equal, dtypes, expected, ops, rank_inputs, seeds

worlds = st.integers(1, 5)


def run_nccl(fn, world_size, timeout=30.0, choose_gpu=True, **group_kwargs):
    """``fn(group)`` on ``world_size`` threads, each with its own fake GPU and a backend "nccl" group
    over LocalTransport; the results in rank order, or the first rank's error (others as notes)."""
    transports = LocalTransport.world(world_size, timeout)
    results, errors = [None] * world_size, {}

    def main(rank):
        try:
            if choose_gpu:
                select_device(rank, world_size)
            results[rank] = fn(ProcessGroup(transports[rank], backend="nccl", **group_kwargs))
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors[rank] = e
        finally:
            transports[rank].hub.mark_exited(rank, "ended")

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = errors[min(errors)]
        for r, e in sorted(errors.items())[1:]:
            first.add_note(f"rank {r} also failed: {type(e).__name__}: {e}")
        raise first
    return results


def check(cp, results, want):
    for got in results:
        assert type(got) is cp.ndarray, f"the result left the device: {type(got)}"
    assert_all_equal([got.get() for got in results], want)  # a float16 average: within its bound


# ---- collectives against NumPy -------------------------------------------------------------------------

@SETTINGS
@given(worlds, st.lists(st.integers(0, 7), max_size=2), dtypes, ops, seeds)
def test_all_reduce_leaves_every_rank_the_same_reduction(cp, n, shape, dtype, op, seed):
    inputs = rank_inputs(n, tuple(shape), dtype, op, seed)

    def body(g):
        x = cp.asarray(inputs[g.rank])
        assert g.all_reduce(x, op) is x
        return x
    check(cp, run_nccl(body, n), expected(inputs, op))


@SETTINGS
@given(worlds, st.integers(0, 40), st.integers(1, 3), dtypes, ops, st.booleans(), seeds)
def test_reduce_scatter_and_all_gather_follow_array_split(cp, n, rows, width, dtype, op, give_out, seed):
    """Uneven parts (rows not divisible by n, rows < n, rows 0) go through NCCL's equal parts padded."""
    inputs = rank_inputs(n, (rows, width), dtype, op, seed)
    want = expected(inputs, op)
    parts = np.array_split(want, n)

    def body(g):
        x = cp.asarray(inputs[g.rank])
        out = cp.empty(parts[g.rank].shape, dtype) if give_out else None
        part = g.reduce_scatter(x, op, out=out)
        assert out is None or part is out
        np.testing.assert_array_equal(x.get(), inputs[g.rank])  # the input is left alone
        whole = cp.empty(want.shape, dtype)
        start = sum(p.shape[0] for p in parts[:g.rank])
        whole[start:start + part.shape[0]] = part  # in place: the shard is a view of out
        gathered = g.all_gather(whole[start:start + part.shape[0]], count=rows, out=whole)
        return part, gathered
    results = run_nccl(body, n)
    for r, (part, _) in enumerate(results):
        check(cp, [part], parts[r])
    check(cp, [whole for _, whole in results], want)


@SETTINGS
@given(worlds, st.data(), st.integers(0, 30), dtypes, ops, seeds)
def test_broadcast_and_reduce_reach_or_leave_the_root(cp, n, data, length, dtype, op, seed):
    root = data.draw(st.integers(0, n - 1))
    inputs = rank_inputs(n, (length,), dtype, op, seed)

    def body(g):
        reduced = g.reduce(cp.asarray(inputs[g.rank]), root, op)
        return reduced, g.broadcast(cp.asarray(inputs[g.rank]), root)
    results = run_nccl(body, n)
    check(cp, [results[root][0]], expected(inputs, op))
    for r, (reduced, _) in enumerate(results):
        if r != root:
            np.testing.assert_array_equal(reduced.get(), inputs[r])  # other ranks keep their input
    check(cp, [b for _, b in results], inputs[root])


def test_equal_counts_need_no_padding_and_the_trace_names_nccl(cp):
    def body(g):
        part = g.reduce_scatter(cp.arange(12.0))
        whole = g.all_gather(part, count=12)
        g.barrier()
        return part, whole, [(e.op, e.algorithm) for e in g.trace.events], sorted(k[0] for k in g._native._workspace._buffers)
    for r, (part, whole, events, scratch) in enumerate(run_nccl(body, 4)):
        np.testing.assert_array_equal(part.get(), 4 * np.arange(12.0)[3 * r:3 * r + 3])
        np.testing.assert_array_equal(whole.get(), 4 * np.arange(12.0))
        assert events == [("reduce_scatter", "nccl"), ("all_gather", "nccl"), ("barrier", "nccl")]
        assert scratch == []  # no padded copies


def test_barrier_lets_no_rank_through_before_all_arrive(cp):
    arrived = []

    def body(g):
        arrived.append(g.rank)
        g.barrier()
        return len(arrived)
    assert run_nccl(body, 4) == [4] * 4


def test_async_all_reduce_runs_on_the_groups_gpu_from_the_comm_thread(cp):
    def body(g):
        x = cp.full(5, float(g.rank))
        work = g.all_reduce(x, op="avg", async_op=True)
        return work.wait()
    check(cp, run_nccl(body, 3), np.full(5, 1.0))


def test_debug_mode_and_forced_ring_still_work_on_backend_nccl(cp):
    def body(g):
        return g.all_reduce(cp.full(3, g.rank + 1, dtype=np.int64), algorithm="ring")
    check(cp, run_nccl(body, 3, debug=True), np.full(3, 6, dtype=np.int64))


# ---- groups from split: their own communicators -----------------------------------------------------------

def test_mesh_axes_from_split_get_their_own_communicators(cp):
    """A 2 x 3 mesh: rows and columns reduce independently, each over its own NCCL communicator."""
    def body(g):
        row, col = g.split(g.rank // 3), g.split(g.rank % 3)
        x = cp.full(4, float(g.rank))
        row_sum = row.all_reduce(x.copy())
        col_sum = col.all_reduce(x.copy())
        col_parts = col.reduce_scatter(cp.arange(3.0))
        return row_sum, col_sum, col_parts, {id(g._native.comm), id(row._native.comm), id(col._native.comm)}
    results = run_nccl(body, 6)
    for r, (row_sum, col_sum, col_parts, comms) in enumerate(results):
        members_row = [q for q in range(6) if q // 3 == r // 3]
        members_col = [q for q in range(6) if q % 3 == r % 3]
        np.testing.assert_array_equal(row_sum.get(), np.full(4, float(sum(members_row))))
        np.testing.assert_array_equal(col_sum.get(), np.full(4, float(sum(members_col))))
        np.testing.assert_array_equal(col_parts.get(), np.array_split(2 * np.arange(3.0), 2)[r // 3])
        assert len(comms) == 3


# ---- point to point --------------------------------------------------------------------------------------

def test_send_and_recv_deliver_in_posting_order(cp):
    def body(g):
        if g.rank == 0:
            for i in range(3):
                g.send(cp.full(4, i, dtype=np.int32), 1)
            return None
        return [g.recv(cp.empty(4, np.int32), 0).get() for _ in range(3)]
    got = run_nccl(body, 2)[1]
    np.testing.assert_array_equal(got, [[0] * 4, [1] * 4, [2] * 4])


def test_two_ranks_exchanging_at_once_do_not_deadlock(cp):
    """Both send to each other at the same time: isend/irecv are launched in one NCCL group."""
    def body(g):
        peer = 1 - g.rank
        got_sendrecv = g.sendrecv(cp.full(3, 10.0 * g.rank), peer, cp.empty(3), peer)
        mine, theirs = cp.arange(6, dtype=np.int64) + 100 * g.rank, cp.empty(6, np.int64)
        send, recv = g.isend(mine, peer), g.irecv(theirs, peer)
        while not recv.test():  # test() launches the batch too
            pass
        send.wait()
        return got_sendrecv.get(), theirs.get()
    for r, (a, b) in enumerate(run_nccl(body, 2)):
        np.testing.assert_array_equal(a, np.full(3, 10.0 * (1 - r)))
        np.testing.assert_array_equal(b, np.arange(6) + 100 * (1 - r))


@pytest.mark.parametrize("n", [1, 3, 5])
def test_sendrecv_shifts_a_ring_of_any_size(cp, n):
    def body(g):
        right, left = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        return g.sendrecv(cp.full(2, g.rank, dtype=np.float16), right, cp.empty(2, np.float16), left).get()
    for r, got in enumerate(run_nccl(body, n)):
        np.testing.assert_array_equal(got, np.full(2, (r - 1) % n, dtype=np.float16))


def test_two_blocking_sends_at_each_other_time_out_as_on_real_nccl(cp):
    """A lone send holds its stream until the peer receives: two ranks that both send first wait on
    each other. The group says so at its timeout instead of hanging."""
    def body(g):
        g.send(cp.zeros(3), 1 - g.rank)
        g.recv(cp.zeros(3), 1 - g.rank)
    with pytest.raises(CommTimeoutError, match=r"send #1 on group 'world': rank \d waited .* for rank \d"):
        run_nccl(body, 2, timeout=0.3)


@pytest.mark.parametrize("backend", ["ring", "nccl"])
def test_batch_isend_irecv_checks_every_op_then_posts_them_together(cp, backend):
    """One batch of sends and receives: refused whole when any op is wrong (nothing posted), else
    every op posted, each recorded in the trace with its label; both ranks send first and receive
    second, which a batch allows (one NCCL group)."""
    xp = cp if backend == "nccl" else np

    def body(g):
        peer, theirs = 1 - g.rank, xp.zeros(3)
        mine = xp.full(3, float(g.rank))
        with pytest.raises(ValueError, match="a P2POp is 'isend' or 'irecv', got 'send'"):
            g.batch_isend_irecv([P2POp("isend", mine, peer), P2POp("send", mine, peer)])
        with pytest.raises(ValueError, match=r"peer must be a rank of group 'world' \(0\.\.1\), got 5"):
            g.batch_isend_irecv([P2POp("isend", mine, peer), P2POp("irecv", theirs, 5)])
        assert g.p2p_seq == 0
        requests = g.batch_isend_irecv([P2POp("isend", mine, peer, label="activation: mine"),
                                        P2POp("irecv", theirs, peer, label="activation: theirs")])
        for request in requests:
            request.wait()
        return theirs.get() if backend == "nccl" else theirs, [(e.op, e.label) for e in g.trace.events]
    run = run_nccl if backend == "nccl" else run_local
    for rank, (theirs, events) in enumerate(run(body, 2)):
        assert theirs.tolist() == [1.0 - rank] * 3
        assert events == [("isend", "activation: mine"), ("irecv", "activation: theirs")]


def test_a_later_launch_waits_behind_a_send_that_waits_for_its_peer(cp):
    """A stream runs in order: a lone send holds back everything launched after it on the rank until
    its peer receives. Two ranks that each launch a send, then a receive, wait for ever, though both
    receives were launched; the same two messages in one batch (one NCCL group) go through."""
    def alone(g):
        g.batch_isend_irecv([P2POp("isend", cp.zeros(3), 1 - g.rank)])
        g.batch_isend_irecv([P2POp("irecv", cp.zeros(3), 1 - g.rank)])[0].wait()
    with pytest.raises(CommTimeoutError, match=r"irecv #2 on group 'world': rank \d waited"):
        run_nccl(alone, 2, timeout=0.3)

    def together(g):
        requests = g.batch_isend_irecv([P2POp("isend", cp.full(3, float(g.rank)), 1 - g.rank),
                                        P2POp("irecv", got := cp.zeros(3), 1 - g.rank)])
        requests[1].wait()
        return got.get()
    assert [got.tolist() for got in run_nccl(together, 2)] == [[1.0] * 3, [0.0] * 3]


def tagged(a):
    """What a test message carries: its SEND's stage, micro-batch and direction."""
    send = matching(a) if a.op in RECVS else a
    return 1000 * send.stage + 10 * send.microbatch + (send.op == "SEND_B")


def run_rounds(cp, schedule, p, placement, timeout=1.0):
    """Post ``schedule``'s messages as the executor does (each round one batch, its receives waited
    for, the sends at the end) over NCCL, each message tagged; returns the receives per rank."""
    def body(g):
        pending, received = [], 0
        for batch in rounds_of(schedule[g.rank]):
            ops = [P2POp("isend" if a.op in SENDS else "irecv", cp.full(4, tagged(a), dtype=np.int64),
                         stage_rank(a.peer_stage(), p, placement), a.channel_tag()) for a in batch]
            for a, op, request in zip(batch, ops, g.batch_isend_irecv(ops)):
                if a.op in SENDS:
                    pending.append(request)
                    continue
                request.wait()
                assert (op.buffer.get() == tagged(matching(a))).all(), f"{a} got {op.buffer.get()}"
                received += 1
        for request in pending:
            request.wait()
        return received
    return run_nccl(body, p, timeout=timeout)


@pytest.mark.parametrize("schedule, p, m, v", [
    ("gpipe", 2, 3, 1), ("gpipe", 4, 5, 1), ("1f1b", 2, 8, 1), ("1f1b", 4, 6, 1), ("1f1b", 3, 1, 1),
    ("interleaved", 2, 2, 3), ("interleaved", 4, 4, 2), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2),
    ("interleaved", 3, 6, 3), ("zb-h1", 2, 4, 1), ("zb-h1", 4, 8, 1), ("zbv", 2, 4, 2), ("zbv", 3, 5, 2),
    ("zbv", 4, 8, 2)])
def test_pipeline_schedules_run_over_nccl_point_to_point(cp, schedule, p, m, v):
    """NCCL matches messages by order alone (no tags) and a batch completes only with all of its
    messages: every receive still gets the message its action pairs with, and nothing deadlocks."""
    received = run_rounds(cp, build_schedule(schedule, p, m, v), p, placement_of(schedule))
    local_edges = placement_of(schedule) == "v"  # the V's bottom: stages p-1 and p on one rank, handed over
    assert sum(received) == 2 * m * (p * v - 1 - local_edges)


@pytest.mark.parametrize("schedule, p, m, v", [("interleaved", 2, 4, 2), ("zbv", 2, 4, 2)])
def test_receives_left_before_their_compute_deadlock_as_the_validator_says(cp, schedule, p, m, v):
    """Without rounds.receive_when_sent (each receive right before the compute action that needs
    it), interleaved 1F1B and ZB-V deadlock in rounds: validate says so first, and the double agrees."""
    compute = interleaved_1f1b(p, m, v) if schedule == "interleaved" else zbv(p, m)
    naive = add_communication(compute, p * v, placement_of(schedule))
    with pytest.raises(ScheduleError, match=r"deadlock over NCCL \(each round one batch\): rank 0 posts .* and "
                                            r"waits for rank 1; rank 1 posts .* and waits for rank 0"):
        check_rounds(naive, p, placement_of(schedule))
    with pytest.raises(CommTimeoutError):
        run_rounds(cp, naive, p, placement_of(schedule), timeout=0.3)


def test_interleaved_and_zbv_train_over_nccl_like_over_the_ring(cp):
    """The engine over backend "nccl" (fake GPUs, fake NCCL) against the same steps on NumPy over the
    ring: interleaved 1F1B and ZB-V, once refused over NCCL, give bitwise the same losses and weights."""
    from tests.test_pipeline_engine import B, TOKENS, config

    def body(world, schedule, p, m, v, device):
        mesh = DeviceMesh(world, pp=p)
        model = GPT(config(p * v), seed=1, dtype="float64")
        stage = PipelineStage(model.to("cuda") if device else model, mesh.pp_rank, p, v,
                              placement=placement_of(schedule))
        engine = PipelineEngine(stage, mesh, schedule, m, v)
        optimizer = SGD(stage.named_parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(3):
            batch = get_batch(TOKENS, step, B, 8, seed=3)  # (B, T+1) token ids, on the stage's device
            micro = split_micro_batches(cp.asarray(batch) if device else batch, m)
            optimizer.zero_grad()
            losses.append(engine.forward_backward(micro))
            engine.all_reduce_tied_grads()
            optimizer.step()
        return losses, engine.evaluate(micro), stage.state_dict()

    for schedule, p, m, v in [("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2)]:
        over_nccl = run_nccl(lambda g: body(g, schedule, p, m, v, True), p)
        over_ring = run_local(lambda g: body(g, schedule, p, m, v, False), p)
        for (losses, val, state), (ref_losses, ref_val, ref_state) in zip(over_nccl, over_ring):
            assert losses == ref_losses and val == ref_val, schedule
            assert state.keys() == ref_state.keys()
            for name, value in ref_state.items():
                np.testing.assert_array_equal(state[name], value, err_msg=f"{schedule}: {name}")


# ---- failing well ----------------------------------------------------------------------------------------

def test_host_arrays_on_an_nccl_group_go_over_the_transport(cp):
    """NCCL moves GPU memory only; a host array (a flag, a gathered log line) on an NCCL group runs
    the hand-written algorithms over the transport instead, and the trace says so."""
    def body(g):
        flag = g.all_reduce(np.array([g.rank + 1.0]))
        got = g.sendrecv(np.full(2, g.rank), 1 - g.rank, np.empty(2, np.int64), 1 - g.rank)
        device = g.all_reduce(cp.ones(3))
        return flag, got, device, [e.algorithm for e in g.trace.events if e.op == "all_reduce"]
    for rank, (flag, got, device, algorithms) in enumerate(run_nccl(body, 2)):
        assert type(flag) is np.ndarray and flag.tolist() == [3.0]
        assert got.tolist() == [1 - rank] * 2
        assert type(device) is cp.ndarray and device.get().tolist() == [2.0] * 3
        assert algorithms == ["doubling", "nccl"]


def test_mixed_host_and_device_buffers_are_refused_before_anything_is_sent(cp):
    def body(g):
        for call in (lambda: g.all_gather(cp.ones(1), out=np.ones(2)),
                     lambda: g.sendrecv(cp.ones(2), 1 - g.rank, np.ones(2), 1 - g.rank)):
            with pytest.raises(ValueError, match="memory but the input is in"):
                call()
        return g.seq, g.p2p_seq
    assert run_nccl(body, 2) == [(0, 0), (0, 0)]


def test_missing_cupy_or_nccl_is_a_clear_error(cp, monkeypatch):
    transport = LocalTransport.world(1)[0]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "cupy", None)  # `import cupy` fails, as without CuPy
        with pytest.raises(ImportError, match="backend 'nccl' needs CuPy and an NVIDIA GPU"):
            ProcessGroup(transport, backend="nccl")
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "cupy.cuda.nccl", None)  # CuPy without NCCL
        m.delattr(sys.modules["cupy.cuda"], "nccl")
        with pytest.raises(ImportError, match="backend 'nccl' needs CuPy with NCCL"):
            ProcessGroup(transport, backend="nccl")
    with pytest.raises(ValueError, match="backend 'nccl' needs one process per GPU: run under mpiexec"):
        run_local(lambda g: None, 2, backend="nccl")


def test_two_ranks_on_one_gpu_are_refused_with_the_way_out(cp, monkeypatch):
    monkeypatch.setattr(sys.modules["cupy"].cuda.runtime, "getDeviceCount", lambda: 1)
    for local_rank in range(2):  # every rank of the node says it
        with pytest.raises(RuntimeError, match=r"2 ranks on this node but only 1 GPUs: NCCL does not allow two "
                                               r"ranks of a communicator on one GPU .* run at most 1 ranks per "
                                               r"node, or use backend 'ring'"):
            select_device(local_rank, 2)


def test_select_device_makes_the_local_rank_current(cp):
    assert select_device(0, 2) == 0
    assert run_nccl(lambda g: sys.modules["cupy"].cuda.Device().id, 3) == [0, 1, 2]
    with pytest.raises(fake_nccl.NcclError, match="Duplicate GPU"):  # the double refuses it like NCCL
        run_nccl(lambda g: None, 2, choose_gpu=False)


def test_a_rank_that_skips_a_collective_ends_in_a_timeout_naming_op_and_rank(cp):
    def body(g):
        g.all_reduce(cp.ones(2))
        if g.rank == 0:
            return None  # skips the second all-reduce
        with pytest.raises(CommTimeoutError, match=r"all_reduce #2 on group 'world': rank 1 waited 0\.\ds for a "
                                                   r"peer, which never answered") as error:
            g.all_reduce(cp.ones(2))
        assert error.value.peer == -1
        with pytest.raises(RuntimeError, match="NCCL communicator was aborted after all_reduce timed out"):
            g.barrier()
        return "timed out"
    # check_calls=False: NCCL's own timeout (the host-side check would name rank 0 before NCCL runs)
    assert run_nccl(body, 2, timeout=0.3, check_calls=False) == [None, "timed out"]


def test_a_receive_nobody_sends_ends_in_a_timeout_naming_the_peer(cp):
    def body(g):
        if g.rank == 1:
            with pytest.raises(CommTimeoutError, match=r"irecv #1 on group 'world': rank 1 waited .* for rank 0"):
                g.irecv(cp.empty(3), 0).wait()
    run_nccl(body, 2, timeout=0.3)


# ---- the trainer over NCCL -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [
    dict(dp=2), pytest.param(dict(dp=2, zero=1), marks=pytest.mark.slow), dict(dp=2, zero=3), dict(tp=2),
    dict(pp=2, micro_batches=2), dict(dp=2, ep=2, n_experts=4, zero=1),
    pytest.param(dict(pp=2, micro_batches=4, schedule="zb-h1"), marks=pytest.mark.slow),  # zbv splits B and W too
    pytest.param(dict(pp=2, micro_batches=4, schedule="interleaved", virtual_stages=2, n_layer=4), marks=pytest.mark.slow),
    dict(pp=2, micro_batches=4, schedule="zbv", virtual_stages=2, n_layer=4)],
    ids=["dp", "zero1", "zero3", "tp", "pp", "ep", "zb-h1", "interleaved", "zbv"])
def test_the_trainer_over_nccl_trains_bitwise_like_the_host_run(cp, tmp_path, layout):
    """``--device cuda --backend nccl`` on 2 ranks (threads, a fake GPU each) against the same run on
    NumPy over the ring. Two ranks' sums do not depend on the order of addition, so: bitwise."""
    cfg = TrainConfig(**{**TINY, **layout}, data_dir=str(tmp_path), optimizer="sgd", momentum=0.9)

    def body(group):
        model, history = train(dataclasses.replace(cfg, device="cuda", backend="nccl"), progress=False, world=group)
        return [r["loss"] for r in history], model.state_dict(), {type(p.data) for p in model.parameters()}
    for (losses, state, types), (ref_losses, _, ref_state, _) in zip(run_nccl(body, 2), run(cfg)):
        assert types == {cp.ndarray} and losses == ref_losses
        for name, value in ref_state.items():
            np.testing.assert_array_equal(state[name], value, err_msg=name)
