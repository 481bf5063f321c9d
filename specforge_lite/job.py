"""One training job from a composed configuration: what ``python train.py`` runs after Hydra, and what
``python -m specforge_lite.adapt`` runs for each candidate draft (from a configuration file).

config -> data -> target (capture) -> draft -> training -> export / eval, each stage from its subpackage.
"""

from __future__ import annotations

import math
from pathlib import Path

from .config import Config


def run(config: Config, run_dir: Path, log=print) -> dict:
    """Train, export and evaluate one draft into ``run_dir``; the summary of what was written."""
    import torch
    from omegaconf import OmegaConf

    from .data.sources import check_data_sources
    from .methods import draft_method
    from .offline import store_run
    from .run import Run, use_expandable_segments
    from .settings import check_settings
    from .training.distributed import init_distributed, process_group
    from .training.loop import train
    from .training.output_dir import hold_output_dir

    check_settings(config)  # (every setting, once, before anything is built)
    for line in describe_recipe(config, draft_method(config.draft.method)):  # before the target loads
        log(line)
    if config.data.source != "offline":
        check_data_sources(config.data)
    use_expandable_segments(config.model.device)  # (CUDA's allocator reads it once: before the group and the target)
    with process_group(lambda: init_distributed(config.trainer)) as ctx:  # (destroyed when the run ends)
        if not ctx.is_main:
            log = lambda message: None  # noqa: E731  (rank 0 speaks for the run)
        if config.trainer.num_threads:
            torch.set_num_threads(config.trainer.num_threads)
        with hold_output_dir(run_dir, holder=ctx.is_main):  # (one run writes a folder at a time)
            if ctx.is_main:
                OmegaConf.save(OmegaConf.structured(config), run_dir / "config.yaml")
            # the target (live, or read back from a store), data, draft vocabulary, teacher and objective
            job = store_run(config, ctx, log) if config.data.source == "offline" else Run.online(config, ctx, log)
            draft = job.build_draft()
            job.write_stats(run_dir)
            batches = job.batches()
            groups = batches.micro_batches_per_epoch()  # (token-budget micro-batches: counted from the rows' lengths)
            per_epoch = steps_per_epoch(config, len(job.train_data), ctx.data_world_size, groups)
            if config.trainer.epochs is not None:  # (the same count on resume: the prepared data is cached)
                config.trainer.max_steps = max(1, math.ceil(config.trainer.epochs * per_epoch))
                log(f"[train] {config.trainer.epochs:g} epochs over {len(job.train_data)} conversations"
                    + (f" in {groups} micro-batches of up to {config.trainer.micro_batch_tokens} tokens" if groups
                       else "") + f": {config.trainer.max_steps} steps (trainer.epochs)")
            result = train(config.trainer, job.objective, job.teacher, draft, batches, run_dir,
                           lambda step: job.tracker(run_dir, step), draft.spec.to_dict(), log=log, ctx=ctx,
                           steps_per_epoch=per_epoch, periodic=periodic_eval(config, job, draft.spec))
            return finish(job, result, draft, run_dir, log)  # export, evaluation, served check


def finish(run, result, draft, run_dir: Path, log=print) -> dict:
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
        from .export.for_target import export_final

        summary["final"] = str(export_final(config, run.target, result.weights, draft.spec, run_dir, log))
        _evaluate(run, summary, result, run_dir, log)
    ctx.barrier()
    if str(summary.get("served", "")).startswith("failed"):  # loud, after the other ranks were released
        raise SystemExit(f"error: {summary['served']}")
    return summary


def _evaluate(run, summary: dict, result, run_dir: Path, log) -> None:
    """Rank 0's evaluation of the export, when it can run here."""
    again = f"python -m specforge_lite.evaluate --run-dir {run_dir}"
    if run.config.target.shard == "zero3" and run.ctx.enabled:
        # A sharded target needs every rank in each of its forwards: evaluated afterwards on one process.
        log(f"[eval] skipped in a sharded-target run: {again}")
        return
    if run.data is None:
        log(f"[eval] a store-trained draft is evaluated where its target runs: {again}")
        return
    if run.config.target.backend == "vllm":  # (the trainer holds the target's parts only: nothing decodes here)
        log(f"[eval] a draft trained from a served target is evaluated where its target runs in-process: {again}")
        return
    if run.config.eval.enabled:
        from .evaluate.acceptance import evaluate_export, write_eval
        from .evaluate.served import served_check

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


def periodic_eval(config: Config, run, spec):
    """The run's periodic held-out evaluation (job.py) of a draft of ``spec``, or None when
    eval.every_steps/every_minutes are null."""
    ev = config.eval
    if ev.every_steps is None and ev.every_minutes is None:
        return None
    from .data.chat import pad_id
    from .data.images import image_inputs
    from .device import resolve_dtype
    from .evaluate.acceptance import prompt_acceptance
    from .evaluate.heldout import heldout_accuracy
    from .evaluate.prompts import heldout_set
    from .export.for_target import draft_from_weights
    from .training.periodic import PeriodicEval

    # the end-of-run evaluation's objective (not sharded across a sequence-parallel group: every rank measures all)
    objective = run.method.objective.from_config(config.draft)
    pad, images = pad_id(run.tokenizer), image_inputs(run.target)
    acceptance = None
    if ev.every_prompts:  # (the draft as its export would hold it, decoded as the end-of-run evaluation decodes)
        prompts, dtype = heldout_set(run.data, ev.every_prompts), config.export.dtype
        exported = (lambda w: w) if dtype == "auto" else lambda w: {  # noqa: E731
            k: v.to(resolve_dtype(dtype, v.device)) if v.is_floating_point() else v for k, v in w.items()}
        acceptance = lambda weights: prompt_acceptance(  # noqa: E731
            run.target, draft_from_weights(spec, exported(weights), run.target), run.tokenizer, prompts, ev)
    return PeriodicEval(lambda module: heldout_accuracy(objective, run.teacher, module, run.data.heldout, pad,
                                                        ev.heldout_batches, images), ev.every_steps, ev.every_minutes,
                        acceptance)


