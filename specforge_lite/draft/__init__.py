"""What every draft method shares: the spec and the model base (model.py), the unroll objective every method's
builds on, with the training-time-test unroll and its loss (objective.py, ttt.py, attention.py, head_loss.py,
sequence_parallel.py), chain drafting (drafting.py) and what a method is (method.py). The methods themselves,
each in its folder, are registered in specforge_lite/methods/."""

from .method import DraftMethod
from .model import DraftSpec, TargetWiredDraft
from .objective import TTTOutput, UnrollObjective, by_device, device_settings, sim_accepted_drafts
from .ttt import TTTCache, ttt_attention

Draft = TargetWiredDraft  # what a registered method's model is

__all__ = ["Draft", "DraftMethod", "DraftSpec", "TTTCache", "TTTOutput", "TargetWiredDraft", "UnrollObjective",
           "by_device", "device_settings", "sim_accepted_drafts", "ttt_attention"]
