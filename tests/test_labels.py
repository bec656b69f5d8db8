"""Every collective and point-to-point call says why it was made: its call site's label,
``"<purpose>: <what>"``, recorded in the trace (comm/trace.py's PURPOSES), which ``--explain`` and
``python -m minidist.inspect`` print instead of guessing from sizes.

The rules, over one traced training step (with its evaluation and checkpoint save) of every layout
of the composition test's default sample (tests/test_composition.py):
- every call has a label, and its purpose is one of PURPOSES;
- no gradient or parameter collective is called an activation. Decided from facts that need no
  sizes: data-parallel replicas (the dp, dp x cp and expert-dp groups) never exchange activations,
  there a reduce-scatter is a gradient, an all-gather or a broadcast a parameter, an all-reduce a
  gradient or a metric; the pipeline's embedding group sums the tied embedding's gradients; the
  collectives of the step made outside its forward, backward and weight passes (the gradient
  pipeline: SP sums, clipping, ZeRO's publishing; the loss) move no activation; and inside the
  step only activations (and their gradients) travel point to point (pipeline stages, ring
  attention);
- and the other way round, inside the passes tensor, context and expert parallelism exchange
  activations (or the loss, a metric) only.

A call without a label is reported with its op, group and the line of library code that made it,
which the test learns by watching the group's dispatch (the library records nothing for it).
"""
import dataclasses
import os
import traceback
from collections import Counter

import pytest

from minidist import run_local
from minidist.comm import ProcessGroup
from minidist.comm.trace import PURPOSES, purpose_of
from minidist.inspect.accounting import axis_of
from minidist.inspect.spans import is_module_span
from minidist.train import train
from minidist.train.support_matrix import config_for
from tests.test_composition import (ADAMW_CELLS, CP_CELLS, FIRST, MOE_COVER, OFFLOAD_COVER, SAMPLE, SIZES, TRAIN,
                                    experts, run_dtype, sample)

CELLS = list(dict.fromkeys(sample(SAMPLE) + ADAMW_CELLS + CP_CELLS[:FIRST] + MOE_COVER[:FIRST] + OFFLOAD_COVER[:FIRST]))
LIBRARY = os.path.join("minidist", "")
COMM = os.path.join("minidist", "comm", "")


def _caller() -> str:
    """``path:line`` of the innermost library frame outside minidist/comm that made the call."""
    for frame in reversed(traceback.extract_stack()):
        if LIBRARY in frame.filename and COMM not in frame.filename:
            return f"{frame.filename[frame.filename.rindex(LIBRARY):]}:{frame.lineno}"
    return "?"


@pytest.fixture(scope="module")
def traced(data_dir, tmp_path_factory):
    """{cell: (events of every rank, {(op, group): call sites of the calls made without a label})}
    for one step of each cell of CELLS, saving a checkpoint where the cell checkpoints."""
    unlabelled: dict = {}
    dispatch, p2p = ProcessGroup._dispatch, ProcessGroup._p2p

    def watched_dispatch(self, name, *args, label="", **kwargs):
        if not label:
            unlabelled.setdefault((name, self.name), Counter())[_caller()] += 1
        return dispatch(self, name, *args, label=label, **kwargs)

    def watched_p2p(self, name, peer, nbytes, label=""):
        if not label:
            unlabelled.setdefault((name, self.name), Counter())[_caller()] += 1
        return p2p(self, name, peer, nbytes, label)

    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ProcessGroup, "_dispatch", watched_dispatch)
        patch.setattr(ProcessGroup, "_p2p", watched_p2p)
        for cell in CELLS:
            tmp = tmp_path_factory.mktemp("labels")
            cfg = dataclasses.replace(config_for(cell, **SIZES), **{**TRAIN, "steps": 1},
                                      **experts(cell.dtype, cell.moe != "none"), dtype=run_dtype(cell.dtype),
                                      data_dir=data_dir, ckpt_dir=str(tmp / "ckpt") if cell.checkpoint else None,
                                      save_every=1 if cell.checkpoint else 0,
                                      offload_dir=str(tmp / "offload") if cell.offload == "optimizer,params" else None)

            def rank_main(world, cfg=cfg):
                with world.trace.capture() as events:
                    train(cfg, progress=False, world=world)
                return events
            unlabelled.clear()
            found[cell] = (run_local(rank_main, cell.dp * cell.tp * cell.pp * cell.cp), dict(unlabelled))
    return found


