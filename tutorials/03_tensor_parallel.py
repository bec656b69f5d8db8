"""Lesson 3: tensor parallelism (Megatron-LM), then sequence parallelism.

    mpiexec -n 2 python tutorials/03_tensor_parallel.py      # or -n 4, over MPI
    python tutorials/03_tensor_parallel.py --local 4         # 4 threads in one process
    python tutorials/03_tensor_parallel.py --local 4 --png tp.png   # also draw the shards and the collectives

One GPT is cut across the ranks of a tensor-parallel group: every rank holds a slice of every big
matrix and computes with it, and the ranks add their partial results where the math needs a sum.

  1. Which shard each rank holds: attention split by heads (c_attn's q, k, v keep whole heads),
     the MLP's c_fc by output columns and both c_proj by input rows, the vocabulary by rows (padded
     to a multiple of the group size). LayerNorms, position embeddings and c_proj biases are copies.
     Why columns first, then rows (Megatron): a column-parallel c_fc gives each rank WHOLE hidden
     features, so the elementwise GELU runs on them locally, with no communication; the row-parallel
     c_proj then consumes exactly that local shard and yields a partial sum of the full output, which
     one all-reduce completes. One all-reduce per MLP forward (and per attention: heads are columns).
  2. Where the ranks talk: Megatron's f (identity forward, all-reduce backward) enters attention and
     the MLP, g (all-reduce forward, identity backward) leaves them, so a block costs 2 all-reduces
     forward and 2 backward; the vocab-parallel cross-entropy adds 3 all-reduces of one number per
     token. Read from the trace of one training step, block by block in both directions (a marker in
     the autograd graph notes when backward crosses from one block into the next).
  3. Sequence parallelism: the same step with the activations between the blocks cut along the
     sequence; every all-reduce of activations becomes an all-gather plus a reduce-scatter (the same
     bytes on the wire). What it buys is memory: the LayerNorms' saved arrays are 1/n per rank,
     measured from the autograd graph and set beside the planner's term-by-term account.
  4. The proof: loss and every gradient, joined from the shards, equal one process's (float64).
"""
import argparse

import numpy as np

import minidist
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.inspect.accounting import activation_bytes
from minidist.inspect.spans import ModuleSpans, is_module_span
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.compose.complete import sync_sequence_parallel_grads
from minidist.parallel.tensor.tensor_parallel import tp_layout, unshard
from minidist.plan.layout import RunSpec
from minidist.plan.memory import activation_bytes as planned_activation_bytes, layer_activation_terms
from minidist.plan.models import from_gpt_config

CONFIG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=4, n_embd=8)  # vocab 11: padded
B, T = 2, 8
PIECES = ["embedding"] + [f"h.{i}" for i in range(CONFIG.n_layer)] + ["head"]  # inspect/spans.py's names
SPLIT = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # drawn


def batch():
    rng = np.random.default_rng(0)
    return rng.integers(0, CONFIG.vocab_size, (B, T)), rng.integers(0, CONFIG.vocab_size, (B, T))


