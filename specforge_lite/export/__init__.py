"""Exports that inference servers load as they are: written (``export_draft``, ``export_run``), read back
(``load_export``) and checked (check.py), in the formats of the registered methods. Each format is a class in its
method's folder (methods/<name>/export, on formats/ ``ExportFormat``) and comes with the method's registration
(``DraftMethod.export_formats``): adding a format is its class there and its place in that tuple, and a method
registered at run time brings its own."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ..device import resolve_dtype
from ..draft.model import DRAFT_ACT, DraftSpec
from ..formats import PROVENANCE_KEY, ExportFormat, ExportRefused
from ..formats.layout import draft_weights, write_export
from ..methods import DEFAULT, METHODS, draft_method, read_spec
from ..records import (SPEC, WEIGHTS, CheckpointError, latest_checkpoint, load_checkpoint,
                       unusable_checkpoints)
from .card import write_model_card
from .check import AGAIN
from .published import (fit_to_target, meta_state, published_formats, read_published, vocab_map_problem,
                        weight_mismatch)


class _Formats(Mapping):
    """export.format=<name> -> the format: every registered method's ``export_formats`` (the first method to
    name a format gives it), read from the methods' registry at each use."""

    def _by_name(self) -> dict[str, ExportFormat]:
        found: dict[str, ExportFormat] = {}
        for method in METHODS.values():
            for form in method.export_formats:
                found.setdefault(form.name, form)
        return found

    def __getitem__(self, name: str) -> ExportFormat:
        return self._by_name()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name())

    def __len__(self) -> int:
        return len(self._by_name())


FORMATS: Mapping[str, ExportFormat] = _Formats()


def export_format(fmt: str, method: str) -> ExportFormat:
    """The format that writes ``fmt`` for a draft of ``method``: export.format=vllm is the layout vLLM loads for
    the method (the first of its ``export_formats``: EAGLE3's Llama layout, or the method's own)."""
    if fmt not in FORMATS:
        raise ValueError(f"export.format={fmt!r}: choose one of {sorted(FORMATS)}")
    return draft_method(method).export_formats[0] if fmt == "vllm" else FORMATS[fmt]


def export_refusals(form: ExportFormat, draft) -> list[str]:
    """What ``form`` cannot write of a draft (its trained spec, or its method's settings before training), each
    with the fix: a format that is not one of the draft's method's, else the format's own refusals."""
    if form.name not in {f.name for f in draft_method(draft.method).export_formats}:
        return [f"export.format={form.name} cannot write a {draft.method} draft: export it with "
                f"export.format=vllm (vLLM's own layout for it)"]
    return form.refusals(draft)


def export_draft(weights: dict[str, torch.Tensor], spec: DraftSpec, fmt: str, out_dir: Path, dtype: str = "auto",
                 embedding: torch.Tensor | None = None, warn=None, verifier: dict | None = None,
                 num_speculative_tokens: int = 3) -> Path:
    """Write ``fmt``'s config.json and model.safetensors. ``verifier``: the target's ``name_or_path`` (recorded in
    every format's provenance block, so that the folder names the target it drafts for) and ``architectures``
    (speculators' config); ``num_speculative_tokens``: its proposal length."""
    form = export_format(fmt, spec.method)
    if spec.hidden_act != DRAFT_ACT:
        raise ValueError(f"this draft was trained with hidden_act={spec.hidden_act!r}; the servers' EAGLE3 draft is a "
                         f"Llama layer whose MLP runs {DRAFT_ACT} only (vLLM and SGLang refuse anything else), and "
                         "relabelling the activation would change what the weights compute. Retrain it with this "
                         f"version, which trains every family's draft with {DRAFT_ACT}")
    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=2))
    torch_dtype = weights["fc.weight"].dtype if dtype == "auto" else resolve_dtype(dtype, torch.device("cpu"))
    problems = export_refusals(form, spec)
    if problems:
        raise ExportRefused("; ".join(problems))
    config = form.write_config(spec, torch_dtype, verifier or {}, num_speculative_tokens, warn)
    if (verifier or {}).get("name_or_path"):
        config[PROVENANCE_KEY]["target"] = verifier["name_or_path"]
    tensors = draft_weights(weights, torch_dtype, form.with_vocab_maps(spec), embedding)
    return write_export(out_dir, config, {form.weight_name(k): v for k, v in tensors.items()})


def export_run(run_dir: Path, fmt: str, out_dir: Path, checkpoint: Path | None = None, dtype: str = "auto") -> Path:
    weights, spec = _run_draft(Path(run_dir), checkpoint)
    verifier, k = {}, 3
    if (Path(run_dir) / "config.yaml").is_file():  # the target the run trained against, for speculators
        from ..config import read_config_node

        saved = read_config_node(Path(run_dir) / "config.yaml")
        verifier = {"name_or_path": saved.model.get("path") or saved.model.get("name")}
        k = int(saved.eval.get("num_draft_tokens", 3))
    out = export_draft(weights, spec, fmt, out_dir, dtype, verifier=verifier, num_speculative_tokens=k)
    write_model_card(out, Path(run_dir))
    return out


