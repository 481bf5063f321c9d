"""The optimizer's state inside a checkpoint: consolidated, named, and free of pickles.

Per trainable weight: its fp32 master copy and AdamW's two moments, whole (gathered from ZeRO partitions
where the run had them), keyed by the weight's name, in ``optimizer.safetensors``; the step count, the
learning rates and the schedule's state in ``optimizer.json``. Every engine writes and reads this one
layout, so a run resumes on any number of ranks and under any ZeRO stage, and loading a checkpoint
someone else made runs no code (safetensors and JSON hold data only).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TENSORS = "optimizer.safetensors"
META = "optimizer.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
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
