"""The training loop: capture -> teacher -> TTT loss -> AdamW, with checkpoints and exact resume."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import DraftConfig, TrainerConfig
from ..data.loader import Batch, BatchStream
from ..draft.loss import TTTOutput, ttt_loss
from ..draft.ttt import shift_left
from ..targets.hf import HFTarget
from .checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .optim import build_optimizer, build_scheduler
from .tracking import Tracker


def autocast_for(precision: str, device: torch.device):
    """bf16 autocast where asked (``auto`` means bf16 on GPU, fp32 on CPU); master weights stay fp32."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if precision not in ("auto", "bf16", "fp32"):
        raise ValueError(f"trainer.precision={precision!r}: use auto, fp32 or bf16")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()


def batch_loss(target: HFTarget, draft, batch: Batch, draft_cfg: DraftConfig, precision: str = "fp32") -> TTTOutput:
    """One micro-batch: the frozen target's capture and teacher (in the target's own dtype), then the
    draft's TTT unroll (under the trainer's precision)."""
    captured = target.capture(batch.input_ids, batch.attention_mask)
    # The teacher at position j is scored only where x[j+1] carries loss (see ttt_loss's alignment).
    needed = shift_left(batch.loss_mask, 1).bool()
    teacher, in_vocab = target.teacher(captured.final_hidden, needed)
    with autocast_for(precision, batch.input_ids.device):
        return ttt_loss(draft, captured.aux, batch.input_ids, teacher, in_vocab, batch.loss_mask,
                        draft_cfg.ttt_length, draft_cfg.step_loss_decay)


@dataclass
class TrainResult:
    step: int
    last_metrics: dict = field(default_factory=dict)
    checkpoint: Path | None = None


def sim_accept_len(accs: list[float]) -> float:
    """Expected number of accepted draft tokens: sum over k of prod(acc_0..acc_k)."""
    total, prod = 0.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total


def train(cfg: TrainerConfig, draft_cfg: DraftConfig, target: HFTarget, draft: torch.nn.Module, stream: BatchStream,
          run_dir: Path, tracker_factory, spec: dict, log=print) -> TrainResult:
    device = target.device
    optimizer = build_optimizer(draft.parameters(), cfg)
    scheduler = build_scheduler(optimizer, cfg)
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
        missing = draft.load_state_dict(weights, strict=False)
        if missing.unexpected_keys or [k for k in missing.missing_keys if not k.startswith("embed_tokens.")]:
            raise RuntimeError(f"checkpoint {resume_from} does not fit this draft: {missing}")
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        stream.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        log(f"[train] resumed from {resume_from} at step {step}")

    def checkpoint() -> Path:
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "data": stream.state_dict(),
                 "rng": rng_state(), "step": step, "tokens_seen": tokens_seen}
        return save_checkpoint(run_dir, step, draft.trainable_state_dict(), state, spec, keep=cfg.keep_checkpoints)

    stop_at = min(cfg.max_steps, cfg.stop_at_step) if cfg.stop_at_step is not None else cfg.max_steps
    tracker = tracker_factory(step)
    bar = None
    if cfg.progress_bar and step < stop_at:
        from tqdm import tqdm

        bar = tqdm(total=stop_at, initial=step, desc="train", dynamic_ncols=True)
    draft.train()
    metrics: dict = {}
    last_ckpt = None
    t_window, tok_window = time.perf_counter(), 0
    try:
        while step < stop_at:
            step_losses, step_correct, step_valid = 0.0, None, None
            for _ in range(cfg.grad_accum_steps):
                batch = next(stream).to(device)
                out = batch_loss(target, draft, batch, draft_cfg, cfg.precision)
                (out.loss / cfg.grad_accum_steps).backward()
                step_losses += float(out.loss.detach()) / cfg.grad_accum_steps
                corr = torch.stack([s.correct for s in out.steps]).float()
                val = torch.stack([s.valid for s in out.steps]).float()
                step_correct = corr if step_correct is None else step_correct + corr
                step_valid = val if step_valid is None else step_valid + val
                tokens_seen += batch.num_tokens
                tok_window += batch.num_tokens
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad],
                                                       cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0 or step == stop_at:
                accs = (step_correct / step_valid.clamp(min=1)).tolist()
                elapsed = time.perf_counter() - t_window
                metrics = {"step": step, "loss": step_losses, "lr": scheduler.get_last_lr()[0],
                           "grad_norm": float(grad_norm), "tokens_seen": tokens_seen,
                           "tokens_per_s": tok_window / max(elapsed, 1e-9),
                           **{f"acc_{k}": a for k, a in enumerate(accs)}, "sim_accept_len": sim_accept_len(accs)}
                tracker.log(metrics)
                t_window, tok_window = time.perf_counter(), 0
                if bar is not None:
                    bar.set_postfix(loss=f"{step_losses:.3f}", acc0=f"{accs[0]:.2f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
            if bar is not None:
                bar.update(1)
            if cfg.save_every > 0 and step % cfg.save_every == 0:
                last_ckpt = checkpoint()
        if last_ckpt is None or not last_ckpt.name.endswith(f"{step:08d}"):
            last_ckpt = checkpoint()
    finally:
        if bar is not None:
            bar.close()
        tracker.close()
    return TrainResult(step=step, last_metrics=metrics, checkpoint=last_ckpt)
