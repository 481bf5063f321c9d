"""``LlamaEagle3Format``: the Llama-EAGLE3 layout (layout.py) as an export format, the base of the vLLM, SGLang and
speculators formats (vllm.py, sglang.py, speculators.py): its config and weight names, the aux ids as the server
reads them, P-EAGLE's mask slots (which only a format that writes them takes), and the rules every server reading
the layout shares (check.py).
"""

from __future__ import annotations

import re

import torch

from ....formats import PROVENANCE_KEY, ExportFormat
from ..spec import Eagle3Spec
from .check import check_layout
from .layout import LATER_LAYER_WEIGHTS, LAYER_WEIGHTS, LLAMA_ARCHS, llama_draft_config


class LlamaEagle3Format(ExportFormat):
    layout = "llama-eagle3"
    layer_prefix = "midlayer."  # the decoder layer's weight prefix in the written file
    serve_method = "eagle3"
    writes_mask_slots = False  # P-EAGLE's mask_token_id and mask_hidden

    def serve_options(self, config: dict) -> dict:
        """P-EAGLE's mask slots: vLLM takes parallel drafting from its speculative config, not from the folder."""
        return {"parallel_drafting": True} if config.get("parallel_drafting") else {}

    # ---- writing ----------------------------------------------------------------------------------
    def server_aux_ids(self, spec: Eagle3Spec, warn) -> list[int]:
        """Our aux ids (targets/capture.py) in the server's own convention."""
        return list(spec.aux_layer_ids)

    def refusals(self, draft) -> list[str]:
        if not self.writes_mask_slots and draft.parallel_drafting:
            return [f"draft.parallel_drafting=true: the {self.name} format has no mask slots (this version writes "
                    "P-EAGLE for vLLM only); export with export.format=vllm and serve it with speculative_config "
                    "method=eagle3, parallel_drafting=true"]
        return []

    def write_config(self, spec: Eagle3Spec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        config = llama_draft_config(spec, self.server_aux_ids(spec, warn), dtype)
        config[PROVENANCE_KEY]["format"] = self.name
        return config

    # ---- reading (the check) ----------------------------------------------------------------------
    def reads(self, config: dict) -> bool:
        return any(a in LLAMA_ARCHS for a in config.get("architectures") or [])

    def check_shared(self, layer: dict, config: dict, shapes: dict, report) -> None:
        """The rules every Llama-EAGLE3 layout shares (check.py), with this format's decoder-layer prefix."""
        check_layout(layer, config, shapes, self.layer_prefix, report)

    def read_aux_ids(self, config: dict) -> list[int] | None:
        """vLLM and speculators read the top-level ids, ours (layer inputs)."""
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        return list(ids) if ids else None

    def unknown_weights(self, shapes: dict) -> list[str]:
        layer = re.escape(self.layer_prefix) + f"(?:{LAYER_WEIGHTS})"
        known = rf"fc\.weight|norm\.weight|lm_head\.weight|d2t|t2d|embed_tokens\.weight|input_norm\.weight" \
                rf"|fc_norm\.\d+\.weight|mask_hidden|{layer}|{LATER_LAYER_WEIGHTS}"
        return [k for k in shapes if not re.fullmatch(known, k)]
