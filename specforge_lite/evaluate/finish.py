"""The end of a run: the export servers load, the evaluation where the target runs whole on one
process, and the served check (eval.serve); and the same evaluation of a finished run later
(python -m specforge_lite.evaluate --run-dir DIR)."""

from __future__ import annotations

from pathlib import Path

from ..data.vocab import DraftVocab
from ..draft import Draft
from ..run import Run
from .acceptance import evaluate_export, write_eval

SERVED_CHECKS = (None, "vllm")  # eval.serve (checked before anything runs: settings.py)


def finish(run: Run, result, draft: Draft, run_dir: Path, log=print) -> dict:
    """Export (rank 0), evaluate, and the served check. Every rank returns the summary after the others
    are released; a failed served check then exits loudly."""
    config, ctx = run.config, run.ctx
    summary = {"run_dir": str(run_dir), "step": result.step, "checkpoint": str(result.checkpoint),
               "metrics": str(run_dir / "metrics.jsonl")}
    if not result.finished:
        log(f"[train] stopped at step {result.step} of {config.trainer.max_steps} (trainer.stop_at_step); "
            f"run again with the same output_dir to resume")
        return summary
    if ctx.is_main:
        summary["final"] = str(export_final(run, result.weights, draft, run_dir, log))
        _evaluate(run, summary, result, run_dir, log)
    ctx.barrier()
    if str(summary.get("served", "")).startswith("failed"):  # loud, after the other ranks were released
        raise SystemExit(f"error: {summary['served']}")
    return summary


def export_final(run: Run, weights: dict, draft: Draft, run_dir: Path, log=print) -> Path:
    """RUN/final in export.format, for the target the run trained against."""
    from ..export import export_draft
    from ..export.card import write_model_card

    config, target = run.config, run.target
    embedding = target.embedding_weight() if config.export.include_embeddings else None
    verifier = {"name_or_path": config.model.path or str(target.location),
                "architectures": list(getattr(target.config, "architectures", None) or [])}
    final = export_draft(weights, draft.spec, config.export.format, run_dir / "final", config.export.dtype,
                         embedding, warn=lambda m: log(f"[export] warning: {m}"), verifier=verifier,
                         num_speculative_tokens=config.eval.num_draft_tokens)
    write_model_card(final, run_dir)
    return final


def _evaluate(run: Run, summary: dict, result, run_dir: Path, log) -> None:
    """Rank 0's evaluation of the export, when it can run here."""
    again = f"python -m specforge_lite.evaluate --run-dir {run_dir}"
    if run.config.target.shard == "zero3" and run.ctx.enabled:
        # A sharded target needs every rank in each of its forwards: evaluated afterwards on one process.
        log(f"[eval] skipped in a sharded-target run: {again}")
        return
    if run.data is None:
        log(f"[eval] a store-trained draft is evaluated where its target runs: {again}")
        return
    if run.config.eval.enabled:
        evaluation = evaluate_export(run.config, run.target, run.tokenizer, run.data, Path(summary["final"]), log=log)
        summary["eval"] = str(write_eval(run_dir, evaluation))
        # the cheap training-time estimate next to the measured number, where the sweep's runs are compared
        run.tracker(run_dir, result.step).close(summary={
            "eval/mean_acceptance_length": evaluation["mean_acceptance_length"],
            "eval/heldout_sim_accepted_drafts": evaluation["heldout_sim_accepted_drafts"],
            "train/sim_accepted_drafts": result.last_metrics.get("sim_accepted_drafts")})
        log(f"[eval] mean acceptance length {evaluation['mean_acceptance_length']:.3f} at "
            f"k={evaluation['num_draft_tokens']}, held-out acc {[round(a, 3) for a in evaluation['heldout_acc']]}")
        if run.config.eval.serve:
            summary["served"] = served_check(run_dir, log)
    log("[done] " + ", ".join(f"{k}: {v}" for k, v in summary.items()))


def served_check(run_dir: Path, log) -> str:
    """eval.serve=vllm: vLLM serves the export; 'failed: why' when its outputs differ from greedy."""
    from ..serving import serving_python
    from .served import ServedMismatch, serve

    if serving_python() is None:  # asked for, not possible here: say how, keep the run's results
        log("[serve] skipped: no serving environment. Build it (bash scripts/setup_serving.sh), then "
            f"python -m specforge_lite.evaluate.served {run_dir}")
        return "skipped (no serving environment)"
    try:
        serve([run_dir], log=log)
    except ServedMismatch as e:
        return f"failed: {e}"
    return str(run_dir / "vllm_eval.json")


