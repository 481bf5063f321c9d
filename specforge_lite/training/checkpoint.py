"""Checkpoints written atomically and durably, read without unpickling anything, and exact resume.

A checkpoint is a folder ``checkpoints/step_XXXXXXXX`` holding the draft's full trainable weights
(safetensors, consolidated from ZeRO shards), the optimizer and schedule consolidated the same way
(optimizer_state.py), the data position, step and world size (JSON), and every rank's RNG state (JSON).
Nothing in it is a pickle, so resuming from or exporting a folder someone else made runs no code.

It is written under a temporary name, flushed to disk (every file, then the folder), and renamed into
place once every rank has written its part, so a run killed at any moment, or a machine losing power,
leaves either the previous checkpoint or the new one, never half of one. Re-saving a step that exists
moves the old folder aside until the new one is in place: some complete copy is always on disk.
``latest`` names the newest complete folder; ``best`` (trainer.keep_best) names the folder whose periodic held-out
metric was highest, with the metric, value and step (JSON), and that folder is never pruned.
``CheckpointManager`` is what the loop sees: the stateful parts saved and restored together.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save_file

from ..files import WRITE_ERRORS, fsync, write_failure, write_then_rename
from ..records import (REPLACED, SPEC, STATE, WEIGHTS, CheckpointError, checkpoint_folders, checkpoint_root,
                       latest_checkpoint, load_checkpoint, rng_file, unusable_checkpoints)
from ..records import OPTIMIZER_META, OPTIMIZER_TENSORS
from .distributed import use_bf16

BEST = "best"  # checkpoints/best: the best checkpoint by trainer.keep_best (JSON: checkpoint, step, metric, value)
PRUNED = ".pruned-"  # an older checkpoint on its way out, out of the listing before any file goes
VOCAB_MAPS = ("d2t", "t2d")  # the draft's vocabulary mapping, saved with its weights
# Trainer settings a checkpoint records and a resume compares: those a resumed run applies from its first step
# (each change said in one line), and those it cannot apply, refused with the reason.
APPLIED_ON_RESUME = ("max_steps", "max_minutes", "warmup_ratio", "schedule", "min_lr_ratio", "micro_batch_size",
                     "grad_accum_steps", "grad_clip", "weight_decay", "betas", "precision", "muon_weight_decay",
                     "muon_ns_steps")
_SAVED_LR = "the optimizer and schedule come back with the saved peak learning rate"
REFUSED_ON_RESUME = {"lr": _SAVED_LR, "muon_lr": _SAVED_LR,
                     "seed": "the data order and every random generator come back as saved",
                     "optimizer": "the saved optimizer state is the other optimizer's"}
# the setting that freezes each weight a draft may leave out of training (frozen: no optimizer state)
FREEZES = {"lm_head.weight": "draft.freeze_lm_head"}


def optimizer_state_kinds(path: Path) -> dict[str, set[str]]:
    """What a checkpoint's optimizer state holds: weight name -> the kinds of tensor kept for it (AdamW's
    moments, Muon's momentum, a master copy); {} for a checkpoint without that file."""
    from safetensors import safe_open

    if not (Path(path) / OPTIMIZER_TENSORS).is_file():
        return {}
    kinds: dict[str, set[str]] = {}
    with safe_open(str(Path(path) / OPTIMIZER_TENSORS), "pt") as f:
        for key in f.keys():
            kind, name = key.split("/", 1)
            kinds.setdefault(name, set()).add(kind)
    return kinds


def settings_before_recorded(path: Path) -> dict:
    """The settings of a checkpoint as far as its optimizer state shows them, for one written before they were
    recorded (trainer_state.json without ``settings``, or without the optimizer among them): the optimizer (Muon
    keeps a momentum per matrix, AdamW two moments) and AdamW's peak learning rate (the schedule's base rate), so
    a resume under the recipe's newer optimizer is refused with the settings that resume it."""
    from .optimizer_state import MOMENTUM

    path = Path(path)
    kinds = set().union(*optimizer_state_kinds(path).values())
    if not kinds or not (path / OPTIMIZER_META).is_file():
        return {}
    settings = {"optimizer": "muon" if kinds & set(MOMENTUM) else "adamw"}
    base = (json.loads((path / OPTIMIZER_META).read_text()).get("scheduler") or {}).get("base_lrs") or []
    if settings["optimizer"] == "adamw" and len(set(base)) == 1:
        settings["lr"] = base[0]
    return settings


