"""EAGLE3 drafts another trainer wrote: a folder in speculators' format (``speculators_model_type``) or in
SpecForge's and SGLang's Llama-EAGLE3 layout (``LlamaForCausalLMEagle3`` without our provenance block), read into
our spec and weight names so that a run continues it (``draft.init_from``) and the evaluation measures it. The
method lists those two formats as its ``published_formats``; export/published.py picks the one whose layout the
folder has and checks the weights against the spec read here.

The format classes that write those layouts know them: the decoder config block (``layer_config``), the weight
names (``our_weight_name``), the aux ids the server the folder was written for feeds (``published_aux_ids``:
eagle_config's are SGLang's and SpecForge's layer outputs, one less than ours; top-level ones are vLLM's and
speculators', ours) and ``norm_before_residual`` when the folder leaves it out (``norm_before_residual_default``:
vLLM's speculators adapter takes true, its Llama-EAGLE3 model false). This module inverts what they write, and
nothing else.

What a folder leaves unsaid stays open until the target is known (export/published.py ``fit_to_target``): with no
aux ids the servers capture their default ids of the target, [2, L//2, L-3], and so does a run continuing the draft.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ....draft.model import _LLAMA_ROPE_TYPES as LLAMA_ROPE_TYPES
from ....draft.model import DRAFT_ACT
from ....formats import UNKNOWN_LAYERS, ExportFormat, Report
from ....formats.layout import decoder_fields
from ....targets.capture import CONVENTION
from ..spec import Eagle3Spec
from .layout import eagle_flag


def read_folder(form: ExportFormat, folder: Path, config: dict,
                tensors: dict[str, torch.Tensor]) -> tuple[Eagle3Spec, dict]:
    """(spec, weights under our names) of a draft folder another trainer wrote in ``form``'s layout
    (``tensors``: its safetensors)."""
    weights = {form.our_weight_name(k): v for k, v in tensors.items()}
    try:
        spec = _spec(folder, config, _layer_config(folder, config, form), form, weights)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(str(folder)) else f"{folder}/config.json: {e}") from None
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
    ids = form.published_aux_ids(config) or []
    _check_fc_width(folder, weights, ids, target_hidden)
    return Eagle3Spec(**fields, vocab_size=_target_vocab(folder, layer, weights),
                      draft_vocab_size=_draft_vocab(folder, config, weights),
                      target_hidden_size=target_hidden, target_num_layers=UNKNOWN_LAYERS, aux_layer_ids=list(ids),
                      aux_convention=CONVENTION, use_aux_norm=bool(config.get("fc_norm") or config.get("use_aux_norm")),
                      norm_before_residual=bool(config.get("norm_before_residual",
                                                           form.norm_before_residual_default)),
                      norm_before_fc=eagle_flag(config, "norm_before_fc"),
                      norm_output=eagle_flag(config, "norm_output"))


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
