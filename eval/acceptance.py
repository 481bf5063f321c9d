"""Greedy chain speculative decoding with a trained draft on held-out prompts.

    python eval/acceptance.py --run-dir runs/DIR [--k 3] [--num-prompts 16] [--max-new-tokens 64] [--temperature 0.7]

Writes DIR/eval.json with mean_acceptance_length and per-position acceptance.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specforge_lite.evaluate.acceptance import evaluate_run  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--k", type=int, default=None, help="draft tokens per verification (default: the run's eval.num_draft_tokens)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="> 0: speculative sampling (default: greedy)")
    a = p.parse_args(argv)
    overrides = {k: v for k, v in {"num_draft_tokens": a.k, "num_prompts": a.num_prompts,
                                   "max_new_tokens": a.max_new_tokens, "temperature": a.temperature}.items()
                 if v is not None}
    result = evaluate_run(a.run_dir, overrides)
    print(json.dumps({k: result[k] for k in ("mean_acceptance_length", "per_position_acceptance", "heldout_acc")}, indent=1))
    print(f"wrote {a.run_dir / 'eval.json'}")


if __name__ == "__main__":
    main()
