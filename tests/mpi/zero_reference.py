"""Shared by the ZeRO tests (in-process and under MPI): a tiny float64 GPT trained for a few steps,
once in one process on the full batch (the reference) and once per rank under ZeRO.

The model's unit sizes are all multiples of 4, so on 2 or 4 dp ranks every shard is exactly 1/N of
its unit and the ZeRO paper's memory formulas hold to the byte.
"""
import numpy as np

from minidist.data import get_batch, inputs_and_targets
from minidist.model import GPT, GPTConfig
from minidist.optim import SGD, AdamW, clip_grad_norm, lr_at
from minidist.parallel.whole_model.consolidate import consolidated_state_dict
from minidist.nn.recompute import recompute_blocks
from minidist.parallel.tensor.apply import tensor_parallel
from minidist.parallel.compose.gradients import apply_gradients
from minidist.parallel.zero.full_state import full_parameters
from minidist.parallel.zero.optimizer import ZeroOptimizer

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH, STEPS, SEED, CLIP = 8, 10, 3, 0.5
HYPER = {"sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.1),
         "adamw": dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)}
TOKENS = np.random.default_rng(SEED).integers(0, CONFIG.vocab_size, size=4000)


def lr(step, optimizer):
    base = HYPER[optimizer]["lr"]
    return lr_at(step, base, 2, STEPS, base / 10)


def batch(step):
    """(idx, targets) of the global batch of ``step``, each (BATCH, T)."""
    return inputs_and_targets(get_batch(TOKENS, step, BATCH, CONFIG.block_size, SEED))


def reference(optimizer, steps=STEPS, config=CONFIG):
    """One process, full batch: (losses, grad norms, final state_dict)."""
    model = GPT(config, seed=SEED, dtype="float64")
    opt = (SGD if optimizer == "sgd" else AdamW)(model.named_parameters(), **HYPER[optimizer])
    losses, norms = [], []
    for step in range(steps):
        idx, targets = batch(step)
        opt.zero_grad()
        _, loss = model(idx, targets)
        loss.backward()
        norms.append(clip_grad_norm(model.parameters(), CLIP))
        opt.lr = lr(step, optimizer)
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def zero_rank(group, stage, optimizer, steps=STEPS, micro_batches=1, config=CONFIG, recompute=False,
              mesh=None):
    """This dp rank's run under ZeRO on dp group ``group`` (or on ``mesh``: its dp group, with a
    tensor-parallel GPT over its tp group): its rows of each global batch in ``micro_batches``
    pieces, each micro-batch's loss scaled by 1/micro_batches. Returns (this rank's mean loss per
    step, grad norms, full final state_dict, the ZeroOptimizer)."""
    if mesh is None:
        model = GPT(config, seed=SEED, dtype="float64")
    else:
        group, model = mesh.dp_group, tensor_parallel(GPT(config, SEED, "float64"), mesh.tp_group)
    if recompute:
        recompute_blocks(model)
    zero = ZeroOptimizer(model, group, stage, optimizer, **HYPER[optimizer])
    rows = np.array_split(np.arange(BATCH), group.size)[group.rank]
    losses, norms = [], []
    for step in range(steps):
        idx, targets = batch(step)
        zero.zero_grad()
        step_loss = 0.0
        for micro in np.array_split(rows, micro_batches):
            _, loss = model(idx[micro], targets[micro])
            (loss * (1.0 / micro_batches)).backward()
            step_loss += loss.item() / micro_batches
        norms.append(apply_gradients(zero, lr(step, optimizer), CLIP, mesh=mesh))
        losses.append(step_loss)
    with full_parameters(zero):
        state = model.state_dict() if mesh is None else consolidated_state_dict(model, mesh)
    return losses, norms, state, zero


def max_relative_error(a: dict, b: dict) -> float:
    """Largest |a - b| / max|b| over the arrays of two state_dicts with the same names."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float(np.abs(a[k] - b[k]).max() / np.abs(b[k]).max()) for k in a)
