"""vLLM's DSpark layout (``DSparkDraftModel`` with ``model_type`` qwen3, which vLLM maps to its
``Qwen3DSparkModel``; served with ``method=dspark``; vLLM's qwen3_dspark.py).

DFlash's layout (methods/dflash/export.py: ``dflash_config`` with the mask token and the aux ids as layer outputs)
plus the DSpark heads and the fields vLLM reads for them: ``markov_rank`` and ``markov_head_type`` (vanilla),
``enable_confidence_head`` with ``confidence_head_with_markov`` (the head reads the slot state and the Markov
embedding), and ``block_size`` = k with ``sample_from_anchor`` (the next token's slot is the first
prediction, k - 1 mask slots after it). Without ``enable_confidence_head`` vLLM drops the head's weights and
adaptive verification falls back to its own estimate, so it is always written.
"""

from __future__ import annotations

import torch

from ..dflash.export import DFlashFormat, expect_shapes, v2_runner_only
from .spec import DSparkSpec


class DSparkFormat(DFlashFormat):
    name, server, layout = "dspark", "vLLM (method=dspark)", "dspark"
    serve_method = "dspark"
    arch = "DSparkDraftModel"
    extra_weights = r"markov_head\.markov_w[12]\.weight|confidence_head\.proj\.(?:weight|bias)"
    cpu_serving_refusal = v2_runner_only("method=dspark",
                                         "Model Runner V1 does not support: dspark speculative decoding")

    def serve_options(self, config: dict) -> dict:
        return {"enable_adaptive_verification": True}  # vLLM sizes verification from its confidence head

    def write_config(self, spec: DSparkSpec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        config = super().write_config(spec, dtype, verifier, num_speculative_tokens, warn)
        config.update({
            "block_size": spec.block_size,  # k: the next token's slot and k - 1 mask slots, each a prediction
            "sample_from_anchor": True,
            "markov_rank": spec.markov_rank,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        })
        return config

    def fixed_draft_tokens(self, config: dict) -> int | None:
        """k slots, every one a prediction: vLLM's block_size is k."""
        return config.get("block_size")

    def check_extra(self, config: dict, shapes: dict, report) -> None:
        rank, H = config.get("markov_rank"), config.get("hidden_size")
        vocab = config.get("vocab_size")
        draft_vocab = config.get("draft_vocab_size") or vocab
        if not isinstance(rank, int) or rank < 1:
            report.errors.append(f"markov_rank {rank!r}: vLLM builds the Markov head from a positive rank")
            return
        if config.get("markov_head_type", "vanilla") != "vanilla":
            report.errors.append(f"markov_head_type {config['markov_head_type']!r}: vLLM serves the vanilla head only")
        if config.get("sample_from_anchor") is False:
            report.errors.append("sample_from_anchor=false: the draft was trained with the next token's slot as the "
                                 "first prediction (vLLM's default, true)")
        expected = {"markov_head.markov_w1.weight": (vocab, rank), "markov_head.markov_w2.weight": (draft_vocab, rank)}
        if config.get("enable_confidence_head"):
            width = H + (rank if config.get("confidence_head_with_markov") else 0)
            expected.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
        else:
            report.warnings.append("enable_confidence_head is not set: vLLM drops the confidence head and adaptive "
                                   "verification estimates acceptance itself")
        expect_shapes(expected, shapes, report)
        if config.get("block_size"):
            report.servers["vLLM"] = report.servers.get("vLLM", "").replace("method=dflash", "method=dspark") + \
                f", k={config['block_size']} (block_size), Markov rank {rank}, confidence head"
