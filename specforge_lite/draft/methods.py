"""The draft methods trained from one capture, registered by name (``draft.method``).

A method is one ``DraftMethod``, written in its own module (draft/eagle3.py, draft/dflash.py) and registered
there with ``register``: everything the rest of the project needs to know of it. Its model and objective (both
read the same target states, so one hidden-state store trains any method), the settings it refuses, how an
evaluation drafts with it, which export formats can write it, and its name in tables. Nothing outside
draft/ branches on a method's name: it asks the method. P-EAGLE and EAGLE 3.1 are EAGLE3 with options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class DraftMethod:
    name: str  # draft.method=<name>
    model: type  # built from its spec (draft/model.py Eagle3Spec: every method's fields)
    objective: type  # its loss over the unrolled steps; ``from_config(draft_config, sequence)``
    # the settings of a composed config it cannot take, each "what and the fix" (settings.py asks before anything)
    refused: Callable[[Any], list[str]]
    # the evaluation settings (eval.*) it cannot be measured with, given the draft's settings (a DraftConfig
    # before training, the trained draft's spec after: the same field names)
    refused_evaluation: Callable[[Any, Any], list[str]]
    # what keeps a draft's context across rounds and proposes each round's k tokens (evaluation's drafting);
    # its ``one_forward`` says whether all k come from one forward (mask slots) or one step each
    drafting: Callable[[Any], Any]
    # the export formats that can write it (export/): the first is what export.format=vllm writes (EAGLE3's
    # Llama layout, or vLLM's own layout for the method)
    export_formats: tuple[str, ...]
    # a draft's name in tables, from its spec (a checkpoint's spec.json, an export's provenance block)
    label: Callable[[dict], str]
    # whether a draft with these settings embeds a mask token in slots (P-EAGLE, DFlash): one is then chosen
    has_mask_slots: Callable[[Any], bool]
    # the spec fields (draft/model.py Eagle3Spec) its settings fix beyond the shared ones: a block draft's
    # block_size, DSpark's markov_rank
    spec_fields: Callable[[Any], dict] = lambda draft_settings: {}
    # the one k a draft can be served and evaluated at, from its spec (a dict): a block draft's block is its
    # input, so its k is fixed at training; None: any k
    fixed_draft_tokens: Callable[[dict], int | None] = lambda spec: None
    # whether its draft keeps the whole target vocabulary whatever draft.draft_vocab_size says (DFlash 2: its
    # selector indexes codebooks with token ids as vLLM does)
    whole_vocabulary: bool = False
    # the values it gives the draft settings a user left null (config.py: norm_before_fc, norm_output), from
    # the rest of its settings (``setting`` reads them); one it does not name is off
    defaults: Callable[[Any], dict] = lambda draft_settings: {}


METHODS: dict[str, DraftMethod] = {}
DEFAULT = "eagle3"  # draft.method's default, and the method of a spec written before methods were recorded


def register(method: DraftMethod) -> DraftMethod:
    METHODS[method.name] = method
    return method


def draft_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise ValueError(f"draft.method={name!r}: use one of {sorted(METHODS)}")
    return METHODS[name]


def setting(draft_cfg, name: str):
    """A draft setting whose default is the method's (null in config.py) as a run of these settings uses it:
    the user's value, else the method's default, else off. A draft's spec records the result, so a
    checkpoint or an export never depends on this default again."""
    value = getattr(draft_cfg, name)
    if value is None:
        value = bool(draft_method(draft_cfg.method).defaults(draft_cfg).get(name, False))
    return value


def build_objective(draft_cfg, sequence=None):
    """The objective of the configured method (``sequence``: a rank's share of each row, EAGLE3 only)."""
    return draft_method(draft_cfg.method).objective.from_config(draft_cfg, sequence)


def shape_settings(draft_settings, spec) -> dict | None:
    """The draft settings (DraftConfig fields) that differ from ``draft_settings`` and give a draft of ``spec``'s
    method the shape ``spec`` has where the method's settings fix it (a block draft's block_size comes from
    draft.ttt_length); {} when they already do, None when no settings give it."""
    import dataclasses

    method = draft_method(spec.method)
    if all(getattr(spec, key) == value for key, value in method.spec_fields(draft_settings).items()):
        return {}
    k = method.fixed_draft_tokens(spec.to_dict())
    fixes = {**({"ttt_length": k} if k is not None else {}),
             **{key: getattr(spec, key) for key in method.spec_fields(draft_settings) if hasattr(draft_settings, key)}}
    fixes = {key: value for key, value in fixes.items() if getattr(draft_settings, key) != value}
    fits = all(getattr(spec, key) == value
               for key, value in method.spec_fields(dataclasses.replace(draft_settings, **fixes)).items())
    return fixes if fits else None


def draft_vocab_size(draft_cfg, target_vocab_size: int) -> int:
    """The draft vocabulary a run of these settings has: draft.draft_vocab_size capped at the target's, or the
    whole target vocabulary for a method that needs it."""
    if draft_method(draft_cfg.method).whole_vocabulary:
        return target_vocab_size
    return min(draft_cfg.draft_vocab_size, target_vocab_size)


def layers_label(spec: dict) -> str:
    layers = spec.get("num_layers", 1)
    return f"{layers} layer{'s' if layers > 1 else ''}"