# the way out of a damaged checkpoint (an export, as a resume: training/checkpoint.py says the same)
EARLIER = "export an earlier checkpoint of the run (--checkpoint FOLDER)"


def _run_draft(run_dir: Path, checkpoint: Path | None) -> tuple[dict[str, torch.Tensor], DraftSpec]:
    """The draft of a run to export: the checkpoint given, else the newest; a run without checkpoints whose final/
    holds a draft (an evaluated published draft: python -m specforge_lite.evaluate --export) exports that."""
    if checkpoint is not None and not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no such folder; give one of the run's checkpoints/step_* "
                                "folders, or leave --checkpoint out for the newest")
    ckpt = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir, log=print)
    if ckpt is not None:
        weights, _, saved = load_checkpoint(ckpt)
        try:
            spec = read_spec(saved)
        except (TypeError, ValueError) as e:  # (a dataclass built from a mapping that lacks fields: a TypeError)
            raise CheckpointError(f"checkpoint {ckpt} is damaged: its {SPEC} does not read as a draft's ({e}); "
                                  f"{EARLIER}") from None
        problem = weight_mismatch(meta_state(spec), weights)
        if problem:  # (an export would stop on a missing name, or write a folder no server loads)
            raise CheckpointError(f"checkpoint {ckpt} is damaged: its {WEIGHTS} does not fit its own {SPEC} "
                                  f"({problem}); {EARLIER}")
        return weights, spec
    unusable = unusable_checkpoints(run_dir)
    if not unusable and (run_dir / "final" / "config.json").is_file():
        spec, weights = load_export(run_dir / "final")
        return weights, spec
    raise FileNotFoundError(f"no checkpoint under {run_dir / 'checkpoints'} can be read"
                            + (f" ({'; '.join(unusable)})" if unusable else "") + "; train first or pass --checkpoint")


