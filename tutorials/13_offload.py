"""Lesson 13: ZeRO-Offload and ZeRO-Infinity: what each rank holds on the device, the host and the disk.

    mpiexec -n 2 python tutorials/13_offload.py                 (or --local 2; alone: 2 threads)
    python tutorials/13_offload.py --local 2 --png off.png      (also draw what each rank holds)

Read lessons 5 (ZeRO) and 9 (ZeRO in float16) first. ZeRO cuts the model states over the N dp ranks,
but each rank keeps its shards in DEVICE memory. The largest is the optimizer's: in mixed-precision
AdamW, 12 of the paper's 16 bytes per parameter (float32 master, exp_avg, exp_avg_sq), and it is
touched once per step, by an element-wise update that needs no GPU. So (minidist/parallel/zero/offload.py):

    ZeRO-Offload    the optimizer shard lives in host memory and the update runs there: each gradient
                    shard goes down (device -> host) once it is final, the updated parameter shard up
    ZeRO-Infinity   the same in files on the disk (memory-mapped, one per array, DIR/rank<r>/), and
                    under ZeRO-3 the parameter shards too: each goes up before every all-gather

A tiny GPT (every unit's size divides by N) is trained 4 float16 AdamW steps in six configurations:
ZeRO-2 and ZeRO-3, each without offload, offloaded to the host, and offloaded to files (in a
temporary folder, removed at the end). The lesson prints:

  1. what offload moves, in a few lines;
  2. what rank 0 holds after backward on the device, the host and the disk, measured from the live
     arrays, next to ``zero_memory.formula(zero)`` (equal to the byte on every rank);
  3. the paper's 16 bytes per parameter split by where they live (P = 2, G = 2, O = 12; /N where
     sharded), each cell x Psi checked against the measured bytes;
  4. the bytes moved in the last step (``Offload.moved``) next to the formula: down = G/N, up = P/N
     (ZeRO-3 with its parameters offloaded: the input of every all-gather, counted in the trace),
     the store read from and written to the disk once per step;
  5. the proof: each offloaded run's losses, gradient norms and final masters are bitwise those of
     the run without offload at the same stage (the same arithmetic, elsewhere);
  6. ZeRO-Infinity's files on rank 0, and nothing left once ``zero.close()`` ran.
"""
import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

import minidist
from minidist.amp import DynamicLossScaler
from minidist.data import get_batch, inputs_and_targets
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.zero.offload import Offload
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer
from minidist.inspect import zero_memory

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)  # units: multiples of 8 elements
BATCH, STEPS, LR, CLIP = 8, 4, 1e-2, 1.0
OPTIMIZER = "adamw"  # or "sgd" (with momentum): K = 8
OPTIMIZERS = {  # name: (hyper-parameters, K = the optimizer's bytes per parameter, what they hold)
    "adamw": (dict(betas=(0.9, 0.95), weight_decay=0.1), 12, "float32 master + exp_avg + exp_avg_sq"),
    "sgd": (dict(momentum=0.9, weight_decay=0.1), 8, "float32 master + momentum"),
}
HYPER, K, SLOTS = OPTIMIZERS[OPTIMIZER]
TOKENS = np.random.default_rng(0).integers(0, 64, size=4000)
CONFIGS = [  # (label, ZeRO stage, what is offloaded (None: nothing), in files)
    ("ZeRO-2", 2, None, False),
    ("ZeRO-2 + optimizer -> host", 2, "optimizer", False),
    ("ZeRO-2 + optimizer -> files", 2, "optimizer", True),
    ("ZeRO-3", 3, None, False),
    ("ZeRO-3 + optimizer,params -> host", 3, "optimizer,params", False),
    ("ZeRO-3 + optimizer,params -> files", 3, "optimizer,params", True),
]
PARTS = ("parameters", "gradients", "optimizer")  # what, in the picture's colours
PLACES = ("device", "host", "disk")  # where


def batch(step):
    return inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size))  # (B, T), (B, T)


def where_it_lives(zero, held):
    """{place: {part: bytes}}: the device's from model_state_bytes; the host's and the disk's split
    from the shards' arrays: the gradient shard's host buffer, and the store (the optimizer shard,
    with ZeRO-3's parameters offloaded the parameter shard too), on the host or on the disk."""
    split = {place: dict.fromkeys(PARTS, 0) for place in PLACES}
    split["device"] = {part: held[part] for part in PARTS}
    if zero.offload is not None:
        store = zero.offload.where  # "host" or "disk"
        split["host"]["gradients"] = sum(s.host_grad.nbytes for s in zero.shards)
        params = sum(s.compute.nbytes for s in zero.shards if any(a is s.compute for a in s.stored))
        split[store]["parameters"] = params
        split[store]["optimizer"] = sum(a.nbytes for s in zero.shards for a in s.stored) - params
    return split


