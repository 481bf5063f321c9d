"""A finished run's export evaluated in a process of its own (python -m specforge_lite.evaluate --run-dir DIR),
and a draft folder, ours or one another trainer published, evaluated as a run of it (--export DRAFT)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import Config, out_of_range
from ..export import load_export
from ..export.for_target import draft_from_weights, export_final
from ..generation import prepare_with_target
from ..methods import shape_settings
from ..targets import build_target, describe_target, load_tokenizer
from ..targets.store import Manifest
from .acceptance import evaluate_export, write_eval
from .prompts import prompt_set_problems


def finished_run(run_dir: Path, eval_overrides: dict | None = None, log=print) -> tuple[Config, Any, Any, Any]:
    """(config, target, tokenizer, prepared data) of a finished run (its config.yaml and final/ export), for
    evaluating its export: the target captures the export's aux ids. A store-trained run's held-out prompts
    come from the data the store was made from."""
    from ..compose import read_config_file, to_config

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "final" / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished run (needs config.yaml and final/config.json)")
    config = read_config_file(run_dir / "config.yaml")
    if config.data.source == "offline":
        saved = Manifest.load(Path(config.data.store)).source.get("data")
        if not saved:
            raise ValueError(f"the store {config.data.store} does not record its data settings; evaluate with "
                             "data.* overrides naming the data it was made from")
        config.data = to_config({"data": saved}).data
    if config.target.backend == "vllm":  # (decoding with a KV cache runs the target in this process)
        config.target.backend = "hf"
    with_eval_settings(config, eval_overrides)
    spec, _ = load_export(run_dir / "final")
    return (config, *online_parts(config, spec.aux_layer_ids, log))


def with_eval_settings(config: Config, eval_overrides: dict | None) -> None:
    """The evaluation's own settings (the command line's --k, --num-prompts, ...) set in ``config.eval``, checked as
    train.py checks them (their ranges, the prompt files read whole) before anything loads or is written."""
    for key, value in (eval_overrides or {}).items():
        setattr(config.eval, key, value)
    problems = [p for p in out_of_range(config) if p.startswith("eval.")]
    problems += prompt_set_problems(list(config.eval.prompt_sets), dict(config.eval.prompt_files or {}))
    if problems:
        raise ValueError("; ".join(problems))


def online_parts(config: Config, aux_layer_ids: list[int], log=print) -> tuple[Any, Any, Any]:
    """(target, tokenizer, prepared data) an evaluation runs on: the live target capturing ``aux_layer_ids``
    (the draft's), its tokenizer, and the data its held-out prompts come from."""
    target = build_target(config, aux_layer_ids=aux_layer_ids)
    tokenizer = load_tokenizer(target, config.model.chat_template)
    log(f"[target] {describe_target(config, target)}")
    return target, tokenizer, prepare_with_target(config, target, tokenizer, log=log)


def evaluate_finished_run(run_dir: Path, eval_overrides: dict | None = None, log=print) -> dict:
    """Evaluate a finished run's export (python -m specforge_lite.evaluate --run-dir DIR)."""
    config, target, tokenizer, data = finished_run(run_dir, eval_overrides, log)
    result = evaluate_export(config, target, tokenizer, data, Path(run_dir) / "final", log=log)
    write_eval(run_dir, result)
    return result


def evaluate_published(draft_dir: Path, run_dir: Path, overrides: list[str], eval_overrides: dict | None = None,
                       log=print) -> dict:
    """Evaluate a draft folder, ours or one another trainer published (python -m specforge_lite.evaluate --export
    DIR --run-dir OUT [model=...]): ``run_dir`` becomes a run of it, which the served check and a later
    ``--run-dir`` evaluation read as any other (config.yaml with draft.init_from naming the folder, final/ the draft
    in export.format as this project writes it, with its model card, eval.json)."""
    from omegaconf import OmegaConf

    from ..compose import load_config

    draft_dir, run_dir = Path(draft_dir), Path(run_dir)
    if (run_dir / "checkpoints").is_dir():
        raise ValueError(f"--run-dir {run_dir} holds a training run; give another folder for the evaluation of "
                         f"{draft_dir}")
    spec, weights = load_export(draft_dir)  # (read before the target loads: a folder that cannot be is refused)
    # (the draft's own method's settings: draft=<its method>)
    config = load_config(["tracker=none", f"draft={spec.method}", *target_overrides(draft_dir, overrides), *overrides])
    config.draft.init_from = str(draft_dir.resolve())
    for key, value in (shape_settings(config.draft, spec) or {}).items():  # (a block draft's k is its own)
        setattr(config.draft, key, value)
    with_eval_settings(config, eval_overrides)
    target, tokenizer, data = online_parts(config, spec.aux_layer_ids, log)  # (the draft's own aux ids)
    spec = draft_from_weights(spec, weights, target).spec  # (the weights fit this target; what a published
    # folder leaves unsaid settled for it)
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")
    final = export_final(config, target, weights, spec, run_dir, log)  # (its weights in the dtype it was saved in)
    result = evaluate_export(config, target, tokenizer, data, final, log=log)
    write_eval(run_dir, result)
    return result


def target_overrides(draft_dir: Path, overrides: list[str]) -> list[str]:
    """The target a draft folder is evaluated with: the one the overrides name (model=..., model.path=...), else
    the one its config names (speculators' verifier), as the preset of that hub id when there is one; a folder
    that names none is refused, saying how to name it."""
    import os

    from ..config import available_presets, model_preset
    from ..export.published import named_target

    if any(o.split("=", 1)[0].lstrip("+~") in ("model", "model.path") for o in overrides):
        return []
    name = named_target(draft_dir)
    if not name:
        raise ValueError(f"{draft_dir}/config.json does not name the target it drafts for (speculators' "
                         "speculators_config.verifier.name_or_path, or this project's provenance block; SpecForge's "
                         "and SGLang's layout has no such field): name it, e.g. model=llama3_8b (a preset) or "
                         "model.path=meta-llama/Llama-3.1-8B-Instruct (a hub id or a local folder)")
    preset = next((p for p in available_presets("model") if model_preset(p).path == name), None)
    if preset:
        return [f"model={preset}"]
    return [f"model.path={name}"] + ([] if os.path.isdir(os.path.expanduser(name)) else ["model.source=hub"])
