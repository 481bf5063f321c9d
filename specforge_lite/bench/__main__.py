"""python -m specforge_lite.bench <benchmark> [options]   (--help on each)

Benchmarks: train_step, regenerate, capture, served_capture, memory, store, packing, seq_scaling, draft_cache,
kill_resume, adapt, soft_ce.
The studies that hold the package against the peers' code (the GPU benchmark gpu_scale, step_speed, recipe parity)
and the recipe studies served by vLLM live beside the package: python -m studies --help, from a checkout."""

from __future__ import annotations

from . import run_named

BENCHMARKS = {name: f"specforge_lite.bench.{module}" for name, module in {
    "train_step": "train_step", "regenerate": "regenerate", "capture": "capture", "memory": "zero_memory",
    "store": "store", "packing": "packing", "seq_scaling": "seq_scaling", "draft_cache": "draft_cache",
    "kill_resume": "kill_resume", "adapt": "adapt", "served_capture": "served_capture", "soft_ce": "soft_ce"}.items()}


def main(argv: list[str] | None = None) -> None:
    run_named("python -m specforge_lite.bench", BENCHMARKS, __doc__, argv)


if __name__ == "__main__":
    main()
