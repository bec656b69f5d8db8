"""The flight recorder: on a timeout each rank shows its last calls, the failed one marked, so the
rank that stopped early (or called something else) can be found by reading the dumps side by side."""
import re

import numpy as np
import pytest

import minidist
from minidist.comm.flight_recorder import FlightRecorder, format_events
from minidist.comm.trace import Trace
from minidist.comm.transport import CommTimeoutError
from tests.mpi.harness import run_mpi


def test_a_skipped_collective_is_dumped_marked_after_the_calls_before_it(tmp_path):
    recorder = FlightRecorder(last=3, directory=tmp_path, stream=open(tmp_path / "stderr.txt", "w"))

    def rank_fn(group):
        x = np.ones(10, np.float64)
        for _ in range(3):
            group.all_reduce(x)
        if group.rank == 1:
            return None  # rank 1 skips the fourth all_reduce
        with pytest.raises(CommTimeoutError) as info:
            group.all_reduce(x)
        return recorder.dump(group.trace, info.value)

    text = minidist.run_local(rank_fn, 2, timeout=5)[0]
    lines = text.splitlines()
    assert lines[0].startswith("flight recorder, rank 0: last 3 of 4 calls before: CommTimeoutError: all_reduce #4")
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[3]) for r in rows] == [("2", "all_reduce", "world"), ("3", "all_reduce", "world"),
                                                   ("4", "all_reduce", "world")]
    assert [r[5] for r in rows] == ["80", "80", "80"]  # bytes
    assert lines[-1].endswith("<-- TIMED OUT") and not any("TIMED OUT" in line for line in lines[2:-1])
    recorder.stream.close()
    assert (tmp_path / "flight_rank0.txt").read_text() == text + "\n"
    assert text in (tmp_path / "stderr.txt").read_text()


def test_empty_trace_and_no_error():
    assert format_events(Trace(rank=3), None).splitlines()[0] == "flight recorder, rank 3: last 0 of 0 calls"


def test_hung_peer_under_mpi_times_out_and_every_other_rank_dumps_its_record(tmp_path):
    run = run_mpi(3, "flight.py", tmp_path, timeout=60)
    # mpiexec forwards each rank's output as it comes, so two ranks' lines may arrive glued together
    assert sorted(re.findall(r"DUMPED rank=\d", run.stdout)) == ["DUMPED rank=0", "DUMPED rank=1"]
    for r in (0, 1):
        rows = (tmp_path / f"flight_rank{r}.txt").read_text().splitlines()
        assert "all_reduce #3 on group 'world'" in rows[0]
        assert [row.split()[1] for row in rows[2:]] == ["all_reduce", "barrier", "all_reduce"]
        assert rows[-1].endswith("<-- TIMED OUT")
        assert rows[-1] in run.stderr
    assert not (tmp_path / "flight_rank2.txt").exists()
