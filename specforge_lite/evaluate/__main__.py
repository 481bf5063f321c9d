"""Speculative decoding with a trained draft on each prompt set: acceptance and speed-up.

    python -m specforge_lite.evaluate --run-dir runs/DIR [--k 3] [--num-prompts 16] [--max-new-tokens 64]
    python -m specforge_lite.evaluate --export DRAFT --run-dir OUT [model=PRESET | model.path=ID] [key=value ...]
        [--temperature 0.7] [--drafting tree --tree-topk 4 --tree-budget 16]
        [--prompt-sets heldout mtbench gsm8k summarization humaneval]
        [--prompt-file mtbench=/data/mt_bench/question.jsonl --prompt-file gsm8k=/data/gsm8k/test.jsonl]

Writes DIR/eval.json (pooled and per set: mean acceptance length, acceptance per position, tokens/s,
measured and estimated speed-up), DIR/eval.md (the table) and DIR/eval.png (acceptance per position per set).

--export DRAFT evaluates a draft folder, ours or one published in speculators' format or SpecForge's and SGLang's
Llama-EAGLE3 layout, for the target its config names (speculators' verifier) or the one the overrides name
(train.py's key=value overrides: model, data, eval, ...). OUT becomes a run of it: config.yaml, final/ (the draft
as this project exports it, with its model card), eval.json; python -m specforge_lite.evaluate.served OUT then
serves it with vLLM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import Drafting, choices
from ..errors import said_in_one_line
from ..hub import DRAFT_FILES, local_or_hub


def main(argv=None) -> None:
    from .finished import evaluate_finished_run, evaluate_published

    p = argparse.ArgumentParser(prog="python -m specforge_lite.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path, help="a finished run; with --export, the folder to write")
    p.add_argument("--export", default=None, metavar="DRAFT",
                   help="a draft folder to evaluate (ours, speculators', SpecForge's or SGLang's layout), or a "
                        "public draft's hub id")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="with --export: the target and settings")
    p.add_argument("--k", type=int, default=None, help="draft tokens per verification (default: the run's "
                                                       "eval.num_draft_tokens)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="> 0: speculative sampling (default: greedy)")
    p.add_argument("--drafting", choices=choices(Drafting), default=None)
    p.add_argument("--tree-topk", type=int, default=None)
    p.add_argument("--tree-budget", type=int, default=None, help="tree nodes verified per round")
    p.add_argument("--prompt-sets", nargs="+", default=None, help="default: the run's eval.prompt_sets")
    p.add_argument("--prompt-file", action="append", default=[], metavar="SET=PATH",
                   help="a set's file in its public format (MT-bench question.jsonl, GSM8K jsonl, ...)")
    a = p.parse_intermixed_args(argv)
    if a.prompt_sets:  # (--prompt-sets takes the words after it: the key=value ones are overrides, no set's name)
        a.overrides += [w for w in a.prompt_sets if "=" in w]
        a.prompt_sets = [w for w in a.prompt_sets if "=" not in w] or None
    if a.overrides and a.export is None:
        p.error(f"{a.overrides[0]}: overrides go with --export (a run's config.yaml names its target and data)")
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
        if a.export is not None:
            evaluate_published(local_or_hub(a.export, "--export", only=DRAFT_FILES), a.run_dir, a.overrides,
                               overrides)
        else:
            evaluate_finished_run(a.run_dir, overrides)
    print((a.run_dir / "eval.md").read_text())
    print(f"wrote {a.run_dir / 'eval.json'}, eval.md, eval.png")


if __name__ == "__main__":
    main()
