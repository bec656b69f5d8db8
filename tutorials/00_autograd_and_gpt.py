"""Lesson 00: autograd and one GPT training step, on one process.

    python tutorials/00_autograd_and_gpt.py
    python tutorials/00_autograd_and_gpt.py --png autograd.png   # also draw the graph and a gradient

Every later lesson splits this computation across processes (data, tensor, pipeline parallel,
ZeRO) and proves that it gets the same numbers as this one. So first we make the one-process
numbers trustworthy:

  1. a parameter and its gradient: autograd's answer checked against finite differences;
  2. a GPT's loss on one batch, and the gradient of a few of its weights, checked the same way;
  3. one training step by hand (p -= lr * grad) and the loss before and after it;
  4. the same step by minidist's SGD optimizer: bit-for-bit the hand-written one.

The script checks every claim it prints and exits non-zero if one fails. With ``--png PATH`` it
draws what this run did: the ops of the GPT's graph that backward walked, and the loss along one
weight with the tangent whose slope autograd gave.
"""
import argparse
import sys
from collections import Counter

import numpy as np

from minidist.autograd import Tensor, no_grad
from minidist.data import default_corpus, get_batch, inputs_and_targets, load_tokens
from minidist.launch_check import check_launch
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD

parser = argparse.ArgumentParser(description="Lesson 00: autograd and one GPT training step.")
parser.add_argument("--png", help="draw the GPT's graph (ops by kind) and one gradient as a tangent into this PNG")
args = parser.parse_args()
check_launch(parser, args, mpiexec=False)  # one process, alone; a --png it could not write is refused now
failures = []


def check(ok, claim):
    """Print a claim with its verdict; remember failures for the exit code."""
    print(f"  [{'ok' if ok else 'FAILED'}] {claim}")
    if not ok:
        failures.append(claim)


def relative_error(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def graph_ops(t) -> Counter:
    """How many nodes of each op (Function class) the graph behind tensor ``t`` holds: what
    backward will visit, each node once."""
    seen, stack = {}, [t._node]
    while stack:
        node = stack.pop()
        if node is not None and id(node) not in seen:
            seen[id(node)] = type(node).__name__
            stack.extend(i._node for i in node.inputs if i is not None)
    return Counter(seen.values())


# ---------------------------------------------------------------------------------------------------
print("1. A parameter and its gradient")
print("   A Tensor that requires grad is a leaf: backward() adds d(loss)/d(leaf) into its .grad.")
rng = np.random.default_rng(0)
x, y = rng.standard_normal((8, 3)), rng.standard_normal((8, 1))   # (N, 3) inputs, (N, 1) targets
w = Tensor(rng.standard_normal((3, 1)), requires_grad=True)        # (3, 1) the parameter


def squared_error(w_array):
    """The same loss on a plain array: what finite differences evaluate."""
    return float(((x @ w_array - y) ** 2).mean())


loss = ((Tensor(x) @ w - Tensor(y)) ** 2).mean()                  # () records the graph
loss.backward()                                                    # fills w.grad, shape (3, 1)
print(f"   loss = {loss.item():.6f}, w.grad = {w.grad.ravel().round(6)}")
analytic = 2 * x.T @ (x @ w.data - y) / len(x)                     # d/dw mean((xw - y)^2), by hand
check(np.allclose(w.grad, analytic, rtol=1e-12), "w.grad equals the hand-derived 2 x^T (xw - y) / N")
h = 1e-6
numeric = np.zeros_like(w.data)
for i in range(w.data.shape[0]):
    e = np.zeros_like(w.data)
    e[i] = h
    numeric[i] = (squared_error(w.data + e) - squared_error(w.data - e)) / (2 * h)   # central difference
check(np.allclose(w.grad, numeric, rtol=1e-7), f"w.grad equals central differences (h = {h:g})")

# ---------------------------------------------------------------------------------------------------
print("\n2. A GPT's loss and gradients on one batch")
config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)
model = GPT(config, seed=0, dtype="float64")                       # float64: exact comparisons
tokens = load_tokens(default_corpus())                              # generated English-like sentences
idx, targets = inputs_and_targets(get_batch(tokens, step=0, batch_size=4, block_size=32, seed=0))  # (4, 32)
n_params = sum(p.data.size for p in model.parameters())
print(f"   model: {config.n_layer} layers, width {config.n_embd}, {n_params:,} parameters, float64")
print(f"   batch: {idx.shape[0]} rows of {idx.shape[1]} bytes, e.g. {bytes(idx[0].astype(np.uint8).tolist())!r}")

_, loss = model(idx, targets)
loss_before = loss.item()
ops = graph_ops(loss)  # before backward, which frees the graph
print(f"   the graph behind the loss: {sum(ops.values())} ops, "
      + ", ".join(f"{n} {name}" for name, n in ops.most_common()))
