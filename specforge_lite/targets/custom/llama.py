"""Lean forward for the plain layout: Llama 3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k
norm), Phi-3/Phi-4 (fused qkv and gate_up projections, partial rotary), SmolLM. Reads the HF modules'
weights in place (no copy)."""

from __future__ import annotations

import torch

from .lean import LeanForward, rotate, segment_attention


class LlamaLeanForward(LeanForward):
    def __init__(self, decoder, config):
        super().__init__(decoder, config)
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv = getattr(c, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.num_heads
        from transformers.activations import ACT2FN

        self.act = ACT2FN[c.hidden_act]

    def qkv(self, attn, x):
        nq, nkv = self.num_heads * self.head_dim, self.num_kv * self.head_dim
        if hasattr(attn, "qkv_proj"):  # Phi-3
            return attn.qkv_proj(x).split([nq, nkv, nkv], dim=-1)
        return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)

    def layer_forward(self, i, h, rope, lengths):
        layer = self.layers[i]
        attn, d = layer.self_attn, self.head_dim
        x = layer.input_layernorm(h)
        q, k, v = self.qkv(attn, x)
        q = q.view(1, -1, self.num_heads, d)
        k = k.view(1, -1, self.num_kv, d)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before rope
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope["default"]
        q = rotate(q.transpose(1, 2), cos, sin)
        k = rotate(k.transpose(1, 2), cos, sin)
        v = v.view(1, -1, self.num_kv, d).transpose(1, 2)
        a = segment_attention(q, k, v, lengths, attn.scaling, getattr(attn, "sliding_window", None))
        del q, k, v, x  # (locals would otherwise stay alive through the MLP and raise the peak)
        h = h + attn.o_proj(a)
        del a
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate first, then up
            gate_up = mlp.gate_up_proj(x)
            gate, up = gate_up.chunk(2, dim=-1)
            return h + mlp.down_proj(self.act(gate) * up)
        return h + mlp.down_proj(self.act(mlp.gate_proj(x)) * mlp.up_proj(x))
