"""Qwen3-VL (``qwen3_vl``, ``qwen3_vl_moe``): a text decoder behind a vision tower, with deepstack.

Deepstack adds visual features at the image-token positions to the *outputs* of text layers 0, 1, 2
(``vision_config.deepstack_visual_indexes`` picks the vision blocks). The servers capture "input of
layer i" with the injection included, and our forward pre-hooks on the text layers see the same tensor;
HF's ``output_hidden_states[1..3]`` are taken before the injection and would differ on image prompts.
Image inputs (``pixel_values``, ``image_grid_thw``; ``mm_token_type_ids`` derived from the ids when
absent) go through the multimodal model, which merges the
image features and computes the interleaved mrope positions; text-only batches take the same path.

Decoding keeps the prompt's mrope offset (``rope_deltas``) on the model between cached steps; a new
prompt (empty cache) clears it, or a text prompt after an image prompt would decode at shifted positions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..protocol import ImageIntake
from .base import TargetFamily

IMAGE_INPUTS = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
# What Qwen3-VL's chat template renders for one image; the processor repeats the pad per token.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class Qwen3VLFamily(TargetFamily):
    name = "qwen3_vl"
    # mrope positions are 3D and derived from the images by the model: no explicit tree or packed positions.
    supports_tree_mask = False
    supports_packing = False

    def image_intake(self, location: str, config: Any) -> ImageIntake:
        from transformers import AutoImageProcessor

        return ImageIntake(AutoImageProcessor.from_pretrained(location), IMAGE_PLACEHOLDER, config.image_token_id,
                           config.vision_config.spatial_merge_size)

    def _image_inputs(self, model: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(inputs) - set(IMAGE_INPUTS))
        if unknown:
            raise ValueError(f"qwen3_vl capture takes {IMAGE_INPUTS}; got unexpected inputs {unknown}")
        if "pixel_values" in inputs and "mm_token_type_ids" not in inputs:
            inputs["mm_token_type_ids"] = self.token_types(model.config, input_ids)
        return inputs

    def run_decoder(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        if position_ids is not None:
            raise ValueError("qwen3_vl targets cannot take packed rows (their 3D mrope positions are computed from "
                             "each conversation's images); use data.packing=false")
        inputs = self._image_inputs(model, input_ids, inputs)
        return model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                           **inputs).last_hidden_state

    def run_cached(self, model: nn.Module, input_ids: torch.Tensor, cache: Any,
                   attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        if attention_mask is not None or position_ids is not None:
            raise ValueError("qwen3_vl targets cannot verify a draft tree (mrope positions are computed by the "
                             "model); use eval.drafting=chain")
        if cache.get_seq_length() == 0:
            model.model.rope_deltas = None
        inputs = self._image_inputs(model, input_ids, inputs)
        return model(input_ids=input_ids, past_key_values=cache, use_cache=True, **inputs).logits

    @staticmethod
    def token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """What the processor returns beside input_ids for the mrope positions: 1 at image tokens, 2 at
        video tokens, 0 elsewhere (so token ids alone are enough to capture a stored sample)."""
        types = torch.zeros_like(input_ids, dtype=torch.int)
        types[input_ids == config.image_token_id] = 1
        types[input_ids == config.video_token_id] = 2
        return types
