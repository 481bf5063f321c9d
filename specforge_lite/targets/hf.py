"""The live target: a frozen causal LM that emits only the selected hidden states.

``target.backend=hf`` runs the transformers modules with capture hooks. ``target.backend=lean`` runs our
lean forward (targets/lean/) over the same weights for the families that have one: a right-padded batch
is unpadded into one row, attention is plain causal per sequence, and only the requested states come
back. Families without one, and modality inputs (images), run the transformers modules either way.
Decoding with a KV cache (evaluation) always runs the transformers modules.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..config import ModelConfig
from ..device import resolve_device, resolve_dtype
from .acquire import ModelUnavailableError, resolve_model_dir, unavailable_error
from .capture import CONVENTION, AuxCapture
from .families import TargetFamily, get_family
from .lean import build_lean_forward
from .protocol import Captured
from .sharding import gathered, is_partitioned

BACKENDS = ("hf", "lean")


class HFTarget:
    def __init__(self, model: nn.Module, family: TargetFamily, aux_layer_ids: Sequence[int] | None,
                 location: str = "", backend: str = "hf", parts_only: bool = False, trust_remote_code: bool = False):
        """``parts_only``: the model holds only its embedding, final norm and lm_head (family.load_parts);
        it gives a store its parts and the teacher its head, and cannot run a forward. ``trust_remote_code``:
        the user's consent to run the checkpoint's own code, given to every later load from ``location``
        (its tokenizer, a generator's copy of the model)."""
        if backend not in BACKENDS:
            raise ValueError(f"target.backend={backend!r}: use hf (transformers modules) or lean (our lean forward)")
        self.model = model.eval().requires_grad_(False)
        self.backend = backend
        self.location = location  # where the weights (and tokenizer) were loaded from
        self.family = family
        self.capture_hooks = AuxCapture(family.layers(model), family.final_norm(model), aux_layer_ids)
        self.aux_layer_ids = self.capture_hooks.aux_layer_ids
        self.convention = CONVENTION
        self.lean = build_lean_forward(family, model) if backend == "lean" else None
        self.parts_only = parts_only
        self.trust_remote_code = trust_remote_code

    @classmethod
    def from_config(cls, cfg: ModelConfig, aux_layer_ids: Sequence[int] | None, backend: str = "hf",
                    parts_only: bool = False) -> "HFTarget":
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        family = get_family(cfg.family)
        location = resolve_model_dir(cfg)
        if parts_only:
            model = family.load_parts(location, dtype, device, trust_remote_code=cfg.trust_remote_code)
            return cls(model, family, aux_layer_ids, location, "hf", parts_only=True,
                       trust_remote_code=cfg.trust_remote_code)
        try:
            model = family.load(location, dtype=dtype, attn_implementation=cfg.attn_implementation,
                                trust_remote_code=cfg.trust_remote_code)
        except OSError as e:  # hub unreachable, missing files
            raise unavailable_error(cfg, str(e).splitlines()[0]) from e
        model.to(device)
        model.config.use_cache = False
        return cls(model, family, aux_layer_ids, location, backend, trust_remote_code=cfg.trust_remote_code)

    def close(self) -> None:
        """Remove the capture hooks (the model stays usable, e.g. by another HFTarget)."""
        self.capture_hooks.remove()

    def with_aux_layer_ids(self, aux_layer_ids: Sequence[int]) -> "HFTarget":
        """The same model and backend capturing other states (this target's hooks are removed)."""
        self.close()
        return HFTarget(self.model, self.family, aux_layer_ids, self.location, self.backend, self.parts_only,
                        self.trust_remote_code)

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

    def full_head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole lm_head and its bias or None (gathered from the ranks' shards under a sharded target:
        a collective call)."""
        bias = self.family.lm_head_bias(self.model)
        return gathered(self.family.lm_head_weight(self.model)), None if bias is None else gathered(bias)

    def head_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = self.full_head()
        ids = ids.to(weight.device)
        return weight.index_select(0, ids), None if bias is None else bias.index_select(0, ids)

    def llama_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``index`` as a Llama layer's weights (the family's ``llama_layer``), gathered where
        partitioned: what a draft warm-started from the target copies."""
        return {k: gathered(v) for k, v in self.family.llama_layer(self.model, self.location, index).items()}

    def final_norm_weight(self) -> torch.Tensor:
        return gathered(self.family.final_norm(self.model).weight)

    @property
    def image_intake(self) -> Any:
        """How this target takes images (targets.protocol.ImageIntake), or None for text-only targets."""
        if not hasattr(self, "_image_intake"):
            self._image_intake = self.family.image_intake(self.location, self.config)
        return self._image_intake

    # ---- training capture -------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **inputs: Any) -> Captured:
        """Run the decoder (no lm_head, no KV cache) and keep only the aux states and the final state.

        ``position_ids``: packed rows (data.packing). ``inputs`` are modality inputs for the families that
        take them (Qwen3-VL ``pixel_values``)."""
        if self.lean is not None and not inputs:
            states, final = self.lean(input_ids, attention_mask, layers_to_output_hidden_states=self.aux_layer_ids,
                                      position_ids=position_ids)
            return Captured(aux=[states[i] for i in self.aux_layer_ids], final_hidden=final)
        if position_ids is not None:
            # transformers keeps attention inside each conversation when it is given positions and no 2D
            # mask; the pads at a row's end come after every real token, so dropping their mask is safe.
            attention_mask = None
        with self.capture_hooks.recording() as states:
            final = self.family.run_decoder(self.model, input_ids, attention_mask, position_ids=position_ids, **inputs)
        return Captured(aux=self.capture_hooks.collect(states), final_hidden=final)

    # ---- decoding (evaluation) --------------------------------------------------------------
    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, cache: Any,
                       **inputs: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One incremental forward with a KV cache: aux states of the new positions and their logits.
        ``inputs``: a prompt's images (vision targets), with its first forward; or a draft tree's 4D
        ``attention_mask`` and ``position_ids``."""
        with self.capture_hooks.recording() as states:
            logits = self.family.run_cached(self.model, input_ids, cache, **inputs)
        return self.capture_hooks.collect(states), logits


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also when ZeRO-3 keeps only this rank's partition of it."""
    return tuple(getattr(param, "ds_shape", param.shape))


__all__ = ["BACKENDS", "HFTarget", "ModelUnavailableError"]
