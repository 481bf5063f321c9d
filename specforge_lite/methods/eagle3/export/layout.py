"""The Llama-EAGLE3 layout every EAGLE3 export writes (vLLM's and SGLang's as they are, speculators' rearranged): the
flat Llama config with the EAGLE3 fields, and the weight names. Server-specific choices (which aux-id convention,
when d2t/t2d are written) are passed in by the format classes (llama.py and the servers' on it); nothing here
knows a server's quirks.
"""

from __future__ import annotations

import torch

from ....device import dtype_name
from ....formats import PROVENANCE_KEY
from ....formats.layout import decoder_shape
from ..spec import Eagle3Spec

LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# The first decoder layer's weights, after its prefix (midlayer. or layers.0.), as a regular expression.
LAYER_WEIGHTS = (r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight"
                 r"|(?:input_layernorm|hidden_norm|post_attention_layernorm)\.weight")
# Layers 1.. of a multi-layer draft (layers.{i}.*): the same without hidden_norm.
LATER_LAYER_WEIGHTS = (r"layers\.[1-9]\d*\.(?:(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight"
                       r"|(?:input_layernorm|post_attention_layernorm)\.weight)")


def llama_draft_config(spec: Eagle3Spec, server_aux_ids: list[int], dtype: torch.dtype) -> dict:
    """The Llama-EAGLE3 config.json of an EAGLE3 draft."""
    rope = dict(spec.rope_parameters)
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **decoder_shape(spec),
        "rope_scaling": scaling,
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
        "vocab_size": spec.vocab_size,  # the TARGET vocabulary: servers size the d2t scatter with it
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "tie_word_embeddings": False,
        # Written at the top level (vLLM) and in eagle_config (SGLang): a missing id list makes servers
        # fall back to defaults silently.
        "eagle_aux_hidden_state_layer_ids": list(server_aux_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(server_aux_ids), "use_aux_hidden_state": True},
        # The speculators adapter defaults this to true when absent; this draft was trained with false.
        "norm_before_residual": spec.norm_before_residual,
        # EAGLE 3.1: vLLM reads both at the top level (norm_before_fc also from eagle_config)
        "norm_before_fc": spec.norm_before_fc,
        "norm_output": spec.norm_output,  # false: the next step is fed the pre-norm state
        "torch_dtype": dtype_name(dtype),
        PROVENANCE_KEY: {"aux_layer_ids": list(spec.aux_layer_ids), "aux_convention": spec.aux_convention,
                         "spec": spec.to_dict()},
    }
    if spec.parallel_drafting:  # P-EAGLE: vLLM reads the mask slots' token here (mask_hidden is a weight)
        config["parallel_drafting"] = True
        config["mask_token_id"] = spec.mask_token_id
    if spec.use_aux_norm:
        config["fc_norm"] = True
        config["use_aux_norm"] = True  # legacy alias read by older SGLang builds
    return config


def eagle_flag(config: dict, name: str) -> bool:
    """An EAGLE 3.1 flag (norm_before_fc, norm_output) of a Llama-draft config as vLLM reads it: from
    eagle_config first, then the top level."""
    return bool((config.get("eagle_config") or {}).get(name, config.get(name, False)))
