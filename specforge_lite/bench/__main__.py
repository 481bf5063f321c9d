"""python -m specforge_lite.bench <benchmark> [options]

Benchmarks: train_step, regenerate, capture, memory, store, packing, seq_scaling, draft_cache, kill_resume, levers,
recipe_parity, recipe_card, adapt, gpu_scale."""

from __future__ import annotations

import sys

BENCHMARKS = {"train_step": "specforge_lite.bench.train_step", "regenerate": "specforge_lite.bench.regenerate",
              "capture": "specforge_lite.bench.capture", "memory": "specforge_lite.bench.zero_memory",
              "store": "specforge_lite.bench.store", "packing": "specforge_lite.bench.packing",
              "seq_scaling": "specforge_lite.bench.seq_scaling", "draft_cache": "specforge_lite.bench.draft_cache",
              "kill_resume": "specforge_lite.bench.kill_resume", "levers": "specforge_lite.bench.levers",
              "recipe_parity": "specforge_lite.bench.recipe_parity", "recipe_card": "specforge_lite.bench.recipe_card",
              "adapt": "specforge_lite.bench.adapt", "gpu_scale": "specforge_lite.bench.gpu_scale"}


def main() -> None:
    usage = f"usage: python -m specforge_lite.bench {{{','.join(BENCHMARKS)}}} [options]  (--help on each)"
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        sys.exit(usage)
    import importlib

    import torch

    from ..device import describe_cpu

    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(f"[machine] {describe_cpu()}{gpu}")
    importlib.import_module(BENCHMARKS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