def finished_run(run_dir: Path, eval_overrides: dict | None = None, log=print) -> Run:
    """A finished run (its config.yaml and final/ export) rebuilt online for evaluation, with the
    export's aux ids and draft vocabulary. A store-trained run's held-out prompts come from the data
    the store was made from."""
    from ..config import read_config_file, to_config
    from ..export import load_export

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "final" / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished run (needs config.yaml and final/config.json)")
    config = read_config_file(run_dir / "config.yaml")
    if config.data.source == "offline":
        from ..offline import Manifest

        saved = Manifest.load(Path(config.data.store)).source.get("data")
        if not saved:
            raise ValueError(f"the store {config.data.store} does not record its data settings; evaluate with "
                             "data.* overrides naming the data it was made from")
        config.data = to_config({"data": saved}).data
    for key, value in (eval_overrides or {}).items():
        setattr(config.eval, key, value)
    spec, weights = load_export(run_dir / "final")
    vocab = DraftVocab.from_d2t(weights["d2t"], spec.vocab_size)
    config.draft.init_from = None  # (final/ is what is evaluated, not the draft the run started from)
    return Run.online(config, log=log, aux_layer_ids=spec.aux_layer_ids, vocab=vocab)


def evaluate_finished_run(run_dir: Path, eval_overrides: dict | None = None, log=print) -> dict:
    """Evaluate a finished run's export (python -m specforge_lite.evaluate --run-dir DIR)."""
    run = finished_run(run_dir, eval_overrides, log)
    result = evaluate_export(run.config, run.target, run.tokenizer, run.data, Path(run_dir) / "final", log=log)
    write_eval(run_dir, result)
    return result


def evaluate_published(draft_dir: Path, run_dir: Path, overrides: list[str], eval_overrides: dict | None = None,
                       log=print) -> dict:
    """Evaluate a draft folder, ours or one another trainer published (python -m specforge_lite.evaluate --export
    DIR --run-dir OUT [model=...]): ``run_dir`` becomes a run of it, which the served check and a later
    ``--run-dir`` evaluation read as any other (config.yaml with draft.init_from naming the folder, final/ the draft
    in export.format as this project writes it, with its model card, eval.json)."""
    from omegaconf import OmegaConf

    from ..config import load_config
    from ..export import load_export
    from ..pipeline import shape_settings

    draft_dir, run_dir = Path(draft_dir), Path(run_dir)
    if (run_dir / "checkpoints").is_dir():
        raise ValueError(f"--run-dir {run_dir} holds a training run; give another folder for the evaluation of "
                         f"{draft_dir}")
    spec = load_export(draft_dir)[0]  # (read before the target loads: a folder that cannot be is refused)
    config = load_config(["tracker=none", *target_overrides(draft_dir, overrides), *overrides])
    config.draft.method, config.draft.init_from = spec.method, str(draft_dir.resolve())
    for key, value in (shape_settings(config.draft, spec) or {}).items():  # (a block draft's k is its own)
        setattr(config.draft, key, value)
    for key, value in (eval_overrides or {}).items():
        setattr(config.eval, key, value)
    run = Run.online(config, log=log)  # (the draft's own aux ids and vocabulary: draft.init_from)
    draft = run.build_draft()
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")
    final = export_final(run, run.initial[1], draft, run_dir, log)  # (its weights in the dtype it was saved in)
    result = evaluate_export(config, run.target, run.tokenizer, run.data, final, log=log)
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
                         "speculators_config.verifier.name_or_path; SpecForge's and SGLang's layout has no such "
                         "field): name it, e.g. model=llama3_8b (a preset) or "
                         "model.path=meta-llama/Llama-3.1-8B-Instruct (a hub id or a local folder)")
    preset = next((p for p in available_presets("model") if model_preset(p).path == name), None)
    if preset:
        return [f"model={preset}"]
    return [f"model.path={name}"] + ([] if os.path.isdir(os.path.expanduser(name)) else ["model.source=hub"])
