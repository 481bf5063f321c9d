"""P-EAGLE (parallel drafting): an EAGLE3 draft that proposes all k tokens in one forward.

A plain EAGLE3 draft runs k forwards per round, each fed the token it just proposed and its own output
state. A parallel draft runs one: the committed token's slot (the target's aux states, as in EAGLE3) and
k - 1 mask slots after it, each fed a fixed token (``mask_token_id``) and a learned state (``mask_hidden``:
one vector as wide as the concatenated aux states, fused through the same norms and ``fc``), attending
causally to the context and to the slots before it. vLLM 0.32 serves it as ``method=eagle3`` with
``parallel_drafting=true`` (its ``llm_base_proposer``: the mask slots' state is
``combine_hidden_states(mask_hidden)``, the token id read from the config's ``mask_token_id``).

The key pattern is exactly TTT's (ttt.py): slot d after row t sits at position t + d and sees the
step-0 keys of rows <= t and the keys of slots 1..d of its own row. So the same unroll trains it; only what
step k >= 1 reads changes (``mask_slot_inputs``), which is what this module holds, with the drafting that
serves it (``ParallelDraftContext``: one forward per round).
"""

from __future__ import annotations

import torch
from torch import nn

from ...draft.drafting import greedy_with_confidence
from .drafting import DraftContext
from .ttt import TTTCache

# Scale of mask_hidden at initialisation: unit-scale like the residual stream it stands in for (a zero
# vector would make the fused state's RMSNorm divide by ~sqrt(eps)).
_MASK_HIDDEN_STD = 1.0


def new_mask_hidden(fc_input_size: int) -> nn.Parameter:
    """The learned state of every mask slot, [1, n_aux * target_hidden] (vLLM's buffer shape)."""
    return nn.Parameter(torch.randn(1, fc_input_size) * _MASK_HIDDEN_STD)


def mask_slot_inputs(draft, input_ids: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a mask slot reads in place of (the next token, the previous step's state): the mask token at
    every row, and ``mask_hidden`` through the aux fusion (norms, fc), broadcast to the rows."""
    spec = draft.spec
    parts = draft.mask_hidden.split(spec.target_hidden_size, dim=-1)  # one chunk per aux state, as vLLM splits it
    fused = draft.project_aux([p.to(state.dtype) for p in parts]).to(state.dtype)  # [1, H]
    return torch.full_like(input_ids, spec.mask_token_id), fused.expand(*state.shape[:-1], fused.shape[-1])


class ParallelDraftContext(DraftContext):
    """P-EAGLE drafting as vLLM runs it (``parallel_drafting=true``): ONE draft forward per round, over the
    rows committed since the last round followed by k - 1 mask slots, causal over all of them. Mask slot d
    sits at position n - 1 + d and sees the step-0 keys of every committed row and the slots before it:
    exactly the keys unroll step d at row n - 1 sees (ttt.py), so the proposals equal the k-step
    ``draft_chain``'s. Only the committed rows' keys are kept for the next round."""

    one_forward = True

    def propose(self, aux_new: list[torch.Tensor], context: list[int], next_token: int, k: int) -> list[int]:
        (first, n), draft, device = self.new_rows(aux_new, context), self.draft, aux_new[0].device
        rows = draft.project_aux(aux_new)
        mask_ids, mask_states = draft.next_step_inputs(torch.zeros(1, k - 1, dtype=torch.long, device=device),
                                                       rows.new_zeros(1, k - 1, rows.shape[-1]))
        ids = torch.cat([torch.tensor([(context + [next_token])[first + 1:]], device=device), mask_ids], dim=1)
        cache = TTTCache(context=self.kept)
        states = draft.step(ids, torch.cat([rows, mask_states.to(rows.dtype)], dim=1),
                            torch.arange(first, n + k - 1, device=device)[None], cache, q_offset=first)
        self.kept, self.rows = [(k_[..., :n, :], v_[..., :n, :]) for k_, v_ in cache.context_kv()], n
        logits = draft.compute_logits(states[:, n - first - 1:])  # row n-1, then the k-1 mask slots
        best, self.confidences = greedy_with_confidence(logits[0])
        return draft.draft_to_target(best).tolist()
