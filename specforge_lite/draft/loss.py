"""The EAGLE3 objective per TTT step: soft cross-entropy to the target's draft-vocabulary distribution, or
the acceptance loss (draft.loss=acceptance, -log of the expected speculative-sampling acceptance)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ttt import TTTCache, shift_left


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar, mean over valid tokens of this step
    correct: torch.Tensor  # scalar count: draft argmax == teacher argmax
    valid: torch.Tensor  # scalar count of valid tokens


@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps (what backward() sees)
    steps: list[StepStats]

    def accuracies(self) -> list[float]:
        return [float(s.correct) / max(float(s.valid), 1.0) for s in self.steps]


LOSSES = ("soft_ce", "acceptance")


def token_loss(kind: str, teacher_p: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Per-token loss [N] between the teacher's distribution and the draft's logits.

    soft_ce: -sum_v p_t(v) log p_d(v). acceptance: -log sum_v min(p_t(v), p_d(v)), the log of the
    probability that speculative sampling accepts the draft's token (1 - total variation): zero exactly
    when the two distributions agree, and it spends no effort on the teacher's tail beyond the overlap."""
    if kind == "soft_ce":
        return -(teacher_p * torch.log_softmax(draft_logits, dim=-1)).sum(-1)
    if kind == "acceptance":
        accept = torch.minimum(teacher_p, torch.softmax(draft_logits, dim=-1)).sum(-1)
        return -torch.log(accept.clamp_min(1e-6))
    raise ValueError(f"draft.loss={kind!r}: use one of {LOSSES}")


def ttt_loss(draft, aux: list[torch.Tensor], input_ids: torch.Tensor, teacher_logits: torch.Tensor,
             in_vocab: torch.Tensor, loss_mask: torch.Tensor, ttt_length: int, decay: float = 0.8,
             loss: str = "soft_ce", position_ids: torch.Tensor | None = None) -> TTTOutput:
    """Unroll the draft ``ttt_length`` steps over a batch and score every step.

    Alignment (step k, row t): input token x[t+1+k] at position t+k, hidden = fused aux state h[t] at
    k=0 and the previous step's pre-norm output after; the teacher is the target's distribution at
    position t+1+k (which predicts x[t+2+k]); the row counts only if x[t+2+k] is an assistant token
    (mask aligned with the predicted token) and the target's full-vocab argmax lies in the draft vocab.
    Each step's loss is normalised over its valid tokens; step k is weighted decay**k.

    ``position_ids`` (packed rows): positions restart at 0 where a conversation starts. The draft then
    attends only within a conversation and a row counts only if the token it predicts is in its own
    conversation, so the loss equals that of the same conversations unpacked.
    """
    B, T = input_ids.shape
    hidden = draft.project_aux(aux)
    segments = None
    if position_ids is None:
        positions = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
    else:
        positions = position_ids
        segments = (position_ids == 0).long().cumsum(-1)  # 1, 2, ... per conversation; 0 never occurs
    teacher_top = teacher_logits.argmax(-1)
    cache = TTTCache(segments)
    total = hidden.new_zeros((), dtype=torch.float32)
    steps = []
    for k in range(ttt_length):
        hidden = draft.step(shift_left(input_ids, 1 + k), hidden, positions + k, cache)
        valid = shift_left(loss_mask, 2 + k).bool() & shift_left(in_vocab, 1 + k)
        if segments is not None:
            valid &= shift_left(segments, 2 + k) == segments
        rows = valid.nonzero(as_tuple=True)
        t_rows = (rows[0], rows[1] + 1 + k)  # teacher rows for the valid positions
        n = valid.sum()
        if int(n) == 0:
            zero = total.new_zeros(())
            steps.append(StepStats(zero, zero, zero))
            continue
        logits = draft.compute_logits(hidden[rows]).float()
        target_p = torch.softmax(teacher_logits[t_rows].float(), dim=-1)
        step_loss = token_loss(loss, target_p, logits).sum() / n
        total = total + (decay ** k) * step_loss
        correct = (logits.argmax(-1) == teacher_top[t_rows]).sum()
        steps.append(StepStats(step_loss.detach(), correct.detach(), n.detach()))
    if not total.requires_grad:
        # No token to score in this micro-batch (e.g. the target's answers all fall outside the draft
        # vocabulary): a zero loss that still reaches every trainable weight, so backward() runs and,
        # under data parallelism, every rank takes part in the gradient reduction.
        total = total + sum((p * 0).sum() for p in draft.parameters() if p.requires_grad)
    return TTTOutput(total, steps)
