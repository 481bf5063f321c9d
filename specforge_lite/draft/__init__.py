"""What every draft method shares: the spec and the model base (model.py), the objective every method's builds on
and its loss (objective.py, head_loss.py), causal attention with its log-sum-exp (attention.py), a row shared by
ranks (sequence_parallel.py), what drafting gives an evaluation (drafting.py) and what a method is (method.py).
The methods themselves, each in its folder, are registered in specforge_lite/methods/."""

from .method import DraftMethod
from .model import DraftSpec, TargetWiredDraft
from .objective import DraftObjective, ObjectiveOutput, sim_accepted_drafts

Draft = TargetWiredDraft  # what a registered method's model is

__all__ = ["Draft", "DraftMethod", "DraftObjective", "DraftSpec", "ObjectiveOutput", "TargetWiredDraft",
           "sim_accepted_drafts"]