def holdings(group, model):
    """Rank 0 prints, per parameter of block 0 and the embeddings, what every rank holds. Returns,
    for the picture, each split matrix of block 0 as an owner map: entry = the rank that holds it."""
    if group.rank == 0:
        print(f"=== 1. who holds what: GPT(vocab {CONFIG.vocab_size}, {CONFIG.n_head} heads, "
              f"C={CONFIG.n_embd}) over {group.size} ranks ===")
    owners = {}
    for name, p in model.named_parameters():
        if ".h.1." in name:
            continue  # block 1 is split exactly like block 0
        shapes = group.all_gather(np.array([p.shape + (1,) * (2 - p.ndim)]))  # (n, 2): every rank's shape
        if group.rank == 0:
            per_rank = "  ".join(f"r{r}:{tuple(int(s) for s in shape[:p.ndim])}" for r, shape in enumerate(shapes))
            print(f"  {name:<34} {tp_layout(name):<10} {per_rank}")
        if name.endswith(SPLIT):  # where each rank's shard sits: unshard shards filled with their rank
            owners[name] = unshard(name, [np.full(tuple(s[:p.ndim]), r) for r, s in enumerate(shapes)])
    if group.rank == 0:
        heads = CONFIG.n_head // group.size
        print(f"  c_attn rank r: heads {heads}r..{heads}r+{heads - 1} of q, then of k, then of v;"
              f" wte rows beyond {CONFIG.vocab_size - 1} are zero padding")
        print("  why c_fc by columns and c_proj by rows (Megatron): column-parallel c_fc gives rank r WHOLE\n"
              "  hidden features, h_r = x @ W_fc[rows of r].T, and GELU is elementwise, so GELU(h_r) needs nothing\n"
              "  from the others; row-parallel c_proj takes exactly that shard, y_r = GELU(h_r) @ W_proj[:, cols\n"
              "  of r].T, a partial sum of y = sum_r y_r: ONE all-reduce (g) per MLP forward. Rows first would\n"
              "  leave c_fc's output a partial sum, and GELU(a + b) != GELU(a) + GELU(b): a second all-reduce.\n"
              "  Attention is the same pair: c_attn by heads (columns of q, k, v), each head local, c_proj by rows.")
    return owners


def one_step(group, model):
    """Forward and backward of one batch, with the trace watched so that it records a span per
    module (embedding, each block, head) inside each pass (minidist/inspect/spans.py).
    Returns the loss, the activation bytes the graph keeps, and per (module, "forward" |
    "backward") the collectives that started inside that module's span, in order."""
    idx, targets = batch()
    trace = group.trace
    trace.clear()
    with trace.capture() as events:  # watched: module spans are recorded
        spans = ModuleSpans(trace)
        with trace.record("forward", kind="compute"), spans.forward(model) as tape:
            _, loss = model(idx, targets)
            tape.output(loss)
        held = activation_bytes(loss, exclude=[p.data for p in model.parameters()])  # what backward will read
        with trace.record("backward", kind="compute"), spans.backward(tape):
            loss.backward()
        with trace.record("sync_sequence_parallel_grads", kind="compute"):
            sync_sequence_parallel_grads(model, group)
    modules = [e for e in events if is_module_span(e)]
    by_piece = {}
    for e in events:
        if e.kind != "collective":
            continue
        inside = [m for m in modules if m.start <= e.start <= m.end]
        key = (inside[-1].op, inside[-1].algorithm) if inside else ("after backward", "sync")
        by_piece.setdefault(key, []).append(e)
    return loss, held, by_piece


def describe(group, title, by_piece):
    """Rank 0 prints the collectives of the step, piece by piece, forward then backward (in reverse)."""
    if group.rank != 0:
        return
    print(f"\n=== {title} ===")
    print(f"  {'module':<9} {'pass':<9} collective and bytes each rank hands in ({B * T * CONFIG.n_embd * 8} = (B, T, C) "
          f"float64, {B * T * 8} = (B, T))")
    order = [(p, "forward") for p in PIECES] + [(p, "backward") for p in reversed(PIECES)]
    for piece, direction in order + [("after backward", "sync")]:
        events = by_piece.get((piece, direction), [])
        if events or direction != "sync":
            ops = ", ".join(f"{e.op} {e.nbytes}" for e in events) or "-"
            print(f"  {piece:<9} {direction:<9} {ops}")


