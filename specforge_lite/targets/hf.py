"""The HF transformers target backend: a frozen causal LM that emits only the selected hidden states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..device import resolve_device, resolve_dtype
from .capture import CONVENTION, AuxCapture
from .families import TargetFamily, get_family
from .sources import ModelUnavailableError, resolve_model_dir, unavailable_error

# Positions per chunk when the full-vocabulary argmax is needed (never a [T, V] tensor for a whole batch).
_ARGMAX_CHUNK = 256


@dataclass
class Captured:
    """What one target forward yields for training: the aux states and the post-norm final state."""

    aux: list[torch.Tensor]  # len(aux_layer_ids) tensors [B, T, H_target], in aux id order
    final_hidden: torch.Tensor  # [B, T, H_target], after the final norm (what lm_head reads)


class HFTarget:
    def __init__(self, model: nn.Module, family: TargetFamily, aux_layer_ids: Sequence[int] | None,
                 location: str = ""):
        self.model = model.eval().requires_grad_(False)
        self.location = location  # where the weights (and tokenizer) were loaded from
        self.family = family
        self.capture_hooks = AuxCapture(family.layers(model), family.final_norm(model), aux_layer_ids)
        self.aux_layer_ids = self.capture_hooks.aux_layer_ids
        self.convention = CONVENTION
        self._draft_rows: torch.Tensor | None = None
        self._t2d: torch.Tensor | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, aux_layer_ids: Sequence[int] | None) -> "HFTarget":
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        family = get_family(cfg.family)
        location = resolve_model_dir(cfg)
        try:
            model = family.load(location, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                trust_remote_code=cfg.trust_remote_code)
        except OSError as e:  # hub unreachable, missing files
            raise unavailable_error(cfg, str(e).splitlines()[0]) from e
        model.to(device)
        model.config.use_cache = False
        return cls(model, family, aux_layer_ids, location)

    def close(self) -> None:
        """Remove the capture hooks (the model stays usable, e.g. by another HFTarget)."""
        self.capture_hooks.remove()

    # ---- facts about the target -------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.family.embedding(self.model).weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.family.embedding(self.model).weight.dtype

    @property
    def num_layers(self) -> int:
        return self.capture_hooks.num_layers

    @property
    def hidden_size(self) -> int:
        return self.family.embedding(self.model).weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.family.lm_head_weight(self.model).shape[0]

    def embedding_weight(self) -> torch.Tensor:
        return self.family.embedding(self.model).weight

    def lm_head_weight(self) -> torch.Tensor:
        return self.family.lm_head_weight(self.model)

    # ---- training capture -------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **inputs: Any) -> Captured:
        """Run the decoder (no lm_head, no KV cache) and keep only the aux states and the final state.

        ``inputs`` are modality inputs for the families that take them (Qwen3-VL ``pixel_values``)."""
        with self.capture_hooks.recording() as states:
            final = self.family.run_decoder(self.model, input_ids, attention_mask, **inputs)
        return Captured(aux=self.capture_hooks.collect(states), final_hidden=final)

    def set_draft_vocab(self, draft_to_target: torch.Tensor, t2d: torch.Tensor) -> None:
        """Keep only the lm_head rows the draft vocabulary selects, for the teacher."""
        w = self.lm_head_weight()
        self._draft_rows = w.index_select(0, draft_to_target.to(w.device))
        bias = self.family.lm_head_bias(self.model)
        self._draft_bias = None if bias is None else bias.index_select(0, draft_to_target.to(w.device))
        self._t2d = t2d.to(w.device)

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        if self._draft_rows is None:
            raise RuntimeError("call set_draft_vocab() before teacher()")
        logits = h.to(self._draft_rows.dtype) @ self._draft_rows.T
        if self._draft_bias is not None:
            logits = logits + self._draft_bias
        return self.family.postprocess_logits(logits.float(), self.model.config)

    @torch.no_grad()
    def teacher_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher logits over the draft vocabulary [N, Vd] (fp32) for final states [N, H], and whether the
        target's argmax over its full vocabulary lies in the draft vocabulary [N]."""
        logits = self._draft_logits(rows)
        if bool(self._t2d.all()):
            return logits, torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        return logits, self._t2d[self._full_argmax(rows.to(self._draft_rows.dtype))]

    @torch.no_grad()
    def teacher(self, final_hidden: torch.Tensor, needed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher logits over the draft vocabulary [B, T, Vd] (fp32) at every position, and whether the
        target's full-vocabulary argmax lies in the draft vocabulary [B, T] (False where not ``needed``)."""
        logits = self._draft_logits(final_hidden)
        if needed is None:
            needed = torch.ones(final_hidden.shape[:2], dtype=torch.bool, device=final_hidden.device)
        where = needed.nonzero(as_tuple=True)
        in_vocab = torch.zeros(final_hidden.shape[:2], dtype=torch.bool, device=final_hidden.device)
        if bool(self._t2d.all()):
            in_vocab[where] = True
        else:
            in_vocab[where] = self._t2d[self._full_argmax(final_hidden[where].to(self._draft_rows.dtype))]
        return logits, in_vocab

    def _full_argmax(self, rows: torch.Tensor) -> torch.Tensor:
        w = self.lm_head_weight()
        bias = self.family.lm_head_bias(self.model)
        out = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
        for s in range(0, rows.shape[0], _ARGMAX_CHUNK):
            chunk = rows[s : s + _ARGMAX_CHUNK] @ w.T
            if bias is not None:
                chunk = chunk + bias
            out[s : s + _ARGMAX_CHUNK] = self.family.postprocess_logits(chunk, self.model.config).argmax(-1)
        return out

    # ---- decoding (evaluation) --------------------------------------------------------------
    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, cache: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One incremental forward with a KV cache: aux states of the new positions and their logits."""
        with self.capture_hooks.recording() as states:
            out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        return self.capture_hooks.collect(states), out.logits


__all__ = ["HFTarget", "Captured", "ModelUnavailableError"]
