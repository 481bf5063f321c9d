"""What every export writes alike, whatever its method and layout: the decoder's config fields (and their reading
back), the provenance block's key, the weights, the folder written whole. Each layout's own config and weight names
are its method's (methods/<name>/export); nothing here knows a method or a server.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..draft.model import DraftSpec
from ..errors import UserError
from ..files import WRITE_ERRORS, write_failure, write_then_rename

PROVENANCE_KEY = "specforge_lite"
# target_num_layers of a draft read from a folder another trainer wrote, whose target is not known yet
# (export/published.py ``fit_to_target`` completes the spec once it is)
UNKNOWN_LAYERS = 0


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
