"""The optimizer's state inside a checkpoint: consolidated, named, and free of pickles.

Per trainable weight: its fp32 master copy and AdamW's two moments (or Muon's momentum, for the matrices
trainer.optimizer=muon gives it), whole (gathered from ZeRO partitions where the run had them), keyed by
the weight's name, in ``optimizer.safetensors``; the step count, the learning rates and the schedule's
state in ``optimizer.json``. Every engine writes and reads this one layout, so a run resumes on any number
of ranks and under any ZeRO stage, and loading a checkpoint someone else made runs no code (safetensors
and JSON hold data only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..records import OPTIMIZER_META as META
from ..records import OPTIMIZER_TENSORS as TENSORS

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's, per weight
MOMENTUM = ("momentum_buffer",)  # Muon's, per matrix
MASTER = "master"


@dataclass
class OptimizerState:
    tensors: dict[str, torch.Tensor]  # "<moment or master>/<weight name>" -> whole fp32 tensor
    step: int  # AdamW's step count (its bias correction depends on it)
    lrs: list[float]  # per parameter group
    scheduler: dict  # LambdaLR.state_dict(): numbers and lists only

    def get(self, kind: str, name: str) -> torch.Tensor | None:
        return self.tensors.get(f"{kind}/{name}")

    def save(self, folder: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}, str(folder / TENSORS))
        (folder / META).write_text(json.dumps({"step": self.step, "lrs": self.lrs, "scheduler": self.scheduler}))

    @classmethod
    def load(cls, folder: Path) -> OptimizerState:
        if not (folder / TENSORS).is_file() or not (folder / META).is_file():
            raise FileNotFoundError(f"{folder} holds no optimizer state ({TENSORS}, {META})")
        meta = json.loads((folder / META).read_text())
        return cls(load_file(str(folder / TENSORS)), int(meta["step"]), [float(x) for x in meta["lrs"]],
                   meta["scheduler"])


def adam_state(step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter's entry in torch AdamW's ``state``, as AdamW itself creates it (a float32 step)."""
    return {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def state_kinds(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> tuple[str, ...]:
    """The tensors the optimizer keeps for weight ``p``: Muon's momentum for its matrices, else AdamW's moments."""
    kinds = getattr(optimizer, "state_kinds", None)  # (training/optim.py MuonWithAdamW)
    return kinds(p) if kinds is not None else MOMENTS


def saved_state(saved: OptimizerState, name: str, kinds: tuple[str, ...], where: Path,
                device: torch.device) -> dict[str, torch.Tensor]:
    """One weight's optimizer state from a checkpoint, as torch's optimizer itself keeps it."""
    tensors = [saved.get(kind, name) for kind in kinds]
    if any(t is None for t in tensors):
        raise RuntimeError(f"checkpoint {where} has no optimizer state ({', '.join(kinds)}) for {name}: it does "
                           "not fit this draft, or was written by another trainer.optimizer")
    if kinds == MOMENTS:
        return adam_state(saved.step, *(t.to(device) for t in tensors))
    return {kind: t.to(device) for kind, t in zip(kinds, tensors)}


def adam_step(optimizer: torch.optim.Optimizer) -> int:
    """The step count AdamW keeps per parameter (the same for all); 0 before its first step."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def ensure_adam_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """AdamW creates a parameter's state at its first step; a resume fills it in before then."""
    for p in params:
        if not optimizer.state.get(p):
            optimizer.state[p] = adam_state(0, torch.zeros_like(p), torch.zeros_like(p))


def set_adam_step(optimizer: torch.optim.Optimizer, step: int) -> None:
    for state in optimizer.state.values():
        state["step"] = torch.tensor(float(step), dtype=state["step"].dtype, device=state["step"].device)


def set_lrs(optimizer: torch.optim.Optimizer, lrs: list[float]) -> None:
    if len(lrs) != len(optimizer.param_groups):
        raise RuntimeError(f"the checkpoint's optimizer has {len(lrs)} parameter groups, this one "
                           f"{len(optimizer.param_groups)}")
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
