"""vLLM's ``speculators`` format (``Eagle3Speculator``; vLLM reads it through its speculators adapter).

The Llama draft config moves into ``transformer_layer_config`` and the EAGLE3 fields stay at the top
level, with a ``speculators_config`` naming the proposal method and the verifier (the target). Ids
are "input of layer i", as ours, read from the top level only (vLLM's speculators adapter,
vllm/transformers_utils/configs/speculators/algos.py, copies nothing else). The adapter defaults
``norm_before_residual`` to true when absent, so it is always written, and a published folder without it is read
as true. Weights carry no ``model.`` prefix and the decoder layer is ``layers.0``; d2t/t2d
are written only when the draft vocabulary is smaller than the target's.
"""

from __future__ import annotations

import torch

from ..spec import Eagle3Spec
from .llama import LlamaEagle3Format
from .published import read_folder

_LAYER_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "num_hidden_layers", "rms_norm_eps", "hidden_act", "max_position_embeddings",
               "rope_theta", "rope_scaling", "attention_bias", "mlp_bias", "vocab_size", "tie_word_embeddings",
               "torch_dtype")


class SpeculatorsFormat(LlamaEagle3Format):
    name, server, layout = "speculators", "speculators / vLLM", "speculators"
    layer_prefix = "layers.0."
    published_as = "an EAGLE3 draft in speculators' format (speculators_model_type)"
    norm_before_residual_default = True  # (a published folder without the field: vLLM's speculators adapter)

    def write_config(self, spec: Eagle3Spec, dtype: torch.dtype, verifier: dict, num_speculative_tokens: int,
                     warn) -> dict:
        config = super().write_config(spec, dtype, verifier, num_speculative_tokens, warn)
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
            "norm_before_fc": spec.norm_before_fc,
            "fc_norm": bool(spec.use_aux_norm),
            "norm_output": spec.norm_output,
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

    def weight_name(self, ours: str) -> str:
        return "layers.0." + ours.removeprefix("midlayer.") if ours.startswith("midlayer.") else ours

    def our_weight_name(self, theirs: str) -> str:
        return "midlayer." + theirs.removeprefix("layers.0.") if theirs.startswith("layers.0.") else theirs

    def reads(self, config: dict) -> bool:
        return config.get("speculators_model_type") is not None

    def layer_config(self, config: dict, report) -> dict | None:
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            report.errors.append("speculators config lacks transformer_layer_config")
            return None
        return layer

    def check(self, config: dict, shapes: dict, report) -> None:
        if config.get("speculators_model_type") != "eagle3":
            report.errors.append(f"speculators_model_type {config.get('speculators_model_type')!r}, expected 'eagle3'")
        unknown = self.unknown_weights(shapes)
        if unknown:
            report.errors.append(f"unknown weight names {unknown[:5]} (speculators names the decoder layer layers.0.*)")
        sc = config.get("speculators_config") or {}
        if not (sc.get("verifier") or {}).get("architectures"):
            report.warnings.append("speculators_config.verifier names no architectures: the verifier cannot be checked")
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        if not ids and (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"):
            report.errors.append("the aux ids are in eagle_config only: vLLM's speculators adapter reads the top-level "
                                 "eagle_aux_hidden_state_layer_ids only and captures its default ids in silence; write "
                                 "the ids the draft was trained on at the top level (the input of layer i)")
        report.servers[self.server] = (
            (f"captures the input of layers {list(ids)}" if ids else
             "captures its default ids [2, L//2, L-3] of the target (no top-level ids)")
            + f", norm_before_residual={config.get('norm_before_residual', self.norm_before_residual_default)} "
            f"(true when absent), fc_norm={bool(config.get('fc_norm'))}, "
            f"norm_before_fc={bool(config.get('norm_before_fc'))}, norm_output={bool(config.get('norm_output'))}")

    def read_published(self, folder, config: dict, tensors: dict) -> tuple[Eagle3Spec, dict]:
        return read_folder(self, folder, config, tensors)
