"""Hybrid linear attention: Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5_text``, ``qwen3_5``,
``qwen3_5_moe``).

Most layers are Gated DeltaNet (a recurrent state carried along the sequence), one in four full
attention. A recurrent state has no attention mask: a pad token or another sample placed *before* a
sample's tokens in the same row would flow into that sample's states. Right padding is safe (pads come
after every real token and never influence it), so capture checks that each row is right-padded and
refuses anything else; packing several samples into one row is never done for this family.
The lean backend has no forward for these: ``target.backend=lean`` runs the HF modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import TargetFamily


class HybridLinearAttentionFamily(TargetFamily):
    name = "qwen3_next"
    needs_right_padding = True
    # A recurrent state follows one sequence: it cannot hold a tree's branches or restart inside a row.
    supports_tree_mask = False
    supports_packing = False

    def run_decoder(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        self.check_padding(attention_mask)
        if position_ids is not None:
            raise ValueError("qwen3_next/qwen3_5 targets cannot take packed rows (recurrent layers); use "
                             "data.packing=false")
        return super().run_decoder(model, input_ids, attention_mask, **inputs)
