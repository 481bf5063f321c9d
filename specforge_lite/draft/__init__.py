"""The EAGLE3 draft: model, training-time-test unroll and objective."""

from .loss import TTTOutput, ttt_loss
from .model import Eagle3Draft, Eagle3Spec
from .ttt import TTTCache, ttt_attention

__all__ = ["Eagle3Draft", "Eagle3Spec", "TTTCache", "TTTOutput", "ttt_attention", "ttt_loss"]