def steps_per_epoch(config: Config, conversations: int, data_ranks: int, micro_batches: int | None = None) -> float:
    """Optimizer steps per pass over ``conversations``: each step reads micro_batch_size x grad_accum_steps
    conversations on every data-parallel rank, or, given ``micro_batches`` (the token-budget micro-batches of an
    epoch, all ranks together: trainer.micro_batch_tokens), grad_accum_steps of them on every rank."""
    t = config.trainer
    if micro_batches is not None:
        return micro_batches / (t.grad_accum_steps * data_ranks)
    return conversations / (t.micro_batch_size * t.grad_accum_steps * data_ranks)


def describe_recipe(config: Config, method) -> list[str]:
    """The run's plan in one line (and a second where the 2-core demo's recipe meets a real target, or the scale
    recipe's token-budget micro-batches meet rows that cannot pack): what is
    trained (a draft of ``method``), as the settings, the data's sources and a continued draft make it, not as the
    recipe proposed."""
    from .compose import unpacked_reason
    from .config import SCALE_RECIPE, small_offline_model
    from .data.sources import mix_sources

    d, g, t = config.data, config.data.generation, config.trainer
    source = d.path if d.source == "path" else d.source
    if d.source == "mix":
        kept = mix_sources(d)
        source = "+".join(m.source for m in kept) + "".join(
            f" ({m.source} left out: its requests are answered only with data.regenerate=true)"
            for m in d.mix if m not in kept)
    answers = (f"the target's own answers (regenerated: engine {g.engine}" + (f" at {g.server_url}" if g.server_url
               else "") + ")") if d.regenerate else "the answers as written"
    if d.source == "offline":
        source, answers = f"the hidden-state store {d.store}", "its stored states and tokens"
    draft = (f"continuing the draft of {config.draft.init_from} (its vocabulary, aux ids and shape)"
             if config.draft.init_from else "the target's whole vocabulary" if method.whole_vocabulary
             else f"draft vocabulary {config.draft.draft_vocab_size}")
    depth = ", ".join(f"{key.replace('_', ' ')} {value}"  # (what its objective unrolls: EAGLE3's TTT, a block)
                      for key, value in method.steps_settings(method.scored_steps(config.draft)).items())
    if d.regenerate and d.source != "offline" and g.max_minutes is not None and \
            g.round_conversations < g.max_conversations:
        answers += (f", {g.round_conversations} conversations a round up to {g.max_conversations} while "
                    f"{g.max_minutes:g} min allow")
    length = f"{t.epochs:g} epochs" if t.epochs is not None else f"{t.max_steps} steps"
    if t.max_minutes is not None:
        length += f", at most {t.max_minutes:g} min"
    saves = " or ".join(([f"every {t.save_every} steps"] if t.save_every else [])
                        + ([f"every {t.save_every_minutes:g} min"] if t.save_every_minutes else [])) or "at the end"
    per_step = (f"{t.grad_accum_steps} micro-batch(es) of up to {t.micro_batch_tokens} tokens" if t.micro_batch_tokens
                else f"{t.micro_batch_size * t.grad_accum_steps} conversation(s)")
    lines = [f"[recipe] {config.recipe_name}: {config.model.name} on {source}, {answers}; rows up to {d.max_length} "
             f"tokens; {draft}, {depth}; {length}, {per_step} per step and rank; {t.optimizer} lr {t.lr:g}; "
             f"checkpoints {saves}"]
    unpacked = unpacked_reason(config.model.family, str(d.source), config.draft.method)
    if config.recipe_name == SCALE_RECIPE and unpacked and not t.micro_batch_tokens:
        lines.append(f"[recipe] {SCALE_RECIPE}: one conversation per micro-batch, not micro-batches of a token budget "
                     f"(trainer.micro_batch_tokens=null): {unpacked}")
    if config.recipe_name == "cpu_20min" and not small_offline_model(config.model.name):
        lines.append(f"[recipe] cpu_20min is the embedded default's 2-core demo (a few hundred conversations, a small "
                     f"draft vocabulary, a 10-minute cap); to train a draft for {config.model.name}, leave recipe "
                     f"out (recipe=scale, the default for a real target)")
    return lines


def main(argv=None) -> None:
    """``python -m specforge_lite.job CONFIG.yaml RUN_DIR``: the job of a saved configuration (a run's
    config.yaml, or one that adapt wrote), in its own process."""
    import argparse

    from .compose import read_config_file
    from .errors import said_in_one_line

    p = argparse.ArgumentParser(prog="python -m specforge_lite.job", description=main.__doc__)
    p.add_argument("config", type=Path, help="a configuration file in the layout of a run's config.yaml")
    p.add_argument("run_dir", type=Path)
    a = p.parse_args(argv)
    with said_in_one_line():
        config = read_config_file(a.config)
        config.output_dir = str(a.run_dir)
        a.run_dir.mkdir(parents=True, exist_ok=True)
        run(config, a.run_dir)


if __name__ == "__main__":
    main()