def train(group, stage, what, folder):
    """STEPS float16 OPTIMIZER steps under ZeRO ``stage``, offloading ``what`` (in files under ``folder``,
    or in host memory when None). Returns what the lesson prints and checks, as a dict."""
    model = GPT(CONFIG, seed=0, dtype="float16")
    offload = Offload(what, folder, group.rank) if what else None
    zero = ZeroOptimizer(model, group, stage, OPTIMIZER, lr=LR, **HYPER, offload=offload,
                         mixed_precision="float16", scaler=DynamicLossScaler(group=group))
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]  # this rank's rows
    losses, norms = [], []
    for step in range(STEPS):
        idx, targets = batch(step)
        zero.zero_grad()  # also clears offload.moved: from here on, this step's bytes
        group.trace.clear()
        _, loss = model(idx[rows], targets[rows])
        (loss * zero.scaler.scale).backward()
        losses.append(loss.item())
        zero.reduce()
        if step == 0:
            held, formula = zero_memory.model_state_bytes(zero), zero_memory.formula(zero)  # after backward: at their largest
            split = where_it_lives(zero, held)
        norms.append(apply_gradients(zero, LR, CLIP, zero.scaler))  # found-inf, clip, update where the state lives
        assert norms[-1] is not None, f"step {step} overflowed: the lesson expects every step applied"
    gathers = [e.nbytes for e in group.trace.events if e.op == "all_gather" and e.group == group.name]
    files = {}
    if offload is not None and offload.where == "disk":  # before close() removes them
        files = {p.name: p.stat().st_size for p in sorted(offload.store.folder.glob("*.bin"))}
    with full_parameters(zero, masters=True):
        masters = {name: p.data.copy() for name, p in model.named_parameters()}  # float32, full
    zero.close()
    left = sorted(str(p) for p in Path(folder).rglob("*")) if folder else []
    return dict(losses=losses, norms=norms, masters=masters, held=held, formula=formula, split=split,
                moved=dict(offload.moved) if offload else {}, gathers=gathers,
                store=sum(a.nbytes for s in zero.shards for a in s.stored), files=files, left=left,
                units=[(s.unit.name, s.unit.numel) for s in zero.shards])


def kib(n):
    return f"{n / 1024:.1f}"


def per_parameter(stage, what, disk):
    """Where the paper's bytes per parameter live on each rank: {place: [terms]}, with P = G = 2
    (float16) and O = K (AdamW: 12, the float32 master and two moments) bytes per parameter, /N where sharded."""
    store = ["O/N"] + (["P/N"] if what == "optimizer,params" else [])
    device = ["P/N" if stage == 3 else "P", "G/N", "O/N"]
    if not what:
        return {"device": device, "host": [], "disk": []}
    return {"device": [t for t in device if t not in store], "host": ["G/N"] + ([] if disk else store),
            "disk": store if disk else []}


def show_terms(terms, n):
    """('P + G/N + O/N = 9', 9.0) for N = 2: the terms and the bytes per parameter they add up to."""
    if not terms:
        return "-", 0.0
    value = sum({"P": 2, "G": 2, "O": K}[t[0]] / (n if t.endswith("/N") else 1) for t in terms)
    return " + ".join(terms) + f" = {value:g}", value


