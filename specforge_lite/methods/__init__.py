"""The draft methods, one folder each (its model, spec, settings, drafting, refusals, label and export formats),
registered here by name: adding a method is its folder and its line in ``METHODS`` (with its name in the import),
and draft=<name> then selects its settings (compose.py) and export.format its formats (export/). The rest of the
project asks the method (``draft_method(name)``), never its name (draft/method.py: what a method offers)."""

from __future__ import annotations

import dataclasses

from ..draft.method import DraftMethod
from ..draft.model import DraftSpec
from . import dflash, dflash2, dspark, eagle3

METHODS: dict[str, DraftMethod] = {m.name: m for m in (
    eagle3.METHOD,
    dflash.METHOD,
    dspark.METHOD,
    dflash2.METHOD,
)}
DEFAULT = "eagle3"  # draft.method's default, and the method of a spec written before methods were recorded


def draft_method(name: str) -> DraftMethod:
    if name not in METHODS:
        raise ValueError(f"draft={name}: no such method; use one of {', '.join(sorted(METHODS))}")
    return METHODS[name]


def register(method: DraftMethod) -> DraftMethod:
    """A method added at run time (a plug-in outside this package; the tests' own)."""
    METHODS[method.name] = method
    return method


def draft_spec(target_config, draft_cfg, aux_layer_ids: list[int], convention: str, vocab_size: int,
               draft_vocab_size: int, target_hidden_size: int) -> DraftSpec:
    """The spec of a new draft of these settings for this target (``DraftMethod.new_spec`` of their method)."""
    return draft_method(draft_cfg.method).new_spec(target_config, draft_cfg, aux_layer_ids, convention, vocab_size,
                                                   draft_vocab_size, target_hidden_size)


def read_spec(fields: dict) -> DraftSpec:
    """A saved spec (a checkpoint's spec.json, an export's provenance block) as its method's spec. A spec written
    before each method had its own holds every method's fields, those of the others off (false, 0 or null): they
    are dropped. A field the method does not have that is on says the file is not a draft of that method."""
    method = draft_method(fields.get("method") or DEFAULT)
    own = {f.name for f in dataclasses.fields(method.spec)}
    foreign = {key: value for key, value in fields.items() if key not in own and value not in (None, False, 0)}
    if foreign:
        raise ValueError(f"a spec of a {method.name} draft records {foreign}, which a {method.name} draft does not "
                         "have: the file was not written for this draft; export or train the draft again")
    return method.spec(**{**{key: value for key, value in fields.items() if key in own}, "method": method.name})


def build_objective(draft_cfg, sequence=None):
    """The objective of the configured method (``sequence``: a rank's share of each row, EAGLE3 only)."""
    return draft_method(draft_cfg.method).objective.from_config(draft_cfg, sequence)


def fixed_fields(draft_settings, spec) -> dict:
    """The spec fields of a block draft that the settings fix (``spec_fields``): its block is its input, so a run
    continuing ``spec`` trains the shape its settings give. None for a draft of any k (EAGLE3: a continued draft
    keeps its own shape), and none that the settings leave null (a mask token chosen from the data)."""
    method = draft_method(spec.method)
    if method.fixed_draft_tokens(spec.to_dict()) is None:
        return {}
    return {key: value for key, value in method.spec_fields(draft_settings).items() if value is not None}


def shape_settings(draft_settings, spec) -> dict | None:
    """The draft settings that differ from ``draft_settings`` and give a draft of ``spec``'s method the shape
    ``spec`` has where the method's settings fix it (a block draft's block_size, the settings that give its k); {}
    when they already do, None when no settings give it."""
    if all(getattr(spec, key) == value for key, value in fixed_fields(draft_settings, spec).items()):
        return {}
    method = draft_method(spec.method)
    k = method.fixed_draft_tokens(spec.to_dict())
    fixes = {**(method.steps_settings(k) if k is not None else {}),
             **{key: getattr(spec, key) for key in fixed_fields(draft_settings, spec) if hasattr(draft_settings, key)}}
    fixes = {key: value for key, value in fixes.items() if getattr(draft_settings, key) != value}
    fits = all(getattr(spec, key) == value
               for key, value in fixed_fields(dataclasses.replace(draft_settings, **fixes), spec).items())
    return fixes if fits else None


def draft_vocab_size(draft_cfg, target_vocab_size: int) -> int:
    """The draft vocabulary a run of these settings has (``DraftMethod.draft_vocab_size`` of their method)."""
    return draft_method(draft_cfg.method).draft_vocab_size(draft_cfg, target_vocab_size)


__all__ = ["DEFAULT", "METHODS", "build_objective", "draft_method", "draft_spec", "draft_vocab_size", "fixed_fields",
           "read_spec", "register", "shape_settings"]
