"""DFlash 2 as a registered method (methods/__init__.py): DFlash's block draft with local convolutions and a
candidate selector (model.py; vLLM method=dflash, DFlash2DraftModel)."""

from __future__ import annotations

from ...draft.method import DraftMethod, layers_label
from ..dflash import block_fields, refused as block_draft_refused, refused_evaluation
from .export import DFlash2Format
from .model import DFlash2Context, DFlash2Draft, DFlash2Objective
from .settings import DFlash2Settings
from .spec import DFlash2Spec


def refused(config) -> list[str]:
    problems = block_draft_refused(config)
    d = config.draft
    if d.selector_top_k < 1 or d.selector_rank < 1 or d.conv_kernel_size < 1:
        problems.append("draft=dflash2 needs draft.selector_top_k, draft.selector_rank and "
                        "draft.conv_kernel_size >= 1")
    elif d.conv_kernel_size > d.block_size:
        problems.append(f"draft.conv_kernel_size={d.conv_kernel_size} is longer than the block (draft.block_size="
                        f"{d.block_size} slots): use at most {d.block_size}")
    return problems


def label(spec: dict) -> str:
    return f"DFlash 2, {layers_label(spec)}"


METHOD = DraftMethod(
    "dflash2", DFlash2Draft, DFlash2Spec, DFlash2Settings, DFlash2Objective, refused, refused_evaluation,
    DFlash2Context, (DFlash2Format(),), label,
    **block_fields(DFlash2Settings),
    spec_fields=lambda d: {"block_size": d.block_size, "conv_kernel_size": d.conv_kernel_size,
                           "conv_group_size": d.conv_group_size, "selector_rank": d.selector_rank,
                           "selector_top_k": d.selector_top_k, "mask_token_id": d.mask_token_id},
    whole_vocabulary=True)
