"""python -m specforge_lite.bench <benchmark> [options]   (--help on each)

Benchmarks: train_step, regenerate, capture, memory, store, packing, seq_scaling, draft_cache, kill_resume, adapt,
gpu_scale. The recipe studies served by vLLM (levers, recipe parity, recipe card) live beside the package:
python -m studies --help, from a checkout."""

from __future__ import annotations

import importlib
import sys

from . import say_machine

BENCHMARKS = {"train_step": "train_step", "regenerate": "regenerate", "capture": "capture", "memory": "zero_memory",
              "store": "store", "packing": "packing", "seq_scaling": "seq_scaling", "draft_cache": "draft_cache",
              "kill_resume": "kill_resume", "adapt": "adapt", "gpu_scale": "gpu_scale"}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m specforge_lite.bench {{{','.join(BENCHMARKS)}}} [options]  (--help on each)"
    if args and args[0] in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return
    if not args or args[0] not in BENCHMARKS:
        sys.exit(usage)
    say_machine()
    importlib.import_module(f"specforge_lite.bench.{BENCHMARKS[args[0]]}").main(args[1:])


if __name__ == "__main__":
    main()