def check_counts(group, by_piece, sequence_parallel):
    """The formula: per block 2 all-reduces forward and 2 backward, or under sequence parallelism 2
    all-gathers and 2 reduce-scatters each way; the head's cross-entropy 3 small all-reduces."""
    if group.size == 1:
        return  # a group of one: the collectives return at once and are still recorded, nothing to count
    want = ({"all_gather": 2, "reduce_scatter": 2} if sequence_parallel else {"all_reduce": 2})
    for i in range(CONFIG.n_layer):
        for direction in ("forward", "backward"):
            got = {}
            for e in by_piece.get((f"h.{i}", direction), []):
                got[e.op] = got.get(e.op, 0) + 1
            assert got == want, f"h.{i} {direction}: {got} != {want}"
    head = [e.op for e in by_piece[("head", "forward")]]
    assert head.count("all_reduce") == 3, head
    if group.rank == 0:
        what = "2 all-gathers + 2 reduce-scatters" if sequence_parallel else "2 all-reduces"
        print(f"  per block: {what} forward, the same backward; the loss: 3 all-reduces")


def memory(group, plain_bytes, sp_bytes):
    """Activation bytes per rank with and without sequence parallelism: measured from the autograd
    graph (accounting.activation_bytes), next to the planner's term-by-term account (minidist.plan)."""
    n = group.size
    rows = group.all_gather(np.array([[plain_bytes, sp_bytes]]))  # (n, 2)
    spec = from_gpt_config(CONFIG)
    runs = [RunSpec(seq=T, micro_batch_size=B, tp=n, sequence_parallel=sp, dtype="float64") for sp in (False, True)]
    planned = [planned_activation_bytes(spec, run)[0] for run in runs]
    if group.rank != 0:
        return
    ref = GPT(CONFIG, seed=0, dtype="float64")
    _, loss = ref(*batch())
    one = activation_bytes(loss, exclude=[p.data for p in ref.parameters()])
    print("\n=== 4. what sequence parallelism buys: activation memory, the arrays autograd keeps for backward ===")
    print(f"  per rank, measured: tp {n} {plain_bytes:,} B, tp {n} + sp {sp_bytes:,} B ({sp_bytes - plain_bytes:,} B, "
          f"{100 * (sp_bytes - plain_bytes) / plain_bytes:.1f}%); one process {one:,} B")
    assert (rows == rows[0]).all(), f"ranks differ: {rows.tolist()}"
    print(f"  one block, term by term (minidist.plan.memory.layer_activation_terms), B of {B}x{T} tokens:")
    print(f"    {'term':<52} {f'tp {n}':>7} {'+ sp':>7}")
    for (what, a), (_, b) in zip(*(layer_activation_terms(spec, run) for run in runs)):
        note = {True: f"  1/{n}: its T/{n} tokens", False: ""}[b < a]
        print(f"    {what:<52} {int(a):>7,} {int(b):>7,}{note}")
    if n > 1:
        assert [plain_bytes, sp_bytes] == planned, f"measured {[plain_bytes, sp_bytes]} != planned {planned}"
        print(f"  the step's total (blocks, head, embeddings) as planned = measured, to the byte, on all {n} ranks")
    print(f"  tp alone already cuts q, k, v, the attention and the MLP's hidden by {n}; the LayerNorms' saved arrays\n"
          "  stay whole on every rank until sp cuts them along the sequence. The Linears' gathered inputs stay\n"
          "  whole here; Megatron-LM keeps them cut and all-gathers them again in backward, so a block holds\n"
          "  sbh(34/t + 5as/ht) with sp against sbh(10 + 24/t + 5as/ht) without (Korthikanti et al. 2022).")


def check(group, model, loss, title):
    """Join the gradient shards (all-gather over the group) and compare with one process."""
    ref = GPT(CONFIG, seed=0, dtype="float64")
    _, ref_loss = ref(*batch())
    ref_loss.backward()
    worst = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        shards = group.all_gather(np.ascontiguousarray(p.grad).reshape(1, -1))  # (n, local size)
        full = unshard(name, [s.reshape(p.shape) for s in shards], CONFIG.vocab_size)
        worst = max(worst, np.abs(full - q.grad).max() / np.abs(q.grad).max())
    if worst > 1e-10:
        raise AssertionError(f"rank {group.rank}: {title} differs from one process by {worst:.2e}")
    if group.rank == 0:
        print(f"  {title}: loss {loss.item():.12f} = one process's; worst relative error {worst:.1e}")


