"""The lessons' pictures say what the lessons print, and their text never overlaps.

Each lesson runs in this process on threads (its ``lesson`` function, as ``--local N`` would) with a
``--png`` path; every figure it saves is kept (``Figure.savefig`` is wrapped) and read back: titles
against the printed lines, text extents measured on matplotlib's renderer. What is compared is
text, never a time: a title must carry the very number the lesson printed, whatever it is. Lessons
02, 04 and 12 run whole here, again after tests/test_tutorials.py: with ``--slow``.
"""
import re
import runpy
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import minidist  # noqa: E402
from minidist.parallel.pipeline import build_schedule, placement_of, validate  # noqa: E402
from minidist.parallel.pipeline.timeline import Panel, draw_panels, draw_timelines  # noqa: E402

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def lesson(script):
    """The lesson's functions and constants (its ``__main__`` block does not run)."""
    return runpy.run_path(str(TUTORIALS / script), run_name=f"lesson_{script[:2]}")


@pytest.fixture
def saved(monkeypatch):
    """Every figure saved while the test runs, in order (each still written to its file)."""
    figures, save = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def renderer(fig):
    """The renderer the figure was saved with (an Agg canvas again, once the figure was closed)."""
    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    return fig.canvas.get_renderer()


def extents(ax):
    """(text, window extent) of every visible, non-empty text drawn in ``ax``."""
    return [(t.get_text(), t.get_window_extent(renderer(ax.figure))) for t in ax.texts
            if t.get_visible() and t.get_text()]


def overlapping(fig):
    """Every pair of texts of one axes whose extents overlap: (axes title, text, text)."""
    found = []
    for ax in fig.axes:
        boxes = extents(ax)
        found += [(ax.get_title(), a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:]
                  if box.overlaps(other)]
    return found


def outside_boxes(fig, margin=2):
    """Every timeline label not inside one of its axes' boxes (bars) with ``margin`` pixels clear on
    its left and right (labels that touch read as one: "F0.0F1.0"): (axes title, label)."""
    found = []
    for ax in fig.axes:
        bars = [p.get_window_extent(renderer(fig)) for p in ax.patches if isinstance(p, Rectangle)]
        for text, box in extents(ax):
            if not any(bar.x0 + margin <= box.x0 and box.x1 + margin <= bar.x1 and bar.y0 <= box.y0 and box.y1 <= bar.y1
                       for bar in bars):
                found.append((ax.get_title(), text))
    return found


def titles(fig):
    return [ax.get_title(loc="left") or ax.get_title() for ax in fig.axes]


# ---- the pipeline timeline: labels fit their boxes ------------------------------------------------

@pytest.mark.parametrize("name,columns", [("interleaved", 2), ("zbv", 1)])
def test_timeline_labels_stay_inside_their_boxes_and_never_overlap(tmp_path, saved, name, columns):
    """Interleaved 1F1B on 4 ranks once printed "F0.0F1.0F2.0" across three boxes. Two columns: the
    lessons' layout; one: the benchmark's (``draw_timelines``)."""
    ideal = validate(build_schedule(name, 4, 8, 2), 4, 8, 2, placement=placement_of(name))
    if columns == 2:
        draw_panels(tmp_path / "a.png", [[Panel(ideal, f"{name}: ideal", 1e3), Panel(ideal, "again", 1e3)]], name)
    else:
        draw_timelines(tmp_path / "b.png", ideal, ideal, name)
    (fig,) = saved
    labels = [text for ax in fig.axes for text, _ in extents(ax)]
    assert len(labels) > 0.25 * sum(map(len, ideal.spans)) * len(fig.axes)  # many boxes keep a label ...
    assert overlapping(fig) == [] and outside_boxes(fig) == []  # ... and each stays in its own


# ---- lessons 04 and 12: known stage costs beside this machine, titles = printed numbers -----------

def bubbles_in_titles(fig, names):
    """{(schedule, "known" / "machine" / "ideal"): the percentage its panel's title shows}."""
    found = {}
    for title in titles(fig):
        for name in names:
            known = re.fullmatch(rf"{name}, executed with known stage costs: bubble ([\d.]+)%, ideal ([\d.]+)%",
                                 title)
            machine = re.fullmatch(rf"{name}, executed on this machine \(the GPT, last step\): bubble ([\d.]+)%", title)
            if known:
                found[name, "known"], found[name, "ideal"] = known.groups()
            if machine:
                found[name, "machine"] = machine.group(1)
    return found


@pytest.mark.slow  # a whole lesson again (tests/test_tutorials.py runs it): 10-30 s
def test_lesson_04_draws_known_stage_costs_beside_this_machine_with_the_printed_bubbles(tmp_path, saved, capsys):
    module = lesson("04_pipeline.py")
    minidist.run_local(lambda world: module["lesson"](world, str(tmp_path / "pp.png"), local=True), 2)
    printed = capsys.readouterr().out
    (fig,) = saved
    names = ("gpipe", "1f1b", "interleaved")
    shown = bubbles_in_titles(fig, names)
    assert len(shown) == 3 * len(names), titles(fig)  # every schedule: both panels, each labelled as what it is
    for name in names:
        line = re.search(rf"  {name} +measured +([\d.]+)% +ideal +([\d.]+)% +with known stage costs +([\d.]+)%",
                         printed)
        assert line, printed
        assert (shown[name, "machine"], shown[name, "ideal"], shown[name, "known"]) == line.groups()
    assert overlapping(fig) == [] and outside_boxes(fig) == []


