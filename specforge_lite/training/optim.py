"""The optimizer (AdamW, or Muon with AdamW: trainer.optimizer) with linear warmup and a decay (cosine or
linear: trainer.schedule), over steps or over a time budget."""

from __future__ import annotations

import math

import torch

from ..config import Schedule, TrainerConfig
from .distributed import use_bf16
from .optimizer_state import MOMENTS, MOMENTUM

# the learning rate's decay after the warmup (trainer.schedule), as a factor of the decay's progress in [0, 1]
# (1 -> 0): cosine (SpecForge's, EAGLE's) or linear (speculators' default, transformers'
# get_linear_schedule_with_warmup)
DECAYS = {Schedule.cosine: lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
          Schedule.linear: lambda progress: 1 - progress}
# 2-D weights indexed by token id, which Muon leaves to AdamW. Our rule: speculators' (and Muon's author's) leaves
# the embedding and the lm_head to AdamW; ours also every other matrix with a row or column per token, DSpark's
# Markov factors (markov_w1 is an embedding of the previous token, markov_w2 a head onto the draft vocabulary) and
# DFlash 2's codebooks. A step orthogonalised over the whole matrix moves the rows of tokens a batch never saw
# as much as the others; AdamW's per-weight step moves a token's row by the tokens that use it, as for the
# embedding and the lm_head. speculators applies Muon to the Markov factors.
TOKEN_INDEXED = ("embed_tokens", "lm_head", "markov_w1", "markov_w2", "codebook")


def build_optimizer(named_params, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """``named_params``: the draft's ``named_parameters()``; the frozen ones are left out."""
    named = [(name, p) for name, p in named_params if p.requires_grad]
    adamw = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if cfg.optimizer != "muon":
        return torch.optim.AdamW([p for _, p in named], **adamw)
    # the orthogonalisation in the run's training precision: torch's Muon always runs it in bf16, which an
    # AVX2 CPU computes ~57x slower than fp32 (use_bf16 is true only where bf16 is native, or asked for)
    ns_dtype = torch.bfloat16 if use_bf16(cfg.precision, named[0][1].device) else torch.float32
    muon = {"lr": cfg.lr if cfg.muon_lr is None else cfg.muon_lr, "weight_decay": cfg.muon_weight_decay,
            "ns_dtype": ns_dtype, "ns_steps": cfg.muon_ns_steps}
    return MuonWithAdamW(named, adamw, muon)


def for_muon(name: str, p: torch.Tensor) -> bool:
    """A matrix Muon orthogonalises: 2-D, not a vector, not indexed by token (``TOKEN_INDEXED``)."""
    return p.ndim == 2 and min(p.shape) > 1 and not any(hint in name for hint in TOKEN_INDEXED)


def named_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """The learning rates now, each under the setting that sets it: ``lr`` (trainer.lr: AdamW's) and, with
    Muon, ``muon_lr`` (trainer.muon_lr: its matrices')."""
    parts = optimizer.parts if isinstance(optimizer, MuonWithAdamW) else [optimizer]
    return {"muon_lr" if isinstance(part, Muon) else "lr": part.param_groups[0]["lr"] for part in parts}


def orthogonalised(update: torch.Tensor, dtype: torch.dtype, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Muon's approximate orthogonalisation: the update scaled to spectral norm <= 1 (by its Frobenius norm),
    then ``steps`` quintic Newton-Schulz iterations X <- a X + (b S + c S^2) X, S = X X^T, on the wide
    orientation (S is the smaller Gram matrix). Its singular values end near 1, not at 1: Muon's design."""
    a, b, c = 3.4445, -4.7750, 2.0315  # Muon's coefficients (the steepest slope at zero)
    tall = update.shape[0] > update.shape[1]
    x = (update.T if tall else update).to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon over 2-D weights with speculators' settings of torch's Muon (momentum 0.95 with Nesterov,
    ``ns_steps`` Newton-Schulz steps: trainer.muon_ns_steps, 5 as theirs; decoupled weight decay, the step scaled by
    0.2 sqrt(max(rows, cols)) so that its RMS matches AdamW's and AdamW's learning rates carry over), its
    orthogonalisation in ``ns_dtype`` (tests/test_training.py compares it with torch.optim.Muon)."""

    def __init__(self, params, lr: float, weight_decay: float, ns_dtype: torch.dtype, ns_steps: int,
                 momentum: float = 0.95):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "ns_dtype": ns_dtype,
                                  "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                momentum.mul_(mu).add_(p.grad, alpha=1 - mu)  # an average of the gradients
                nesterov = p.grad * (1 - mu) + momentum * mu  # looking one step ahead
                update = orthogonalised(nesterov, group["ns_dtype"], group["ns_steps"]).to(p.dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))


class MuonWithAdamW(torch.optim.Optimizer):
    """speculators' optimizer: Muon over the layers' matrices, torch's AdamW over the rest (``for_muon``: our
    split, speculators' widened to every token-indexed matrix). One optimizer to
    the schedule, the clipping and the checkpoint: its parameter groups (and per-weight state) are the two
    optimizers' own, shared, so each steps exactly as it would alone."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], adamw: dict, muon: dict):
        matrices = [p for n, p in named if for_muon(n, p)]
        self.matrices = {id(p) for p in matrices}
        parts = [(Muon, matrices, muon), (torch.optim.AdamW, [p for n, p in named if not for_muon(n, p)], adamw)]
        self.parts = [kind(params, **settings) for kind, params, settings in parts if params]
        super().__init__([group for part in self.parts for group in part.param_groups], {})
        for part in self.parts:  # (the groups are the same dicts; the state becomes one)
            part.state = self.state

    def state_kinds(self, p: torch.Tensor) -> tuple[str, ...]:
        """The state tensors of weight ``p`` (training/optimizer_state.py saves and restores them)."""
        return MOMENTUM if id(p) in self.matrices else MOMENTS

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure")
        for part in self.parts:
            part.step()


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


def warmup_decay(cfg: TrainerConfig, budget: Budget | None = None):
    """The learning-rate factor of the step after ``step`` steps: linear warmup over ``warmup_ratio`` of the
    run, then the ``trainer.schedule`` decay to ``min_lr_ratio``. Over steps; with a time budget, over the
    budget's progress (what a run cut short by time has left of its schedule is the decay, not the warmup)."""
    shape = DECAYS[cfg.schedule]

    def decay(progress: float) -> float:
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape(min(1.0, progress))

    if budget is not None and budget.seconds is not None:
        def by_time(step: int) -> float:
            # as the step schedule: the warmup up to where the coming step ends, the decay from where it starts
            # (so the last step does not train at the decay's floor)
            start, end = budget.progress(step), budget.progress(step + 1)
            if end <= cfg.warmup_ratio:
                return end / cfg.warmup_ratio
            return decay(max(0.0, start - cfg.warmup_ratio) / max(1e-9, 1 - cfg.warmup_ratio))

        return by_time

    warmup = max(1, round(cfg.warmup_ratio * cfg.max_steps)) if cfg.warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return decay((step - warmup) / max(1, cfg.max_steps - warmup))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainerConfig,
                    budget: Budget | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_decay(cfg, budget))
