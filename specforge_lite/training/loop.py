"""The training loop: the objective (capture -> teacher -> TTT unroll) -> backward -> optimizer step, with
checkpoints and exact resume."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import TrainerConfig
from ..data.loader import BatchStream
from ..draft.objective import DraftObjective
from ..errors import UserError
from ..targets.teacher import Teacher
from .checkpoint import CheckpointManager
from .distributed import DistributedContext
from .engine import build_engine
from .optim import Budget
from .periodic import PeriodicEval, best_metric_key


# steps in a row that may score no token before the run stops: one such batch happens (a batch of short
# answers, all outside the draft vocabulary); many in a row mean nothing is learned at all
UNSCORED_STEPS_LIMIT = 5


class NothingScored(UserError):
    """Training steps in a row whose batches held no position the loss counts."""


class Interrupted(UserError):
    """SIGTERM or SIGINT ended training early, after a resumable checkpoint of the last finished step."""


class StopRequests:
    """SIGTERM and SIGINT ask the loop to stop after the step under way and save it, not to die in the middle
    of a write; a second SIGINT stops at once. Handled from construction to ``restore``, in the main thread
    only (where Python delivers signals)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous = ({s: signal.signal(s, self._ask) for s in self.SIGNALS}
                          if threading.current_thread() is threading.main_thread() else {})

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _ask(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def asked(self, ctx: DistributedContext) -> bool:
        """Whether any rank was asked to stop: every rank then stops after the same step."""
        if not ctx.enabled:
            return self.received is not None
        return float(ctx.all_reduce_sum(torch.tensor([float(self.received is not None)]))) > 0


def spec_field_defaults(spec) -> dict:
    """Each field default of a draft's spec dataclass (what a checkpoint written before the field existed means)."""
    import dataclasses

    if not dataclasses.is_dataclass(spec):
        return {}
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(spec)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def check_scored(step: int, scored: int, unscored: int, log) -> int:
    """The count of steps in a row that scored nothing, after this one; loud when it is not 0."""
    if scored:
        return 0
    unscored += 1
    why = ("no position of the batch has both a loss-mask 1 and a target token inside the draft vocabulary, so the "
           "loss, gradients and accuracies are 0 and nothing trains. Check the data's assistant turns (the loss "
           "mask) and raise draft.draft_vocab_size (a random or tiny target's argmax can lie outside it)")
    if unscored >= UNSCORED_STEPS_LIMIT:
        raise NothingScored(f"{unscored} training steps in a row scored no token (up to step {step}): {why}")
    log(f"[train] warning: step {step} scored no token: {why}")
    return unscored


def time_to_save(cfg: TrainerConfig, saved_at: float, ctx: DistributedContext) -> bool:
    """Whether trainer.save_every_minutes have passed since the last checkpoint, on any rank (every rank then
    saves: a ZeRO checkpoint is written by all of them)."""
    if cfg.save_every_minutes is None:
        return False
    due = time.perf_counter() - saved_at >= 60.0 * cfg.save_every_minutes
    return bool(ctx.all_reduce_sum(torch.tensor([float(due)], dtype=torch.float64)) > 0)


@dataclass
class TrainResult:
    step: int
    finished: bool = True  # False when trainer.stop_at_step ended it before the run's end
    last_metrics: dict = field(default_factory=dict)
    checkpoint: Path | None = None
    weights: dict = field(default_factory=dict)  # the full trained weights (gathered from ZeRO shards)
    best: dict | None = None  # trainer.keep_best: checkpoints/best (checkpoint, step, metric, value)


def train(cfg: TrainerConfig, objective: DraftObjective, teacher: Teacher, draft: torch.nn.Module,
          stream: BatchStream, run_dir: Path, tracker_factory, spec: dict, log=print,
          ctx: DistributedContext | None = None, steps_per_epoch: float | None = None,
          periodic: PeriodicEval | None = None) -> TrainResult:
    """The loop every rank runs. Each rank draws its own share of every global batch (``stream``),
    metrics are summed over ranks before logging, and only rank 0 logs and writes shared files.
    ``steps_per_epoch``: optimizer steps per pass over the training data, for the metrics' epoch count.
    ``periodic``: the held-out evaluation during training (eval.every_steps / every_minutes), whose row joins
    that step's metrics and chooses the best checkpoint (trainer.keep_best)."""
    ctx = ctx or DistributedContext()
    budget = Budget(cfg)
    engine = build_engine(draft, cfg, ctx, budget)
    checkpoints = CheckpointManager(run_dir, cfg, spec, ctx, engine=engine, stream=stream, budget=budget,
                                    spec_defaults=spec_field_defaults(getattr(draft, "spec", None)))
    step, tokens_seen = checkpoints.resume(log)
    started = time.perf_counter() - budget.elapsed
    # The time budget's clock starts after this process's first step: that step's one-off costs (kernels' first
    # calls, the first batch) are no pace, and a run whose steps fit the budget stays independent of timing.
    budget_clock = None

    stop_at = min(cfg.max_steps, cfg.stop_at_step) if cfg.stop_at_step is not None else cfg.max_steps
    tracker = tracker_factory(step) if ctx.is_main else None
    bar = None
    if cfg.progress_bar and step < stop_at and ctx.is_main:
        from tqdm import tqdm

        bar = tqdm(total=stop_at, initial=step, desc="train", dynamic_ncols=True)
    engine.module.train()
    metrics: dict = {}
    last_ckpt = None
    unscored = 0
    t_window, tok_window = time.perf_counter(), 0
    saved_at = time.perf_counter()  # (trainer.save_every_minutes counts from the last checkpoint)
    stop = StopRequests()
    try:
        while step < stop_at and not budget.spent(step) and not stop.asked(ctx):
            tally = objective.tally()  # summed over micro-batches here and over ranks below
            for _ in range(cfg.grad_accum_steps):
                batch = next(stream).to(teacher.device)
                out = objective(engine.forward, teacher, batch)
                engine.backward(out.loss)
                # a row shared by a sequence-parallel group counts its tokens once
                tally.add(out, batch.num_tokens if ctx.sp_rank == 0 else 0, loss_divisor=cfg.grad_accum_steps)
            grad_norm = engine.step()
            ctx.all_reduce_sum(tally.sums)
            step += 1
            if budget.seconds is not None:  # every rank stops at the same step and schedules the same lr
                now = time.perf_counter()
                budget_clock = budget_clock if budget_clock is not None else now - budget.elapsed
                budget.elapsed = float(ctx.all_reduce_sum(torch.tensor([now - budget_clock],
                                                                      dtype=torch.float64))) / ctx.world_size
            unscored = check_scored(step, tally.scored, unscored, log)
            tokens_seen += tally.tokens
            tok_window += tally.tokens
            held = periodic(engine) if periodic is not None and periodic.due(step, ctx) else {}

            if ctx.is_main and (step % cfg.log_every == 0 or step == stop_at or budget.spent(step) or held):
                elapsed = time.perf_counter() - t_window
                scores = tally.metrics(ranks=ctx.data_world_size)
                metrics = {"step": step, "loss": scores.pop("loss"), **engine.lrs, "grad_norm": grad_norm,
                           "tokens_seen": tokens_seen, "tokens_per_s": tok_window / max(elapsed, 1e-9),
                           "elapsed_s": time.perf_counter() - started, **scores, **held}
                if steps_per_epoch:
                    metrics["epoch"] = step / steps_per_epoch
                tracker.log(metrics)
                t_window, tok_window = time.perf_counter(), 0
                if bar is not None:
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc0=f"{metrics['acc_0']:.2f}",
                                    tok_s=f"{metrics['tokens_per_s']:.0f}")
            if bar is not None:
                bar.update(1)
            # (decided by rank 0's measurement: every rank then saves)
            best = held.get(best_metric_key(cfg.keep_best)) if held and cfg.keep_best else None
            improved = ctx.all_reduce_sum(torch.tensor([float(best is not None and ctx.is_main
                                                              and checkpoints.improves(best))])) > 0 if held else False
            if (cfg.save_every > 0 and step % cfg.save_every == 0) or time_to_save(cfg, saved_at, ctx) or improved:
                last_ckpt = checkpoints.save(step, tokens_seen)
                saved_at = time.perf_counter()
            if improved:
                checkpoints.mark_best(last_ckpt, step, best)
        if last_ckpt is None or not last_ckpt.name.endswith(f"{step:08d}"):
            last_ckpt = checkpoints.save(step, tokens_seen)
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        if tracker is not None:
            tracker.close()
    if step < stop_at and not budget.spent(step):  # (the loop ended on a stop signal, after saving)
        raise Interrupted(f"stopped by {stop.received or 'a stop signal to another rank'} at step {step}; the "
                          f"checkpoint {last_ckpt} holds it, and the same command resumes from there")
    if budget.seconds is not None and budget.spent(step) and step < cfg.max_steps:
        log(f"[train] time budget of {cfg.max_minutes} min spent at step {step} (trainer.max_minutes)")
    weights = engine.full_state_dict()
    if cfg.export_best and checkpoints.best is not None:
        weights = checkpoints.best_weights()
        log(f"[train] final/ is the best checkpoint {checkpoints.best['checkpoint']} ({cfg.keep_best}="
            f"{checkpoints.best['value']:.4g}), not the last step's (trainer.export_best)")
    return TrainResult(step=step, finished=step >= cfg.max_steps or budget.spent(step), last_metrics=metrics,
                       checkpoint=last_ckpt, weights=weights, best=checkpoints.best)
