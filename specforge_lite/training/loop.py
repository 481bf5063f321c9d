"""The training loop: the objective (capture -> teacher -> TTT unroll) -> backward -> optimizer step, with
checkpoints and exact resume."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..data.loader import BatchStream
from ..draft.objective import Eagle3Objective
from ..targets.teacher import Teacher
from .checkpoint import latest_checkpoint, load_checkpoint, load_rng, save_checkpoint, set_rng_state
from .distributed import DistributedContext
from .engine import build_engine


@dataclass
class TrainResult:
    step: int
    last_metrics: dict = field(default_factory=dict)
    checkpoint: Path | None = None
    weights: dict = field(default_factory=dict)  # the full trained weights (gathered from ZeRO shards)


def train(cfg: TrainerConfig, objective: Eagle3Objective, teacher: Teacher, draft: torch.nn.Module,
          stream: BatchStream, run_dir: Path, tracker_factory, spec: dict, log=print,
          ctx: DistributedContext | None = None) -> TrainResult:
    """The loop every rank runs. Each rank draws its own share of every global batch (``stream``),
    metrics are summed over ranks before logging, and only rank 0 logs and writes shared files."""
    ctx = ctx or DistributedContext()
    engine = build_engine(draft, cfg, ctx)
    step, tokens_seen = 0, 0

    resume_from = None
    if cfg.resume == "auto":
        resume_from = latest_checkpoint(run_dir)
    elif cfg.resume not in ("never", "none", ""):
        resume_from = Path(cfg.resume)
    if resume_from is not None:
        weights, state, saved_spec = load_checkpoint(resume_from)
        changed = {k: (saved_spec.get(k), v) for k, v in spec.items() if saved_spec.get(k) != v}
        if changed:
            raise RuntimeError(f"checkpoint {resume_from} does not fit this draft (saved vs now: {changed}); "
                               "resume with the same model and draft settings, or use a new output_dir")
        saved_world = state.get("world_size", 1)
        if saved_world != ctx.world_size and cfg.deepspeed.enabled and cfg.deepspeed.zero_stage > 0:
            # DeepSpeed 0.19 refuses ZeRO-1/2/3 optimizer partitions from another data-parallel size, and its
            # universal-checkpoint converter does not take a plain torch optimizer's state.
            raise RuntimeError(
                f"checkpoint {resume_from} was written by {saved_world} ranks under ZeRO-{cfg.deepspeed.zero_stage} "
                f"and this run has {ctx.world_size}: partitioned optimizer state cannot be re-split on load. Resume "
                f"with {saved_world} ranks (the global batch is micro_batch_size x grad_accum_steps x ranks), or "
                "train with trainer=zero0, whose replicated state resumes on any number of ranks")
        engine.load(resume_from, weights, ctx)
        stream.load_state_dict(state["data"])
        if not load_rng(resume_from, ctx.rank) and "rng" in state:
            set_rng_state(state["rng"])  # checkpoints written before per-rank RNG files
        step, tokens_seen = state["step"], state["tokens_seen"]
        log(f"[train] resumed from {resume_from} at step {step}"
            + (f" (written by {saved_world} ranks, now {ctx.world_size})" if saved_world != ctx.world_size else ""))

    def checkpoint() -> Path:
        state = {"data": stream.state_dict(), "step": step, "tokens_seen": tokens_seen, "world_size": ctx.world_size,
                 "engine": engine.kind}
        return save_checkpoint(run_dir, step, engine.full_state_dict(), state, spec, keep=cfg.keep_checkpoints,
                               ctx=ctx, save_engine=lambda folder: engine.save(folder, ctx))

    stop_at = min(cfg.max_steps, cfg.stop_at_step) if cfg.stop_at_step is not None else cfg.max_steps
    tracker = tracker_factory(step) if ctx.is_main else None
    bar = None
    if cfg.progress_bar and step < stop_at and ctx.is_main:
        from tqdm import tqdm

        bar = tqdm(total=stop_at, initial=step, desc="train", dynamic_ncols=True)
    engine.module.train()
    metrics: dict = {}
    last_ckpt = None
    t_window, tok_window = time.perf_counter(), 0
    try:
        while step < stop_at:
            tally = objective.tally()  # summed over micro-batches here and over ranks below
            for _ in range(cfg.grad_accum_steps):
                batch = next(stream).to(teacher.device)
                out = objective(engine.forward, teacher, batch)
                engine.backward(out.loss)
                tally.add(out, batch.num_tokens, loss_divisor=cfg.grad_accum_steps)
            grad_norm = engine.step()
            ctx.all_reduce_sum(tally.sums)
            step += 1
            tokens_seen += tally.tokens
            tok_window += tally.tokens

            if ctx.is_main and (step % cfg.log_every == 0 or step == stop_at):
                elapsed = time.perf_counter() - t_window
                scores = tally.metrics(ranks=ctx.world_size)
                metrics = {"step": step, "loss": scores.pop("loss"), "lr": engine.lr, "grad_norm": grad_norm,
                           "tokens_seen": tokens_seen, "tokens_per_s": tok_window / max(elapsed, 1e-9), **scores}
                tracker.log(metrics)
                t_window, tok_window = time.perf_counter(), 0
                if bar is not None:
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc_0']:.2f}",
                                    tok_s=f"{metrics['tokens_per_s']:.0f}")
            if bar is not None:
                bar.update(1)
            if cfg.save_every > 0 and step % cfg.save_every == 0:
                last_ckpt = checkpoint()
        if last_ckpt is None or not last_ckpt.name.endswith(f"{step:08d}"):
            last_ckpt = checkpoint()
    finally:
        if bar is not None:
            bar.close()
        if tracker is not None:
            tracker.close()
    return TrainResult(step=step, last_metrics=metrics, checkpoint=last_ckpt, weights=engine.full_state_dict())
