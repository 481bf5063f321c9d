"""Target backends: run the frozen target and emit only the selected hidden states (protocol.py), the target
built from a run's settings (build.py), the teacher built on any of them (teacher.py), and the hidden-state store
that keeps its captures on disk (store.py)."""

from .acquire import ModelUnavailableError
from .build import build_target, describe_target, load_tokenizer, target_identity, tokenizer_before_target
from .capture import CONVENTION, default_aux_layer_ids, resolve_aux_layer_ids
from .hf import HFTarget
from .protocol import Captured, Target
from .teacher import Teacher

__all__ = ["CONVENTION", "Captured", "HFTarget", "ModelUnavailableError", "Target", "Teacher", "build_target",
           "default_aux_layer_ids", "describe_target", "load_tokenizer", "resolve_aux_layer_ids",
           "target_identity", "tokenizer_before_target"]
