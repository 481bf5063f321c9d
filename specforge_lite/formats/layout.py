"""What every EAGLE3 Llama-draft export shares: the flat Llama config and the weight names; and what every
export writes alike: the decoder's fields, the provenance block's key, the weights, the folder written whole.

Server-specific choices (which aux-id convention, when d2t/t2d are written) are passed in by the
format classes (methods/eagle3/export/: vllm.py, sglang.py, speculators.py); nothing here knows a server's
quirks. The spec is read by its fields (EAGLE3's options among them), so nothing here imports a method.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..device import dtype_name
from ..draft.model import DraftSpec
from ..errors import UserError
from ..files import WRITE_ERRORS, write_failure, write_then_rename

PROVENANCE_KEY = "specforge_lite"
# target_num_layers of a draft read from a folder another trainer wrote, whose target is not known yet
# (export/published.py ``fit_to_target`` completes the spec once it is)
UNKNOWN_LAYERS = 0
# The first decoder layer's weights, after its prefix (midlayer. or layers.0.), as a regular expression.
LAYER_WEIGHTS = (r"(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight"
                 r"|(?:input_layernorm|hidden_norm|post_attention_layernorm)\.weight")
# Layers 1.. of a multi-layer draft (layers.{i}.*): the same without hidden_norm.
LATER_LAYER_WEIGHTS = (r"layers\.[1-9]\d*\.(?:(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight"
                       r"|(?:input_layernorm|post_attention_layernorm)\.weight)")


# The decoder layers' config fields every draft layout writes alike, as (config key, DraftSpec field).
DECODER_FIELDS = (("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
                  ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
                  ("head_dim", "head_dim"), ("num_hidden_layers", "num_layers"), ("rms_norm_eps", "rms_norm_eps"),
                  ("hidden_act", "hidden_act"), ("max_position_embeddings", "max_position_embeddings"))


def decoder_shape(spec: DraftSpec) -> dict:
    """The decoder layers' config fields every draft layout writes alike."""
    return {**{key: getattr(spec, field) for key, field in DECODER_FIELDS},
            "rope_theta": spec.rope_parameters.get("rope_theta", 10000.0)}


def decoder_fields(layer: dict) -> dict:
    """The inverse of ``decoder_shape``: our spec's fields from a draft's decoder config as another trainer
    saved it. transformers' config class fills what the file leaves out (``save_pretrained`` writes only what
    differs from the class's defaults, and servers read the file through the same class), and turns legacy
    rope fields (rope_theta, rope_scaling) into ``rope_parameters``."""
    from transformers import AutoConfig

    full = AutoConfig.for_model(layer.get("model_type") or "llama", **{k: v for k, v in layer.items()
                                                                       if k != "model_type"})
    values = full.to_dict()
    return {**{field: values[key] for key, field in DECODER_FIELDS},
            "head_dim": values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"],
            "attention_bias": bool(values.get("attention_bias")), "mlp_bias": bool(values.get("mlp_bias")),
            "rope_parameters": dict(full.rope_parameters)}


def llama_draft_config(spec: DraftSpec, server_aux_ids: list[int], dtype: torch.dtype) -> dict:
    """The Llama-EAGLE3 config.json of an EAGLE3 draft (``spec``: an Eagle3Spec, read by its option fields)."""
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


def draft_weights(state: dict[str, torch.Tensor], dtype: torch.dtype, with_vocab_maps: bool,
                  embedding: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.startswith("embed_tokens."):
            continue
        if name in ("d2t", "t2d"):
            if with_vocab_maps:
                out[name] = t.detach().cpu().to(torch.int64 if name == "d2t" else torch.bool).contiguous()
            continue
        out[name] = t.detach().cpu().to(dtype).contiguous()
    if embedding is not None:
        out["embed_tokens.weight"] = embedding.detach().cpu().to(dtype).contiguous()
    return out


class ExportWriteError(UserError):
    """An export that could not be written (a full disk, a folder that cannot be written)."""


def write_export(out_dir: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """config.json last, each file written under a temporary name and renamed into place: a folder holding a
    config.json holds the whole export, and a write cut short (a kill, a full disk) leaves none."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").unlink(missing_ok=True)  # (the folder is incomplete until the new one is in)
        write_then_rename(out_dir / "model.safetensors",
                          lambda tmp: save_file(weights, str(tmp), metadata={"format": "pt"}))
        write_then_rename(out_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))
    except WRITE_ERRORS as e:
        raise ExportWriteError(f"the export to {out_dir} could not be written ({write_failure(e)}); it is left "
                               "without config.json (incomplete). Free space or choose a writable folder, then "
                               f"export again: python -m specforge_lite.export --run-dir RUN --out {out_dir}") from None
    return out_dir
