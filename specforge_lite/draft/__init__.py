"""The drafts: EAGLE3 (and P-EAGLE, EAGLE 3.1) with its training-time-test unroll, DFlash, DSpark and DFlash 2;
each method registered with everything about it in its own module (methods.py: the registry; eagle3.py,
dflash.py, dspark.py, dflash2.py)."""

from . import eagle3  # noqa: F401  (registers the method)
from .dflash import DFlashDraft, DFlashObjective
from .dflash2 import DFlash2Draft, DFlash2Objective
from .dspark import DSparkDraft, DSparkObjective
from .methods import METHODS, DraftMethod, build_objective, draft_method
from .model import Eagle3Draft, Eagle3Spec
from .objective import Eagle3Objective, TTTOutput, sim_accepted_drafts
from .ttt import TTTCache, ttt_attention

Draft = Eagle3Draft | DFlashDraft | DSparkDraft | DFlash2Draft  # what build_draft makes: a registered method's model

__all__ = ["DFlash2Draft", "DFlash2Objective", "DFlashDraft", "DFlashObjective", "DSparkDraft", "DSparkObjective",
           "Draft", "DraftMethod", "Eagle3Draft", "Eagle3Objective", "Eagle3Spec", "METHODS", "TTTCache", "TTTOutput",
           "build_objective", "draft_method", "sim_accepted_drafts", "ttt_attention"]
