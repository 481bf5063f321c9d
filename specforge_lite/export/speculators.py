"""vLLM's ``speculators`` format (``Eagle3Speculator``; vLLM reads it through its speculators adapter).

The Llama draft config moves into ``transformer_layer_config`` and the EAGLE3 fields stay at the top
level, with a ``speculators_config`` naming the proposal method and the verifier (the target). Ids
are "input of layer i", as ours. The adapter defaults ``norm_before_residual`` to true when absent, so
it is always written. Weights carry no ``model.`` prefix and the decoder layer is ``layers.0``; d2t/t2d
are written only when the draft vocabulary is smaller than the target's.
"""

from __future__ import annotations

from ..draft.model import Eagle3Spec

NAME = "speculators"
_LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_hidden_layers", "rms_norm_eps", "hidden_act", "max_position_embeddings",
               "rope_theta", "rope_scaling", "attention_bias", "mlp_bias", "vocab_size", "tie_word_embeddings",
               "torch_dtype")


def server_aux_ids(spec: Eagle3Spec, warn) -> list[int]:
    return list(spec.aux_layer_ids)


def with_vocab_maps(spec: Eagle3Spec) -> bool:
    return spec.draft_vocab_size != spec.vocab_size


def adapt_config(config: dict, spec: Eagle3Spec, verifier: dict, num_speculative_tokens: int) -> dict:
    layer = {k: config[k] for k in _LAYER_KEYS if k in config}
    layer["architectures"] = ["LlamaForCausalLM"]
    out = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config["eagle_aux_hidden_state_layer_ids"]),
        "norm_before_residual": spec.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": bool(spec.use_aux_norm),
        "norm_output": False,
        "torch_dtype": config["torch_dtype"],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier.get("name_or_path"),
                         "architectures": list(verifier.get("architectures") or [])},
        },
    }
    for key in [k for k in config if k not in out and k not in _LAYER_KEYS]:
        if key.startswith("specforge"):
            out[key] = config[key]
    return out


def weight_name(name: str) -> str:
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def our_weight_name(name: str) -> str:
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
