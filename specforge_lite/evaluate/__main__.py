"""Speculative decoding with a trained draft on each prompt set: acceptance and speed-up.

    python -m specforge_lite.evaluate --run-dir runs/DIR [--k 3] [--num-prompts 16] [--max-new-tokens 64]
        [--temperature 0.7] [--drafting tree --tree-topk 4 --tree-budget 16]
        [--prompt-sets heldout mtbench gsm8k summarization humaneval]
        [--prompt-file mtbench=/data/mt_bench/question.jsonl --prompt-file gsm8k=/data/gsm8k/test.jsonl]

Writes DIR/eval.json (pooled and per set: mean acceptance length, acceptance per position, tokens/s,
measured and estimated speed-up), DIR/eval.md (the table) and DIR/eval.png (acceptance per position per set).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import said_in_one_line


def main(argv=None) -> None:
    from .finish import evaluate_finished_run

    p = argparse.ArgumentParser(prog="python -m specforge_lite.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--k", type=int, default=None, help="draft tokens per verification (default: the run's "
                                                       "eval.num_draft_tokens)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="> 0: speculative sampling (default: greedy)")
    p.add_argument("--drafting", choices=["chain", "tree"], default=None)
    p.add_argument("--tree-topk", type=int, default=None)
    p.add_argument("--tree-budget", type=int, default=None, help="tree nodes verified per round")
    p.add_argument("--prompt-sets", nargs="+", default=None, help="default: the run's eval.prompt_sets")
    p.add_argument("--prompt-file", action="append", default=[], metavar="SET=PATH",
                   help="a set's file in its public format (MT-bench question.jsonl, GSM8K jsonl, ...)")
    a = p.parse_args(argv)
    files = {}
    for entry in a.prompt_file:
        name, sep, path = entry.partition("=")
        if not sep:
            p.error(f"--prompt-file {entry!r}: write SET=PATH, e.g. mtbench=/data/question.jsonl")
        files[name] = path
    overrides = {k: v for k, v in {"num_draft_tokens": a.k, "num_prompts": a.num_prompts,
                                   "max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
                                   "drafting": a.drafting, "tree_topk": a.tree_topk, "tree_budget": a.tree_budget,
                                   "prompt_sets": a.prompt_sets, "prompt_files": files or None}.items()
                 if v is not None}
    with said_in_one_line():
        evaluate_finished_run(a.run_dir, overrides)
    print((a.run_dir / "eval.md").read_text())
    print(f"wrote {a.run_dir / 'eval.json'}, eval.md, eval.png")


if __name__ == "__main__":
    main()
