"""EAGLE3 as a registered method (methods/__init__.py), with its options: EAGLE 3.1 (``draft.norm_before_fc``,
``draft.norm_output``), P-EAGLE (``draft.parallel_drafting``: the later tokens from mask slots, one forward)
and several layers (``draft.num_layers``). The model is model.py here, P-EAGLE's mask slots and drafting
parallel.py; its objective, the training-time-test unroll, objective.py, over the attention pattern and key caches
of ttt.py (ulysses.py: across a sequence-parallel group); its chain and tree drafting, drafting.py."""

from __future__ import annotations

import torch

from ...draft.method import DraftMethod, layers_label
from .drafting import DraftContext
from .export import EXPORT_FORMATS, PUBLISHED_FORMATS
from .model import Eagle3Draft
from .objective import TTTObjective
from .parallel import ParallelDraftContext
from .settings import Eagle3Settings
from .spec import Eagle3Spec, norm_problems
from .ttt import TTT_ATTENTION


def spec_fields(draft_settings) -> dict:
    """The spec's EAGLE3 fields from the settings. A norm left null is EAGLE 3.1's unless the per-aux norm
    (fc_norm) was asked for: EAGLE 3.1 won all five comparisons served by vLLM at equal time or steps
    (docs/levers.md, "EAGLE 3.1, repeated"), and the norm over the concatenated states excludes the per-aux one."""
    d, eagle31 = draft_settings, not draft_settings.use_aux_norm
    return {"use_aux_norm": d.use_aux_norm,
            "norm_before_fc": eagle31 if d.norm_before_fc is None else d.norm_before_fc,
            "norm_output": eagle31 if d.norm_output is None else d.norm_output,
            "norm_before_residual": d.norm_before_residual, "parallel_drafting": d.parallel_drafting,
            "mask_token_id": d.mask_token_id if d.parallel_drafting else None}


def refused(config) -> list[str]:
    d = config.draft
    problems = norm_problems(d.use_aux_norm, d.norm_before_fc)
    if d.ttt_attention is not None and d.ttt_attention not in TTT_ATTENTION:
        problems.append(f"draft.ttt_attention={d.ttt_attention!r}: use one of {', '.join(TTT_ATTENTION)}")
    elif d.ttt_attention == "flex" and not torch.cuda.is_available():
        problems.append("draft.ttt_attention=flex needs a CUDA device (flex attention has no backward on a CPU); use "
                        "draft.ttt_attention=blockwise, the same attention in query blocks")
    return problems


def refused_evaluation(draft_settings, ev) -> list[str]:
    if draft_settings.parallel_drafting and ev.drafting == "tree":
        return ["a parallel (P-EAGLE) draft proposes one chain in one forward, from mask slots that follow no sampled "
                "token: use eval.drafting=chain"]
    return []


def warm_start(draft, draft_settings, target) -> None:
    """draft.init_layers_from_target: the draft's layers begin as the target's after the top aux id."""
    if not draft_settings.init_layers_from_target:
        return
    spec = draft.spec
    top = max(spec.aux_layer_ids)
    if top + spec.num_layers > target.num_layers:
        raise ValueError(f"draft.init_layers_from_target: the draft's {spec.num_layers} layer(s) start as target "
                         f"layers {top}.. after the top aux id {top}, and the target has {target.num_layers}; lower "
                         "the top of draft.aux_layer_ids or draft.num_layers")
    draft.start_from_target([target.llama_layer(top + i) for i in range(spec.num_layers)], target.final_norm_weight())


def drafting_of(draft) -> DraftContext:
    """A draft's drafting at serving time: P-EAGLE's one forward, or one step per token."""
    return ParallelDraftContext(draft) if draft.spec.parallel_drafting else DraftContext(draft)


def label(spec: dict) -> str:
    norms = [name for name, key in (("norm_before_fc", "norm_before_fc"), ("fc_norm", "use_aux_norm"),
                                    ("norm_output", "norm_output"),
                                    ("norm_before_residual", "norm_before_residual")) if spec.get(key)]
    name = "EAGLE 3.1" if {"norm_before_fc", "norm_output"} <= set(norms) else "EAGLE3"
    if spec.get("parallel_drafting"):  # the mask slots: every draft token from one forward
        name = f"P-EAGLE ({name} layers)"
    return f"{name}, {layers_label(spec)}" + (f" ({', '.join(norms)})" if norms else "")


METHOD = DraftMethod("eagle3", Eagle3Draft, Eagle3Spec, Eagle3Settings, TTTObjective, refused, refused_evaluation,
                     drafting_of, EXPORT_FORMATS, label,
                     has_mask_slots=lambda draft_settings: draft_settings.parallel_drafting,
                     scored_steps=lambda draft_settings: draft_settings.ttt_length,
                     steps_settings=lambda n: {"ttt_length": n}, spec_fields=spec_fields,
                     warm_start=warm_start, published_formats=PUBLISHED_FORMATS)