def rng_state() -> dict:
    """Every generator's state as JSON: plain numbers and lists."""
    version, keys, gauss = random.getstate()
    kind, mt, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(keys), gauss], "numpy": [kind, mt.tolist(), int(pos), int(has_gauss),
                                                                float(cached)],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, mt, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(mt, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _fsync_tree(folder: Path) -> None:
    """Every file under ``folder``, then the folders themselves (deepest first), on disk."""
    paths = sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for path in [p for p in paths if p.is_file()] + [p for p in paths if p.is_dir()] + [folder]:
        fsync(path)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


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
    (tmp / rng_file(rank)).write_text(json.dumps(rng_state()))
    if is_main:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
        (tmp / STATE).write_text(json.dumps(trainer_state, indent=1))
        (tmp / SPEC).write_text(json.dumps(spec, indent=1))
    barrier()
    if is_main:
        _fsync_tree(tmp)
        _publish(tmp, final)
        write_then_rename(root / "latest", lambda tmp: tmp.write_text(final.name))
        _prune(root, keep)
    barrier()
    return final


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder into place; a folder already there (the same step saved again) is moved
    aside first and removed only once the new one is on disk, so a kill in between loses neither."""
    root = final.parent
    replaced = root / f"{REPLACED}{final.name}"
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(tmp, final)
    fsync(root)
    shutil.rmtree(replaced, ignore_errors=True)


def load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG from a checkpoint; False when it has none for this rank (other world size)."""
    f = Path(path) / rng_file(rank)
    if not f.is_file():
        return False
    set_rng_state(json.loads(f.read_text()))
    return True


def read_best(root: Path) -> dict | None:
    """What ``checkpoints/best`` says (checkpoint, step, metric, value), or None where there is none."""
    try:
        best = json.loads((Path(root) / BEST).read_text())
    except (OSError, ValueError):
        return None
    return best if isinstance(best, dict) and {"checkpoint", "step", "metric", "value"} <= set(best) else None


def _prune(root: Path, keep: int) -> None:
    """Remove the older checkpoints, never the best one (``best``): each is renamed out of the listing first,
    so a kill in the middle of its removal never leaves a half-deleted ``step_*`` folder listed."""
    best = (read_best(root) or {}).get("checkpoint")
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != best)
    for old in done[: max(0, len(done) - max(keep, 1))]:
        doomed = root / f"{PRUNED}{old.name}"
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    stale = [*root.glob(".tmp-step_*"), *root.glob(f"{REPLACED}step_*"), *root.glob(f"{PRUNED}step_*")]
    for folder in stale:  # left by a killed save or prune
        shutil.rmtree(folder, ignore_errors=True)


