"""What the training objective of every draft method shares (``DraftObjective``, which each method's objective
builds on): the target's capture and the teacher on it (which teacher positions a batch needs), the loss per token
(soft cross-entropy, or draft.loss=acceptance: -log of the expected speculative-sampling acceptance) computed in
chunks of rows, the decay over the scored steps, the metrics (accuracy per step, the simulated acceptance length)
and the step's settings a device chooses. What the draft computes over a batch and which rows each of its steps
scores is the method's own (``score_steps``): EAGLE3's training-time-test unroll (methods/eagle3/objective.py),
a block draft's slots (methods/dflash/model.py).

Adding a loss option is a branch in ``token_loss`` and a name in ``LOSSES`` (and the config's comment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import fused

if TYPE_CHECKING:  # (only named in signatures: the draft stage imports nothing of the target's at run time)
    from ..targets.teacher import Teacher

LOSSES = ("soft_ce", "acceptance", "tv")


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar, this step's loss summed over this rank's rows / valid tokens of the whole rows
    correct: torch.Tensor  # scalar count: draft argmax == teacher argmax (this rank's rows)
    valid: torch.Tensor  # scalar count of valid tokens (this rank's rows)


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # weighted sum over steps (what backward() sees)
    steps: list[StepStats]

    def accuracies(self) -> list[float]:
        return [float(s.correct) / max(float(s.valid), 1.0) for s in self.steps]


@dataclass
class UnrollInputs:
    """What the draft's steps over a batch [B, T] read: the target's aux states, the teacher's logits and
    in-vocabulary flags, the tokens and their loss mask, and (packed rows) the positions."""

    aux: list[torch.Tensor]
    input_ids: torch.Tensor
    teacher_logits: torch.Tensor
    in_vocab: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, n:] padded with zeros at the end back to x's length."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


def token_loss(kind: str, teacher_p: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Per-token loss [N] between the teacher's distribution and the draft's logits.

    soft_ce: -sum_v p_t(v) log p_d(v). acceptance: -log sum_v min(p_t(v), p_d(v)), the log of the
    probability that speculative sampling accepts the draft's token (1 - total variation): zero exactly
    when the two distributions agree, and it spends no effort on the teacher's tail beyond the overlap.
    tv: 1 - sum_v min(p_t(v), p_d(v)), that probability's complement itself (bounded: a hopeless row
    weighs no more than 1, where -log grows without bound)."""
    if kind == "soft_ce":
        return -(teacher_p * torch.log_softmax(draft_logits, dim=-1)).sum(-1)
    if kind in ("acceptance", "tv"):
        accept = torch.minimum(teacher_p, torch.softmax(draft_logits, dim=-1)).sum(-1)
        return -torch.log(accept.clamp_min(1e-6)) if kind == "acceptance" else 1 - accept
    raise ValueError(f"draft.loss={kind!r}: use one of {LOSSES}")


def sim_accepted_drafts(accs: list[float]) -> float:
    """Expected number of accepted draft tokens over every step given: sum over k of prod(acc_0..acc_k).
    Not a served acceptance length: that counts the bonus token (+1) and stops at the served k (it is
    ``1 + sim_accepted_drafts(accs[:k])``), hence the name."""
    total, prod = 0.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total


# A step's settings left null take the value of the device it runs on. On a GPU (an H200 at Llama-3.1-8B's shape:
# docs/benchmarks.md) the compiled chains were part of the fastest correct way of the step, and 4096-row loss chunks
# ran faster than 512 (each chunk adds the lm_head's whole weight gradient once more; small chunks leave the device
# underused). Elsewhere: eager chains (compiling there needs a C++ compiler), 512 rows. A method's objective adds
# its own settings (EAGLE3: its attention, methods/eagle3/objective.py).
@dataclass(frozen=True)
class DeviceDefaults:
    """The values of a step's settings left null: ``cuda``'s on a GPU, ``other``'s anywhere else."""

    cuda: dict
    other: dict

    def value(self, name: str, setting, device: torch.device):
        """``setting``, or where it is null, the value of draft.``name`` on ``device``'s kind."""
        return setting if setting is not None else (self.cuda if device.type == "cuda" else self.other)[name]

    def settings(self, draft_settings, device: torch.device) -> dict[str, tuple]:
        """Each of these settings that ``draft_settings`` has: (its value on ``device``, whether the device chose
        it)."""
        return {n: (self.value(n, getattr(draft_settings, n), device), getattr(draft_settings, n) is None)
                for n in self.other if hasattr(draft_settings, n)}

    def joined(self, cuda: dict, other: dict) -> "DeviceDefaults":
        """These with a method's own settings (said first in the run's [step] line; a method's value wins)."""
        mine = lambda own, shared: {**own, **{k: v for k, v in shared.items() if k not in own}}  # noqa: E731
        return DeviceDefaults(mine(cuda, self.cuda), mine(other, self.other))


