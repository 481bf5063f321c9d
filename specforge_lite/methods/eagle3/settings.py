"""EAGLE3's settings (draft=eagle3, the default): the shared ones (config.py ``DraftSettings``) and its options,
the training-time-test unroll's depth, EAGLE 3.1's norms, P-EAGLE's mask slots, a warm start from the target's
layers and the unroll's attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ...config import DraftSettings, TokenLoss


@dataclass
class Eagle3Settings(DraftSettings):
    ranges: ClassVar[dict[str, str]] = {"ttt_length": "[1, inf)"}
    former_defaults: ClassVar[dict[str, tuple]] = {"ttt_attention": ("blockwise",)}  # (before the device chose it)
    method: str = "eagle3"
    # Training-time-test unroll steps: step k is fed the draft's own output of step k - 1 (the EAGLE3 paper's 7,
    # SpecForge's and speculators' default); served at any k
    ttt_length: int = 7
    use_aux_norm: bool = False  # one RMSNorm per aux state before fc (exported as fc_norm)
    # EAGLE 3.1 (speculators 0.9's defaults, served by vLLM 0.32): one RMSNorm over the concatenated aux
    # states before fc (exclusive with use_aux_norm). Null: on unless use_aux_norm is (EAGLE 3.1 won every
    # comparison of docs/levers.md).
    norm_before_fc: Optional[bool] = None
    norm_output: Optional[bool] = None  # EAGLE 3.1: the next unroll step is fed the draft's normed output
    # The first layer's residual taken after hidden_norm instead of before (speculators' default; vLLM and
    # speculators read it, SGLang always takes it before: the sglang export refuses such a draft)
    norm_before_residual: bool = False
    # P-EAGLE (methods/eagle3/parallel.py): all k draft tokens in one forward, the later ones from mask slots (vLLM:
    # method=eagle3, parallel_drafting=true), which embed draft.mask_token_id.
    parallel_drafting: bool = False
    # soft_ce: cross-entropy to the teacher's draft-vocabulary distribution (EAGLE3). acceptance: -log of
    # the expected acceptance sum_v min(p_target(v), p_draft(v)), what speculative sampling accepts (LK).
    # tv: the total variation 1 - sum_v min(p_target(v), p_draft(v)).
    loss: TokenLoss = TokenLoss.soft_ce
    # Warm start: the draft's layers begin as the target's layers after the top aux id (attention, MLP, norms;
    # the embedding half of the first layer's input zero), fc passing the top aux state through, the target's
    # final norm. Llama-layout targets only (the draft's layer is a Llama layer).
    init_layers_from_target: bool = False
    # Long rows: blockwise holds no [T, T] scores (memory linear in T); flex is the same through one compiled
    # flex-attention kernel (CUDA only); dense (every [T, T] score held) and sdpa (one SDPA call over every
    # step's keys with an explicit mask) are the references whose memory grows with T squared. Null: the
    # device's fastest correct way (objective.py device_defaults): flex on a GPU, blockwise elsewhere.
    ttt_attention: Optional[str] = None
    # Recompute each TTT step's draft layer in backward instead of keeping its activations.
    checkpointing: bool = False
