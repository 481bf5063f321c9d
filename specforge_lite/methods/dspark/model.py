"""DSpark: DFlash's block backbone, a Markov head and a confidence head, from the same capture as EAGLE3.

The backbone is methods/dflash/model.py's, with DSpark's block layout (vLLM's ``sample_from_anchor``): a block of k
slots, the committed token (the bonus token the target just chose, at position n) and k - 1 mask slots
after it, and every slot s predicts the token after its own position (n + s + 1), so one forward over k
slots proposes k tokens (DFlash spends one slot more: its anchor predicts nothing).

- The **Markov head** puts back the dependency a parallel block lacks: slot s's logits get a low-rank bias
  from the token before the one it predicts, ``markov_w2(markov_w1[token])`` (``markov_w1`` indexed by
  the target's ids, ``markov_w2`` onto the draft vocabulary). At serving time that token is the one just
  drafted, so the block is sampled left to right (``DSparkContext``); in training it is the row's own
  token, the one the target committed there.
- The **confidence head** (``proj`` over the slot's normed state and that token's Markov embedding, in
  fp32, a sigmoid) estimates the probability that the slot's token is accepted. vLLM's adaptive
  verification sizes each request's verification from it; our evaluation reports its calibration.

The loss is DSpark's (speculators 0.9's DSpark recipe): 0.1 x soft cross-entropy + 0.9 x total variation
to the teacher, both on the Markov-biased logits, plus ``confidence_weight`` x the confidence head's
binary cross-entropy against the slot's overlap with the teacher, sum_v min(p_target, p_draft) (the
probability that speculative sampling accepts its token). Slot s's terms weigh ``decay ** s``.

This is vLLM 0.32's ``Qwen3DSparkForCausalLM`` (qwen3_dspark.py; served as ``method=dspark``; exported by
export.py here). vLLM runs it in its GPU model runner only, so on CPU the export is proven by loading it
into vLLM's own class (tests/test_dspark.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits

from ...draft.objective import UnrollInputs, chunked, token_loss
from ..dflash.model import DFlashContext, DFlashDraft, DFlashObjective

CE_WEIGHT, TV_WEIGHT = 0.1, 0.9  # DSpark's token loss (speculators' DSpark recipe)


class MarkovHead(nn.Module):
    """The low-rank bias ``markov_w2(markov_w1[previous token])`` onto the draft vocabulary."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The r-wide embedding of target-vocabulary ids."""
        return self.markov_w1(token_ids)


class ConfidenceHead(nn.Module):
    """One logit per slot from [normed slot state, the Markov embedding of its previous token], in fp32 as
    vLLM computes it (its weights are fp32 there whatever the draft's dtype)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1, bias=True)

    def forward(self, state: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([state, markov_embed.to(state.dtype)], dim=-1).float()
        with torch.autocast(x.device.type, enabled=False):
            return nn.functional.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


class DSparkDraft(DFlashDraft):
    """DFlash's draft with vLLM's DSpark heads (``markov_head.markov_w1/markov_w2``, ``confidence_head.proj``)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.markov_head = MarkovHead(spec.vocab_size, spec.draft_vocab_size, spec.markov_rank)
        self.confidence_head = ConfidenceHead(spec.hidden_size + spec.markov_rank)
        with torch.no_grad():  # small: the bias starts near zero, the backbone's logits as DFlash's would be
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
            nn.init.normal_(self.markov_head.markov_w2.weight, std=0.02)
            nn.init.normal_(self.confidence_head.proj.weight, std=0.02)
            nn.init.zeros_(self.confidence_head.proj.bias)

    def slot_logits(self, state: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Markov-biased draft-vocabulary logits, the confidence logit) of slot states [N, H] (pre-norm)
        whose previous tokens are ``previous`` [N] (target ids)."""
        normed = self.norm(state)
        embed = self.markov_head.embed(previous)
        logits = self.lm_head(normed) + self.markov_head.markov_w2(embed.to(normed.dtype))
        return logits, self.confidence_head(normed, embed)


class DSparkObjective(DFlashObjective):
    """DFlash's anchors with DSpark's block (k slots, slot s predicting x[a + s + 1] from the teacher at row
    a + s, its previous token x[a + s]) and DSpark's loss (module docstring)."""

    first_scored = 0

    def __init__(self, k: int, decay: float = 0.8, loss_chunk_rows: int | None = None,
                 confidence_weight: float = 1.0, compile: bool = False):
        super().__init__(k, decay, "soft_ce", loss_chunk_rows, compile)
        self.confidence_weight = confidence_weight

    @classmethod
    def from_config(cls, draft_cfg, sequence=None) -> "DSparkObjective":
        return cls(draft_cfg.draft_tokens, draft_cfg.step_loss_decay, draft_cfg.loss_chunk_rows,
                   draft_cfg.confidence_weight, draft_cfg.compile)

    def _score_rows(self, draft, x: UnrollInputs, h, t_rows, teacher_top, weights) -> tuple[torch.Tensor, ...]:
        teacher = x.teacher_logits.flatten(0, 1)
        previous = x.input_ids.flatten()[t_rows]  # the token at the teacher's row: the one before the predicted

        def chunk(h, rows, previous, top, w):
            logits, confidence = draft.slot_logits(h, previous)
            logits = logits.float()
            target_p = torch.softmax(teacher.index_select(0, rows).float(), dim=-1)
            overlap = 1 - token_loss("tv", target_p, logits)  # sum_v min(p_target, p_draft)
            row_loss = CE_WEIGHT * token_loss("soft_ce", target_p, logits) + TV_WEIGHT * (1 - overlap)
            bce = binary_cross_entropy_with_logits(confidence, overlap.detach(), reduction="none")
            return (((row_loss + self.confidence_weight * bce) * w).sum(), row_loss.detach(),
                    logits.argmax(-1) == top)

        return chunked(chunk, (h, t_rows, previous, teacher_top, weights), self.loss_chunk_rows)


class DSparkContext(DFlashContext):
    """DSpark drafting at serving time, as vLLM's DSpark speculator runs it: one forward over the block
    [next token, k - 1 masks], then the k tokens sampled left to right, each slot's logits biased by the
    token drafted before it. ``confidences`` are the confidence head's (what adaptive verification reads)."""

    @torch.no_grad()
    def propose(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int) -> list[int]:
        draft = self.draft
        states = self.block_states(aux_new, context, next_token, k - 1)[0, :, 0]  # every slot [k, H]
        previous = torch.tensor([next_token], device=states.device)
        drafted, self.confidences = [], []
        for s in range(k):
            logits, confidence = draft.slot_logits(states[s : s + 1], previous)
            previous = draft.draft_to_target(logits.argmax(-1))
            drafted.append(int(previous))
            self.confidences.append(float(torch.sigmoid(confidence)))
        return drafted