@pytest.mark.slow  # a whole lesson again (tests/test_tutorials.py runs it): 10-30 s
def test_lesson_12_draws_known_stage_costs_beside_this_machine_with_the_printed_bubbles(tmp_path, saved, capsys):
    module = lesson("12_zero_bubble.py")
    minidist.run_local(lambda world: module["lesson"](world, str(tmp_path / "zb.png")), 2)
    printed = capsys.readouterr().out
    executed, schedules = saved  # zb.png, then zb_schedules.png (the three ideal timelines)
    names = ("zb-h1", "zbv")
    shown = bubbles_in_titles(executed, names)
    assert len(shown) == 3 * len(names), titles(executed)
    for name in names:
        line = re.search(rf"  {name} +on this machine +([\d.]+)% +with known stage costs +([\d.]+)% +ideal +([\d.]+)%",
                         printed)
        assert line, printed
        assert (shown[name, "machine"], shown[name, "known"], shown[name, "ideal"]) == line.groups()
    for fig in saved:
        assert overlapping(fig) == [] and outside_boxes(fig) == []


# ---- lesson 02: the titles say what the text says ---------------------------------------------------

@pytest.mark.slow  # a whole lesson again (tests/test_tutorials.py runs it): 10-30 s
def test_lesson_02_titles_carry_the_printed_shares_and_what_the_overlap_saved(tmp_path, saved, capsys):
    module = lesson("02_data_parallel.py")
    drawing = minidist.run_local(module["lesson"], 2)[0]
    module["draw"](str(tmp_path / "dp.png"), *drawing)
    printed = capsys.readouterr().out
    (fig,) = saved
    median = re.search(r"the median pass \((\d+) of (\d+)\), per rank:", printed)
    panels = [t for t in titles(fig) if t.startswith("rank ")]
    assert len(panels) == 2
    for r, title in enumerate(panels):
        words = re.fullmatch(rf"rank {r}, the median pass \((\d+) of (\d+)\): (\d+% of its all-reduce time .*)", title)
        assert words and words.groups()[:2] == median.groups(), title
        assert f"\n  rank {r}: {words.group(3)}\n" in printed  # the same share, the same exposed ms
    saved_ms = re.search(r"\n  ([\d.]+ ms after backward \(exposed, median\), .*: saved [-+][\d.]+ ms)\.\n", printed)
    assert saved_ms and fig.get_suptitle() == f"Data parallelism on 2 ranks: the step waits {saved_ms.group(1)}"
    assert overlapping(fig) == []


# ---- lesson 09: the loss scale over the steps, the skipped step marked ----------------------------

def test_lesson_09_draws_the_loss_scale_with_the_skipped_step_marked(tmp_path, saved, capsys):
    module = lesson("09_mixed_precision_zero.py")
    minidist.run_local(lambda world: module["lesson"](world, str(tmp_path / "amp.png")), 4)
    printed = capsys.readouterr().out
    (fig,) = saved
    step = module["OVERFLOW_STEP"]
    part3 = re.search(rf"step {step} rank 0: .* SKIPPED, scale (\d+) -> (\d+)", printed).groups()
    part3b = re.search(rf"\n  step {step}: scale +(\d+) -> +(\d+) +overflow: skipped, halved", printed).groups()
    runs = {title: ax for ax in fig.axes for title in [ax.get_title(loc="left")] if "growth_interval" in title}
    assert len(runs) == 2, titles(fig)
    for (title, ax), (before, after) in zip(runs.items(), (part3, part3b)):
        marks = [line for line in ax.get_lines() if line.get_label().startswith("skipped step")]
        assert [(list(m.get_xdata()), list(m.get_ydata())) for m in marks] == [([step], [float(before)])], title
        assert [t for t, _ in extents(ax)] == [f"step {step} skipped: {before} -> {after}"], title
    assert overlapping(fig) == []


# ---- lesson 11: routing as a token x expert matrix ---------------------------------------------------

