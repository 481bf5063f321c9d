"""Draft folders another trainer wrote (no provenance block of ours), read through the method whose published
layouts include the folder's (``DraftMethod.published_formats``: EAGLE3's speculators' and SGLang's, read in
methods/eagle3/export/published.py), and what every draft folder read back needs: its weights against the model
its spec builds, and a spec completed for the target once it is known.

What a folder leaves unsaid stays open until the target is known (``fit_to_target``): with no aux ids the servers
capture their default ids of the target, [2, L//2, L-3], and so does a run continuing the draft.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..draft.model import DraftSpec
from ..formats import PROVENANCE_KEY, UNKNOWN_LAYERS, ExportFormat
from ..methods import METHODS, draft_method
from ..targets.capture import default_aux_layer_ids


def published_formats() -> list[ExportFormat]:
    """Every registered method's published layouts, in the order tried."""
    return [form for method in METHODS.values() for form in method.published_formats]


def published_format(folder: Path, config: dict) -> ExportFormat:
    """The format whose conventions the folder was written in; refused in one line when none."""
    known = published_formats()
    form = next((form for form in known if form.reads(config)), None)
    if form is None:
        raise ValueError(f"{folder}/config.json: architectures {config.get('architectures')} is neither "
                         f"{' nor '.join(dict.fromkeys(form.published_as for form in known))}; give the folder of a "
                         "draft in one of them")
    return form


def read_published(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> tuple[DraftSpec, dict]:
    """(spec, weights under our names) of a draft folder another trainer wrote (``tensors``: its safetensors)."""
    spec, weights = published_format(folder, config).read_published(folder, config, tensors)
    problem = weight_mismatch(meta_state(spec), weights)
    if problem:
        raise ValueError(f"{folder}: its weights do not fit its config.json ({problem}); the folder is damaged or "
                         "its config is not the one it was saved with")
    return spec, weights


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


def vocab_map_problem(weights: dict[str, torch.Tensor], draft_vocab_size: int, vocab_size: int) -> str | None:
    """What keeps a draft's vocabulary maps from drafting for a target vocabulary of ``vocab_size``, or None: d2t
    (target id = draft id + d2t[draft id]) must send each of the ``draft_vocab_size`` draft ids to its own id of
    the target's vocabulary, and t2d, when there is one, mark exactly the target ids d2t reaches. (Run, evaluation
    and servers index the target's vocabulary with these: an id outside it is an IndexError there.)"""
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if d2t is None:
        return None
    if not _integers(d2t):
        return f"d2t holds {d2t.dtype} values, not integer offsets (target id = draft id + d2t[draft id])"
    if tuple(d2t.shape) != (draft_vocab_size,):
        return f"d2t has shape {tuple(d2t.shape)}, draft_vocab_size {draft_vocab_size} implies ({draft_vocab_size},)"
    targets = d2t.long() + torch.arange(draft_vocab_size)
    outside = ((targets < 0) | (targets >= vocab_size)).nonzero().flatten()
    if outside.numel():
        i, more = int(outside[0]), outside.numel() - 1
        return (f"d2t maps draft id {i} to target id {int(targets[i])}, outside the target's vocabulary (vocab_size "
                f"{vocab_size}: ids 0..{vocab_size - 1})" + (f", and {more} more draft ids" if more else ""))
    ordered, order = targets.sort(stable=True)
    same = (ordered[1:] == ordered[:-1]).nonzero().flatten()
    if same.numel():
        j = int(same[0])
        a, b = sorted((int(order[j]), int(order[j + 1])))
        return (f"d2t maps draft ids {a} and {b} both to target id {int(ordered[j])} ({same.numel()} such "
                "collisions): each draft id stands for a token of its own")
    if t2d is None:
        return None
    if not (t2d.dtype == torch.bool or (_integers(t2d) and bool(((t2d == 0) | (t2d == 1)).all()))):
        return f"t2d holds {t2d.dtype} values, not a mask (bools) of the target ids d2t maps to"
    if tuple(t2d.shape) != (vocab_size,):
        return f"t2d has shape {tuple(t2d.shape)}, vocab_size {vocab_size} implies ({vocab_size},)"
    mapped = torch.zeros(vocab_size, dtype=torch.bool)
    mapped[targets] = True
    differ = (t2d.bool() != mapped).nonzero().flatten()
    if differ.numel():
        t = int(differ[0])
        return (f"t2d marks {int(t2d.bool().sum())} target ids and d2t maps to {draft_vocab_size} (first difference: "
                f"target id {t}, {'marked and not mapped to' if mapped[t] == 0 else 'mapped to and not marked'})")
    return None


def _integers(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def meta_state(spec: DraftSpec) -> dict[str, torch.Tensor]:
    """The state dict our draft of ``spec`` has (shapes only, nothing allocated); the aux ids, which fix only how
    many states fc reads, stand in as 0..n-1 when the folder names none."""
    n_aux = len(spec.aux_layer_ids) or 3
    with torch.device("meta"):
        model = draft_method(spec.method).model(dataclasses.replace(spec, aux_layer_ids=list(range(n_aux))))
    return model.state_dict()


def named_target(folder: Path) -> str | None:
    """The target a draft folder names (speculators' verifier, or the one our provenance block records), or None."""
    config = json.loads((Path(folder) / "config.json").read_text())
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return verifier.get("name_or_path") or (config.get(PROVENANCE_KEY) or {}).get("target") or None


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