def load_export(export_dir: Path) -> tuple[DraftSpec, dict[str, torch.Tensor]]:
    """Read a draft folder into our spec and state dict: ours (the round trip, evaluation of final/), or a draft
    another trainer published in a layout a registered method reads (EAGLE3's: speculators' format, SpecForge's
    and SGLang's Llama layout; export/published.py: what it leaves unsaid is settled by ``fit_to_target`` once the
    target is known)."""
    export_dir = Path(export_dir)
    config, tensors = _read_folder(export_dir)
    if PROVENANCE_KEY in config:
        spec = _recorded_spec(export_dir, config[PROVENANCE_KEY])
        form = FORMATS.get(config[PROVENANCE_KEY].get("format", "vllm"), FORMATS["vllm"])
        weights = {form.our_weight_name(k): v for k, v in tensors.items()}
    else:
        spec, weights = read_published(export_dir, config, tensors)
    if "d2t" not in weights and spec.draft_vocab_size != spec.vocab_size:
        raise ValueError(f"{export_dir}: draft_vocab_size {spec.draft_vocab_size} and vocab_size {spec.vocab_size} "
                         "but no d2t among its weights: which target token each draft id stands for is unknown; the "
                         f"folder is damaged: {AGAIN}")
    if "d2t" not in weights:  # full draft vocabulary: identity maps
        weights["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
        weights["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    problem = vocab_map_problem(weights, spec.draft_vocab_size, spec.vocab_size)
    if problem:  # (before a run or evaluation indexes the target's vocabulary with it)
        raise ValueError(f"{export_dir}: {problem}; the folder is damaged, or its config.json is not the one its "
                         f"weights were saved with: {AGAIN}")
    problem = weight_mismatch(meta_state(spec), weights)
    if problem:
        raise ValueError(f"{export_dir}: its weights do not fit the draft its config.json records ({problem}): the "
                         f"folder is damaged; {AGAIN}")
    return spec, weights


def _read_folder(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every *.safetensors file of a draft folder (a published draft may come in shards)."""
    from safetensors.torch import load_file

    from ..files import read_json, safetensors_problem

    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: give the folder of a draft (config.json and "
                                "*.safetensors)")
    config = read_json(folder / "config.json", AGAIN)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights (a pytorch_model.bin is not read: convert it "
                                f"to safetensors); if it had them, {AGAIN}")
    damaged = [problem for path in files if (problem := safetensors_problem(path))]
    if damaged:
        raise ValueError(f"{folder}: {'; '.join(damaged)}; {AGAIN}")
    tensors = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return config, tensors


def _recorded_spec(folder: Path, provenance: dict) -> DraftSpec:
    """The spec our export records (its provenance block), as its method's (``read_spec``). A method or a field
    this version does not know is a newer version's; a missing field without a default, damage."""
    import dataclasses

    spec = provenance.get("spec") if isinstance(provenance, dict) else None
    if not isinstance(spec, dict):
        raise ValueError(f"{folder}/config.json is damaged (its {PROVENANCE_KEY!r} block records no draft spec); "
                         f"{AGAIN}")
    known = {f.name for m in METHODS.values() for f in dataclasses.fields(m.spec)}
    unknown = sorted(set(spec) - known)
    if (spec.get("method") or DEFAULT) not in METHODS:
        unknown = [f"method={spec['method']}", *unknown]
    if unknown:
        raise ValueError(f"{folder}/config.json records draft settings this version does not know "
                         f"({', '.join(unknown)}): it was written by a newer specforge_lite; read it with that "
                         "version, or export it again with this one")
    fields = dataclasses.fields(draft_method(spec.get("method") or DEFAULT).spec)
    lacking = [f.name for f in fields if f.name not in spec and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if lacking:
        raise ValueError(f"{folder}/config.json is damaged (its draft spec lacks {', '.join(lacking)}); {AGAIN}")
    try:
        return read_spec(spec)
    except ValueError as e:
        raise ValueError(f"{folder}/config.json: {e}") from None


def record_confidence_calibration(export_dir: Path, fit: dict) -> None:
    """The evaluation's fitted calibration of the draft's confidences (evaluate/confidence.py: calibrated =
    sigmoid(a * logit(confidence) + b)) in the export's provenance block, where a reader of the folder finds it
    (servers ignore the block). The config is replaced whole, never left half written."""
    from ..files import write_then_rename

    path = Path(export_dir) / "config.json"
    config = json.loads(path.read_text())
    if PROVENANCE_KEY not in config:
        return
    config[PROVENANCE_KEY]["confidence_calibration"] = {k: fit[k] for k in ("kind", "a", "b", "ece_before",
                                                                              "ece_after")}
    write_then_rename(path, lambda tmp: tmp.write_text(json.dumps(config, indent=2) + "\n"))


def cpu_serving_refusal(export_dir: Path) -> str | None:
    """Why vLLM's CPU build cannot serve this export (its format's reason), or None when it can (or when there is
    no export to read: what is missing is then said by whoever needs it)."""
    from ..files import read_json

    path = Path(export_dir) / "config.json"
    if not path.is_file():
        return None
    config = read_json(path, AGAIN)
    form = next((f for f in FORMATS.values() if f.cpu_serving_refusal and f.reads(config)), None)
    return form.cpu_serving_refusal if form else None


def fixed_draft_tokens(export_dir: Path) -> int | None:
    """The one k an export can be served and evaluated at, or None when any k will do: a block draft's block
    (DFlash: the next token and k mask slots; DSpark: k slots) is its input, so its k is fixed at training."""
    return _fixed_draft_tokens(export_dir)[0]


def _fixed_draft_tokens(export_dir: Path):
    """(``fixed_draft_tokens``, the method of the draft: None for a folder no format reads)."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    spec = (config.get(PROVENANCE_KEY) or {}).get("spec")
    if spec:
        method = draft_method(spec.get("method", DEFAULT))
        return method.fixed_draft_tokens(spec), method
    form = next((f for f in FORMATS.values() if f.reads(config)), None)  # a folder written elsewhere
    if form is None:
        return None, None
    return form.fixed_draft_tokens(config), next(m for m in METHODS.values() if form in m.export_formats)


def check_draft_tokens(export_dir: Path, k: int) -> None:
    """Refuse serving or evaluating an export at a k it cannot run as trained (``fixed_draft_tokens``)."""
    fixed, method = _fixed_draft_tokens(export_dir)
    if fixed is not None and k != fixed:
        block = " ".join(f"draft.{key}={value}" for key, value in method.steps_settings(k).items())
        raise ValueError(f"{export_dir} is a block draft ({method.name}) trained to propose k={fixed} tokens per "
                         f"block: a block of another size is an input it never saw, so its acceptance at k={k} says "
                         f"nothing of it. Serve and evaluate it at k={fixed}, or train a draft for k={k} "
                         f"(draft={method.name} {block} eval.num_draft_tokens={k})")


__all__ = ["FORMATS", "ExportFormat", "ExportRefused", "check_draft_tokens", "cpu_serving_refusal", "export_draft",
           "export_format", "export_refusals", "export_run", "fit_to_target", "fixed_draft_tokens", "load_export",
           "published_formats", "record_confidence_calibration"]
