"""Lean forward for Gemma 3 text: scaled embedding, (1 + w) RMSNorms (the HF norm modules are reused),
per-head q/k norm, four norms per layer, sliding/full layers with a rope base per layer type, and the
query_pre_attn_scalar attention scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import LeanForward, rotate


class Gemma3LeanForward(LeanForward):
    def __init__(self, family, model):
        super().__init__(family, model)
        c = self.config
        if getattr(c, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("Gemma attention-logit softcapping is not in the lean forward; use "
                                      "target.backend=hf")
        self.num_heads, self.num_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.layer_types = c.layer_types
        from transformers.activations import ACT2FN

        self.act = ACT2FN[c.hidden_activation]

    def embed(self, ids):
        # sqrt(hidden) in the weight's dtype, as the HF embedding module multiplies
        w = self.embedding.weight
        return F.embedding(ids, w) * torch.tensor(self.config.hidden_size ** 0.5, dtype=w.dtype)

    def rope(self, h, positions):
        out = {}
        for kind in sorted(set(self.layer_types)):
            cos, sin = self.decoder.rotary_emb(h, positions[None], kind)
            out[kind] = (cos[:, None], sin[:, None])
        return out

    def project(self, i, h, rope):
        layer = self.layers[i]
        attn, d = layer.self_attn, self.head_dim
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).view(1, -1, self.num_heads, d)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(1, -1, self.num_kv, d)).transpose(1, 2)
        v = attn.v_proj(x).view(1, -1, self.num_kv, d).transpose(1, 2)
        cos, sin = rope[self.layer_types[i]]
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def window(self, i):
        return self.config.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def finish(self, i, h, attended):
        layer = self.layers[i]
        h = h + layer.post_attention_layernorm(layer.self_attn.o_proj(attended))
        x = layer.pre_feedforward_layernorm(h)
        mlp = layer.mlp
        return h + layer.post_feedforward_layernorm(mlp.down_proj(self.act(mlp.gate_proj(x)) * mlp.up_proj(x)))
