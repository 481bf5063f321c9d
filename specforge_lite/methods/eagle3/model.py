"""The EAGLE3 draft: a Llama decoder layer fed by the fused aux states (and, optionally, more plain Llama
layers after it), with server weight names.

Names match what SGLang and vLLM load (eagle3-contracts.md): ``fc``, ``fc_norm.{k}`` (optional),
``midlayer.{input_layernorm,hidden_norm,self_attn.*,post_attention_layernorm,mlp.*}``, ``norm``,
``lm_head``, ``d2t``, ``t2d``. The token embedding is the target's, frozen and shared (not copied).

EAGLE 3.1 (speculators' default since 0.9, served by vLLM 0.32) adds three options, each a flag in the
export: ``norm_before_fc`` (one RMSNorm ``input_norm`` over the concatenated aux states before ``fc``;
exclusive with the per-aux ``fc_norm``), ``norm_output`` (the next unroll step is fed the final norm's
output rather than the pre-norm state; the logits are the same function of the pre-norm state) and
``num_layers > 1`` (layers ``layers.{1..}``: plain pre-norm Llama layers over the hidden state, each
with its own keys, as vLLM's and speculators' multi-layer drafts run them).
"""

from __future__ import annotations

import torch
from torch import nn

from ...draft import fused
from ...draft.model import DraftMLP, DraftRMSNorm, TargetWiredDraft
from .parallel import mask_slot_inputs, new_mask_hidden
from .spec import Eagle3Spec
from .ttt import DraftCache


