"""``ExportFormat``: what a server format is, as one class per server: how it writes an export (ids in its
convention, which vocabulary maps, weight names, config layout) and how that server reads a folder (its
checks for ``python -m specforge_lite.export --check``). The defaults are the Llama-EAGLE3 layout's
(layout.py, check.py). Each format class lives in its method's folder (methods/<name>/export) and comes with
the method's registration (``DraftMethod.export_formats``); export/ gathers them by name.
"""

from __future__ import annotations

import re

import torch

from ..draft.model import DraftSpec
from .check import check_layout
from .layout import LATER_LAYER_WEIGHTS, LAYER_WEIGHTS, PROVENANCE_KEY, llama_draft_config

LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class ExportRefused(ValueError):
    """A draft this format cannot express, with the fix."""


class ExportFormat:
    name = ""  # export.format=<name>
    server = ""  # who reads it, as the check's report names it
    layout = "llama-eagle3"  # the config layout: several servers may read one
    layer_prefix = "midlayer."  # the decoder layer's weight prefix in the written file
    serve_method = "eagle3"  # vLLM's speculative_config method for a folder of this layout
    serve_options: dict = {}  # and what else vLLM's speculative_config should say for it
    writes_mask_slots = False  # a draft's mask slots: P-EAGLE's mask_token_id and mask_hidden, a block draft's token
    # why vLLM's CPU build (scripts/setup_serving.sh) cannot serve this layout, when it cannot: the served check
    # and the ranking then say so and use our own evaluation
    cpu_serving_refusal: str | None = None

    # ---- writing ----------------------------------------------------------------------------------
    def server_aux_ids(self, spec: DraftSpec, warn) -> list[int]:
        """Our aux ids (targets/capture.py) in the server's own convention."""
        return list(spec.aux_layer_ids)

    def with_vocab_maps(self, spec: DraftSpec) -> bool:
        """Whether d2t/t2d are written (by default only for a reduced draft vocabulary)."""
        return spec.draft_vocab_size != spec.vocab_size

    def refusals(self, draft) -> list[str]:
        """What this format cannot express of a draft of its method, each with the fix: asked of the trained
        draft's spec at export, and of the method's settings (the same field names) before training (settings.py).
        Whether the format writes the draft's method at all is asked first, by export/ (``export_refusals``)."""
        if not self.writes_mask_slots and draft.parallel_drafting:  # (an EAGLE3 layout: its option)
            return [f"draft.parallel_drafting=true: the {self.name} format has no mask slots (this version writes "
                    "P-EAGLE for vLLM only); export with export.format=vllm and serve it with speculative_config "
                    "method=eagle3, parallel_drafting=true"]
        return []

    def write_config(self, spec: DraftSpec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        """The config.json of a draft this format writes (its refusals already asked by export/)."""
        config = llama_draft_config(spec, self.server_aux_ids(spec, warn), dtype)
        config[PROVENANCE_KEY]["format"] = self.name
        return config

    def weight_name(self, ours: str) -> str:
        return ours

    def our_weight_name(self, theirs: str) -> str:
        return theirs

    # ---- reading (the check) ----------------------------------------------------------------------
    def reads(self, config: dict) -> bool:
        """Whether this server's loader takes a folder with this config.json."""
        return any(a in LLAMA_ARCHS for a in config.get("architectures") or [])

    def layer_config(self, config: dict, report) -> dict | None:
        """The decoder layer's fields (the flat config, or a nested block); None after reporting why not."""
        return config

    def check_shared(self, layer: dict, config: dict, shapes: dict, report) -> None:
        """The rules every Llama-draft layout shares (check.py), with this format's decoder-layer prefix."""
        check_layout(layer, config, shapes, self.layer_prefix, report)

    def check(self, config: dict, shapes: dict, report) -> None:
        """This server's own reading rules, beyond the layout's shared ones (check.py)."""

    def fixed_draft_tokens(self, config: dict) -> int | None:
        """The one k a folder of this layout can be served at (a block draft's), or None: any k."""
        return None

    def read_aux_ids(self, config: dict) -> list[int] | None:
        """The aux ids this server captures when it loads the folder, in OUR convention (targets/capture.py:
        id i = the input of layer i); None when the config names none. vLLM and speculators read ours."""
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        return list(ids) if ids else None

    def unknown_weights(self, shapes: dict) -> list[str]:
        layer = re.escape(self.layer_prefix) + f"(?:{LAYER_WEIGHTS})"
        known = rf"fc\.weight|norm\.weight|lm_head\.weight|d2t|t2d|embed_tokens\.weight|input_norm\.weight" \
                rf"|fc_norm\.\d+\.weight|mask_hidden|{layer}|{LATER_LAYER_WEIGHTS}"
        return [k for k in shapes if not re.fullmatch(known, k)]

    # ---- reading a folder another trainer wrote (a method's ``published_formats``) -----------------------
    published_as = ""  # such a folder's layout, as a one-line refusal names it

    def published_aux_ids(self, config: dict) -> list[int] | None:
        """The aux ids a folder another trainer wrote in this layout was trained on, in OUR convention: the ones the
        server the folder was written for captures (by default this format's reading); None when it names none (the
        servers' defaults). A ValueError (one line, with the fix) when the folder cannot tell."""
        return self.read_aux_ids(config)

    def read_published(self, folder, config: dict, tensors: dict) -> tuple[DraftSpec, dict]:
        """(spec, weights under our names) of a folder another trainer wrote in this layout (``tensors``: its
        safetensors), without our provenance block."""
        raise NotImplementedError(f"the {self.name} format reads no folder another trainer wrote")

