"""DFlash as a registered method (methods/__init__.py): a block-diffusion draft that proposes k tokens in one
forward from mask slots (model.py; vLLM method=dflash). DSpark and DFlash 2 are built on its backbone."""

from __future__ import annotations

from ...draft.method import DraftMethod, layers_label
from .export import DFlashFormat
from .model import DFlashContext, DFlashDraft, DFlashObjective
from .settings import DFlashSettings
from .spec import DFlashSpec


def refused(config) -> list[str]:
    """What a block draft (DFlash, and DSpark and DFlash 2 on its backbone) cannot be trained or served with."""
    d, method, problems = config.draft, config.draft.method, []
    unsupported = [name for name, on in (("data.packing", config.data.packing),
                                         ("trainer.deepspeed.sequence_parallel",
                                          config.trainer.deepspeed.sequence_parallel != 1)) if on]
    if unsupported:
        problems.append(f"draft={method} does not take {', '.join(unsupported)} (not implemented for block drafts): "
                        "turn them off")
    k = config.eval.num_draft_tokens
    if d.draft_tokens != k:  # (the block attends bidirectionally: its size is input)
        problems.append(f"draft={method} with draft.block_size={d.block_size} proposes {d.draft_tokens} tokens per "
                        f"block but is served with eval.num_draft_tokens={k}: a block draft sees all its slots, so a "
                        f"block of another size is another input; set draft.block_size={k + d.anchor_slots} for "
                        f"k={k}, or eval.num_draft_tokens={d.draft_tokens}")
    return problems


def refused_evaluation(draft_settings, ev) -> list[str]:
    if ev.drafting == "tree" or ev.temperature > 0:
        return [f"a {draft_settings.method} draft is evaluated greedy and as a chain (one block per round): use "
                "eval.drafting=chain eval.temperature=0"]
    return []


def label(spec: dict) -> str:
    return f"DFlash, {layers_label(spec)}"


def block_fields(settings: type) -> dict:
    """What every block draft's ``DraftMethod`` says of its block, for its settings class ``settings``: its mask
    slots, its rows one conversation each, and its k (what it scores, and is served at) from its block's size."""
    return {"has_mask_slots": lambda draft_settings: True, "packs_rows": False,
            "scored_steps": lambda draft_settings: draft_settings.draft_tokens,
            "steps_settings": lambda k: {"block_size": k + settings.anchor_slots},
            "fixed_draft_tokens": lambda spec: spec["block_size"] - settings.anchor_slots}


METHOD = DraftMethod(
    "dflash", DFlashDraft, DFlashSpec, DFlashSettings, DFlashObjective, refused, refused_evaluation, DFlashContext,
    (DFlashFormat(),), label, **block_fields(DFlashSettings),
    spec_fields=lambda d: {"block_size": d.block_size, "mask_token_id": d.mask_token_id})
