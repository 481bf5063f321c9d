"""python -m specforge_lite.bench <benchmark> [options]; benchmarks: train_step, regenerate, capture, memory, store, packing"""

from __future__ import annotations

import sys

BENCHMARKS = {"train_step": "specforge_lite.bench.train_step", "regenerate": "specforge_lite.bench.regenerate",
              "capture": "specforge_lite.bench.capture", "memory": "specforge_lite.bench.zero_memory",
              "store": "specforge_lite.bench.store", "packing": "specforge_lite.bench.packing"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        sys.exit(f"usage: python -m specforge_lite.bench {{{','.join(BENCHMARKS)}}} [options]  (--help on each)")
    import importlib

    importlib.import_module(BENCHMARKS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    main()
