"""AdamW with linear warmup and cosine decay, over steps or over a time budget."""

from __future__ import annotations

import math

import torch

from ..config import TrainerConfig


def build_optimizer(params, cfg: TrainerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=cfg.lr, betas=tuple(cfg.betas),
                             weight_decay=cfg.weight_decay)


class Budget:
    """How far training has come: the share of ``trainer.max_steps`` done or, with ``trainer.max_minutes``,
    of the time budget spent, whichever is further. ``elapsed`` (seconds of training, the same on every
    rank) is set by the loop after each step and saved with checkpoints, so a resumed run spends only what
    is left."""

    def __init__(self, cfg: TrainerConfig):
        if cfg.max_minutes is not None and cfg.max_minutes <= 0:
            raise ValueError(f"trainer.max_minutes={cfg.max_minutes}: give a positive time budget, or null for none")
        self.max_steps = cfg.max_steps
        self.seconds = None if cfg.max_minutes is None else 60.0 * cfg.max_minutes
        self.elapsed = 0.0

    def progress(self, steps: int) -> float:
        done = steps / self.max_steps
        if self.seconds is not None:
            done = max(done, self.elapsed / self.seconds)
        return min(done, 1.0)

    def spent(self, steps: int) -> bool:
        return self.progress(steps) >= 1.0


def warmup_cosine(cfg: TrainerConfig, budget: Budget | None = None):
    """The learning-rate factor of the step after ``step`` steps: linear warmup over ``warmup_ratio`` of the
    run, then cosine decay to ``min_lr_ratio``. Over steps; with a time budget, over the budget's progress
    (what a run cut short by time has left of its schedule is the decay, not the warmup)."""

    def cosine(progress: float) -> float:
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    if budget is not None and budget.seconds is not None:
        def by_time(step: int) -> float:
            done = budget.progress(step + 1)  # where the coming step ends
            if done < cfg.warmup_ratio:
                return done / cfg.warmup_ratio
            return cosine((done - cfg.warmup_ratio) / max(1e-9, 1 - cfg.warmup_ratio))

        return by_time

    warmup = max(1, round(cfg.warmup_ratio * cfg.max_steps)) if cfg.warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return cosine((step - warmup) / max(1, cfg.max_steps - warmup))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig,
                    budget: Budget | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg, budget))
