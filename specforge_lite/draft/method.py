"""What a draft method is to the rest of the project: one ``DraftMethod``, written in its own folder
(methods/<name>/) and registered by name (``draft.method``) in methods/__init__.py: everything the rest of the
project needs to know of it. Its model and objective (both read the same target states, so one hidden-state
store trains any method), the settings it refuses, how an evaluation drafts with it, the export formats that
write it (and read what other trainers published of it), and its name in tables. Nothing outside
methods/ branches on a method's name: it asks the method. P-EAGLE and EAGLE 3.1 are EAGLE3 with options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class DraftMethod:
    name: str  # draft=<name>
    model: type  # built from its spec
    spec: type  # its spec: draft/model.py DraftSpec's fields and its own (``from_target``)
    settings: type  # its settings: config.py DraftSettings' fields and its own (draft=<name> selects them)
    objective: type  # its loss over the unrolled steps; ``from_config(draft_config, sequence)``
    # the settings of a composed config it cannot take, each "what and the fix" (settings.py asks before anything)
    refused: Callable[[Any], list[str]]
    # the evaluation settings (eval.*) it cannot be measured with, given the draft's settings (its settings
    # before training, the trained draft's spec after: the same field names)
    refused_evaluation: Callable[[Any, Any], list[str]]
    # what keeps a draft's context across rounds and proposes each round's k tokens (evaluation's drafting);
    # its ``one_forward`` says whether all k come from one forward (mask slots) or one step each
    drafting: Callable[[Any], Any]
    # the export formats that can write it (formats/ ``ExportFormat`` objects, their classes in the method's
    # folder: methods/<name>/export), gathered by name in export/: the first is what export.format=vllm writes
    # (EAGLE3's Llama layout, or vLLM's own layout for the method)
    export_formats: tuple[Any, ...]
    # a draft's name in tables, from its spec (a checkpoint's spec.json, an export's provenance block)
    label: Callable[[dict], str]
    # whether a draft with these settings embeds a mask token in slots (P-EAGLE, DFlash): one is then chosen
    has_mask_slots: Callable[[Any], bool]
    # how many positions its objective scores at each anchor, from its settings (the held-out accuracy's acc_0 ..
    # acc_{n-1}, what trainer.keep_best may name): EAGLE3's unroll depth, a block draft's k (its block's slots that
    # predict a token)
    scored_steps: Callable[[Any], int]
    # its settings that give ``n`` scored steps, the inverse of ``scored_steps``: EAGLE3's {"ttt_length": n}, a
    # DFlash block's {"block_size": n + 1}
    steps_settings: Callable[[int], dict]
    # the fields of its spec that its settings fix beyond the shared ones: EAGLE3's norms, a
    # block draft's block_size and mask token, DSpark's markov_rank
    spec_fields: Callable[[Any], dict] = lambda draft_settings: {}
    # the one k a draft can be served and evaluated at, from its spec (a dict): a block draft's block is its
    # input, so its k is fixed at training; None: any k
    fixed_draft_tokens: Callable[[dict], int | None] = lambda spec: None
    # whether its draft keeps the whole target vocabulary whatever draft.draft_vocab_size says (DFlash 2: its
    # selector indexes codebooks with token ids as vLLM does)
    whole_vocabulary: bool = False
    # whether its objective trains on packed rows, several conversations a row (data.packing,
    # trainer.micro_batch_tokens): EAGLE3's TTT keeps them apart by their position ids; a block draft does not
    packs_rows: bool = True
    # what a new draft takes from its target beyond its lm_head's rows, given its settings (EAGLE3: its layers,
    # with draft.init_layers_from_target)
    warm_start: Callable[[Any, Any, Any], None] = lambda draft, draft_settings, target: None
    # the layouts, in the order tried, of draft folders another trainer wrote that it reads (EAGLE3: speculators'
    # and SGLang's): each format's ``read_published`` gives the spec and the weights of such a folder
    published_formats: tuple[Any, ...] = ()

    def new_spec(self, target_config, draft_settings, aux_layer_ids: list[int], convention: str, vocab_size: int,
                 draft_vocab_size: int, target_hidden_size: int):
        """The spec of a new draft of these settings for this target: the shared fields from the target, its own
        from its settings (``spec_fields``; a null setting resolved as the method decides, so a checkpoint or an
        export never depends on that default again)."""
        return self.spec.from_target(target_config, draft_settings, aux_layer_ids, convention, vocab_size,
                                     draft_vocab_size, target_hidden_size, self.spec_fields(draft_settings))

    def draft_vocab_size(self, draft_settings, target_vocab_size: int) -> int:
        """The draft vocabulary a run of these settings has: draft.draft_vocab_size capped at the target's, or the
        whole target vocabulary where the method needs it (``whole_vocabulary``)."""
        return target_vocab_size if self.whole_vocabulary else min(draft_settings.draft_vocab_size, target_vocab_size)


def layers_label(spec: dict) -> str:
    layers = spec.get("num_layers", 1)
    return f"{layers} layer{'s' if layers > 1 else ''}"