def calls(events):
    """The collectives and point-to-point calls among ``events``."""
    return [e for e in events if e.kind in ("collective", "p2p")]


def test_every_call_has_a_label_with_a_purpose(traced):
    sites: dict = {}  # "op on group at path:line" -> the cells that made such calls
    wrong = set()
    for cell, (ranks, unlabelled) in traced.items():
        recorded = {(e.op, e.group) for events in ranks for e in calls(events) if not e.label}
        for (op, group) in recorded | set(unlabelled):
            for caller in unlabelled.get((op, group), ["? (recorded in the trace without the group's dispatch)"]):
                sites.setdefault(f"{op:<14} on {group.split('[')[0]:<10} from {caller}", {})[str(cell)] = None
        wrong |= {(e.op, e.group, e.label) for events in ranks for e in calls(events)
                  if e.label and purpose_of(e.label) not in PURPOSES}
    report = [f"{site}  ({len(cells)} layouts, e.g. {next(iter(cells))})" for site, cells in sorted(sites.items())]
    assert not report, f"{len(report)} call sites give no label:\n" + "\n".join(report)
    assert not wrong, f"labels whose purpose is not one of {list(PURPOSES)}: {sorted(wrong)}"


def _step(events):
    """(start, end) of the training step in one rank's ``events``: from its first compute span to
    the end of its optimizer span."""
    spans = [e for e in events if e.kind == "compute"]
    return min(e.start for e in spans), max(e.end for e in spans if e.op == "optimizer")


def _inside(e, spans) -> bool:
    return any(s.start <= e.start <= s.end for s in spans)


DP_PURPOSES = {"reduce_scatter": {"gradient"}, "all_gather": {"parameter"}, "broadcast": {"parameter"},
               "all_reduce": {"gradient", "metric"}}  # on a group of data-parallel replicas


def test_no_gradient_or_parameter_collective_is_called_an_activation(traced):
    wrong = Counter()
    for cell, (ranks, _) in traced.items():
        for events in ranks:
            lo, hi = _step(events)
            passes = [e for e in events if e.kind == "compute" and not is_module_span(e)
                      and e.op in ("forward", "backward", "weight")]
            for e in calls(events):
                purpose, in_step = purpose_of(e.label), lo <= e.start <= hi
                if not purpose or e.op == "split":
                    continue  # the test above reports it; a split is setup by its own label
                if axis_of(e.group) == "dp" and purpose not in DP_PURPOSES.get(e.op, {"setup"}):
                    wrong[f"{e.op} on the data-parallel group {e.group}: {e.label!r}"] += 1
                if e.group.endswith("/embedding") and purpose != "gradient":
                    wrong[f"{e.op} on the tied embedding group: {e.label!r}"] += 1
                if in_step and e.kind == "collective" and not _inside(e, passes) and purpose == "activation":
                    wrong[f"{e.op} on {e.group} outside the passes: {e.label!r}"] += 1
                if in_step and e.kind == "p2p" and purpose != "activation":
                    wrong[f"{e.op} on {e.group} in the step: {e.label!r}"] += 1
    assert not wrong, "\n".join(f"{n} x {what}" for what, n in wrong.most_common())


def test_the_activations_are_called_activations(traced):
    """The other way round: inside the passes, tensor, context and expert parallelism exchange only
    activations and their gradients (and the cp ranks' loss average, a metric)."""
    wrong = Counter()
    for cell, (ranks, _) in traced.items():
        for events in ranks:
            passes = [e for e in events if e.kind == "compute" and not is_module_span(e)
                      and e.op in ("forward", "backward", "weight")]
            for e in calls(events):
                purpose = purpose_of(e.label)
                if (axis_of(e.group) in ("tp", "cp", "ep") and _inside(e, passes) and purpose
                        and purpose not in ("activation", "metric")):
                    wrong[f"{e.op} on {e.group} in a pass: {e.label!r}"] += 1
    assert not wrong, "\n".join(f"{n} x {what}" for what, n in wrong.most_common())