def lesson(world, png=None):
    plain = tensor_parallel(GPT(CONFIG, seed=0, dtype="float64"), world)
    owners = holdings(world, plain)
    loss, plain_bytes, by_piece = one_step(world, plain)
    describe(world, f"2. one step, tensor parallel on {world.size} ranks: g leaves the embedding, attention "
                    "and MLP (forward),\n    f enters the head, MLP and attention (backward, in reverse); "
                    "3 small all-reduces in the loss", by_piece)
    check_counts(world, by_piece, False)
    sp = tensor_parallel(GPT(CONFIG, seed=0, dtype="float64"), world, sequence_parallel=True)
    sp_loss, sp_bytes, sp_by_piece = one_step(world, sp)
    describe(world, "3. the same step with sequence parallelism: all-gather where f was, reduce-scatter "
                    "where g was;\n    LayerNorm and residual gradients of my tokens only, summed after "
                    "backward (sync)", sp_by_piece)
    check_counts(world, sp_by_piece, True)
    memory(world, plain_bytes, sp_bytes)
    if world.rank == 0:
        print("\n=== 5. against one process ===")
    check(world, plain, loss, "tensor parallel")
    check(world, sp, sp_loss, "tensor + sequence parallel")
    if world.rank == 0:
        if png:
            draw(png, world.size, owners, by_piece, sp_by_piece)
            print(f"  the shards and one block's collectives drawn in {png}")
        other = {2: ("--local 4 (or mpiexec -n 4): every shard halves, r0:(6, 8) for c_attn, and sp saves more",
                     "tp 4 22,992 B, tp 4 + sp 18,672 B (-4,320 B, -18.8%)")}.get(world.size, (
            "--local 2 (or mpiexec -n 2): every shard is half of the matrix, r0:(12, 8) for c_attn",
            "tp 2 33,616 B, tp 2 + sp 30,736 B (-2,880 B, -8.6%)"))
        print(f"\nTry: {other[0]}:\n       per rank, measured: {other[1]}\n"
              "     n_layer=3 in CONFIG: one more 'h.2       forward   all_reduce 1024, all_reduce 1024', and backward")
        print(f"Tensor parallelism on {world.size} ranks: 2 all-reduces per block each way, sp activations "
              f"{plain_bytes:,} -> {sp_bytes:,} B a rank. All checks passed.")


# slots of one block, left to right; "f" and "g" are where the ranks may talk
BLOCK = ["ln_1", "f", "c_attn\ncolumn", "attention\nlocal heads", "c_proj\nrow", "g", "+ x",
         "ln_2", "f", "c_fc\ncolumn", "GELU\nlocal", "c_proj\nrow", "g", "+ x"]


