"""What every target offers the stages after it: the capture of selected states, and facts about itself.

Three kinds implement it: ``HFTarget`` (targets/hf.py: a live model, run by the transformers modules or by
our lean forward), ``ServedTarget`` (targets/served.py: states a vLLM server writes for each batch) and
``StoreTarget`` (offline/target.py: states read back from a hidden-state store).
The teacher (targets/teacher.py) is built on top of any of them; decoding with a KV cache (evaluation)
is the live target's alone (``forward_cached``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Captured:
    """What one target forward yields for training: the aux states and the post-norm final state.

    A store knows two things a live target computes in the teacher, because it keeps no full lm_head:
    the in-vocabulary flags (recorded at dump time) and, for ``store.teacher=topk``, the teacher's top-k
    draft-vocabulary logits in place of the final state."""

    aux: list[torch.Tensor]  # len(aux_layer_ids) tensors [B, T, H_target], in aux id order
    final_hidden: torch.Tensor  # [B, T, H_target], after the final norm (what lm_head reads)
    in_vocab: torch.Tensor | None = None  # [B, T] bool: the full-vocabulary argmax lies in the draft vocabulary
    topk: tuple[torch.Tensor, torch.Tensor] | None = None  # ([B, T, k] logits, [B, T, k] draft ids)


@dataclass(frozen=True)
class ImageIntake:
    """How a vision target takes images, as its family states it (the data stage builds its image handling,
    data/images.py ``ImageInputs``, from it: the target never needs the data stage's code)."""

    processor: Any  # the model's image processor (AutoImageProcessor of the checkpoint)
    placeholder_text: str  # what the chat template renders for one image
    image_token_id: int  # the pad token the processor repeats per merged patch group
    merge_size: int  # patches merged per side into one token


class Target(Protocol):
    family: Any  # targets.families.TargetFamily: where the parts live, the logit transform
    config: Any  # the target's transformers config
    location: str  # where the weights (and tokenizer) were loaded from
    aux_layer_ids: list[int]  # in the capture convention (targets/capture.py)
    convention: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    image_intake: ImageIntake | None  # how a vision target takes images, else None

    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **inputs: Any) -> Captured: ...

    def embedding_weight(self) -> torch.Tensor:
        """The full embedding table (the draft shares it)."""

    def head_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lm_head rows (and bias entries, or None) of the given target ids: the draft vocabulary."""

    def full_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The whole lm_head and bias (a collective call under a sharded target), or None where only the
        draft rows are kept (a store: its captures carry ``in_vocab``)."""

    def llama_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Decoder layer ``index``'s weights as a plain Llama layer's (``TargetFamily.llama_layer``), for a
        draft started from the target; ValueError naming what differs when the layer is not one."""

    def final_norm_weight(self) -> torch.Tensor:
        """The final norm's weight (read by the lm_head after it)."""

    def close(self) -> None: ...