STEP_DEFAULTS = DeviceDefaults(cuda={"compile": True, "loss_chunk_rows": 4096},
                               other={"compile": False, "loss_chunk_rows": 512})


def chunk_size(setting: int | None, rows: torch.Tensor) -> int:
    """Rows per loss chunk over ``rows`` [N, ...]: the setting, 0 for all N at once, null for the device's default."""
    return STEP_DEFAULTS.value("loss_chunk_rows", setting, rows.device) or max(rows.shape[0], 1)


def chunked(chunk, rows: tuple[torch.Tensor, ...], size: int | None) -> tuple[torch.Tensor, ...]:
    """``chunk(*rows' slices)`` -> (weighted loss, each row's loss, each row's correctness) over ``size`` rows at
    a time (``chunk_size``), each chunk checkpointed when gradients are on (its [chunk, draft_vocab] logits
    recomputed in backward, never kept for all rows); the three summed / concatenated."""
    n = rows[0].shape[0]
    size = chunk_size(size, rows[0])
    parts = []
    for s in range(0, n, size):
        part = tuple(t[s : s + size] for t in rows)
        parts.append(fused.checkpoint(chunk, *part) if torch.is_grad_enabled() else chunk(*part))
    if not parts:
        h = rows[0]
        return h.new_zeros((), dtype=torch.float32), h.new_zeros(0), h.new_zeros(0, dtype=torch.bool)
    return sum(p[0] for p in parts), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


