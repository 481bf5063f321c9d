"""Target backends: run the frozen target and emit only the selected hidden states."""

from .capture import CONVENTION, default_aux_layer_ids, resolve_aux_layer_ids
from .hf import Captured, HFTarget
from .sources import ModelUnavailableError

__all__ = ["CONVENTION", "Captured", "HFTarget", "ModelUnavailableError", "default_aux_layer_ids",
           "resolve_aux_layer_ids"]
