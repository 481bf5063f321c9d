"""Lean forward for the plain layout: Llama 3, Mistral (sliding window), Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k
norm), Phi-3/Phi-4 (fused qkv and gate_up projections, partial rotary), SmolLM. Reads the HF modules'
weights in place (no copy)."""

from __future__ import annotations


from .base import LeanForward, rotate


class LlamaLeanForward(LeanForward):
    def __init__(self, family, model):
        super().__init__(family, model)
        c = self.config
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

    def project(self, i, h, rope):
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
        return q, k, v.view(1, -1, self.num_kv, d).transpose(1, 2)

    def window(self, i):
        # Qwen2/3 keep each layer's window on its attention module (None on full layers); Mistral and Phi-3
        # have no such attribute: HF masks every layer with config.sliding_window at call time.
        attn = self.layers[i].self_attn
        if hasattr(attn, "sliding_window"):
            return attn.sliding_window
        return getattr(self.config, "sliding_window", None)

    def finish(self, i, h, attended):
        layer = self.layers[i]
        h = h + layer.self_attn.o_proj(attended)
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate first, then up
            gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
            return h + mlp.down_proj(self.act(gate) * up)
        return h + mlp.down_proj(self.act(mlp.gate_proj(x)) * mlp.up_proj(x))
