"""Cross-check with PyTorch (skipped when torch is not installed): minidist's training step and the
same GPT in PyTorch eager (benchmarks/torch_gpt.py), from identical weights, take identical steps."""
import sys
from pathlib import Path

import numpy as np
import pytest

from minidist.data import get_batch, inputs_and_targets
from minidist.parallel.state import WholeState
from minidist.parallel.step import train_step
from minidist.train.build import build_model, build_optimizer
from minidist.train.config import TrainConfig

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from torch_gpt import TorchGPT  # noqa: E402


def test_three_adamw_steps_match_pytorch_in_float64():
    cfg = TrainConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, batch_size=4, dtype="float64",
                      lr=1e-2, weight_decay=0.1, grad_clip=0.5)      # clip 0.5: clipping is active
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    twin = TorchGPT.from_minidist(model, torch.float64)
    params = list(twin.parameters())
    reference = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    tokens = np.random.default_rng(0).integers(0, 256, 10_000)
    for step in range(3):
        batch = get_batch(tokens, step, cfg.batch_size, cfg.block_size)
        loss, _ = train_step(model, WholeState(model, optimizer), batch, cfg.lr, cfg.grad_clip)
        idx, targets = (torch.from_numpy(a.copy()) for a in inputs_and_targets(batch))
        reference.zero_grad()
        ref_loss = twin(idx, targets)[1]
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        reference.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-10), step
    ours, theirs = model.state_dict(), twin.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name].numpy(), rtol=1e-10, atol=1e-12, err_msg=name)
