"""Train an EAGLE3 draft: python train.py [model=...] [draft.use_aux_norm=true] [trainer.max_steps=...]

config -> data -> target (capture) -> draft -> training -> export / eval. Each stage lives in its
subpackage of specforge_lite; this file only wires them. `python train.py --help` lists the groups,
`python train.py --cfg job` prints the composed configuration.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from specforge_lite.config import Config, available_presets, register_configs, to_config

register_configs()


def run(config: Config, run_dir: Path, log=print) -> dict:
    import torch

    from specforge_lite.data import BatchStream
    from specforge_lite.evaluate.acceptance import evaluate_export, write_eval
    from specforge_lite.pipeline import (build_draft, build_target, build_vocab, describe_precision, load_tokenizer,
                                         packing_length, pad_id, prepare)
    from specforge_lite.training.distributed import init_distributed
    from specforge_lite.training.loop import train
    from specforge_lite.training.tracking import Tracker

    if config.eval.serve not in (None, "vllm"):  # (said before training, not after it)
        raise ValueError(f"eval.serve={config.eval.serve!r}: use vllm, or null for no served check")
    ctx = init_distributed(config.trainer)
    if not ctx.is_main:
        log = lambda message: None  # noqa: E731  (rank 0 speaks for the run)
    if config.trainer.num_threads:
        torch.set_num_threads(config.trainer.num_threads)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")

    if config.data.source == "offline":  # the target's states come from a store (python -m specforge_lite.offline)
        from specforge_lite.offline import StoreTarget

        target = StoreTarget.open(config)
        train_data, vocab, tokenizer, data = target.reader, target.vocab, None, None
        stats = {"store": target.location, "samples": len(train_data), "tokens": target.manifest.tokens}
        log(f"[store] {target.location}: {len(train_data)} samples, {target.manifest.tokens} tokens, aux ids "
            f"{target.aux_layer_ids} ({target.convention}), draft vocabulary {vocab.size}")
    else:
        target = build_target(config, ctx=ctx)
        tokenizer = load_tokenizer(target, config.model.chat_template)
        log(f"[target] {config.model.name} from {target.location}: {target.num_layers} layers, hidden "
            f"{target.hidden_size}, vocab {target.vocab_size}, aux ids {target.aux_layer_ids} ({target.convention}) on "
            f"{target.device}/{target.dtype}" + (f"; {ctx.world_size} ranks, target "
            f"{'sharded (ZeRO-3)' if config.target.shard == 'zero3' else 'replicated'}" if ctx.enabled else ""))
        log(f"[precision] {describe_precision(config, target)}")
        # rank 0 prepares (and caches) the data first; the other ranks then read the same cache
        if not ctx.is_main:
            ctx.barrier()
        data = prepare(config, target, tokenizer, log=log)
        if ctx.is_main:
            ctx.barrier()
        train_data = data.train
        vocab = build_vocab(config, target, data.train, tokenizer)
        stats = data.stats
        log(f"[vocab] draft vocabulary {vocab.size} tokens, covering {vocab.coverage:.1%} of training loss tokens")
    draft = build_draft(config, target, vocab)
    spec = draft.spec.to_dict()
    if ctx.is_main:
        (run_dir / "data_stats.json").write_text(json.dumps({**stats, "draft_vocab_coverage": vocab.coverage}, indent=1))

    pad = pad_id(tokenizer) if tokenizer is not None else 0  # pads are masked; the value is never read
    stream = BatchStream(train_data, config.trainer.micro_batch_size, pad, config.trainer.seed,
                         images=target.image_inputs, rank=ctx.rank, world_size=ctx.world_size,
                         pack_length=packing_length(config, target))
    tracker_config = OmegaConf.to_container(OmegaConf.structured(config))
    result = train(config.trainer, config.draft, target, draft, stream, run_dir,
                   lambda step: Tracker(config.tracker, run_dir, tracker_config, resume_step=step), spec, log=log,
                   ctx=ctx)
    summary = {"run_dir": str(run_dir), "step": result.step, "checkpoint": str(result.checkpoint),
               "metrics": str(run_dir / "metrics.jsonl")}
    if result.step < config.trainer.max_steps:
        log(f"[train] stopped at step {result.step} of {config.trainer.max_steps} (trainer.stop_at_step); "
            f"run again with the same output_dir to resume")
        return summary
    # Exports and evaluation are rank 0's while the other ranks wait. A sharded target needs every rank
    # in each of its forwards, so that run is evaluated afterwards by eval/acceptance.py on one process.
    if config.target.shard == "zero3" and ctx.enabled:
        if ctx.is_main:
            summary["final"] = str(_export(config, result, draft, target, run_dir, log))
            log("[eval] skipped in a sharded-target run: python eval/acceptance.py --run-dir " + str(run_dir))
        ctx.barrier()
        return summary
    if not ctx.is_main:
        ctx.barrier()
        return summary
    if data is None:
        summary["final"] = str(_export(config, result, draft, target, run_dir, log))
        log(f"[eval] a store-trained draft is evaluated where its target runs: python eval/acceptance.py --run-dir {run_dir}")
        ctx.barrier()
        return summary

    final = _export(config, result, draft, target, run_dir, log)
    summary["final"] = str(final)
    if config.eval.enabled:
        evaluation = evaluate_export(config, target, tokenizer, data, final, log=log)
        summary["eval"] = str(write_eval(run_dir, evaluation))
        # the cheap training-time estimate next to the measured number, where the sweep's runs are compared
        Tracker(config.tracker, run_dir, tracker_config, resume_step=result.step).close(summary={
            "eval/mean_acceptance_length": evaluation["mean_acceptance_length"],
            "eval/heldout_sim_accept_len": evaluation["heldout_sim_accept_len"],
            "train/sim_accept_len": result.last_metrics.get("sim_accept_len")})
        log(f"[eval] mean acceptance length {evaluation['mean_acceptance_length']:.3f} at k={evaluation['num_draft_tokens']}, "
            f"held-out acc {[round(a, 3) for a in evaluation['heldout_acc']]}")
        if config.eval.serve:
            summary["served"] = _serve(run_dir, log)
    log("[done] " + ", ".join(f"{k}: {v}" for k, v in summary.items()))
    ctx.barrier()
    if str(summary.get("served", "")).startswith("failed"):  # loud, after the other ranks were released
        raise SystemExit(f"error: {summary['served']}")
    return summary


def _export(config: Config, result, draft, target, run_dir: Path, log) -> Path:
    from specforge_lite.export import export_draft

    embedding = target.embedding_weight() if config.export.include_embeddings else None
    verifier = {"name_or_path": config.model.path or str(target.location),
                "architectures": list(getattr(target.config, "architectures", None) or [])}
    return export_draft(result.weights, draft.spec, config.export.format, run_dir / "final", config.export.dtype,
                        embedding, warn=lambda m: log(f"[export] warning: {m}"), verifier=verifier,
                        num_speculative_tokens=config.eval.num_draft_tokens)


def _serve(run_dir: Path, log) -> str:
    """eval.serve=vllm: vLLM serves the export; 'failed: why' when its outputs differ from greedy."""
    from specforge_lite.evaluate.served import ServedMismatch, serve, serving_python

    if serving_python() is None:  # asked for, not possible here: say how, keep the run's results
        log("[serve] skipped: no serving environment. Build it (bash scripts/setup_serving.sh), then "
            f"python -m specforge_lite.evaluate.served {run_dir}")
        return "skipped (no serving environment)"
    try:
        serve([run_dir], log=log)
    except ServedMismatch as e:
        return f"failed: {e}"
    return str(run_dir / "vllm_eval.json")


def _check_preset_argument(argv: list[str]) -> None:
    """Hydra's own message for an unknown group option does not say how to use a local model."""
    for arg in argv:
        if arg.startswith("model=") and "," not in arg:
            name = arg.split("=", 1)[1]
            if name not in available_presets("model"):
                sys.exit(f"error: unknown model preset {name!r}. Presets: {', '.join(available_presets('model'))}.\n"
                         f"For any other model, point at a local folder: model.path=/path/to/model (config.json + weights).")


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    config, hc = to_config(cfg), HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:  # one wandb group per sweep, each run named by its overrides
        config.tracker.group = config.tracker.group or Path(hc.sweep.dir).name
        config.tracker.name = config.tracker.name or (hc.job.override_dirname or f"job{hc.job.num}")
    run(config, Path(hc.runtime.output_dir))


if __name__ == "__main__":
    from specforge_lite.training.distributed import strip_launcher_args

    sys.argv = [sys.argv[0], *strip_launcher_args(sys.argv[1:])]
    _check_preset_argument(sys.argv[1:])
    main()
