"""Optimizers: update math as element-wise functions on arrays, optimizer classes that loop them,
gradient clipping and the learning-rate schedule."""
from minidist.optim.adamw import AdamW, adamw_update
from minidist.optim.clip import clip_coef, clip_grad_norm, grad_norm_sq
from minidist.optim.optimizer import Optimizer, decays
from minidist.optim.schedule import lr_at
from minidist.optim.sgd import SGD, sgd_update
from minidist.optim.state_bytes import OPTIMIZERS, optimizer_bytes_per_parameter, state_bytes_per_parameter

__all__ = ["AdamW", "adamw_update", "SGD", "sgd_update", "Optimizer", "decays", "clip_grad_norm",
           "clip_coef", "grad_norm_sq", "lr_at", "OPTIMIZERS", "optimizer_bytes_per_parameter",
           "state_bytes_per_parameter"]
