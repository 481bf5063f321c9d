"""What steps the draft's weights: plain PyTorch in one process, or a DeepSpeed ZeRO engine.

Both take the same optimizer (AdamW; Muon with AdamW in one process only) and warmup + decay schedule
(optim.py), and offer the loop the same five things: run the draft's training forward, backward a
micro-batch, step after the accumulation, save and load their state inside a checkpoint folder, and the
full trainable weights (gathered from ZeRO-3 shards where needed) for checkpoints and exports. Both save
the optimizer in one consolidated layout (optimizer_state.py), so either resumes what the other wrote, on
any number of ranks.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from ..config import TrainerConfig
from ..records import WEIGHTS, CheckpointError
from .distributed import DistributedContext, deepspeed_config, sequence_parallel_mpu, use_bf16
from .optim import Budget, build_optimizer, build_scheduler, named_lrs
from .optimizer_state import (MASTER, MOMENTS, OptimizerState, adam_step, ensure_adam_state,
                              saved_state, set_adam_step, set_lrs, state_kinds)

DEEPSPEED_DIR = "deepspeed"  # DeepSpeed's own layout, written only with trainer.deepspeed.native_checkpoint


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


class PlainEngine:
    """One process: AdamW (or Muon with AdamW) over fp32 weights, bf16 autocast where asked, clipping,
    accumulation."""

    kind = "plain"

    def __init__(self, draft: torch.nn.Module, cfg: TrainerConfig, budget: Budget | None = None):
        self.module, self.cfg = draft, cfg
        self.optimizer = build_optimizer(draft.named_parameters(), cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg, budget)

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
    def lrs(self) -> dict[str, float]:
        """The learning rates now, named by their settings (``lr``; with Muon also ``muon_lr``)."""
        return named_lrs(self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.trainable_state_dict()

    def save(self, folder: Path, ctx: DistributedContext) -> None:
        tensors = {f"{kind}/{name}": state[kind] for name, p in trainable(self.module)
                   for state in [self.optimizer.state.get(p, {})] for kind in state_kinds(self.optimizer, p)
                   if kind in state}
        OptimizerState(tensors, adam_step(self.optimizer), [g["lr"] for g in self.optimizer.param_groups],
                       self.scheduler.state_dict()).save(folder)

    def load(self, folder: Path, weights: dict[str, torch.Tensor], ctx: DistributedContext) -> None:
        saved = OptimizerState.load(folder)
        # a DeepSpeed run's fp32 master copies are the exact weights where its modules held bf16
        masters = {name: saved.get(MASTER, name) for name, _ in trainable(self.module)}
        load_weights(self.module, {**weights, **{k: v for k, v in masters.items() if v is not None}}, folder)
        for name, p in trainable(self.module):
            self.optimizer.state[p] = saved_state(saved, name, state_kinds(self.optimizer, p), folder, p.device)
        set_lrs(self.optimizer, saved.lrs)
        self.scheduler.load_state_dict(saved.scheduler)


class DeepSpeedEngine:
    """The draft inside ``deepspeed.initialize``: ZeRO stage 0-3 (optionally CPU offload) over the ranks.

    DeepSpeed counts micro-batches itself: ``backward`` is followed by its ``step`` every micro-batch,
    and it updates the weights (clipping, optimizer, schedule) on the accumulation boundary."""

    kind = "deepspeed"

    def __init__(self, draft: torch.nn.Module, cfg: TrainerConfig, ctx: DistributedContext,
                 budget: Budget | None = None):
        import deepspeed

        self.cfg, self.ctx = cfg, ctx
        optimizer = build_optimizer(draft.named_parameters(), cfg)
        scheduler = build_scheduler(optimizer, cfg, budget)
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
    def lrs(self) -> dict[str, float]:
        return {"lr": self.engine.get_lr()[0]}  # (AdamW only: Muon is refused under DeepSpeed)

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

    @property
    def _adam(self) -> torch.optim.Optimizer:
        """The torch AdamW itself (under ZeRO it steps this rank's flat fp32 partitions)."""
        return getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)

    def _full(self, p: torch.nn.Parameter, kind: str) -> torch.Tensor | None:
        """One weight's whole fp32 master copy or moment; every rank calls it (ZeRO gathers the slices)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        if _partitioned(p):
            return safe_get_full_fp32_param(p) if kind == MASTER else safe_get_full_optimizer_state(p, kind)
        return p.detach() if kind == MASTER else self._adam.state.get(p, {}).get(kind)

    def save(self, folder: Path, ctx: DistributedContext) -> None:
        """Every rank takes part in gathering, one weight at a time; rank 0 keeps and writes the whole state."""
        tensors = {}
        for name, p in trainable(self.module):
            for kind in (MASTER, *MOMENTS):
                value = self._full(p, kind)
                if value is not None and ctx.is_main:
                    tensors[f"{kind}/{name}"] = value.detach().float().cpu().clone()
        if ctx.is_main:
            OptimizerState(tensors, adam_step(self._adam), [g["lr"] for g in self._adam.param_groups],
                           self.scheduler.state_dict()).save(folder)
        if self.cfg.deepspeed.native_checkpoint:
            self.engine.save_checkpoint(str(folder / DEEPSPEED_DIR), tag="state", save_latest=False)

    def load(self, folder: Path, weights: dict[str, torch.Tensor], ctx: DistributedContext) -> None:
        """Every rank reads the consolidated state and keeps its own slice: any world size, any ZeRO stage."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        saved = OptimizerState.load(folder)
        named = trainable(self.module)
        masters = {name: saved.get(MASTER, name) for name, _ in named}
        masters = {name: m if m is not None else weights[name].float() for name, m in masters.items()}
        self._load_module_weights({**weights, **masters}, folder)
        # ZeRO-3 hands its flat fp32 partitions to AdamW only while stepping: they are not in param_groups
        partitions = getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", [])
        ensure_adam_state(self._adam, [p for g in self._adam.param_groups for p in g["params"]] + list(partitions))
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO-1/2 and bf16 tie each weight to its slice of the state at the first step
            link()
        for name, p in named:
            state = saved_state(saved, name, MOMENTS, folder, p.device)
            if _partitioned(p):
                safe_set_full_fp32_param(p, masters[name].to(p.device))
                for kind in MOMENTS:
                    safe_set_full_optimizer_state(p, state[kind], kind)
            else:
                self._adam.state[p] = state
        set_adam_step(self._adam, saved.step)
        set_lrs(self._adam, saved.lrs)
        self.scheduler.load_state_dict(saved.scheduler)

    def _load_module_weights(self, weights: dict[str, torch.Tensor], folder: Path) -> None:
        """The module's own (possibly bf16) copies; under ZeRO-3 gathered, set, and re-partitioned."""
        if self.zero_stage < 3:
            load_weights(self.module, weights, folder)
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=0):
            load_weights(self.module, weights, folder)


def _partitioned(p: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed keeps this weight's fp32 copy and optimizer state in partitions (ZeRO-1/2/3, bf16)."""
    return hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")


def load_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor], where: Path) -> None:
    result = module.load_state_dict(weights, strict=False)
    if result.missing_keys or result.unexpected_keys:  # (the spec matched: the weights file is damaged)
        raise CheckpointError(f"checkpoint {where} is damaged: its {WEIGHTS} does not fit this draft (missing "
                              f"{result.missing_keys}, unexpected {result.unexpected_keys}); resume from an earlier "
                              "checkpoint (trainer.resume=FOLDER), or start anew (trainer.resume=never)")


def build_engine(draft: torch.nn.Module, cfg: TrainerConfig, ctx: DistributedContext, budget: Budget | None = None):
    """``budget``: the run's progress, which a time-budgeted schedule (trainer.max_minutes) reads."""
    return DeepSpeedEngine(draft, cfg, ctx, budget) if cfg.deepspeed.enabled else PlainEngine(draft, cfg, budget)