def draw(path, n, owners, by_piece, sp_by_piece):
    """Top: block 0's split matrices, each entry coloured by the rank that holds it (from this run's
    shards). Bottom: block 0's path, forward and backward, with the collectives this run traced in h.0
    placed in the f / g slots they ran at (which op, how many bytes)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    colours = plt.get_cmap("tab10")
    fig = plt.figure(figsize=(15, 8.5))
    grid = fig.add_gridspec(2, 4, height_ratios=[1.1, 1], hspace=0.35)
    from matplotlib.colors import ListedColormap
    cmap = ListedColormap([colours(r) for r in range(n)])
    for k, name in enumerate(sorted(owners, key=lambda s: [s.endswith(x) for x in SPLIT].index(True))):
        ax = fig.add_subplot(grid[0, k])
        owner = owners[name]
        ax.imshow(owner, cmap=cmap, vmin=-0.5, vmax=n - 0.5, interpolation="nearest")
        kind = {"qkv": "by heads: a block of q, of k, of v", "column": "column-parallel: output features",
                "row": "row-parallel: input features"}[tp_layout(name)]
        ax.set_title(f"{name.split('h.0.')[1]} {owner.shape}\n{kind}", fontsize=9)
        ax.set_xlabel("in features", fontsize=8)
        ax.set_ylabel("out features", fontsize=8)
        if tp_layout(name) == "qkv":
            third = owner.shape[0] // 3
            for k3, part in enumerate("qkv"):
                ax.axhline(k3 * third - 0.5, color="black", lw=1.2)
                ax.text(owner.shape[1] - 0.2, (k3 + 0.5) * third, f" {part}", va="center", ha="left", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.legend(handles=[Patch(color=colours(r), label=f"tp rank {r}") for r in range(n)], loc="upper right",
               bbox_to_anchor=(0.995, 0.98), fontsize=9, title="holds", title_fontsize=9)

    ax = fig.add_subplot(grid[1, :])
    ax.set_title("block h.0, the collectives this run traced, at the f and g they ran in (bytes per rank handed in)",
                 fontsize=10, loc="left")
    op_colour = {"all_reduce": "#d62728", "all_gather": "#1f77b4", "reduce_scatter": "#2ca02c"}
    comm_slots = [i for i, s in enumerate(BLOCK) if s in ("f", "g")]  # f1, g1, f2, g2
    rows = [("tp, forward", by_piece, "forward", [5, 12]),
            ("tp, backward", by_piece, "backward", [8, 1]),  # f before the MLP first, then before attention
            ("tp + sp, forward", sp_by_piece, "forward", comm_slots),
            ("tp + sp, backward", sp_by_piece, "backward", comm_slots[::-1])]
    for y, (label, pieces, direction, slots) in enumerate(rows):
        events = pieces.get(("h.0", direction), [])
        placed = dict(zip(slots, events)) if len(events) == len(slots) else {}
        for x, what in enumerate(BLOCK):
            e = placed.get(x)
            if what in ("f", "g"):
                face = op_colour[e.op] if e else "white"
                ax.add_patch(Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, fc=face, ec="black", lw=0.6,
                                       ls="-" if e else "--", alpha=0.85 if e else 1))
                op = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-\nscatter"}
                text = f"{what}: {op[e.op]}\n{e.nbytes} B" if e else f"{what}\nidentity"
                ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                        color="white" if e else "black")
            else:
                ax.add_patch(Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, fc="0.9", ec="0.6", lw=0.5))
                ax.text(x + 0.5, y + 0.5, what, ha="center", va="center", fontsize=7)
        arrow = "->" if direction == "forward" else "<-"
        ax.text(-0.1, y + 0.5, f"{label} {arrow}", ha="right", va="center", fontsize=9)
    ax.set_xlim(0, len(BLOCK))
    ax.set_ylim(len(rows), 0)
    ax.axis("off")
    ax.legend(handles=[Patch(color=c, label=op.replace("_", "-")) for op, c in op_colour.items()]
              + [Patch(fc="white", ec="black", ls="--", label="identity (no message)")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.suptitle(f"Tensor parallelism over {n} ranks: who holds which shard of block 0, and where f and g talk\n"
                 "(weights in PyTorch layout (out, in): Megatron's column split of y = x A cuts the weight's rows, "
                 "the output features; its row split the columns, the input features)", fontsize=10.5)
    fig.subplots_adjust(top=0.86)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description="Lesson 3: tensor parallelism and sequence parallelism.")
    p.add_argument("--local", type=int, metavar="N", help="run N ranks as threads in this process (N = 1, 2, 4)")
    p.add_argument("--png", help="draw the shards of block 0 and its collectives, forward and backward, into this PNG")
    args = p.parse_args()
    check_launch(p, args, ranks=(1, 2, 4), alone=2)  # tp splits the 4 heads; alone: 2 ranks as threads
    if args.local:
        minidist.run_local(lambda world: lesson(world, args.png), args.local)
    else:
        lesson(minidist.init(backend="ring"), args.png)


if __name__ == "__main__":
    main()
