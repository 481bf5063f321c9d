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
from .sharding import gathered, is_partitioned
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
        return _full_shape(self.family.embedding(self.model).weight)[1]

    @property
    def vocab_size(self) -> int:
        return _full_shape(self.family.lm_head_weight(self.model))[0]

    def embedding_weight(self) -> torch.Tensor:
        """The raw embedding table; under a ZeRO-3 sharded target, gathered once into a full copy that is
        identical on every rank (the draft reads it, so it must never be a rank's shard)."""
        weight = self.family.embedding(self.model).weight
        if not is_partitioned(weight):
            return weight
        if getattr(self, "_embedding_full", None) is None:
            self._embedding_full = gathered(weight)
        return self._embedding_full

    def lm_head_weight(self) -> torch.Tensor:
        """The full lm_head (gathered from the ranks' shards under a sharded target: a collective call)."""
        return gathered(self.family.lm_head_weight(self.model))

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The lm_head rows of the given target ids (the draft vocabulary)."""
        w = self.lm_head_weight()
        return w.index_select(0, ids.to(w.device))

    def lm_head_bias(self) -> torch.Tensor | None:
        """The lm_head's bias (gathered under a sharded target), or None."""
        bias = self.family.lm_head_bias(self.model)
        return None if bias is None else gathered(bias)

    @property
    def image_inputs(self) -> Any:
        """How this target takes images (data.images.ImageInputs), or None for text-only targets."""
        if not hasattr(self, "_image_inputs"):
            self._image_inputs = self.family.image_inputs(self.location, self.config)
        return self._image_inputs

    # ---- training capture -------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **inputs: Any) -> Captured:
        """Run the decoder (no lm_head, no KV cache) and keep only the aux states and the final state.

        ``position_ids``: packed rows (data.packing). ``inputs`` are modality inputs for the families that
        take them (Qwen3-VL ``pixel_values``)."""
        if position_ids is not None:
            # transformers keeps attention inside each conversation when it is given positions and no 2D
            # mask; the pads at a row's end come after every real token, so dropping their mask is safe.
            attention_mask = None
        with self.capture_hooks.recording() as states:
            final = self.family.run_decoder(self.model, input_ids, attention_mask, position_ids=position_ids, **inputs)
        return Captured(aux=self.capture_hooks.collect(states), final_hidden=final)

    def set_draft_vocab(self, draft_to_target: torch.Tensor, t2d: torch.Tensor) -> None:
        """Keep only the lm_head rows the draft vocabulary selects, for the teacher."""
        self._draft_rows = self.lm_head_rows(draft_to_target)
        w = self._draft_rows
        bias = self.lm_head_bias()
        self._draft_bias = None if bias is None else bias.index_select(0, draft_to_target.to(w.device))
        self._t2d = t2d.to(w.device)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Teacher logits over the draft vocabulary (fp32, the family's logit transform applied) for
        post-final-norm states ``h``."""
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
        logits = self.draft_logits(rows)
        if bool(self._t2d.all()):
            return logits, torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
        return logits, self._t2d[self._full_argmax(rows.to(self._draft_rows.dtype))]

    @torch.no_grad()
    def teacher(self, final_hidden: torch.Tensor, needed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher logits over the draft vocabulary [B, T, Vd] (fp32) at every position, and whether the
        target's full-vocabulary argmax lies in the draft vocabulary [B, T] (False where not ``needed``)."""
        logits = self.draft_logits(final_hidden)
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
        w = self.lm_head_weight()  # on every rank, rows or not: gathering a sharded head is collective
        bias = self.lm_head_bias()
        out = torch.empty(rows.shape[0], dtype=torch.long, device=rows.device)
        for s in range(0, rows.shape[0], _ARGMAX_CHUNK):
            chunk = rows[s : s + _ARGMAX_CHUNK] @ w.T
            if bias is not None:
                chunk = chunk + bias
            out[s : s + _ARGMAX_CHUNK] = self.family.postprocess_logits(chunk, self.model.config).argmax(-1)
        return out

    # ---- decoding (evaluation) --------------------------------------------------------------
    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, cache: Any, **inputs: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One incremental forward with a KV cache: aux states of the new positions and their logits.
        ``inputs``: a prompt's images (vision targets), with its first forward; or a draft tree's 4D
        ``attention_mask`` and ``position_ids``."""
        with self.capture_hooks.recording() as states:
            logits = self.family.run_cached(self.model, input_ids, cache, **inputs)
        return self.capture_hooks.collect(states), logits


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also when ZeRO-3 keeps only this rank's partition of it."""
    return tuple(getattr(param, "ds_shape", param.shape))


__all__ = ["HFTarget", "Captured", "ModelUnavailableError"]
