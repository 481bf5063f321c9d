"""SGLang (``LlamaForCausalLMEagle3``, python/sglang/srt/models/llama_eagle3.py).

SGLang adds 1 to explicit ids ("id = output of layer i"), so a draft trained on the input of layer i
is written as i - 1. Newer builds add the 1 only when the first id is 1, which the default ids
[2, L//2, L-3] satisfy after translation; other choices are read differently across SGLang versions.
SGLang keeps d2t even for a full draft vocabulary and skips unknown weight names silently.
"""

from __future__ import annotations

from ..draft.model import Eagle3Spec

NAME = "sglang"


class ExportRefused(ValueError):
    pass


def server_aux_ids(spec: Eagle3Spec, warn) -> list[int]:
    ids = list(spec.aux_layer_ids)
    if 0 in ids:
        raise ExportRefused("aux id 0 (the embedding output) cannot be expressed in SGLang's output-of-layer ids; "
                            "train with ids >= 1 to serve on SGLang")
    translated = [i - 1 for i in ids]
    if translated[0] != 1:
        warn(f"SGLang ids {translated}: builds before mid-2026 add 1 to every id (correct), newer builds only when "
             "the first id is 1 (they would read these ids one layer early). Prefer aux ids starting at 2 for SGLang.")
    if spec.target_num_layers in ids:
        warn("aux id == num_layers (pre-norm final state) is not a layer input SGLang captures in every build")
    return translated


def with_vocab_maps(spec: Eagle3Spec) -> bool:
    return True
