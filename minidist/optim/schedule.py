"""The learning-rate schedule of GPT-style training: linear warmup, then cosine decay to a floor."""
import math


def lr_at(step, base_lr, warmup, total, min_lr):
    """Learning rate for ``step`` (0-based) of a ``total``-step run.

    - warmup: steps 0 .. warmup-1 rise linearly, ``base_lr * (step + 1) / warmup``, reaching base_lr;
    - decay: from ``step == warmup`` (base_lr) a half cosine falls to ``min_lr`` at ``step == total``;
    - after ``total``: stays at ``min_lr``.
    """
    if step < warmup:
        return base_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    progress = (step - warmup) / (total - warmup)                 # 0 -> 1
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (base_lr - min_lr)
