"""What every draft method shares: the spec that fixes a draft's shapes and meaning (saved with checkpoints and
exports) and ``TargetWiredDraft``, the base of every method's model (methods/<name>/model.py): the target's
frozen embedding shared by reference, the draft vocabulary and its head, the rotary table.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from . import fused
from .head_loss import DraftHead


# The servers' EAGLE3 draft is a Llama layer whatever the target: vLLM's and SGLang's LlamaMLP refuse any
# activation but silu, so the draft is trained (and exported) with silu for every family.
DRAFT_ACT = "silu"
# Rope variants the Llama draft layer (and the servers' Llama drafts) implement.
_LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class DraftRMSNorm(LlamaRMSNorm):
    """transformers' LlamaRMSNorm (same weight, same math: fused.rms_norm), one kernel under draft.compile. Under
    autocast it computes in the rows' dtype, as a server holding the weight in bf16 does (not promoted to fp32)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return fused.run(fused.rms_norm, hidden_states, self.weight, self.variance_epsilon)


class DraftMLP(LlamaMLP):
    """transformers' LlamaMLP (same weights), its silu activation one kernel under draft.compile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.hidden_act != "silu":
            return super().forward(x)
        return self.down_proj(fused.run(fused.swiglu, self.gate_proj(x), self.up_proj(x)))


@dataclass
class DraftSpec:
    """What fixes a draft's shapes and meaning, saved with checkpoints (spec.json) and exports: the fields every
    method shares. Each method's own spec (methods/<name>/spec.py) adds its fields; methods/__init__.py
    ``read_spec`` reads any saved one, those written before the methods had specs of their own included."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    max_position_embeddings: int
    rope_parameters: dict
    vocab_size: int  # the TARGET vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    aux_layer_ids: list[int]
    aux_convention: str
    num_layers: int = 1
    method: str = ""  # its method's name (methods/<name>/), set by each method's spec
    # the token a draft's mask slots embed (P-EAGLE, the block drafts); None: a draft without mask slots
    mask_token_id: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_layers < 1:
            raise ValueError(f"draft.num_layers={self.num_layers}: a draft has at least one layer")

    def check_mask_token(self) -> None:
        """For a draft with mask slots: its mask token is a token of the target's vocabulary."""
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"a {self.method} draft's mask slots need a mask token id inside the target vocabulary "
                             f"(0..{self.vocab_size - 1}), got draft.mask_token_id={self.mask_token_id}")

    @classmethod
    def from_target(cls, target_config: Any, draft_cfg, aux_layer_ids: list[int], convention: str,
                    vocab_size: int, draft_vocab_size: int, target_hidden_size: int,
                    method_fields: dict) -> "DraftSpec":
        """A new draft's spec: the shapes from the target, ``method_fields`` from the method (its settings)."""
        c = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        # Plain values: per-layer (heterogeneous) configs such as Gemma 4's refuse attribute access.
        get = c.to_dict().get
        heads = get("num_attention_heads")
        rope = dict(get("rope_parameters", None) or {})
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(get("rope_theta", 10000.0))}
        if "full_attention" in rope and isinstance(rope["full_attention"], dict):  # per-layer-type families
            rope = dict(rope["full_attention"])
        if rope.get("rope_type", "default") not in _LLAMA_ROPE_TYPES:  # e.g. Gemma 4's partial "proportional"
            rope = {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))}
        if get("intermediate_size") is None:  # (the draft's MLP width is the target's dense one)
            raise ValueError(f"the target's config names no intermediate_size (a mixture of experts with no dense MLP, "
                             f"{get('model_type')}): this version takes the draft layer's MLP width from it and "
                             "cannot size a draft for this target yet")
        return cls(
            hidden_size=target_hidden_size,
            intermediate_size=get("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", None) or heads,
            head_dim=get("head_dim", None) or target_hidden_size // heads,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            hidden_act=DRAFT_ACT,  # not the target's (Gemma's gelu_pytorch_tanh would load nowhere)
            max_position_embeddings=get("max_position_embeddings", 8192),
            rope_parameters=rope,
            vocab_size=vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target_hidden_size,
            target_num_layers=get("num_hidden_layers"),
            aux_layer_ids=list(aux_layer_ids),
            aux_convention=convention,
            num_layers=draft_cfg.num_layers,
            method=draft_cfg.method,
            **method_fields,  # the method's own (methods/<name>/: EAGLE3's norms, a block draft's block_size)
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings, rope_parameters=dict(self.rope_parameters),
            vocab_size=self.vocab_size, num_hidden_layers=1, attention_bias=self.attention_bias,
            mlp_bias=self.mlp_bias,
        )


class TargetWiredDraft(nn.Module):
    """What every draft method offers the pipeline: the target's frozen embedding shared by reference, the
    draft vocabulary (d2t/t2d, the lm_head's rows), its trainable state, and the forward a training engine
    wraps (the objective's unroll). Subclasses build their layers, then call ``_finish_build``."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        # The target's frozen embedding table, held by reference and not as a parameter: the draft never
        # owns or trains it (servers hand the draft the target's table), and a ZeRO engine wrapping the
        # draft must not partition a tensor the target's own forward still reads.
        self._embedding: torch.Tensor | None = None

    def _finish_build(self) -> None:
        """After a subclass's own layers: the final norm, the draft-vocabulary head and maps, the rotary
        table, then every Linear initialised (in registration order)."""
        spec = self.spec
        self.norm = DraftRMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.lm_head = DraftHead(spec.hidden_size, spec.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(spec.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(spec.llama_config())
        self._init_weights()

    def _init_weights(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Share the target's embedding tensor (frozen; SGLang and vLLM substitute it at load too)."""
        if tuple(weight.shape) != (self.spec.vocab_size, self.spec.hidden_size):
            raise ValueError(f"target embedding {tuple(weight.shape)} does not match the draft's "
                             f"({self.spec.vocab_size}, {self.spec.hidden_size}); the draft was built for another "
                             f"target")
        self._embedding = weight.detach()

    @property
    def embedding_weight(self) -> torch.Tensor:
        if self._embedding is None:
            raise RuntimeError("the draft has no embedding table: call set_embedding(target.embedding_weight())")
        return self._embedding

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.embedding_weight)

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def init_lm_head_from_target(self, target_lm_head: torch.Tensor, draft_to_target: torch.Tensor) -> None:
        with torch.no_grad():
            rows = target_lm_head.index_select(0, draft_to_target.to(target_lm_head.device))
            self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint needs (the target's embedding is not part of the draft's state)."""
        return dict(self.state_dict())

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_vocab_ids(self) -> torch.Tensor:
        """The target id of every draft token, in draft order."""
        return self.draft_to_target(torch.arange(self.spec.draft_vocab_size, device=self.d2t.device))

    def forward(self, inputs, objective):
        """The unroll and its loss over a batch (``objective.unroll``); the module's forward so that a
        training engine (DeepSpeed) wraps exactly what is trained."""
        return objective.unroll(self, inputs)
