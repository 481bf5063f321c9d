"""DSpark as a registered method (methods/__init__.py): DFlash's backbone with a Markov head and a confidence
head (model.py; vLLM method=dspark)."""

from __future__ import annotations

from ...draft.method import DraftMethod, layers_label
from ..dflash import block_fields, refused as block_draft_refused, refused_evaluation
from .export import DSparkFormat
from .model import DSparkContext, DSparkDraft, DSparkObjective
from .settings import DSparkSettings
from .spec import DSparkSpec


def refused(config) -> list[str]:
    problems = block_draft_refused(config)
    if config.draft.markov_rank < 1:
        problems.append(f"draft.markov_rank={config.draft.markov_rank}: DSpark's Markov head needs a rank >= 1 "
                        "(vLLM refuses a DSpark draft without one); draft=dflash is the block draft without it")
    return problems


def label(spec: dict) -> str:
    return f"DSpark, {layers_label(spec)}"


METHOD = DraftMethod(
    "dspark", DSparkDraft, DSparkSpec, DSparkSettings, DSparkObjective, refused, refused_evaluation, DSparkContext,
    (DSparkFormat(),), label, **block_fields(DSparkSettings),
    spec_fields=lambda d: {"block_size": d.block_size, "markov_rank": d.markov_rank, "mask_token_id": d.mask_token_id})