class CheckpointManager:
    """The run's stateful parts, saved and restored as one: the training engine (weights, optimizer,
    schedule), the batch stream's position, every rank's RNG and the step counters. ``trainer.resume``
    says where a run starts from: auto (the newest complete checkpoint), never, or a checkpoint folder."""

    def __init__(self, run_dir: Path, cfg, spec: dict, ctx, engine, stream, budget=None,
                 spec_defaults: dict | None = None):
        """``budget``: the run's optim.Budget, whose elapsed training time is saved and restored.
        ``spec_defaults``: the value each spec field has when a checkpoint does not record it (a field added
        since it was written): its default, which is the behaviour the draft had before the field existed."""
        self.run_dir, self.cfg, self.spec, self.ctx = Path(run_dir), cfg, spec, ctx
        self.engine, self.stream, self.budget = engine, stream, budget
        self.spec_defaults = spec_defaults or {}
        self.best: dict | None = None  # trainer.keep_best: the best so far (``read_best``), kept across a resume

    def resume(self, log=print) -> tuple[int, int]:
        """Restore every part from the checkpoint ``trainer.resume`` names; (step, tokens seen)."""
        cfg, ctx = self.cfg, self.ctx
        path = None
        if cfg.resume == "auto":
            path = latest_checkpoint(self.run_dir, log=log)
            if path is None and checkpoint_folders(checkpoint_root(self.run_dir)):
                raise CheckpointError(
                    f"{checkpoint_root(self.run_dir)} holds checkpoints, and none can be resumed ("
                    f"{'; '.join(unusable_checkpoints(self.run_dir))}). Nothing was trained over them. To start "
                    "anew say so: trainer.resume=never (they are kept, moved aside), or a new output_dir")
        elif cfg.resume in ("never", "none", ""):
            self._set_aside_old_checkpoints(log)
        else:
            path = Path(cfg.resume)
        if path is None:
            return 0, 0
        weights, state, saved_spec = load_checkpoint(path)
        # A key the saved spec lacks is a field added since it was written: the draft it holds behaves as the
        # field's default says (an option off, method eagle3), so only a run that differs from that differs.
        missing = object()
        saved = {**self.spec_defaults, **saved_spec}
        changed = {k: (saved.get(k), v) for k, v in self.spec.items() if saved.get(k, missing) != v}
        if changed:
            raise CheckpointError(f"checkpoint {path} does not fit this draft (saved vs now: {changed}); "
                                  "resume with the same model and draft settings, or use a new output_dir")
        self._check_vocabulary(path, weights)
        self._check_settings(path, state, log)
        self._check_trained_weights(path)
        saved_world = state.get("world_size", 1)
        self.engine.load(path, weights, ctx)
        self.stream.load_state_dict(state["data"])
        load_rng(path, ctx.rank)  # (none for a rank the writing run did not have)
        if self.budget is not None:
            self.budget.elapsed = float(state.get("elapsed_s", 0.0))  # (not recorded before trainer.max_minutes)
        self._resume_best(state["step"], log)
        log(f"[train] resumed from {path} at step {state['step']}"
            + (f" (written by {saved_world} ranks, now {ctx.world_size})" if saved_world != ctx.world_size else ""))
        return state["step"], state["tokens_seen"]

    def _resume_best(self, step: int, log) -> None:
        """The best so far, from ``checkpoints/best``: kept where it is by the same metric, at or before the
        resumed step, and its folder is there (a best from a later step, or by another metric, is dropped)."""
        best = read_best(checkpoint_root(self.run_dir))
        if best is None or self.cfg.keep_best is None:
            return
        folder = checkpoint_root(self.run_dir) / best["checkpoint"]
        if best["metric"] != self.cfg.keep_best or best["step"] > step or not folder.is_dir():
            log(f"[train] the best checkpoint {best['checkpoint']} ({best['metric']}={best['value']}) does not "
                f"carry over (trainer.keep_best={self.cfg.keep_best}, resumed at step {step}): a new best is chosen")
            return
        self.best = best
        log(f"[train] best so far: {best['checkpoint']} ({best['metric']}={best['value']:.4g})")

    def improves(self, value: float) -> bool:
        """Whether ``value`` of trainer.keep_best beats the best so far (higher is better)."""
        return self.cfg.keep_best is not None and (self.best is None or value > self.best["value"])

    def mark_best(self, folder: Path, step: int, value: float) -> None:
        """``checkpoints/best`` names ``folder`` (already saved), replaced atomically as ``latest`` is."""
        self.best = {"checkpoint": Path(folder).name, "step": step, "metric": self.cfg.keep_best,
                     "value": float(value)}
        if self.ctx.is_main:
            write_then_rename(checkpoint_root(self.run_dir) / BEST,
                              lambda tmp: tmp.write_text(json.dumps(self.best, indent=1)))

    def best_weights(self) -> dict[str, torch.Tensor] | None:
        """The best checkpoint's weights (trainer.export_best), or None where there is none."""
        if self.best is None:
            return None
        return load_checkpoint(checkpoint_root(self.run_dir) / self.best["checkpoint"])[0]

    def settings(self) -> dict:
        settings = {key: getattr(self.cfg, key) for key in (*APPLIED_ON_RESUME, *REFUSED_ON_RESUME)}
        # the precision this run trains in, not the word: auto chooses by the machine, which a resume may change
        device = next(self.engine.module.parameters()).device
        settings["precision"] = "bf16" if use_bf16(self.cfg.precision, device) else "fp32"
        return settings

    def _check_settings(self, path: Path, state: dict, log) -> None:
        """A setting changed since the checkpoint is applied from the resumed step with a notice, or refused
        (``REFUSED_ON_RESUME``): never silently ignored."""
        now = self.settings()
        # what an earlier version did not record (no settings, or no optimizer among them) is read from the state
        saved = {**settings_before_recorded(path), **dict(state.get("settings", {}))}
        if saved.get("precision") == "auto":  # (recorded as the word before: what it chose is not known)
            del saved["precision"]
        changed = {k: (v, now[k]) for k, v in saved.items() if k in now and v != now[k]}
        refused = {k: (old, new) for k, (old, new) in changed.items() if k in REFUSED_ON_RESUME}
        if refused:
            changes = "; ".join(f"trainer.{k} {old} -> {new} ({REFUSED_ON_RESUME[k]})"
                                for k, (old, new) in refused.items())
            saved_values = " ".join(f"trainer.{k}={old}" for k, (old, _) in refused.items())
            raise CheckpointError(f"checkpoint {path}: changed since it was written, and a resume cannot apply it: "
                                  f"{changes}. Resume with the saved value ({saved_values}), or start anew (a new "
                                  "output_dir, or trainer.resume=never)")
        for key, (old, new) in changed.items():
            log(f"[train] trainer.{key} changed since {path.name} ({old} -> {new}): applied from step {state['step']}")

    def _check_trained_weights(self, path: Path) -> None:
        """The weights the saved optimizer stepped must be the ones this run trains: a draft setting that freezes
        or thaws weights (draft.freeze_lm_head) since the checkpoint changes the optimizer's parameter set, whose
        saved state would not load (or would be dropped). Refused with the setting to restore."""
        saved = set(optimizer_state_kinds(path))
        now = {name for name, p in self.engine.module.named_parameters() if p.requires_grad}
        if not saved or saved == now:
            return
        changed = saved ^ now
        restore = [f"{FREEZES[name]}={str(name not in saved).lower()}" for name in sorted(changed) if name in FREEZES]
        how = (f"resume with {' '.join(restore)}" if len(restore) == len(changed) else
               "resume with the draft settings it was trained with")
        raise CheckpointError(f"checkpoint {path}: its optimizer stepped other weights than this run trains (saved "
                              f"only: {sorted(saved - now) or 'none'}; now only: {sorted(now - saved) or 'none'}): "
                              f"{how}, or start anew (a new output_dir, or trainer.resume=never)")

    def _set_aside_old_checkpoints(self, log) -> None:
        """A run told to start anew where checkpoints exist keeps them: its own saves would otherwise prune
        them as older steps (or overwrite the same step numbers)."""
        root = checkpoint_root(self.run_dir)
        earlier = bool(checkpoint_folders(root))
        self.ctx.barrier()  # (every rank has looked before the folder moves)
        if earlier and self.ctx.is_main:
            aside = root.with_name(f"{root.name}.before-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
            os.replace(root, aside)
            log(f"[train] trainer.resume=never: the earlier checkpoints are kept in {aside}")
        self.ctx.barrier()

    def _check_vocabulary(self, path: Path, weights: dict[str, torch.Tensor]) -> None:
        """The draft vocabulary comes from the data: changed data of the same size can map draft ids to other
        target tokens, and the saved lm_head rows would then train against another teacher's tokens."""
        now = self.engine.module.state_dict()
        for name in VOCAB_MAPS:
            if name in weights and name in now and not torch.equal(weights[name].cpu(), now[name].cpu()):
                raise CheckpointError(
                    f"checkpoint {path} was trained with another draft vocabulary ({name} sha256 "
                    f"{_sha(weights[name])}, this run's data gives {_sha(now[name])}): the training data changed "
                    "since. Resume with the data it was trained on, or start anew (a new output_dir, or "
                    "trainer.resume=never)")

    def save(self, step: int, tokens_seen: int) -> Path:
        state = {"data": self.stream.state_dict(), "step": step, "tokens_seen": tokens_seen,
                 "world_size": self.ctx.world_size, "engine": self.engine.kind,
                 "elapsed_s": self.budget.elapsed if self.budget is not None else 0.0, "settings": self.settings()}
        try:
            return save_checkpoint(self.run_dir, step, self.engine.full_state_dict(), state, self.spec,
                                   keep=self.cfg.keep_checkpoints, ctx=self.ctx,
                                   save_engine=lambda folder: self.engine.save(folder, self.ctx))
        except WRITE_ERRORS as e:  # (a full disk, a folder made read-only): the half-written one is never published
            shutil.rmtree(checkpoint_root(self.run_dir) / f".tmp-step_{step:08d}", ignore_errors=True)
            raise CheckpointError(f"the checkpoint of step {step} could not be written under "
                                  f"{checkpoint_root(self.run_dir)} ({write_failure(e)}); the newest complete one is "
                                  f"still {latest_checkpoint(self.run_dir) or 'none'}. Free space or make the folder "
                                  "writable, then run the same command to resume") from None