check(ops["Linear"] == 4 * config.n_layer + 1, "4 Linears per block (c_attn, attn c_proj, c_fc, mlp c_proj) + the LM head")
print(f"   loss = {loss_before:.4f}; a model that guesses uniformly over 256 bytes scores ln 256 = {np.log(256):.4f}")
check(abs(loss_before - np.log(256)) < 0.5, "an untrained model's loss is close to ln 256")
loss.backward()
params = dict(model.named_parameters())
check(all(p.grad is not None and p.grad.shape == p.data.shape for p in params.values()),
      "backward() gave every parameter a gradient of its own shape")


def loss_at(p, i, value):
    """The loss with one element of parameter p set to value (no graph is recorded)."""
    old = p.data[i]
    p.data[i] = value
    with no_grad():
        out = model(idx, targets)[1].item()
    p.data[i] = old
    return out


for name in ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight",
             "transformer.ln_f.weight"]:
    p = params[name]
    i = tuple(int(j) for j in np.unravel_index(np.argmax(np.abs(p.grad)), p.data.shape))   # most sensitive element
    numeric = (loss_at(p, i, p.data[i] + h) - loss_at(p, i, p.data[i] - h)) / (2 * h)
    check(relative_error(p.grad[i], numeric) < 1e-6,
          f"d loss / d {name}{list(i)} = {p.grad[i]:+.6e} (finite differences: {numeric:+.6e})")

# ---------------------------------------------------------------------------------------------------
print("\n3. One training step by hand: p -= lr * grad for every parameter")
lr = 0.1
start = {name: value.copy() for name, value in model.state_dict().items()}   # NumPy arrays, by name
for p in params.values():
    p.data -= lr * p.grad                                           # in place: the model sees it
with no_grad():
    loss_after = model(idx, targets)[1].item()
print(f"   loss on the same batch: {loss_before:.6f} -> {loss_after:.6f}")
check(loss_after < loss_before, "one gradient step lowers the loss on its batch")
by_hand = {name: p.data.copy() for name, p in params.items()}

# ---------------------------------------------------------------------------------------------------
print("\n4. The same step with minidist.optim.SGD")
model.load_state_dict(start)                                        # back to the starting weights
model.zero_grad()
_, loss = model(idx, targets)
loss.backward()
check(loss.item() == loss_before, "reloading the start weights reproduces the loss bit for bit")
optimizer = SGD(model.named_parameters(), lr=lr)                    # momentum 0, no weight decay
optimizer.step()
same = all(np.array_equal(p.data, by_hand[name]) for name, p in model.named_parameters())
check(same, "SGD(lr=0.1).step() gives exactly the hand-written update")
print(f"\n   The baseline every later lesson compares against: loss {loss_before:.10f} -> {loss_after:.10f}"
      "\n   (float64, seed 0, batch 0 of the default corpus, lr 0.1).")



def draw(path):
    """Left: the ops of the GPT's graph by kind (what backward walked). Right: the loss along the
    most sensitive element of c_fc's weight in block h.1 (the model at its start weights, batch 0),
    and the tangent whose slope is autograd's gradient there."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model.load_state_dict(start)
    p = params["transformer.h.1.mlp.c_fc.weight"]
    model.zero_grad()
    model(idx, targets)[1].backward()
    i = tuple(int(j) for j in np.unravel_index(np.argmax(np.abs(p.grad)), p.data.shape))
    w0, slope = float(p.data[i]), float(p.grad[i])
    ws = w0 + np.linspace(-0.5, 0.5, 21)
    losses = [loss_at(p, i, w) for w in ws]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw=dict(width_ratios=(1, 1.2)))
    names, counts = zip(*ops.most_common())
    left.barh(range(len(names)), counts, color="#4e79a7")
    left.set_yticks(range(len(names)), names, fontsize=8)
    left.invert_yaxis()
    for y, c in enumerate(counts):
        left.text(c, y, f" {c}", va="center", fontsize=8)
    left.set_xlabel("nodes in the graph behind the loss")
    left.set_title(f"what backward walks: {sum(counts)} ops, {config.n_layer} blocks", fontsize=10)
    right.plot(ws, losses, "o-", color="#4e79a7", markersize=3, label="loss (forward, no graph)")
    right.plot(ws, losses[10] + slope * (ws - w0), "--", color="#e15759", label=f"tangent: slope = autograd's {slope:+.4f}")
    right.axvline(w0, color="0.6", linewidth=0.8)
    right.set_xlabel(f"h.1.mlp.c_fc.weight{list(i)}")
    right.set_ylabel("loss on batch 0")
    right.set_title("one gradient: the slope of the loss along one weight", fontsize=10)
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, frameon=False, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"\n   Drawn into {path}: the graph's ops, and the loss along one weight with autograd's tangent.")


if args.png:
    draw(args.png)

print("\nTry: set n_layer=4 in `config` and run again. Expected: the graph line reports 17 Linear ops"
      "\n     (4 per block + the head), every check still [ok], and a different baseline loss.")

if failures:
    print(f"\n{len(failures)} check(s) FAILED")
    sys.exit(1)
print("\nAll checks passed.")
