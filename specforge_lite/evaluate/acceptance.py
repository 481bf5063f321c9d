"""Acceptance of an exported draft: speculative decoding on each prompt set, held-out accuracy, and the
speed-up, measured against the target alone and estimated from measured step costs."""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ..config import Config, EvalConfig
from ..data.chat import generation_prompt_ids
from ..data.images import image_inputs
from ..device import dtype_name
from ..methods import build_objective, draft_method
from ..targets import target_identity
from ..targets.teacher import Teacher
from .heldout import heldout_accuracy
from .prompts import PromptSet, load_prompt_sets
from .confidence import adaptive_verification, calibration, fitted_calibration
from .spec_decode import (Generation, _new_cache, acceptance_by_context_length, acceptance_summary, greedy_generate,
                          speculative_generate, speculative_sample)
from .tree import check_tree_support, tree_generate

def _decoder(target, draft, ev: EvalConfig, stops: set[int]) -> Callable[[list[int], dict | None], Generation]:
    """prompt ids, prompt inputs -> Generation, as eval.drafting and eval.temperature say."""
    refused = draft_method(draft.spec.method).refused_evaluation(draft.spec, ev)
    if refused:
        raise ValueError("; ".join(refused))
    generator = torch.Generator().manual_seed(ev.seed)
    k, n = ev.num_draft_tokens, ev.max_new_tokens
    if ev.drafting == "tree":
        check_tree_support(target, draft)
        return lambda p, x: tree_generate(target, draft, p, n, k, ev.tree_topk, ev.tree_budget, stops,
                                          ev.temperature, generator, x)
    if ev.temperature > 0:
        return lambda p, x: speculative_sample(target, draft, p, n, k, stops, ev.temperature, generator, x)
    return lambda p, x: speculative_generate(target, draft, p, n, k, stops, x)


def _answer_room(ev: EvalConfig) -> int:
    """Positions a prompt's decoding takes beyond the prompt: the answer and the last round's drafts."""
    return ev.max_new_tokens + ev.num_draft_tokens + 1


def prompt_room(target, ev: EvalConfig) -> int | None:
    """The longest prompt the target's positions (max_position_embeddings) leave room to decode; None when the
    target names no limit."""
    config = getattr(target.config, "text_config", None) or target.config
    positions = getattr(config, "max_position_embeddings", None)
    return positions - _answer_room(ev) if positions else None


