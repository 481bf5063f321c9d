"""The transformers configs of hub presets, for sizing a run without downloading anything.

Each entry is what the preset's config.json says of the shape (from the model cards): enough to build the
model with fake weights and count its bytes. A preset not listed here is sized from its config.json (a local
folder, the hub cache, or a download of that one file)."""

from __future__ import annotations

from typing import Any

_LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})

# model.path -> (transformers model type, config fields)
CONFIG_FIELDS: dict[str, tuple[str, dict[str, Any]]] = {
    "meta-llama/Llama-3.1-8B-Instruct": ("llama", _LLAMA_8B),
    "meta-llama/Llama-3.3-70B-Instruct": ("llama", {**_LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672,
                                                    "num_attention_heads": 64, "num_hidden_layers": 80}),
    "Qwen/Qwen3-8B": ("qwen3", dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, num_hidden_layers=36, vocab_size=151936,
                                    max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "Qwen/Qwen3-32B": ("qwen3", dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64,
                                     num_key_value_heads=8, head_dim=128, num_hidden_layers=64, vocab_size=151936,
                                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


def known_config(path: str):
    """The transformers config of a listed preset's ``model.path``, or None."""
    if path not in CONFIG_FIELDS:
        return None
    from transformers import AutoConfig

    model_type, fields = CONFIG_FIELDS[path]
    return AutoConfig.for_model(model_type, **fields)
