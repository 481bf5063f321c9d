"""vLLM (``Eagle3LlamaForCausalLM``, architecture name ``LlamaForCausalLMEagle3`` accepted).

vLLM captures "aux id i" as the input of layer i, id == num_layers as the pre-norm last state: our
convention, so ids are written as they are. Its loader is strict (an unknown weight name raises) and,
with a full draft vocabulary, wants no d2t/t2d.
"""

from __future__ import annotations

from ..draft.model import Eagle3Spec

NAME = "vllm"


def server_aux_ids(spec: Eagle3Spec, warn) -> list[int]:
    return list(spec.aux_layer_ids)


def with_vocab_maps(spec: Eagle3Spec) -> bool:
    return spec.draft_vocab_size != spec.vocab_size
