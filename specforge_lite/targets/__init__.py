"""Target backends: run the frozen target and emit only the selected hidden states (protocol.py), and
the teacher built on any of them (teacher.py)."""

from .acquire import ModelUnavailableError
from .capture import CONVENTION, default_aux_layer_ids, resolve_aux_layer_ids
from .hf import HFTarget
from .protocol import Captured, Target
from .teacher import Teacher

__all__ = ["CONVENTION", "Captured", "HFTarget", "ModelUnavailableError", "Target", "Teacher", "default_aux_layer_ids",
           "resolve_aux_layer_ids"]
