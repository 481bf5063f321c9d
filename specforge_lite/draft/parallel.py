"""P-EAGLE (parallel drafting): an EAGLE3 draft that proposes all k tokens in one forward.

A plain EAGLE3 draft runs k forwards per round, each fed the token it just proposed and its own output
state. A parallel draft runs one: the committed token's slot (the target's aux states, as in EAGLE3) and
k - 1 mask slots after it, each fed a fixed token (``mask_token_id``) and a learned state (``mask_hidden``:
one vector as wide as the concatenated aux states, fused through the same norms and ``fc``), attending
causally to the context and to the slots before it. vLLM 0.32 serves it as ``method=eagle3`` with
``parallel_drafting=true`` (its ``llm_base_proposer``: the mask slots' state is
``combine_hidden_states(mask_hidden)``, the token id read from the config's ``mask_token_id``).

The key pattern is exactly TTT's (draft/ttt.py): slot d after row t sits at position t + d and sees the
step-0 keys of rows <= t and the keys of slots 1..d of its own row. So the same unroll trains it; only what
step k >= 1 reads changes (``mask_slot_inputs``), which is what this module holds.
"""

from __future__ import annotations

import torch
from torch import nn

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
