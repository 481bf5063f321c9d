"""Drafts another trainer wrote: a folder in speculators' format (``speculators_model_type``) or in SpecForge's and
SGLang's Llama-EAGLE3 layout (``LlamaForCausalLMEagle3`` without our provenance block), read into our spec and
weight names so that a run continues it (``draft.init_from``) and the evaluation measures it.

The format classes that write those layouts know them: the decoder config block (``layer_config``), the weight
names (``our_weight_name``) and the aux-id convention (``read_aux_ids``: SGLang's and SpecForge's ids are layer
outputs, one less than ours; speculators' are ours). This module inverts what they write, and nothing else.

What a folder leaves unsaid stays open until the target is known (``fit_to_target``): with no aux ids the servers
capture their default ids of the target, [2, L//2, L-3], and so does a run continuing the draft.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..draft.model import _LLAMA_ROPE_TYPES as LLAMA_ROPE_TYPES
from ..draft.model import DRAFT_ACT, DraftSpec
from ..methods.eagle3.spec import Eagle3Spec
from ..targets.capture import CONVENTION, default_aux_layer_ids
from .format import ExportFormat
from .layout import PUBLISHED_READERS, decoder_fields, eagle_flag
from .report import Report

UNKNOWN_LAYERS = 0  # target_num_layers of a draft whose target is not known yet


def published_format(folder: Path, config: dict) -> ExportFormat:
    """The format class whose conventions the folder was written in; refused in one line when none."""
    from . import FORMATS

    form = next((FORMATS[name] for name in PUBLISHED_READERS if FORMATS[name].reads(config)), None)
    if form is None:
        raise ValueError(f"{folder}/config.json: architectures {config.get('architectures')} is neither an EAGLE3 "
                         "draft in speculators' format (speculators_model_type) nor SpecForge's and SGLang's Llama "
                         "layout (LlamaForCausalLMEagle3); give the folder of an EAGLE3 draft in one of them")
    return form


def read_published(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> tuple[Eagle3Spec, dict]:
    """(spec, weights under our names) of a draft folder another trainer wrote (``tensors``: its safetensors)."""
    form = published_format(folder, config)
    weights = {form.our_weight_name(k): v for k, v in tensors.items()}
    try:
        spec = _spec(folder, config, _layer_config(folder, config, form), form, weights)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(str(folder)) else f"{folder}/config.json: {e}") from None
    problem = weight_mismatch(meta_state(spec), weights)
    if problem:
        raise ValueError(f"{folder}: its weights do not fit its config.json ({problem}); the folder is damaged or "
                         "its config is not the one it was saved with")
    return spec, weights


def _spec(folder: Path, config: dict, layer: dict, form: ExportFormat, weights: dict) -> Eagle3Spec:
    fields = decoder_fields(layer)
    kind = layer.get("model_type") or "llama"
    if fields["hidden_act"] != DRAFT_ACT or kind != "llama":
        raise ValueError(f"a {kind} draft layer running {fields['hidden_act']}: this version reads Llama-layer EAGLE3 "
                         f"drafts with {DRAFT_ACT} (what vLLM's and SGLang's Llama drafts run)")
    if fields["rope_parameters"].get("rope_type", "default") not in LLAMA_ROPE_TYPES:
        raise ValueError(f"rope type {fields['rope_parameters'].get('rope_type')!r}: the Llama draft layer runs "
                         f"{', '.join(LLAMA_ROPE_TYPES)}")
    target_hidden = config.get("target_hidden_size") or fields["hidden_size"]
    ids = form.read_aux_ids(config) or []
    _check_fc_width(folder, weights, ids, target_hidden)
    return Eagle3Spec(**fields, vocab_size=_target_vocab(folder, layer, weights),
                      draft_vocab_size=_draft_vocab(folder, config, weights),
                      target_hidden_size=target_hidden, target_num_layers=UNKNOWN_LAYERS, aux_layer_ids=list(ids),
                      aux_convention=CONVENTION, use_aux_norm=bool(config.get("fc_norm") or config.get("use_aux_norm")),
                      norm_before_residual=bool(config.get("norm_before_residual", False)),
                      norm_before_fc=eagle_flag(config, "norm_before_fc"),
                      norm_output=eagle_flag(config, "norm_output"))


def weight_mismatch(own: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> str | None:
    """What keeps ``weights`` from loading into a model whose state dict is ``own`` (the target's embedding,
    which the servers substitute, aside), or None."""
    weights = {k: v for k, v in weights.items() if not k.startswith("embed_tokens.")}
    wrong = [f"{k} {tuple(v.shape)}, expected {tuple(own[k].shape)}" for k, v in weights.items()
             if k in own and v.shape != own[k].shape]
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    parts = [f"shapes {wrong[:3]}" if wrong else "", f"missing {missing[:5]}" if missing else "",
             f"unknown names {unexpected[:5]}" if unexpected else ""]
    return "; ".join(p for p in parts if p) or None


def meta_state(spec: DraftSpec) -> dict[str, torch.Tensor]:
    """The state dict our draft of ``spec`` has (shapes only, nothing allocated); the aux ids, which fix only how
    many states fc reads, stand in as 0..n-1 when the folder names none."""
    from ..methods import draft_method

    n_aux = len(spec.aux_layer_ids) or 3
    with torch.device("meta"):
        model = draft_method(spec.method).model(dataclasses.replace(spec, aux_layer_ids=list(range(n_aux))))
    return model.state_dict()


def named_target(folder: Path) -> str | None:
    """The target a draft folder names (speculators' verifier), or None."""
    config = json.loads((Path(folder) / "config.json").read_text())
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or None


def fit_to_target(spec: DraftSpec, num_layers: int) -> DraftSpec:
    """A draft's spec for a target of ``num_layers`` layers: the servers' default aux ids when the draft names
    none; ids past the target's layers are refused (the draft was made for a deeper target)."""
    if spec.target_num_layers != UNKNOWN_LAYERS:
        return spec  # (ours: made for its target; draft_from_weights compares the shapes with this one)
    ids = list(spec.aux_layer_ids) or default_aux_layer_ids(num_layers)
    if max(ids) > num_layers:
        raise ValueError(f"the draft reads aux ids {ids} and this target has {num_layers} layers (ids 0..{num_layers})"
                         ": it was trained for another target; name the one it drafts for (model=...)")
    return dataclasses.replace(spec, aux_layer_ids=ids, target_num_layers=num_layers)


def _layer_config(folder: Path, config: dict, form: ExportFormat) -> dict:
    report = Report(folder)
    layer = form.layer_config(config, report)
    if layer is None:
        raise ValueError(f"{folder}/config.json: {'; '.join(report.errors)}")
    return layer


def _target_vocab(folder: Path, layer: dict, weights: dict) -> int:
    """The target's vocabulary, which the file states (a config class's default would be some other model's)."""
    if layer.get("vocab_size"):
        return int(layer["vocab_size"])
    if "t2d" in weights:
        return int(weights["t2d"].shape[0])
    raise ValueError(f"{folder}/config.json: no vocab_size (the target's vocabulary, which d2t maps into); write it")


def _draft_vocab(folder: Path, config: dict, weights: dict) -> int:
    if config.get("draft_vocab_size"):
        return int(config["draft_vocab_size"])
    if "lm_head.weight" not in weights:
        raise ValueError(f"{folder}: no draft_vocab_size in config.json and no lm_head.weight: the draft's vocabulary "
                         "is unknown (SGLang would borrow the target's head); write draft_vocab_size and the head")
    return int(weights["lm_head.weight"].shape[0])


def _check_fc_width(folder: Path, weights: dict, ids: list[int], target_hidden: int) -> None:
    """fc reads one target state per aux id: its width says how many the draft was trained on."""
    if "fc.weight" not in weights:
        raise ValueError(f"{folder}: no fc.weight among its weights ({sorted(weights)[:6]} ...): not an EAGLE3 draft")
    width = int(weights["fc.weight"].shape[1])
    expected = (len(ids) or 3) * target_hidden
    if width != expected:
        raise ValueError(f"{folder}: fc.weight reads {width} features, the config implies {expected} "
                         f"({len(ids) or 'the default 3'} aux states of {target_hidden}); fix "
                         "eagle_aux_hidden_state_layer_ids or target_hidden_size in its config.json")
