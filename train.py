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
    from specforge_lite.export import export_draft
    from specforge_lite.pipeline import build_draft, build_target, build_vocab, load_tokenizer, pad_id, prepare
    from specforge_lite.training.loop import train
    from specforge_lite.training.tracking import Tracker

    run_dir.mkdir(parents=True, exist_ok=True)
    if config.trainer.num_threads:
        torch.set_num_threads(config.trainer.num_threads)
    OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")

    target = build_target(config)
    tokenizer = load_tokenizer(target, config.model.chat_template)
    log(f"[target] {config.model.name} from {target.location}: {target.num_layers} layers, hidden {target.hidden_size}, "
        f"vocab {target.vocab_size}, aux ids {target.aux_layer_ids} ({target.convention}) on {target.device}/{target.dtype}")
    data = prepare(config, target, tokenizer, log=log)
    vocab = build_vocab(config, target, data.train, tokenizer)
    log(f"[vocab] draft vocabulary {vocab.size} tokens, covering {vocab.coverage:.1%} of training loss tokens")
    draft = build_draft(config, target, vocab)
    spec = draft.spec.to_dict()
    (run_dir / "data_stats.json").write_text(json.dumps({**data.stats, "draft_vocab_coverage": vocab.coverage}, indent=1))

    stream = BatchStream(data.train, config.trainer.micro_batch_size, pad_id(tokenizer), config.trainer.seed)
    tracker_config = OmegaConf.to_container(OmegaConf.structured(config))
    result = train(config.trainer, config.draft, target, draft, stream, run_dir,
                   lambda step: Tracker(config.tracker, run_dir, tracker_config, resume_step=step), spec, log=log)
    summary = {"run_dir": str(run_dir), "step": result.step, "checkpoint": str(result.checkpoint),
               "metrics": str(run_dir / "metrics.jsonl")}
    if result.step < config.trainer.max_steps:
        log(f"[train] stopped at step {result.step} of {config.trainer.max_steps} (trainer.stop_at_step); "
            f"run again with the same output_dir to resume")
        return summary

    final = export_draft(draft.trainable_state_dict(), draft.spec, config.export.format, run_dir / "final",
                         config.export.dtype, target.embedding_weight() if config.export.include_embeddings else None,
                         warn=lambda m: log(f"[export] warning: {m}"))
    summary["final"] = str(final)
    if config.eval.enabled:
        evaluation = evaluate_export(config, target, tokenizer, data, final, log=log)
        summary["eval"] = str(write_eval(run_dir, evaluation))
        log(f"[eval] mean acceptance length {evaluation['mean_acceptance_length']:.3f} at k={evaluation['num_draft_tokens']}, "
            f"held-out acc {[round(a, 3) for a in evaluation['heldout_acc']]}")
    log("[done] " + ", ".join(f"{k}: {v}" for k, v in summary.items()))
    return summary


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

    run(to_config(cfg), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    _check_preset_argument(sys.argv[1:])
    main()
