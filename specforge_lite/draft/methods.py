"""The draft methods trained from one capture, registered by name (``draft.method``): each is a model class
and the objective that trains it. Both read the same target states (aux ids, teacher), so one hidden-state
store (offline dump) trains any of them. P-EAGLE is the EAGLE3 method with ``draft.parallel_drafting``."""

from __future__ import annotations

from dataclasses import dataclass

from .dflash import DFlashDraft, DFlashObjective
from .model import Eagle3Draft
from .objective import Eagle3Objective


Draft = Eagle3Draft | DFlashDraft  # what build_draft makes: the model of a registered method


@dataclass(frozen=True)
class DraftMethod:
    model: type
    objective: type


METHODS = {"eagle3": DraftMethod(Eagle3Draft, Eagle3Objective), "dflash": DraftMethod(DFlashDraft, DFlashObjective)}


def draft_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise ValueError(f"draft.method={name!r}: use one of {sorted(METHODS)}")
    return METHODS[name]


def build_objective(draft_cfg, sequence=None):
    """The objective of the configured method (``sequence``: a rank's share of each row, EAGLE3 only)."""
    return draft_method(draft_cfg.method).objective.from_config(draft_cfg, sequence)
