"""The learning-rate schedule `fit()` trains with: AdamW's cosine decay with warm-up (`schedule: cosine`), or
warm-up, a stable phase and a linear decay (`schedule: wsd`) whose stable phase goes on while validation
still improves when the decay is due, so that the number of steps is not fixed before training.
"""

from __future__ import annotations

import math

import torch
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_cosine_schedule_with_warmup

from loracls.config import TrainConfig


class WarmupStableDecay:
    """The learning-rate factor at a step: linear warm-up over `warmup` steps, 1 until the last `decay` steps
    of `total`, then linearly to 0 at `total`. `total` grows when `extend` moves the decay later; LambdaLR's
    state_dict saves this object's fields, so a resumed run continues the schedule it had reached."""

    def __init__(self, warmup: int, decay: int, total: int, limit: int) -> None:
        self.warmup, self.decay, self.total, self.limit = warmup, decay, total, limit

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / self.warmup
        if step < self.total - self.decay:
            return 1.0
        return max(0.0, (self.total - step) / max(1, self.decay))

    def extend(self, step: int, improved: bool, eval_every: int) -> int | None:
        """After a validation at `step`: when it `improved` on an earlier one (the first validation always
        improves: that says nothing) and it is the last validation before the decay begins, the new total
        that puts the decay after the next validation (at most `limit`); else None."""
        decay_start = self.total - self.decay
        if not improved or step <= eval_every or not decay_start - eval_every < step <= decay_start:
            return None
        total = min(step + eval_every + self.decay, self.limit)
        if total <= self.total:
            return None
        self.total = total
        return total


def optimizer_and_schedule(
    model: torch.nn.Module, cfg: TrainConfig, total_steps: int
) -> tuple[AdamW, LambdaLR, WarmupStableDecay | None]:
    """AdamW over the trainable parameters and its schedule over `total_steps` (the planned steps); under
    `wsd`, also the schedule's factor, which `fit()` asks to extend after each validation."""
    optimizer = AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    warmup = warmup_steps(cfg, total_steps)
    if cfg.schedule == "cosine":
        return optimizer, get_cosine_schedule_with_warmup(optimizer, warmup, total_steps), None
    decay = max(1, round(cfg.decay_ratio * total_steps))
    factor = WarmupStableDecay(warmup, decay, total_steps, math.ceil(cfg.extend_up_to * total_steps))
    return optimizer, LambdaLR(optimizer, factor), factor


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total_steps)


def schedule_words(cfg: TrainConfig, total_steps: int) -> str:
    """The schedule as the plan line tells it."""
    warmup = f"warm-up {warmup_steps(cfg, total_steps)}"
    if cfg.schedule == "cosine":
        return f"cosine, {warmup}"
    decay = max(1, round(cfg.decay_ratio * total_steps))
    return (
        f"wsd: {warmup}, decay over the last {decay}; more while validation improves, up to "
        f"{math.ceil(cfg.extend_up_to * total_steps)}"
    )
