"""The held-out evaluation during training (eval.every_steps / eval.every_minutes) and what trainer.keep_best
chooses the best checkpoint by.

It is the end-of-run held-out TTT accuracy (evaluate/heldout.py ``heldout_accuracy``, which job.py hands the loop as
``measure``) on the weights being trained, logged with the step as ``heldout/acc_<k>``,
``heldout/sim_accepted_drafts`` and ``heldout/tokens``.
Where eval.every_prompts asks, the mean acceptance length of speculative decoding on that many held-out prompts
(``acceptance``: the weights as an export holds them, decoded as the end-of-run evaluation decodes) is logged
beside it as ``heldout/acceptance_length``.
Every rank measures (a sharded draft or target needs all of them in each forward); rank 0 logs. The random
generators come back as they were, so a run with it trains exactly as one without.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

ROW = "heldout/"  # the metrics' prefix in metrics.jsonl and the tracker
SETTING = "heldout_"  # trainer.keep_best's spelling of the same metric: heldout_sim_accepted_drafts


def best_metric_key(name: str) -> str:
    """The metrics row's key of a trainer.keep_best name (heldout_acc_0 -> heldout/acc_0)."""
    return ROW + name.removeprefix(SETTING)


def keep_best_names(scored_steps: int) -> list[str]:
    """What trainer.keep_best may name for a draft whose objective scores ``scored_steps`` positions at each anchor."""
    return [f"{SETTING}sim_accepted_drafts", f"{SETTING}acceptance_length",
            *(f"{SETTING}acc_{k}" for k in range(scored_steps))]


class PeriodicEval:
    """``measure(module)`` (a ``heldout_accuracy`` result), and ``acceptance(weights)`` (a mean acceptance length)
    where given, every ``every_steps`` steps and/or ``every_minutes`` minutes (counted from the previous
    measurement, on any rank: every rank then measures)."""

    def __init__(self, measure: Callable[[torch.nn.Module], dict], every_steps: int | None = None,
                 every_minutes: float | None = None, acceptance: Callable[[dict], float] | None = None):
        self.measure, self.every_steps, self.every_minutes = measure, every_steps, every_minutes
        self.acceptance = acceptance
        self._since = time.perf_counter()

    def due(self, step: int, ctx) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.every_minutes is None:
            return False
        late = time.perf_counter() - self._since >= 60.0 * self.every_minutes
        return bool(ctx.all_reduce_sum(torch.tensor([float(late)], dtype=torch.float64)) > 0)

    def __call__(self, engine) -> dict:
        """The metrics row's held-out part (every rank calls it: ``engine.full_state_dict`` gathers a sharded
        draft); the random generators are left as they were."""
        from .checkpoint import rng_state, set_rng_state

        saved = rng_state()
        try:
            held = self.measure(engine.module)
            accepted = self.acceptance(engine.full_state_dict()) if self.acceptance is not None else None
        finally:
            set_rng_state(saved)
        self._since = time.perf_counter()
        row = {f"{ROW}acc_{k}": a for k, a in enumerate(held["acc"])}
        if accepted is not None:
            row[f"{ROW}acceptance_length"] = accepted
        return {**row, f"{ROW}sim_accepted_drafts": held["sim_accepted_drafts"], f"{ROW}tokens": held["tokens"]}
