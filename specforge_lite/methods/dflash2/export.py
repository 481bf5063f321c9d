"""vLLM's DFlash 2 layout (``DFlash2DraftModel``, served with ``method=dflash``; vLLM's qwen3_dflash2.py).

DFlash's layout (methods/dflash/export.py) under its own architecture, the convolutions' and the selector's sizes in
``dflash_config`` (``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``), and their
weights: ``layers.{i}.attention_conv`` / ``mlp_conv`` (``base_kernel`` [2, taps, H], ``kernel_projection``) and
``candidate_selector`` (``predecessor_codebook`` and ``successor_codebook`` [V, rank], ``hidden_projection``).
"""

from __future__ import annotations

import torch

from ..dflash.export import DFlashFormat, expect_shapes, v2_runner_only
from .spec import DFlash2Spec

SIZES = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlash2Format(DFlashFormat):
    name, server, layout = "dflash2", "vLLM (method=dflash, DFlash2DraftModel)", "dflash2"
    arch = "DFlash2DraftModel"
    extra_weights = (r"layers\.\d+\.(?:attention|mlp)_conv\.(?:base_kernel|kernel_projection\.weight)"
                     r"|candidate_selector\.(?:predecessor_codebook|successor_codebook|hidden_projection\.weight)")
    cpu_serving_refusal = v2_runner_only("DFlash2DraftModel",
                                         "Model Runner V1 does not support: DFlash candidate-head drafts")

    def write_config(self, spec: DFlash2Spec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        config = super().write_config(spec, dtype, verifier, num_speculative_tokens, warn)
        config["dflash_config"].update({key: getattr(spec, key) for key in SIZES})
        return config

    def check_extra(self, config: dict, shapes: dict, report) -> None:
        dflash = config.get("dflash_config") or {}
        missing = [key for key in SIZES if not isinstance(dflash.get(key), int) or dflash[key] < 1]
        if missing:
            report.errors.append(f"dflash_config lacks {missing}: vLLM builds the convolutions and the selector "
                                 "from them")
            return
        H, V = config.get("hidden_size"), config.get("vocab_size")
        if config.get("draft_vocab_size") not in (None, V):
            report.errors.append(f"draft_vocab_size {config['draft_vocab_size']} < vocab_size {V}: vLLM's DFlash 2 "
                                 "selector indexes its codebooks with the draft's token ids, so it needs the whole "
                                 "vocabulary")
        taps, groups, rank = dflash["conv_kernel_size"], H // dflash["conv_group_size"], dflash["selector_rank"]
        expected = {"candidate_selector.predecessor_codebook": (V, rank),
                    "candidate_selector.successor_codebook": (V, rank),
                    "candidate_selector.hidden_projection.weight": (rank, H)}
        for i in range(config.get("num_hidden_layers") or 1):
            for conv in ("attention_conv", "mlp_conv"):
                expected[f"layers.{i}.{conv}.base_kernel"] = (2, taps, H)
                expected[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, H)
        expect_shapes(expected, shapes, report)
        if "vLLM" in report.servers:
            report.servers["vLLM"] += (f", DFlash 2: {taps}-tap convolutions, selector rank {rank} over the top "
                                       f"{dflash['selector_top_k']}")
