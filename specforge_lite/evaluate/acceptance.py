"""Acceptance of an exported draft: speculative decoding on held-out prompts + held-out accuracy."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..config import Config, to_config
from .heldout import heldout_accuracy
from .spec_decode import acceptance_summary, greedy_generate, speculative_generate, speculative_sample


def evaluate_export(config: Config, target, tokenizer, data, export_dir: Path, log=print) -> dict:
    from ..export import load_export
    from ..pipeline import draft_from_weights, pad_id, stop_ids

    spec, weights = load_export(export_dir)
    if list(spec.aux_layer_ids) != list(target.aux_layer_ids):
        raise ValueError(f"the export was trained on aux ids {spec.aux_layer_ids}, the target captures "
                         f"{target.aux_layer_ids}")
    draft = draft_from_weights(spec, weights, target)
    target.set_draft_vocab(draft.draft_vocab_ids(), draft.t2d)
    ev = config.eval
    prompts = data.heldout_prompts[: ev.num_prompts]
    stops = stop_ids(tokenizer, target)
    accepted, new_tokens, outputs, per_prompt = [], 0, [], []
    t0 = time.perf_counter()
    images = target.image_inputs
    generator = torch.Generator().manual_seed(ev.seed)
    for i, prompt in enumerate(prompts):
        paths = data.prompt_images(i)
        inputs = {k: v.to(target.device) for k, v in images.pixels(paths).items()} if paths else None
        if ev.temperature > 0:
            gen = speculative_sample(target, draft, prompt, ev.max_new_tokens, ev.num_draft_tokens, stops,
                                     ev.temperature, generator, inputs)
        else:
            gen = speculative_generate(target, draft, prompt, ev.max_new_tokens, ev.num_draft_tokens, stops, inputs)
        accepted += gen.accepted
        new_tokens += len(gen.tokens)
        outputs.append(gen.tokens)
        per_prompt.append(1 + sum(gen.accepted) / max(len(gen.accepted), 1))
        log(f"[eval] prompt {i + 1}/{len(prompts)}: {len(gen.tokens)} tokens in {len(gen.accepted)} rounds")
    elapsed = time.perf_counter() - t0
    # The same prompts decoded by the target alone, timed in the same process: the measured speed-up.
    t0, greedy_tokens = time.perf_counter(), 0
    for i, prompt in enumerate(prompts):
        paths = data.prompt_images(i)
        inputs = {k: v.to(target.device) for k, v in images.pixels(paths).items()} if paths else None
        greedy_tokens += len(greedy_generate(target, prompt, ev.max_new_tokens, stops, inputs))
    greedy_tps = greedy_tokens / max(time.perf_counter() - t0, 1e-9)
    # What eval/vllm_acceptance.py needs to serve the same prompts and compare outputs token for token.
    (Path(export_dir).parent / "eval_inputs.json").write_text(json.dumps({
        "target": str(target.location), "prompts": prompts, "prompt_images": data.heldout_prompt_images[: len(prompts)],
        "generated": outputs, "stop_ids": sorted(stops),
        "max_new_tokens": ev.max_new_tokens, "num_draft_tokens": ev.num_draft_tokens,
        "max_model_len": max(len(p) for p in prompts) + ev.max_new_tokens + ev.num_draft_tokens + 8}))
    held = heldout_accuracy(target, draft, data.heldout, pad_id(tokenizer), config.draft, ev.heldout_batches, images)
    result = {
        "num_draft_tokens": ev.num_draft_tokens,
        "temperature": ev.temperature,
        "prompts": len(prompts),
        "generated_tokens": new_tokens,
        "tokens_per_s": new_tokens / max(elapsed, 1e-9),
        "target_alone_tokens_per_s": greedy_tps,
        "speedup_vs_target_alone": new_tokens / max(elapsed, 1e-9) / greedy_tps,
        **acceptance_summary(accepted, ev.num_draft_tokens),
        "per_prompt_mean_acceptance_length": per_prompt,
        "heldout_acc": held["acc"],
        "heldout_sim_accept_len": held["sim_accept_len"],
        "heldout_tokens": held["tokens"],
        "note": "mean_acceptance_length = 1 + accepted draft tokens per verification (chain; greedy at temperature "
                "0, speculative sampling above); "
                "heldout_acc is teacher-forced accuracy per TTT step on held-out conversations",
    }
    return result


def evaluate_run(run_dir: Path, overrides: dict | None = None, log=print) -> dict:
    """Load a finished run (its config.yaml, target, data cache and final/ export) and evaluate it."""
    from omegaconf import OmegaConf

    from ..export import load_export
    from ..pipeline import build_target, load_tokenizer, prepare

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "final" / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a finished run (needs config.yaml and final/config.json)")
    config = to_config(OmegaConf.load(run_dir / "config.yaml"))
    if config.data.source == "offline":  # trained from a store: its held-out prompts come from the store's data
        from ..offline import Manifest

        saved = Manifest.load(Path(config.data.store)).source.get("data")
        if not saved:
            raise ValueError(f"the store {config.data.store} does not record its data settings; evaluate with "
                             "data.* overrides naming the data it was made from")
        config.data = to_config({"data": saved}).data
    for key, value in (overrides or {}).items():
        setattr(config.eval, key, value)
    spec, _ = load_export(run_dir / "final")
    target = build_target(config, aux_layer_ids=spec.aux_layer_ids)
    tokenizer = load_tokenizer(target, config.model.chat_template)
    data = prepare(config, target, tokenizer, log=log)
    result = evaluate_export(config, target, tokenizer, data, run_dir / "final", log=log)
    write_eval(run_dir, result)
    return result


def write_eval(run_dir: Path, result: dict) -> Path:
    path = Path(run_dir) / "eval.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