def test_lesson_11_draws_the_routing_as_a_matrix_with_each_tokens_experts_outlined(tmp_path, saved, n=4):
    """On 4 ranks the tangle of routing lines was at its worst, and part 2's rank headings overlapped."""
    module = lesson("11_experts.py")
    T, C, E, K = (module[k] for k in "TCEK")
    probs = []
    for r in range(n):  # part 1's probabilities, as each rank computes them for its sequence
        x = module["tiny_batch"](n)[r:r + 1]
        with module["no_grad"]():
            probs.append(module["softmax"](module["router_layer"]().router(module["Tensor"](x.reshape(T, C)))).data)
    probs = np.array(probs)  # (n, T, E)
    E2 = module["TRAIN"].n_experts
    load = np.array([[700, 30, 2000, 400, 250, 40, 60, 300], [600, 640, 580, 700, 650, 620, 660, 690]])  # (2, E2)
    trained = [(load, load.reshape(2, n, E2 // n).sum(axis=2).T, 2.1), (load[::-1], load[::-1].reshape(
        2, n, E2 // n).sum(axis=2).T, 2.08)]
    module["draw"](str(tmp_path / "moe.png"), n, probs, trained)
    (fig,) = saved
    routing = fig.axes[0]
    (image,) = routing.get_images()
    assert np.array_equal(image.get_array(), probs.reshape(n * T, E))
    experts = [module["route"](probs[r], K) for r in range(n)]  # (T, k) each
    crossing = sum(int(e // (E // n) != r) for r in range(n) for e in experts[r].ravel())
    outlines = [p for p in routing.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(outlines) == n * T * K
    assert sum(p.get_linestyle() == "--" for p in outlines) == crossing
    lines = [line for line in routing.get_lines() if isinstance(line, Line2D)]
    assert all(len(set(line.get_xdata())) == 1 or len(set(line.get_ydata())) == 1 for line in lines)  # separators
    assert overlapping(fig) == []


# ---- lesson 19: the process at each round it chose, ASHA's rungs ------------------------------------

def test_lesson_19_draws_each_round_the_process_chose_at_its_trials_and_the_printed_best(tmp_path, saved, capsys):
    module = lesson("19_hyperparameter_search.py")
    cfg = module["TrainConfig"](**module["SIZES"], **module["RUN"], ckpt_dir=str(tmp_path / "ckpt"),
                                out=str(tmp_path / "out"))
    state = module["part1"](cfg)
    module["draw_png"](str(tmp_path / "search.png"), cfg, state)
    printed = capsys.readouterr().out
    (fig,) = saved
    rounds = [ax for ax in fig.axes if ax.get_title(loc="left").startswith("after ")]
    assert rounds, titles(fig)
    for ax in rounds:
        started, names = re.match(r"after (\d+) steps: trials? ([\d, ]+) chosen from", ax.get_title(loc="left")).groups()
        picked = [state.trials[int(n)] for n in names.split(", ")]
        assert all(t.started == int(started) for t in picked), ax.get_title(loc="left")
        chosen = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--")
        assert chosen == sorted(t.hparams["lr"] for t in picked)
    (key,) = [ax for ax in fig.axes if ax.texts]
    final = re.search(r"final: (.*)", printed).group(1)
    assert key.texts[0].get_text() == final.replace("; ", "\n")
    assert overlapping(fig) == []


# ---- lesson 21: the worlds before the death, after the drop, after the join -------------------------

FT_LINES = ["step     4  ranks 1 lost (ProcessFailedError); going on with dp 2 on 2 ranks, the step redone (0.031 s)",
            "step     4  1 replica joined (rank 2, started in 3.734 s); going on with dp 3 on 3 ranks, the weights and "
            "optimizer state handed over (0.250 MiB to each new rank in 0.015 s; joined in 0.110 s)"]


def test_lesson_21_draws_each_world_from_the_trainers_lines_the_lost_and_joined_processes_marked(tmp_path, saved):
    """From the trainer's two lines (no MPI job): three panels titled with the step and dp, ranks in
    their replica's box, p1 crossed out after the drop, the spare s0 joined as rank 2."""
    module = lesson("21_fault_tolerance.py")
    found = module["worlds"](3, 3, ["unrelated line", *FT_LINES])
    assert [(w.step, w.dp, w.processes, w.lost, w.joined) for w in found] == [
        (1, 3, ["p0", "p1", "p2"], [], []), (4, 2, ["p0", "p2"], ["p1"], []), (4, 3, ["p0", "p2", "s0"], [], ["s0"])]
    assert module["text_drawing"](found[1]) == "replica 0 [rank 0=p0]  replica 1 [rank 1=p2]   lost: p1"
    module["draw"](str(tmp_path / "ft.png"), found)
    (fig,) = saved
    assert [ax.get_title() for ax in fig.axes] == ["step 1: the start\ndp 3 on 3 ranks",
                                                   "step 4: rank 1 lost\ndp 2 on 2 ranks",
                                                   "step 4: 1 replica joined\ndp 3 on 3 ranks"]
    for ax, world in zip(fig.axes, found):
        texts = [t for t, _ in extents(ax)]
        assert [t for t in texts if t.startswith("replica")] == [f"replica {i}" for i in range(world.dp)]
        assert [t for t in texts if t.startswith("rank")] == [f"rank {r}\n({p})" for r, p in enumerate(world.processes)]
        assert [t for t in texts if t.endswith("lost")] == [f"{p}\nlost" for p in world.lost]
        boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(boxes) == world.dp
    green = [t.get_text() for t in fig.axes[2].texts
             if t.get_bbox_patch() is not None and t.get_bbox_patch().get_facecolor()[:3] != (1.0, 1.0, 1.0)]
    assert green == ["rank 2\n(s0)"]
    assert overlapping(fig) == []
