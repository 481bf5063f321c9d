"""What steps the draft's weights: plain PyTorch in one process, or a DeepSpeed ZeRO engine.

Both take the same AdamW and warmup + cosine schedule (optim.py), and offer the loop the same five
things: run the draft's training forward, backward a micro-batch, step after the accumulation, save
and load their state inside a checkpoint folder, and the full trainable weights (gathered from ZeRO-3
shards where needed) for checkpoints and exports.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from ..config import TrainerConfig
from .distributed import DistributedContext, deepspeed_config, sequence_parallel_mpu, use_bf16
from .optim import build_optimizer, build_scheduler

OPTIMIZER_FILE = "optimizer.pt"
DEEPSPEED_DIR = "deepspeed"


class PlainEngine:
    """One process: AdamW over fp32 weights, bf16 autocast where asked, clipping, accumulation."""

    kind = "plain"

    def __init__(self, draft: torch.nn.Module, cfg: TrainerConfig):
        self.module, self.cfg = draft, cfg
        self.optimizer = build_optimizer(draft.parameters(), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)

    def forward(self, *args: Any, **kwargs: Any):
        device = next(self.module.parameters()).device
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16(self.cfg.precision, device)
                    else contextlib.nullcontext())
        with autocast:
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.cfg.grad_accum_steps).backward()

    def step(self) -> float:
        params = [p for p in self.module.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.trainable_state_dict()

    def save(self, folder: Path, ctx: DistributedContext) -> None:
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                   folder / OPTIMIZER_FILE)

    def load(self, folder: Path, weights: dict[str, torch.Tensor], ctx: DistributedContext) -> None:
        if not (folder / OPTIMIZER_FILE).is_file():
            raise FileNotFoundError(f"{folder} holds no {OPTIMIZER_FILE}: it was written by a DeepSpeed run; resume it "
                                    "with the same trainer=zero* setting")
        load_weights(self.module, weights, folder)
        state = torch.load(folder / OPTIMIZER_FILE, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class DeepSpeedEngine:
    """The draft inside ``deepspeed.initialize``: ZeRO stage 0-3 (optionally CPU offload) over the ranks.

    DeepSpeed counts micro-batches itself: ``backward`` is followed by its ``step`` every micro-batch,
    and it updates the weights (clipping, optimizer, schedule) on the accumulation boundary."""

    kind = "deepspeed"

    def __init__(self, draft: torch.nn.Module, cfg: TrainerConfig, ctx: DistributedContext):
        import deepspeed

        self.cfg, self.ctx = cfg, ctx
        optimizer = build_optimizer(draft.parameters(), cfg)
        scheduler = build_scheduler(optimizer, cfg)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=draft, optimizer=optimizer, lr_scheduler=scheduler, mpu=sequence_parallel_mpu(ctx),
            config=deepspeed_config(cfg, ctx.data_world_size))
        self.module = self.engine.module
        self.zero_stage = cfg.deepspeed.zero_stage
        self._norm = float("nan")

    def forward(self, *args: Any, **kwargs: Any):
        return self.engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        if self.zero_stage == 0 and self.engine.is_gradient_accumulation_boundary():
            # ZeRO-0 does not report the norm it clips with; the averaged gradients are in place here
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
            self._norm = float(torch.linalg.vector_norm(norms))
        self.engine.step()

    def step(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else self._norm

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank takes part; under ZeRO-3 the shards are gathered (fp32 copies on every rank)."""
        if self.zero_stage < 3:
            return {k: v.detach().float() if v.is_floating_point() else v
                    for k, v in self.module.trainable_state_dict().items()}
        import deepspeed

        params = [p for p in self.module.parameters()]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return {k: v.detach().clone().float() if v.is_floating_point() else v.clone()
                    for k, v in self.module.trainable_state_dict().items()}

    def save(self, folder: Path, ctx: DistributedContext) -> None:
        """Every rank writes its shards of weights and optimizer state (DeepSpeed's own layout)."""
        self.engine.save_checkpoint(str(folder / DEEPSPEED_DIR), tag="state", save_latest=False)

    def load(self, folder: Path, weights: dict[str, torch.Tensor], ctx: DistributedContext) -> None:
        if not (folder / DEEPSPEED_DIR).is_dir():
            raise FileNotFoundError(f"{folder} holds no DeepSpeed state: it was written by a single-process run "
                                    "(trainer without zero*); resume it the same way")
        path, _ = self.engine.load_checkpoint(str(folder / DEEPSPEED_DIR), tag="state", load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load {folder / DEEPSPEED_DIR}")


def load_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    result = module.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {where} does not fit this draft: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")


def build_engine(draft: torch.nn.Module, cfg: TrainerConfig, ctx: DistributedContext):
    return DeepSpeedEngine(draft, cfg, ctx) if cfg.deepspeed.enabled else PlainEngine(draft, cfg)
