"""Checkpoints written atomically, and exact resume.

A checkpoint is a folder ``checkpoints/step_XXXXXXXX`` holding the draft's trainable weights
(safetensors), the optimizer, scheduler, data position, RNG states and step. It is written under a
temporary name and renamed into place, so a run killed at any moment leaves either the previous
checkpoint or the new one, never half of one; ``latest`` names the newest complete folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "draft.safetensors"
STATE = "trainer_state.pt"
SPEC = "spec.json"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, weights: dict[str, torch.Tensor], trainer_state: dict[str, Any],
                    spec: dict, keep: int = 2) -> Path:
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
    torch.save(trainer_state, tmp / STATE)
    (tmp / SPEC).write_text(json.dumps(spec, indent=1))
    if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_text_atomic(root / "latest", final.name)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in done[: max(0, len(done) - max(keep, 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step_*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = checkpoint_root(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE).is_file():
            return candidate
    done = sorted(p for p in root.glob("step_*") if (p / STATE).is_file())
    return done[-1] if done else None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict]:
    path = Path(path)
    if not (path / STATE).is_file() or not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (needs {WEIGHTS} and {STATE})")
    return load_file(str(path / WEIGHTS)), torch.load(path / STATE, weights_only=False), json.loads((path / SPEC).read_text())
