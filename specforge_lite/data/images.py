"""Images in conversations, for the vision targets (Qwen3-VL).

On disk an image sits in a turn as the marker ``<image>`` (LLaVA/ShareGPT convention; OpenAI-style
``{"type": "image"}`` parts are normalised to it) with its file path kept beside the turn. For a vision
target the marker becomes the text the model's chat template puts where an image goes (Qwen:
``<|vision_start|><|image_pad|><|vision_end|>``), and after tokenising, each image's single pad token
is repeated once per merged patch group, exactly as the model's processor does, so token ids, loss
mask and ``pixel_values`` line up. Pixels are computed per batch from the files (never stored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import MalformedRow

IMAGE_MARKER = "<image>"
_BUILT: dict[int, tuple[Any, "ImageInputs"]] = {}  # per target's intake: one ImageInputs (its token counts kept)


def image_inputs(target) -> "ImageInputs | None":
    """The image handling of a vision target (built once from the intake its family states,
    ``TargetFamily.image_intake``), or None for a text-only target."""
    intake = getattr(target, "image_intake", None)
    if intake is None:
        return None
    if id(intake) not in _BUILT:
        _BUILT[id(intake)] = (intake, ImageInputs(intake.processor, intake.placeholder_text, intake.image_token_id,
                                                  intake.merge_size))
    return _BUILT[id(intake)][1]


@dataclass
class ImageInputs:
    """What a vision target needs to take images, from its family's ``ImageIntake`` (``image_inputs(target)``)."""

    processor: Any  # the model's image processor (AutoImageProcessor of the checkpoint)
    placeholder_text: str  # what the chat template renders for one image
    image_token_id: int  # the pad token the processor repeats per merged patch group
    merge_size: int  # patches merged per side into one token
    _tokens: dict = field(default_factory=dict, repr=False)

    def open(self, path: str):
        from PIL import Image

        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except OSError as e:  # (PIL's UnidentifiedImageError included)
            raise MalformedRow(f"{path} is not an image file that can be read ({e})") from None
        except Image.DecompressionBombError as e:  # a small file declaring a huge size
            raise MalformedRow(f"{path} declares more pixels than any training image has ({e})") from None

    def num_tokens(self, path: str) -> int:
        """Image tokens the model reads for this image (grid t*h*w / merge^2), as its processor computes."""
        if path not in self._tokens:
            grid = self.processor(images=[self.open(path)], return_tensors="pt")["image_grid_thw"][0]
            self._tokens[path] = int(grid.prod()) // self.merge_size**2
        return self._tokens[path]

    def render(self, content: str) -> str:
        return content.replace(IMAGE_MARKER, self.placeholder_text)

    def expand(self, ids: list[int], mask: list[int], paths: list[str]) -> tuple[list[int], list[int]]:
        """Repeat each image's pad token once per image token; mask 0 there (images are never predicted)."""
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != len(paths):
            raise ValueError(f"{found} image placeholders in the rendered conversation for {len(paths)} images")
        out_ids, out_mask, k = [], [], 0
        for t, m in zip(ids, mask):
            if t == self.image_token_id:
                n = self.num_tokens(paths[k])
                out_ids += [t] * n
                out_mask += [0] * n
                k += 1
            else:
                out_ids.append(t)
                out_mask.append(m)
        return out_ids, out_mask

    def truncate(self, ids: list[int], mask: list[int], paths: list[str], max_length: int):
        """Cut to max_length tokens without splitting an image: an image that would be cut is dropped
        with everything after it."""
        if len(ids) <= max_length:
            return ids, mask, paths
        cut, kept, j = max_length, 0, 0
        while j < len(ids):
            if ids[j] == self.image_token_id:
                n = self.num_tokens(paths[kept])
                if j + n > max_length:
                    cut = j
                    break
                kept, j = kept + 1, j + n
            else:
                j += 1
            if j >= max_length:
                break
        return ids[:cut], mask[:cut], paths[:kept]

    def pixels(self, paths: list[str]) -> dict[str, torch.Tensor]:
        """Model inputs for the images of a batch, in order: ``pixel_values`` and ``image_grid_thw``."""
        if not paths:
            return {}
        out = self.processor(images=[self.open(p) for p in paths], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