def lesson(world, png=None):
    n = world.size
    if n not in (2, 4, 8):
        raise SystemExit("the lesson needs 2, 4 or 8 ranks (every unit's size divides by them)")
    psi = sum(p.data.size for p in GPT(CONFIG).parameters())  # the tied embedding once
    rank0 = world.rank == 0
    if rank0:
        print("=== 1. What offload moves ===")
        print("Mixed-precision AdamW keeps, per parameter, the paper's 2 + 2 + 12 bytes: P = 2 (float16 parameter),")
        print("G = 2 (float16 gradient), O = 12 (float32 master 4, exp_avg 4, exp_avg_sq 4). ZeRO shards them over")
        print("the N dp ranks, all on the device. O is 3/4 of it and is used once per step, by an element-wise update:")
        print("  ZeRO-Offload:  O/N lives in host memory; each rank's gradient shard goes DOWN (G/N, device -> host)")
        print("                 once it is final, the host updates masters and moments, the new float16 parameter")
        print("                 shard goes UP (P/N, host -> device) and is all-gathered as in ZeRO-2.")
        print("  ZeRO-Infinity: the same store as files on the disk (read and written once per step, kept out of")
        print("                 memory between uses); with ZeRO-3 the parameter shards P/N too, each fetched UP")
        print("                 before every all-gather that needs it (forward and backward) instead of once per step.")
        print("On this CPU the 'device' and the 'host' are both NumPy: the copies happen, and their bytes are what")
        print("would cross PCIe on a GPU. Offloaded or not, the arithmetic is the same: the runs must be bitwise equal.")

    root = tempfile.mkdtemp(prefix="minidist_lesson13_")  # this rank's: Offload writes under root/<config>/rank<r>/
    try:
        results = {}
        for i, (label, stage, what, disk) in enumerate(CONFIGS):
            results[label] = train(world, stage, what, str(Path(root) / f"config{i}") if disk else None)
        left = sorted(str(p) for p in Path(root).rglob("*.bin"))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    # every rank checks its own numbers; the failures are counted over the world so that all stop together
    failures = []
    for label, stage, what, disk in CONFIGS:
        r = results[label]
        if r["held"] != r["formula"]:
            failures.append(f"{label}: rank {world.rank} holds {r['held']}, the formula says {r['formula']}")
        for place in ("host", "disk"):  # the split adds up to what model_state_bytes measured
            if sum(r["split"][place].values()) != r["held"].get(place, 0):
                failures.append(f"{label}: rank {world.rank}'s {place} split {r['split'][place]} != {r['held']}")
        for place, terms in per_parameter(stage, what, disk).items():  # the paper's bytes per parameter x Psi
            terms_text, value = show_terms(terms, n)
            measured = sum(r["split"][place].values())
            if measured != value * psi:
                failures.append(f"{label}: {place} holds {measured} B, {terms_text} x Psi = {value * psi:g}")
    moved_rows, proofs = [], []
    for label, stage, what, disk in CONFIGS:
        if not what:
            continue
        r, plain = results[label], results[f"ZeRO-{stage}"]  # the run without offload at the same stage
        shard = psi * 2 // n  # P/N = G/N, float16
        store = psi * K // n + (shard if what == "optimizer,params" else 0)  # O/N (+ P/N)
        if r["store"] != store:
            failures.append(f"{label}: rank {world.rank} stores {r['store']} B, the formula says {store}")
        inputs = sum(r["gathers"]) // n  # what this rank's all-gathers sent of their own: its shard each time
        expected = {"down": shard, "up": inputs if what == "optimizer,params" else shard,
                    "read": (store + (inputs if what == "optimizer,params" else 0)) if disk else 0,
                    "write": store if disk else 0}
        moved = {k: r["moved"].get(k, 0) for k in expected}
        if moved != expected:
            failures.append(f"{label}: rank {world.rank} moved {moved}, the formula says {expected}")
        moved_rows.append((label, what, disk, moved, expected, len(r["gathers"])))
        same = (r["losses"] == plain["losses"] and r["norms"] == plain["norms"]
                and all(np.array_equal(r["masters"][k], v) for k, v in plain["masters"].items()))
        if not same:
            failures.append(f"{label}: rank {world.rank}'s run differs from ZeRO-{stage}'s without offload")
        proofs.append((label, stage, same))
        if disk and r["left"]:
            failures.append(f"{label}: files left after close(): {r['left']}")
    if left:
        failures.append(f"files left: {left}")
    # every rank's bytes, side by side (the picture, and the claim that all ranks hold the same)
    mine = np.array([[r["split"][place][part] for place in PLACES for part in PARTS]
                     for r in results.values()], dtype=np.float64)  # (configs, 9)
    everyone = world.all_gather(mine.reshape(1, -1)).reshape(n, len(CONFIGS), len(PLACES), len(PARTS))
    if not (everyone == everyone[0]).all():
        failures.append("the ranks hold different bytes")
    for line in failures:
        print("FAILED:", line)
    failed = int(world.all_reduce(np.array([float(len(failures))]))[0])
    if failed:
        raise AssertionError(f"{failed} checks failed over the ranks, {len(failures)} on rank {world.rank} (see above)")
    if not rank0:
        return

    print(f"\n=== 2. What rank 0 holds after backward: N = {n} ranks, Psi = {psi:,} parameters, float16 + {OPTIMIZER} ===")
    print("KiB measured from the live arrays | zero_memory.formula(zero)")
    head = f"  {'configuration':<36}{'device:':>8}{'params':>7}{'grads':>7}{'optim':>7}{'host':>8}{'disk':>8}"
    print(head + f"  |{'device':>8}{'host':>8}{'disk':>8}")
    for label, *_ in CONFIGS:
        held, formula = results[label]["held"], results[label]["formula"]
        f_device = sum(formula[k] for k in PARTS)
        print(f"  {label:<36}{'':>8}" + "".join(f"{kib(held[k]):>7}" for k in PARTS)
              + f"{kib(held.get('host', 0)):>8}{kib(held.get('disk', 0)):>8}  |{kib(f_device):>8}"
              + f"{kib(formula.get('host', 0)):>8}{kib(formula.get('disk', 0)):>8}")
    print(f"  measured = formula to the byte: {len(CONFIGS)} configurations x {n} ranks, every rank the same bytes")

    print(f"\n=== 3. Where each rank keeps the paper's 2 + 2 + K = {4 + K} bytes per parameter (N = {n}) ===")
    print(f"  P = 2 (float16 parameter), G = 2 (float16 gradient), O = K = {K} ({SLOTS})")
    print(f"  {'configuration':<36}{'device':<22}{'host':<22}disk")
    for label, stage, what, disk in CONFIGS:
        cells = [show_terms(t, n)[0] for t in per_parameter(stage, what, disk).values()]
        print(f"  {label:<36}{cells[0]:<22}{cells[1]:<22}{cells[2]}")
    print("  (G/N on the host: the gradient shard's copy, which the host's update reads; the device keeps its")
    print("  own G/N, where backward reduce-scatters into it.) Each cell x Psi = the measured bytes above.")

    print("\n=== 4. Bytes moved by rank 0 in one step (Offload.moved), KiB | the formula ===")
    print(f"  {'configuration':<36}{'down':>7}{'up':>7}{'read':>7}{'write':>7}  |{'down':>7}{'up':>7}{'read':>7}"
          f"{'write':>7}")
    for label, what, disk, moved, expected, _ in moved_rows:
        print(f"  {label:<36}" + "".join(f"{kib(moved[k]):>7}" for k in moved) + "  |"
              + "".join(f"{kib(expected[k]):>7}" for k in expected))
    gathered = next(row for row in moved_rows if row[1] == "optimizer,params")
    zero3 = results[gathered[0]]
    per_unit = {}  # the units an all-gather's output size belongs to -> how many such all-gathers
    for name, numel in zero3["units"]:
        per_unit.setdefault(numel * 2, []).append(name.replace("transformer.", ""))
    counts = ", ".join(f"{'+'.join(names)} {zero3['gathers'].count(size)}" for size, names in per_unit.items())
    shard = psi * 2 / n
    print(f"  down  = G/N = {psi:,} x 2 B / {n} = {kib(shard)} KiB: the gradient shard, once it is final (in backward)")
    print(f"  up    = P/N = {kib(shard)} KiB under ZeRO-2: the updated parameter shard, once per step (then all-gathered)")
    print(f"        = under ZeRO-3, the input of each of the step's {gathered[5]} all-gathers (from the trace: their"
          f" outputs / N)\n          = {kib(gathered[4]['up'])} KiB = {gathered[4]['up'] / shard:.2f} x P/N; per unit: "
          f"{counts}\n          (forward and again for backward; wte also as the tied lm_head); the step writes the new"
          " shard where it lives")
    print("  read  = the store once per step (O/N, + P/N under ZeRO-3), + every shard fetched for an all-gather")
    print("  write = the store once per step: every array the update changed goes back to its file")

    print("\n=== 5. Offloaded = not offloaded, bitwise (every rank: its losses, gradient norms; the masters) ===")
    for label, stage, same in proofs:
        print(f"  {label:<36}vs ZeRO-{stage}: {STEPS} losses, {STEPS} grad norms, {psi:,} float32 masters; "
              f"bitwise equal: {same}")

    label = CONFIGS[-1][0]
    files = results[label]["files"]
    print(f"\n=== 6. ZeRO-Infinity's files: DIR/rank0/ of '{label}' (one per array and unit) ===")
    units = {}
    for name, size in files.items():
        unit, array = name[:-len(".bin")].rsplit(".", 1)
        units.setdefault(unit, []).append(f"{array} {size:>6,} B")
    for unit, arrays in units.items():
        print(f"  {unit + '.*.bin':<24}" + "   ".join(f"{a:<20}" for a in arrays).rstrip())
    total = sum(files.values())
    print(f"  {len(files)} files, {total:,} B = the disk column above ({kib(total)} KiB); after zero.close(): "
          "no file left, the temporary folder removed")
    assert total == results[label]["held"]["disk"]

    if png:
        draw(png, everyone, psi)
    print("\nTry:")
    print("  1. --local 4. Expect the sharded terms to halve: 2.5 bytes per parameter on the device under ZeRO-2 + "
          "offload\n     (P + G/N), 0.5 under ZeRO-3; device 150.6 -> 68.4 KiB (ZeRO-2), 109.5 -> 13.7 KiB (ZeRO-3); "
          "down 13.7 KiB,\n     up 13.7 (ZeRO-2) and 28.4 KiB (ZeRO-3: still 2.07 x P/N).")
    print('  2. OPTIMIZER = "sgd". Expect K = 8 (a float32 master and the momentum), 2 + 2 + 8 = 12 bytes per '
          "parameter;\n     device 191.6 -> 82.1 KiB (ZeRO-2), 164.2 -> 27.4 KiB (ZeRO-3); the same bytes down "
          "and up\n     (27.4 KiB; up 56.8 under ZeRO-3), a smaller store: read 193.6, write 136.9 KiB; 15 files, "
          "140,160 B.")
    device = {label: sum(results[label]["held"][k] for k in PARTS) for label, *_ in CONFIGS}
    print(f"\nOffload: device bytes fall from {kib(device[CONFIGS[0][0]])} to {kib(device[CONFIGS[1][0]])} KiB "
          f"(ZeRO-2) and from {kib(device[CONFIGS[3][0]])} to {kib(device[CONFIGS[4][0]])} KiB (ZeRO-3) per rank; "
          "offloaded runs equal the runs without, bitwise.")
    print("All checks passed.")


