"""Target shapes the benchmarks build a draft for without loading the target, that draft, and rows for it."""

from __future__ import annotations

import torch

# Llama-layout target configs (the fields a draft's shape reads), by name.
SHAPES = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    num_hidden_layers=30, vocab_size=49152, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    rope_theta=100000.0),
    "llama3_8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0),
    "llama3_70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                       num_hidden_layers=80, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_theta=500000.0),
}


def synthetic_draft(shape: dict, draft_cfg, draft_vocab_size: int):
    """The EAGLE3 draft for a target of ``shape`` (default aux ids, seed 0), with a stand-in embedding."""
    from transformers import LlamaConfig

    from ..methods import draft_spec
    from ..methods.eagle3.model import Eagle3Draft
    from ..targets.capture import CONVENTION

    L = shape["num_hidden_layers"]
    spec = draft_spec(LlamaConfig(**shape), draft_cfg, [2, L // 2, L - 3], CONVENTION,
                      vocab_size=shape["vocab_size"], draft_vocab_size=draft_vocab_size,
                      target_hidden_size=shape["hidden_size"])
    torch.manual_seed(0)
    draft = Eagle3Draft(spec)
    # the target's table is read, never trained: a stride-0 stand-in of the right shape costs no memory
    draft.set_embedding(torch.zeros(1, spec.hidden_size).expand(spec.vocab_size, spec.hidden_size))
    return draft


def synthetic_row(shape: dict, T: int, draft_vocab_size: int):
    """One row of T tokens for that draft, every position scored: random aux states, ids and teacher logits
    (seeded by T, so two measurements at one length see the same row)."""
    from ..draft.objective import UnrollInputs

    g = torch.Generator().manual_seed(T)
    return UnrollInputs([torch.randn(1, T, shape["hidden_size"], generator=g) for _ in range(3)],
                        torch.randint(0, shape["vocab_size"], (1, T), generator=g),
                        torch.randn(1, T, draft_vocab_size, generator=g), torch.ones(1, T, dtype=torch.bool),
                        torch.ones(1, T, dtype=torch.long))