def _run_set(prompt_set: PromptSet, decode, target, tokenizer, ev: EvalConfig, stops: set[int], log) -> dict:
    """Decode every item of a set (multi-turn items turn by turn, each turn after the target's own answer),
    then the same prompts (or the first eval.baseline_prompts) with the target alone, timed in the same
    process."""
    images = image_inputs(target)
    prompts, prompt_images, outputs, accepted, contexts, per_prompt = [], [], [], [], [], []
    confidences = []  # per round (greedy chain decoding records them)
    round_prompts = []  # per round, its conversation (set, item): the Platt fit is judged on other conversations

    def inputs_of(paths):
        return {k: v.to(target.device) for k, v in images.pixels(paths).items()} if paths else None

    longest, too_long = prompt_room(target, ev), 0
    t0 = time.perf_counter()
    for number, item in enumerate(prompt_set.items):
        messages = []
        turns = item.turns or [None]
        for asked, turn in enumerate(turns):
            if turn is None:
                ids = item.ids
            else:
                messages.append({"role": "user", "content": turn})
                ids = generation_prompt_ids(tokenizer, messages)
            if longest is not None and len(ids) > longest:  # (a conversation's later turns are longer still)
                too_long += len(turns) - asked
                break
            gen = decode(ids, inputs_of(item.images))
            prompts.append(ids), prompt_images.append(item.images), outputs.append(gen.tokens)
            accepted += gen.accepted
            contexts += gen.contexts
            confidences += gen.confidences if len(gen.confidences) == len(gen.accepted) else [[]] * len(gen.accepted)
            round_prompts += [(prompt_set.name, number)] * len(gen.accepted)
            per_prompt.append(1 + sum(gen.accepted) / max(len(gen.accepted), 1))
            if turn is not None:
                answer = tokenizer.decode(gen.tokens, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
    elapsed = time.perf_counter() - t0
    if too_long:
        log(f"[eval] {prompt_set.name}: {too_long} prompt(s) longer than {longest} tokens skipped: the target's "
            f"{longest + _answer_room(ev)} positions must hold the prompt, eval.max_new_tokens and a round's drafts")
    if not prompts:
        raise ValueError(f"eval.prompt_sets: every prompt of {prompt_set.name} ({prompt_set.source}) is longer than "
                         f"the {longest} tokens the target's positions leave with eval.max_new_tokens="
                         f"{ev.max_new_tokens}; lower eval.max_new_tokens or drop the set")
    # The target alone on the set's first eval.baseline_prompts prompts (all when null): a batch-1 decode
    # step costs the same whatever the prompt, and on a CPU this timing was 40% of the evaluation.
    t0, alone_tokens, alone = time.perf_counter(), 0, list(zip(prompts, prompt_images))[:ev.baseline_prompts]
    for ids, paths in alone:
        alone_tokens += len(greedy_generate(target, ids, ev.max_new_tokens, stops, inputs_of(paths)))
    # eval.baseline_prompts=0: the target alone is not timed, and nothing is divided by it
    alone_tps = alone_tokens / max(time.perf_counter() - t0, 1e-9) if alone else None
    new_tokens = sum(len(o) for o in outputs)
    summary = acceptance_summary(accepted, ev.num_draft_tokens)
    summary["by_context_length"] = acceptance_by_context_length(accepted, contexts, ev.num_draft_tokens,
                                                                ev.context_length_edges)
    summary["calibration"] = calibration(accepted, confidences, ev.num_draft_tokens)
    log(f"[eval] {prompt_set.name}: {len(prompts)} prompts, mean acceptance length "
        f"{summary['mean_acceptance_length']:.3f}")
    return {"source": prompt_set.source, "skipped_rows": prompt_set.skipped, "too_long_prompts": too_long,
            "conversations": len(prompt_set.items),
            "prompts": len(prompts), "generated_tokens": new_tokens, "tokens_per_s": new_tokens / max(elapsed, 1e-9),
            "target_alone_tokens_per_s": alone_tps, "target_alone_prompts": len(alone),
            "speedup_vs_target_alone": new_tokens / max(elapsed, 1e-9) / alone_tps if alone else None,
            **summary, "per_prompt_mean_acceptance_length": per_prompt,
            "_accepted": accepted, "_contexts": contexts, "_confidences": confidences,
            "_round_prompts": round_prompts, "_prompts": prompts,
            "_images": prompt_images, "_outputs": outputs}


@torch.no_grad()
def prompt_acceptance(target, draft, tokenizer, prompt_set: PromptSet, ev: EvalConfig) -> float:
    """The mean acceptance length of greedy chain drafting (eval.num_draft_tokens, eval.max_new_tokens) on each
    item's first prompt: the evaluation during training (no timing, no target-alone decoding, no later turns)."""
    from ..generation import stop_ids

    stops = stop_ids(tokenizer, target)
    decode = _decoder(target, draft, dataclasses.replace(ev, drafting="chain", temperature=0.0), stops)
    longest, accepted = prompt_room(target, ev), []
    for item in prompt_set.items:
        ids = item.ids if not item.turns else generation_prompt_ids(
            tokenizer, [{"role": "user", "content": item.turns[0]}])
        if longest is None or len(ids) <= longest:
            paths = item.images
            accepted += decode(ids, {k: v.to(target.device) for k, v in image_inputs(target).pixels(paths).items()}
                               if paths else None).accepted
    return acceptance_summary(accepted, ev.num_draft_tokens)["mean_acceptance_length"]


def measure_step_costs(target, draft, prompt: list[int], ev: EvalConfig, repeats: int = 5) -> dict:
    """Median seconds of one target decode step (1 token), one verification forward (the chain's k+1 or
    the tree's budget+1 tokens) and one round of drafting (depth steps of the draft, width 1 for a chain,
    tree_topk for a tree), each with the prompt as context and its draft keys cached, as in the decoding
    (the method's drafting) and in a server. ``target_verify_s_by_k``: the verification at each k' up to k
    (a chain verifies k'+1 tokens, timed at each; a tree its budget's, whatever its depth), for the by-k
    estimate; None for a draft whose k is fixed at training (a block draft: it serves at no other k)."""
    tree = ev.drafting == "tree"
    method = draft_method(draft.spec.method)
    fixed_k = method.fixed_draft_tokens(draft.spec.to_dict()) is not None
    width, verify_len = (ev.tree_topk, ev.tree_budget + 1) if tree else (1, ev.num_draft_tokens + 1)
    device = target.device
    cache = _new_cache(target)
    aux, _ = target.forward_cached(torch.tensor([prompt], device=device), cache)

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            state = fn()  # untimed setup, then the timed call
            t0 = time.perf_counter()
            state()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def target_step(q: int):
        def setup():
            c = copy.deepcopy(cache)
            return lambda: target.forward_cached(torch.tensor([prompt[-1:] * q], device=device), c)
        return setup

    one_forward = method.drafting(draft).one_forward

    def draft_round():
        drafted = method.drafting(draft)
        if drafted.one_forward:  # all k from one forward per round (mask slots): the newest row and the slots
            drafted.propose([a[:, :-1] for a in aux], prompt[:-1], prompt[-1], ev.num_draft_tokens)
            return lambda: drafted.propose([a[:, -1:] for a in aux], prompt, prompt[-1], ev.num_draft_tokens)
        return drafted.round_at_width(aux, prompt, ev.num_draft_tokens, width)

    verify_s = timed(target_step(verify_len))
    k = ev.num_draft_tokens
    if fixed_k:
        by_k = None
    elif tree:
        by_k = [verify_s] * k
    else:
        by_k = [timed(target_step(q + 1)) for q in range(1, k)] + [verify_s]
    return {"target_decode_s": timed(target_step(1)), "target_verify_s": verify_s, "target_verify_s_by_k": by_k,
            "draft_round_s": timed(draft_round), "verify_tokens": verify_len, "draft_width": width,
            "draft_steps_per_round": 1 if one_forward else ev.num_draft_tokens}


def estimated_speedup(mean_acceptance_length: float, costs: dict) -> float:
    """Tokens per round over the time of a round, against one token per target decode step."""
    return mean_acceptance_length * costs["target_decode_s"] / (costs["draft_round_s"] + costs["target_verify_s"])


def speedup_by_k(per_position_acceptance: list[float], costs: dict) -> dict[int, float]:
    """The estimated speed-up of serving with each k up to the measured one: a round at k' yields 1 + the
    acceptance of its first k' positions (as measured at k), and costs the verification at k'
    (``target_verify_s_by_k``: a chain's k'+1 tokens, timed) and k' of the draft's steps (a draft that proposes
    in one forward: one). Acceptance beyond the evaluated k is not measured, so neither is a k beyond it."""
    steps, out = costs.get("draft_steps_per_round", len(per_position_acceptance)), {}
    for k in range(1, len(per_position_acceptance) + 1):
        draft_s = costs["draft_round_s"] * (k / steps if steps > 1 else 1.0)
        tokens = 1.0 + sum(per_position_acceptance[:k])
        out[k] = tokens * costs["target_decode_s"] / (draft_s + costs["target_verify_s_by_k"][k - 1])
    return out


def estimate_by_k(per_position_acceptance: list[float], costs: dict) -> dict:
    """``estimated_speedup_by_k`` and ``best_k``, its largest; both None for a draft whose k is fixed at
    training (``target_verify_s_by_k`` None: it is served at that k only)."""
    if costs.get("target_verify_s_by_k") is None:
        return {"estimated_speedup_by_k": None, "best_k": None}
    by_k = speedup_by_k(per_position_acceptance, costs)
    return {"estimated_speedup_by_k": by_k, "best_k": max(by_k, key=by_k.get) if by_k else None}


def evaluate_export(config: Config, target, tokenizer, data, export_dir: Path, log=print) -> dict:
    from ..export import check_draft_tokens, load_export
    from ..generation import stop_ids
    from ..data import pad_id
    from ..export.for_target import draft_from_weights

    check_draft_tokens(export_dir, config.eval.num_draft_tokens)
    spec, weights = load_export(export_dir)
    if list(spec.aux_layer_ids) != list(target.aux_layer_ids):
        raise ValueError(f"the export was trained on aux ids {spec.aux_layer_ids}, the target captures "
                         f"{target.aux_layer_ids}")
    draft = draft_from_weights(spec, weights, target)
    teacher = Teacher(target, draft.draft_vocab_ids(), draft.t2d)
    ev = config.eval
    stops = stop_ids(tokenizer, target)
    decode = _decoder(target, draft, ev, stops)
    sets = {}
    for prompt_set in load_prompt_sets(list(ev.prompt_sets), dict(ev.prompt_files or {}), data, ev.num_prompts):
        sets[prompt_set.name] = _run_set(prompt_set, decode, target, tokenizer, ev, stops, log)
    every = lambda key: [x for s in sets.values() for x in s[key]]  # noqa: E731
    # step costs are timed on a text prompt when there is one (an image prompt needs its pixels in the prefill)
    text_prompts = [p for p, images in zip(every("_prompts"), every("_images")) if not images]
    costs = measure_step_costs(target, draft, (text_prompts or every("_prompts"))[0], ev)
    for s in sets.values():
        s["estimated_speedup"] = estimated_speedup(s["mean_acceptance_length"], costs)
    # What eval/vllm_acceptance.py needs to serve the same prompts and compare outputs token for token.
    prompts = every("_prompts")
    (Path(export_dir).parent / "eval_inputs.json").write_text(json.dumps({
        "target": str(target.location), "prompts": prompts, "prompt_images": every("_images"),
        "prompt_sets": [name for name, s in sets.items() for _ in s["_prompts"]],
        "generated": every("_outputs"), "stop_ids": sorted(stops),
        "max_new_tokens": ev.max_new_tokens, "num_draft_tokens": ev.num_draft_tokens,
        "dtype": dtype_name(target.dtype),  # what our greedy outputs were computed in; vLLM serves in it too
        "max_model_len": max(len(p) for p in prompts) + ev.max_new_tokens + ev.num_draft_tokens + 8}))
    held = heldout_accuracy(build_objective(config.draft), teacher, draft, data.heldout,
                            pad_id(tokenizer), ev.heldout_batches, image_inputs(target))
    pooled = acceptance_summary(every("_accepted"), ev.num_draft_tokens)
    pooled["by_context_length"] = acceptance_by_context_length(every("_accepted"), every("_contexts"),
                                                               ev.num_draft_tokens, ev.context_length_edges)
    pooled["calibration"] = calibration(every("_accepted"), every("_confidences"), ev.num_draft_tokens)
    pooled["calibration_fit"] = fitted_calibration(every("_accepted"), every("_confidences"), every("_round_prompts"))
    pooled["adaptive_verification"] = adaptive_verification(every("_accepted"), every("_confidences"),
                                                            ev.num_draft_tokens)
    tokens = sum(s["generated_tokens"] for s in sets.values())
    spec_time = sum(s["generated_tokens"] / s["tokens_per_s"] for s in sets.values())
    timed_alone = all(s["target_alone_tokens_per_s"] for s in sets.values())
    alone_time = (sum(s["generated_tokens"] / s["target_alone_tokens_per_s"] for s in sets.values())
                  if timed_alone else 0)
    for s in sets.values():
        for key in [k for k in s if k.startswith("_")]:
            del s[key]
    return {
        "target": target_identity(config, target),  # (the model measured on, as loaded)
        "num_draft_tokens": ev.num_draft_tokens,
        "drafting": ev.drafting,
        **({"tree_topk": ev.tree_topk, "tree_budget": ev.tree_budget} if ev.drafting == "tree" else {}),
        "temperature": ev.temperature,
        "prompts": sum(s["prompts"] for s in sets.values()),
        "generated_tokens": tokens,
        "tokens_per_s": tokens / max(spec_time, 1e-9),
        "target_alone_tokens_per_s": tokens / max(alone_time, 1e-9) if timed_alone else None,
        "speedup_vs_target_alone": alone_time / max(spec_time, 1e-9) if timed_alone else None,
        **pooled,
        "estimated_speedup": estimated_speedup(pooled["mean_acceptance_length"], costs),
        **estimate_by_k(pooled["per_position_acceptance"], costs),
        "step_costs": costs,
        "sets": sets,
        "heldout_acc": held["acc"],
        "heldout_sim_accepted_drafts": held["sim_accepted_drafts"],
        "heldout_tokens": held["tokens"],
        "note": "mean_acceptance_length = 1 + accepted draft tokens per verification round, pooled over the prompt "
                "sets (per set under 'sets'), and per context-length bucket (by_context_length: the tokens before "
                "the drafted position, eval.context_length_edges); greedy at temperature 0, speculative sampling "
                "above. "
                "speedup_vs_target_alone: measured here, the target decoding the same prompts alone (each set's "
                "first eval.baseline_prompts when set); estimated_speedup: acceptance length x target decode "
                "step / (draft round + verification), from step_costs. heldout_acc is teacher-forced accuracy per TTT "
                "step on held-out conversations. estimated_speedup_by_k: the same estimate for serving with each "
                "k up to this one (its first k positions' acceptance, the verification timed at that k, k draft "
                "steps, or one for a draft that proposes in one forward); best_k its largest; both null for a "
                "block draft, whose k is fixed at training. calibration: per draft position, the expected "
                "calibration error of the draft's probability of its token as the probability that it is "
                "accepted (greedy chain decoding), over the rounds that reached the position; calibration_fit: a "
                "Platt fit of those confidences (fit on every other conversation's rounds, its ECE before and "
                "after on the rest's), recorded in the export; adaptive_verification: accepted drafts per verified "
                "slot and tokens per verification when a budget of the rounds' draft slots is verified by "
                "confidence (vLLM's adaptive verification, every round one request of a batch) or without (every "
                "round its first slots)",
    }


def write_eval(run_dir: Path, result: dict) -> Path:
    """eval.json, eval.md (a table per prompt set) and eval.png (acceptance per position per set); the fitted
    calibration of the draft's confidences goes into the export's config (its provenance block)."""
    from .report import write_eval_report

    from ..export import record_confidence_calibration
    from ..export.card import write_model_card

    path = Path(run_dir) / "eval.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    write_eval_report(run_dir, result)
    if (Path(run_dir) / "final" / "config.json").is_file():
        if result.get("calibration_fit"):
            record_confidence_calibration(Path(run_dir) / "final", result["calibration_fit"])
        write_model_card(Path(run_dir) / "final", run_dir)  # with the acceptance just measured
    return path