def draw(path, everyone, psi):
    """Per rank (one panel each) and configuration, three stacked columns: the device, the host and
    the disk, each split into parameters, gradients and optimizer state."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory
    n = everyone.shape[0]
    colours = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868"}
    fig, axes = plt.subplots(n, 1, figsize=(13, 1.2 + 2.9 * n), sharex=True, sharey=True, squeeze=False)
    top = everyone.sum(axis=3).max() / 1024
    for r, ax in enumerate(axes[:, 0]):
        for c, (label, *_) in enumerate(CONFIGS):
            x0 = 4 * c
            if c % 2:
                ax.axvspan(x0 - 0.6, x0 + 2.6, color="#f2f2f2", zorder=0)
            for j, place in enumerate(PLACES):
                bottom = 0.0
                for k, part in enumerate(PARTS):
                    value = everyone[r, c, j, k] / 1024
                    ax.bar(x0 + j, value, bottom=bottom, width=0.8, color=colours[part], edgecolor="black",
                           linewidth=0.4, zorder=2)
                    bottom += value
                ax.text(x0 + j, bottom + top * 0.02, f"{bottom:.0f}" if bottom else "0", ha="center", va="bottom",
                        fontsize=7)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("KiB")
        ax.set_title(f"rank {r}", loc="left", fontsize=10)
    ticks = [4 * c + j for c in range(len(CONFIGS)) for j in range(len(PLACES))]
    bottom_ax = axes[-1, 0]
    bottom_ax.set_xticks(ticks, [place for _ in CONFIGS for place in PLACES], fontsize=8)
    below = blended_transform_factory(bottom_ax.transData, bottom_ax.transAxes)
    for c, (label, *_) in enumerate(CONFIGS):
        name = label.replace(" + ", "\n+ ").replace(" -> ", "\n-> ")
        bottom_ax.text(4 * c + 1, -0.13, name, transform=below, ha="center", va="top", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[part]) for part in PARTS]
    fig.suptitle(f"What each rank holds after backward: a GPT of {psi:,} parameters, float16 {OPTIMIZER}, N = {n}",
                 y=0.985, fontsize=11)
    fig.legend(handles, ["parameters (float16)", "gradients (float16)",
                         f"optimizer state ({SLOTS})"],
               loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=3, fontsize=9, frameon=False)
    fig.subplots_adjust(left=0.06, right=0.99, top=0.88, bottom=0.17, hspace=0.25)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nWhat each rank holds on the device, the host and the disk drawn in {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, nargs="?", const=2, metavar="N", help="run N ranks as threads (default 2)")
    ap.add_argument("--png", help="draw what each rank holds on the device, the host and the disk into this PNG")
    args = ap.parse_args()
    check_launch(ap, args, ranks=(2, 4, 8), alone=2)  # every unit's size divides by them
    if args.local:
        minidist.run_local(lambda world: lesson(world, args.png), args.local)
    else:
        minidist.run_anywhere(lambda world: lesson(world, args.png), threads=2)