class DraftAttention(nn.Module):
    """Attention with the TTT key pattern over an input ``width`` wide: cat(embedding, hidden) (2H) in the
    first layer, the hidden state (H) in later ones."""

    def __init__(self, spec: Eagle3Spec, width: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_attention_heads, spec.num_key_value_heads
        self.head_dim = spec.head_dim
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=spec.attention_bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=spec.attention_bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=spec.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, q_offset: int) -> torch.Tensor:
        """``cache`` decides which keys each query sees: a TTTCache (training, chain drafting) or a
        TreeCache (tree drafting)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = fused.run(fused.rotary, q, k, cos, sin)
        cache.append(k, v)
        out = cache.attend(q, q_offset, self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    """A pre-norm Llama decoder layer over the hidden state: layers 1.. of a multi-layer draft (vLLM runs
    them this way and loads them as ``layers.{i}.*``), and the parts the first layer shares."""

    def __init__(self, spec: Eagle3Spec, width: int | None = None):
        super().__init__()
        self.input_layernorm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = DraftAttention(spec, width or spec.hidden_size)
        self.post_attention_layernorm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = DraftMLP(spec.llama_config())

    def forward(self, hidden, cos, sin, cache: DraftCache, q_offset: int) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(hidden), cos, sin, cache, q_offset) + hidden
        return self.feed_forward(h)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h)) + h


class DraftDecoderLayer(DraftLayer):
    """The EAGLE3 layer: attention over cat(normed embedding, normed hidden), 2H wide."""

    def __init__(self, spec: Eagle3Spec):
        super().__init__(spec, width=2 * spec.hidden_size)
        self.hidden_norm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.norm_before_residual = spec.norm_before_residual

    def forward(self, embeds, hidden, cos, sin, cache: DraftCache, q_offset: int) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        # the residual stream starts from the fused state as it came (SGLang, vLLM's default) or as normed
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        return self.feed_forward(self.self_attn(x, cos, sin, cache, q_offset) + residual)


class Eagle3Draft(TargetWiredDraft):
    def __init__(self, spec: Eagle3Spec, embedding_weight: torch.Tensor | None = None):
        super().__init__(spec)
        if embedding_weight is not None:
            self.set_embedding(embedding_weight)
        n_aux = len(spec.aux_layer_ids)
        self.fc = nn.Linear(n_aux * spec.target_hidden_size, spec.hidden_size, bias=False)
        if spec.use_aux_norm:
            self.fc_norm = nn.ModuleList(DraftRMSNorm(spec.target_hidden_size, eps=spec.rms_norm_eps)
                                         for _ in range(n_aux))
        if spec.norm_before_fc:
            self.input_norm = DraftRMSNorm(n_aux * spec.target_hidden_size, eps=spec.rms_norm_eps)
        self.midlayer = DraftDecoderLayer(spec)
        # keyed "1", "2", ...: the weights are named layers.{i}.*, as the servers load them
        self.layers = nn.ModuleDict({str(i): DraftLayer(spec) for i in range(1, spec.num_layers)})
        self._finish_build()
        if spec.parallel_drafting:  # after the Linear init, so an EAGLE3 draft's init draws are unchanged
            self.mask_hidden = new_mask_hidden(n_aux * spec.target_hidden_size)

    def start_from_target(self, layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor) -> None:
        """draft.init_layers_from_target: begin as the target's own layers after the top aux id.

        ``layers``: Llama-layer weights (``TargetFamily.llama_layer``) of target layers top, top + 1, ... for
        draft layers 0, 1, ...; ``final_norm``: the target's final norm weight. The first layer's attention
        reads the hidden half of its input only (the embedding half of q/k/v zero), with the target layer's
        input norm as ``hidden_norm``; ``fc`` passes the top aux state through unchanged (exactly, without
        aux norms; their scale otherwise). At step 0 the draft then computes the target's layer ``top`` on the
        target's own state: the state the target itself has one layer later (tests/test_ttt.py checks it
        against transformers' forward). The lm_head keeps the target's rows (init_lm_head_from_target)."""
        spec, H = self.spec, self.spec.hidden_size
        if spec.target_hidden_size != H or len(layers) != spec.num_layers:
            raise ValueError(f"draft.init_layers_from_target needs the target's width ({spec.target_hidden_size}, the "
                             f"draft has {H}) and one target layer per draft layer ({len(layers)} for "
                             f"{spec.num_layers})")
        top = spec.aux_layer_ids.index(max(spec.aux_layer_ids))
        with torch.no_grad():
            first = dict(layers[0])
            first["hidden_norm.weight"] = first.pop("input_layernorm.weight")
            for name in ("q_proj", "k_proj", "v_proj"):
                w = first[f"self_attn.{name}.weight"]
                first[f"self_attn.{name}.weight"] = torch.cat([torch.zeros_like(w), w], dim=1)  # [embedding | hidden]
            _copy_weights(self.midlayer, first, keep={"input_layernorm.weight"})
            for i, layer in self.layers.items():
                _copy_weights(layer, layers[int(i)], keep=set())
            self.fc.weight.zero_()
            self.fc.weight[:, top * H : (top + 1) * H] = torch.eye(H)
            self.norm.weight.copy_(final_norm)

    # ---- forward pieces ------------------------------------------------------------------------
    def project_aux(self, aux: list[torch.Tensor]) -> torch.Tensor:
        """Fuse the captured aux states [B, T, H_t] x n into the draft's hidden input [B, T, H]."""
        if len(aux) != len(self.spec.aux_layer_ids):
            raise ValueError(f"got {len(aux)} aux states, the draft was built for {len(self.spec.aux_layer_ids)}")
        if aux[0].shape[-1] != self.spec.target_hidden_size:
            raise ValueError(f"aux hidden size {aux[0].shape[-1]} != the draft's target_hidden_size "
                             f"{self.spec.target_hidden_size}: the captured target is not the one the draft was built "
                             f"for")
        if self.spec.use_aux_norm:
            aux = [norm(a) for norm, a in zip(self.fc_norm, aux)]
        joined = torch.cat(aux, dim=-1)
        if self.spec.norm_before_fc:
            joined = self.input_norm(joined)
        return self.fc(joined.to(fused.compute_dtype(self.fc.weight)))

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, cache: DraftCache,
             q_offset: int = 0) -> torch.Tensor:
        """One draft step through every layer (layer i attends over ``cache.layer(i)``): returns the state fed
        back as the next step's hidden input, the last layer's pre-norm output, or with ``norm_output`` that
        output after the final norm."""
        embeds = self.embed(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        out = self.midlayer(embeds, hidden, cos, sin, cache, q_offset)
        for i, layer in self.layers.items():
            out = layer(out, cos, sin, cache.layer(int(i)), q_offset)
        return self.norm(out) if self.spec.norm_output else out

    def next_step_inputs(self, next_ids: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the next unroll step reads: the next tokens and this step's state (EAGLE3), or, for a
        parallel draft, the mask slot's token and state (parallel.py)."""
        if self.spec.parallel_drafting:
            return mask_slot_inputs(self, next_ids, state)
        return next_ids, state

    def head_input(self, state: torch.Tensor) -> torch.Tensor:
        """What the lm_head reads: the final norm of the pre-norm output (``step``'s state is already normed
        with ``norm_output``: the logits are the same function of the layers' output either way)."""
        return state if self.spec.norm_output else self.norm(state)

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits from a step's state."""
        return self.lm_head(self.head_input(state))

    def soft_cross_entropy(self, state: torch.Tensor, teacher_logits: torch.Tensor, teacher_rows: torch.Tensor,
                           teacher_top: torch.Tensor, row_weights: torch.Tensor, chunk_rows: int):
        """The weighted soft cross-entropy of step states [N, H] against their rows of ``teacher_logits``
        [R, Vd], without their [N, Vd] logits ever held whole (draft/head_loss.py: what it returns)."""
        return self.lm_head(self.head_input(state), teacher=(teacher_logits, teacher_rows, teacher_top, row_weights,
                                                             chunk_rows))


def _copy_weights(module: nn.Module, weights: dict[str, torch.Tensor], keep: set[str]) -> None:
    """Copy ``weights`` into ``module``'s parameters of the same names and shapes; every parameter but those
    in ``keep`` must be given."""
    own = dict(module.named_parameters())
    wrong = sorted(set(weights) - set(own)) + sorted(set(own) - set(weights) - keep)
    shapes = [f"{n} {tuple(w.shape)} != {tuple(own[n].shape)}" for n, w in weights.items()
              if n in own and w.shape != own[n].shape]
    if wrong or shapes:
        raise ValueError(f"draft.init_layers_from_target: the target layer does not fit the draft's layer "
                         f"({', '.join(wrong + shapes)})")
    for n, w in weights.items():
        own[n].copy_(w.to(own[n].dtype))
