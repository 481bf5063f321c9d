"""The EAGLE3 draft: model, training-time-test unroll and objective."""

from .model import Eagle3Draft, Eagle3Spec
from .objective import Eagle3Objective, TTTOutput, sim_accepted_drafts
from .ttt import TTTCache, ttt_attention

__all__ = ["Eagle3Draft", "Eagle3Objective", "Eagle3Spec", "TTTCache", "TTTOutput", "sim_accepted_drafts",
           "ttt_attention"]
