"""The drafts: EAGLE3 (and P-EAGLE, EAGLE 3.1) with its training-time-test unroll, and DFlash; their
objectives, registered by method (methods.py)."""

from .dflash import DFlashDraft, DFlashObjective
from .methods import METHODS, Draft, build_objective, draft_method
from .model import Eagle3Draft, Eagle3Spec
from .objective import Eagle3Objective, TTTOutput, sim_accepted_drafts
from .ttt import TTTCache, ttt_attention

__all__ = ["DFlashDraft", "DFlashObjective", "Draft", "Eagle3Draft", "Eagle3Objective", "Eagle3Spec", "METHODS",
           "TTTCache", "TTTOutput", "build_objective", "draft_method", "sim_accepted_drafts", "ttt_attention"]