class DraftObjective:
    """The objective of a draft method's steps over a batch: the target's capture and the teacher on it, the
    method's steps and which rows each scores (``score_steps``, in the method's subclass), the loss in chunks of
    rows, its decay over the steps and the metrics. ``scored_steps``: how many steps each proposal is scored at
    (the metrics' acc_0 .. acc_{n-1})."""

    device_defaults = STEP_DEFAULTS  # the step's settings a device chooses, where they are left null

    def __init__(self, scored_steps: int, decay: float = 0.8, loss: str = "soft_ce",
                 loss_chunk_rows: int | None = None, compile: bool | None = None):
        """``compile``, ``loss_chunk_rows`` None: the device's (``device_defaults``)."""
        if scored_steps < 1:
            raise ValueError(f"{scored_steps} scored steps: a draft's proposal is scored at one step at least")
        if loss not in LOSSES:
            raise ValueError(f"draft.loss={loss!r}: use one of {LOSSES}")
        self.scored_steps, self.decay, self.loss = scored_steps, decay, loss
        self.loss_chunk_rows = loss_chunk_rows
        self.compile = compile  # the step's elementwise chains as compiled kernels (draft/fused.py)

    @classmethod
    def from_config(cls, draft_cfg, sequence=None) -> "DraftObjective":
        """The method's objective from its draft settings; ``sequence``: this rank's share of every row under
        sequence parallelism (draft/sequence_parallel.py), for a method that trains on a share of a row."""
        raise NotImplementedError(f"{cls.__name__} is built by its method's subclass")

    def __call__(self, draft_forward, teacher: Teacher, batch) -> ObjectiveOutput:
        """One micro-batch: the frozen target's capture and the teacher on it (in the target's own dtype),
        then the draft's steps through ``draft_forward`` (the draft module, or a training engine's
        forward, so that the engine wraps exactly what is trained)."""
        packed = {} if batch.position_ids is None else {"position_ids": batch.position_ids}
        captured = teacher.target.capture(batch.input_ids, batch.attention_mask, **packed, **batch.inputs)
        logits, in_vocab = teacher(captured, self.teacher_positions(batch.loss_mask))
        inputs = UnrollInputs(captured.aux, batch.input_ids, logits, in_vocab, batch.loss_mask, batch.position_ids)
        return draft_forward(inputs, self)

    @staticmethod
    def teacher_positions(loss_mask: torch.Tensor) -> torch.Tensor:
        """Where the teacher is read: position j, where x[j+1] carries loss (the teacher at j predicts x[j+1]; every
        method scores its steps against those positions)."""
        return shift_left(loss_mask, 1).bool()

    def unroll(self, draft, x: UnrollInputs) -> ObjectiveOutput:
        """The draft's steps over a batch, each scored (``score_steps``), the elementwise chains compiled where
        ``compile`` says."""
        # (training steps only: an evaluation under no_grad would compile graphs of its own for a few batches)
        compile = self.device_defaults.value("compile", self.compile, x.input_ids.device)
        with fused.compiled(compile and torch.is_grad_enabled()):
            return self.score_steps(draft, x)

    def score_steps(self, draft, x: UnrollInputs) -> ObjectiveOutput:
        """The method's own pass over a batch: the draft's steps, which rows each scores against which teacher row,
        and their weights; the rows of every step scored at once by ``_scored`` and summed up by ``_output``."""
        raise NotImplementedError(f"{type(self).__name__} does not say how its draft's steps are scored")

    def _scored(self, draft, hidden: torch.Tensor, teacher_logits: torch.Tensor, teacher_rows: torch.Tensor,
                teacher_top: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(weighted loss total, each row's loss, each row's draft argmax == teacher's) for the pre-norm rows
        [N, H] of all steps against their rows of the flattened teacher logits [B * T, Vd], in chunks of
        ``loss_chunk_rows`` rows whose [chunk, draft_vocab] logits are never kept for all N: soft_ce through
        the fused lm_head + loss (draft/head_loss.py), the other losses in checkpointed chunks (recomputed
        in backward)."""
        size = chunk_size(self.loss_chunk_rows, hidden)
        if self.loss == "soft_ce":
            return draft.soft_cross_entropy(hidden, teacher_logits, teacher_rows, teacher_top, weights, size)

        def chunk(h, rows, top, w):
            logits = draft.compute_logits(h).float()
            target_p = torch.softmax(teacher_logits.index_select(0, rows).float(), dim=-1)
            row_loss = token_loss(self.loss, target_p, logits)
            return (row_loss * w).sum(), row_loss.detach(), logits.argmax(-1) == top

        return chunked(chunk, (hidden, teacher_rows, teacher_top, weights), size)

    def _output(self, draft, total: torch.Tensor, row_loss: torch.Tensor, row_correct: torch.Tensor,
                counts: list[tuple[torch.Tensor, torch.Tensor]], sizes: list[int]) -> ObjectiveOutput:
        """The loss and each step's stats from the scored rows of every step, step after step (``sizes``: each
        step's number of rows; ``counts``: each step's normaliser and its valid tokens, which differ where a rank
        scores a share of the rows)."""
        steps, start = [], 0
        for (n, valid), size in zip(counts, sizes):
            end = start + size
            steps.append(StepStats(row_loss[start:end].sum() / n.clamp(min=1), row_correct[start:end].sum(), valid))
            start = end
        if not sum(sizes):
            # No token to score in this micro-batch (e.g. the target's answers all fall outside the draft
            # vocabulary): a zero loss that still reaches every trainable weight, so backward() runs and,
            # under data parallelism, every rank takes part in the gradient reduction.
            total = total.detach() + sum((p * 0).sum() for p in draft.parameters() if p.requires_grad)
        return ObjectiveOutput(total, steps)

    # ---- metrics ------------------------------------------------------------------------------
    def tally(self) -> "Tally":
        return Tally(self.scored_steps)


class Tally:
    """Sums over micro-batches (and, by the caller's all-reduce of ``sums``, over ranks):
    [loss, tokens, correct per step..., valid per step...]."""

    def __init__(self, steps: int):
        self.k = steps
        self.sums = torch.zeros(2 + 2 * steps, dtype=torch.float64)

    def add(self, out: ObjectiveOutput, tokens: int = 0, loss_divisor: int = 1) -> None:
        self.sums[0] += float(out.loss.detach()) / loss_divisor
        self.sums[1] += tokens
        self.sums[2 : 2 + self.k] += torch.stack([s.correct for s in out.steps]).double().cpu()
        self.sums[2 + self.k :] += torch.stack([s.valid for s in out.steps]).double().cpu()

    @property
    def tokens(self) -> int:
        return int(self.sums[1])

    @property
    def scored(self) -> int:
        """Tokens scored at the first step."""
        return int(self.sums[2 + self.k])

    def accuracies(self) -> list[float]:
        return (self.sums[2 : 2 + self.k] / self.sums[2 + self.k :].clamp(min=1)).tolist()

    def metrics(self, ranks: int = 1) -> dict:
        """The logged figures: mean loss per rank, accuracy per step, simulated acceptance length."""
        accs = self.accuracies()
        return {"loss": float(self.sums[0]) / ranks, **{f"acc_{i}": a for i, a in enumerate(accs)},
                "sim_accepted_drafts": sim_accepted_drafts(accs)}
