"""Where the loss is scaled: the one rule the plain step and the pipeline engine both follow.

A step's gradient is that of the MEAN loss over all the rows of the global batch. Each rank runs m
micro-batches, each giving the mean loss over its rows; the data-parallel average then divides by
the dp size. So each micro-batch's backward starts from

    d(loss_scale * loss_i / m) / d loss_i = loss_scale / m

(``loss_scale``: mixed precision's dynamic loss scale, which keeps float16 gradients out of the
underflow zone; 1 otherwise). The optimizer side unscales (amp/master_weights.py, zero/optimizer.py).

A mixture-of-experts layer's load-balancing loss is part of the same objective, so its gradient
starts from the same seed: :func:`seed_aux_losses` hands it to every MoE layer of the model (on any
pipeline stage) before the step's forwards, and each adds its aux gradient in backward (moe.py).
"""
from minidist.autograd import get_array_module
from minidist.moe import MoE


def backward_micro_batch(loss, micro_batches: int, loss_scale: float = 1.0) -> None:
    """Back-propagate from ``loss`` (one micro-batch's mean loss, a one-element Tensor) with the seed
    ``loss_scale / micro_batches``, accumulating into the parameters' ``.grad``. Sends nothing itself
    (gradient hooks of data parallelism or ZeRO may)."""
    loss.backward(get_array_module(loss.data).full_like(loss.data, loss_scale / micro_batches))


def seed_aux_losses(model, micro_batches: int, loss_scale: float = 1.0) -> None:
    """Set the seed ``loss_scale / micro_batches`` on every mixture-of-experts layer of ``model`` (a
    GPT, its tensor-parallel shard or a pipeline stage): the factor its load-balancing loss's
    gradient is added with in backward. Sends nothing."""
    for _, module in model.named_modules():
        if isinstance(module, MoE):
            module.aux_loss_seed = loss_scale / micro_batches
