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

    config, target = run.config, run.target
    embedding = target.embedding_weight() if config.export.include_embeddings else None
    verifier = {"name_or_path": config.model.path or str(target.location),
                "architectures": list(getattr(target.config, "architectures", None) or [])}
    return export_draft(weights, draft.spec, config.export.format, run_dir / "final", config.export.dtype,
                        embedding, warn=lambda m: log(f"[export] warning: {m}"), verifier=verifier,
                        num_speculative_tokens=config.eval.num_draft_tokens)


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
    from omegaconf import OmegaConf

    from ..config import to_config
    from ..export import load_export

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "final" / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished run (needs config.yaml and final/config.json)")
    config = to_config(OmegaConf.load(run_dir / "config.yaml"))
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
    return Run.online(config, log=log, aux_layer_ids=spec.aux_layer_ids, vocab=vocab)


def evaluate_finished_run(run_dir: Path, eval_overrides: dict | None = None, log=print) -> dict:
    """Evaluate a finished run's export (python -m specforge_lite.evaluate --run-dir DIR)."""
    run = finished_run(run_dir, eval_overrides, log)
    result = evaluate_export(run.config, run.target, run.tokenizer, run.data, Path(run_dir) / "final", log=log)
    write_eval(run_dir, result)
    return result
