"""Checkpoints written atomically, and exact resume.

A checkpoint is a folder ``checkpoints/step_XXXXXXXX`` holding the draft's full trainable weights
(safetensors, consolidated from ZeRO shards), the training engine's state (optimizer and schedule:
``optimizer.pt`` in one process, DeepSpeed's sharded layout under ``deepspeed/`` otherwise), the data
position, step and world size, and every rank's RNG state. It is written under a temporary name and
renamed into place once every rank has written its part, so a run killed at any moment leaves either
the previous checkpoint or the new one, never half of one; ``latest`` names the newest complete folder.
``CheckpointManager`` is what the loop sees: the stateful parts saved and restored together.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

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


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def save_checkpoint(run_dir: Path, step: int, weights: dict[str, torch.Tensor], trainer_state: dict[str, Any],
                    spec: dict, keep: int = 2, ctx=None, save_engine: Callable[[Path], None] | None = None) -> Path:
    """Every rank calls this (``ctx``: the DistributedContext); rank 0 writes the shared files and
    publishes the folder after all ranks wrote their parts (``save_engine(folder)``, RNG)."""
    rank, is_main = (ctx.rank, ctx.is_main) if ctx is not None else (0, True)
    barrier = ctx.barrier if ctx is not None else (lambda: None)
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    if save_engine is not None:
        save_engine(tmp)
    torch.save(rng_state(), tmp / rng_file(rank))
    if is_main:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        torch.save(trainer_state, tmp / STATE)
        (tmp / SPEC).write_text(json.dumps(spec, indent=1))
    barrier()
    if is_main:
        if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(root / "latest", final.name)
        _prune(root, keep)
    barrier()
    return final


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG from a checkpoint; False when it has none for this rank (other world size)."""
    f = Path(path) / rng_file(rank)
    if not f.is_file():
        return False
    set_rng_state(torch.load(f, weights_only=False))
    return True


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
    state = torch.load(path / STATE, weights_only=False)
    return load_file(str(path / WEIGHTS)), state, json.loads((path / SPEC).read_text())


class CheckpointManager:
    """The run's stateful parts, saved and restored as one: the training engine (weights, optimizer,
    schedule), the batch stream's position, every rank's RNG and the step counters. ``trainer.resume``
    says where a run starts from: auto (the newest complete checkpoint), never, or a checkpoint folder."""

    def __init__(self, run_dir: Path, cfg, spec: dict, ctx, engine, stream):
        self.run_dir, self.cfg, self.spec, self.ctx = Path(run_dir), cfg, spec, ctx
        self.engine, self.stream = engine, stream

    def resume(self, log=print) -> tuple[int, int]:
        """Restore every part from the checkpoint ``trainer.resume`` names; (step, tokens seen)."""
        cfg, ctx = self.cfg, self.ctx
        path = None
        if cfg.resume == "auto":
            path = latest_checkpoint(self.run_dir)
        elif cfg.resume not in ("never", "none", ""):
            path = Path(cfg.resume)
        if path is None:
            return 0, 0
        weights, state, saved_spec = load_checkpoint(path)
        changed = {k: (saved_spec.get(k), v) for k, v in self.spec.items() if saved_spec.get(k) != v}
        if changed:
            raise RuntimeError(f"checkpoint {path} does not fit this draft (saved vs now: {changed}); "
                               "resume with the same model and draft settings, or use a new output_dir")
        saved_world = state.get("world_size", 1)
        if saved_world != ctx.world_size and cfg.deepspeed.enabled and cfg.deepspeed.zero_stage > 0:
            # DeepSpeed 0.19 refuses ZeRO-1/2/3 optimizer partitions from another data-parallel size, and its
            # universal-checkpoint converter does not take a plain torch optimizer's state.
            raise RuntimeError(
                f"checkpoint {path} was written by {saved_world} ranks under ZeRO-{cfg.deepspeed.zero_stage} "
                f"and this run has {ctx.world_size}: partitioned optimizer state cannot be re-split on load. Resume "
                f"with {saved_world} ranks (the global batch is micro_batch_size x grad_accum_steps x ranks), or "
                "train with trainer=zero0, whose replicated state resumes on any number of ranks")
        self.engine.load(path, weights, ctx)
        self.stream.load_state_dict(state["data"])
        if not load_rng(path, ctx.rank) and "rng" in state:
            set_rng_state(state["rng"])  # checkpoints written before per-rank RNG files
        log(f"[train] resumed from {path} at step {state['step']}"
            + (f" (written by {saved_world} ranks, now {ctx.world_size})" if saved_world != ctx.world_size else ""))
        return state["step"], state["tokens_seen"]

    def save(self, step: int, tokens_seen: int) -> Path:
        state = {"data": self.stream.state_dict(), "step": step, "tokens_seen": tokens_seen,
                 "world_size": self.ctx.world_size, "engine": self.engine.kind}
        return save_checkpoint(self.run_dir, step, self.engine.full_state_dict(), state, self.spec,
                               keep=self.cfg.keep_checkpoints, ctx=self.ctx,
                               save_engine=lambda folder: self.engine.save(folder, self.ctx))
