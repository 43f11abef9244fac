"""The optimizer and learning-rate schedule both training scripts use."""

from __future__ import annotations

import math

import torch
from torch import nn


def cosine_lr(step: int, lr: float, warmup: int, steps: int, min_lr_ratio: float) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine down to lr * min_lr_ratio at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def adamw(
    model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float, cuda: bool
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; norm weights get no weight decay."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith("norm.weight") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, fused=cuda, foreach=not cuda)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
